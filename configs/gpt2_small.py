r"""GPT-2-small shape (12 layers × 768, 12 heads, seq 1024), standard Pre-LN, AdamW: the GPT benchmark shape.

Command (the throughput benchmark this config exists for; benchmarks/README.md):

  python -m dsjax.bench --config=configs/gpt2_small.py [--config.batch_size=32]

Expected runtime and result: see the GPU table of benchmarks/README.md (compile time, ms/step, tokens/s and
MFU per device, with the device and date of each measurement); on one H100 a step of batch 16 takes tens
of milliseconds in bfloat16 with cuDNN attention (`model.dtype='auto'`, `model.attention='auto'`).
On this project's 2-core CPU the model trains, slowly (seconds per step); nothing here was tuned for a
result, so no loss is claimed.

Training it on the embedded byte corpus is possible too (byte vocabulary, 86M parameters):

  python -m dsjax.main --config=configs/gpt2_small.py --workdir=/tmp/gpt2_small

Settings: the GPT-2 small architecture (Radford et al. 2019) with the DNT paper's AdamW GPT-2 recipe
(Qi et al. 2025, arXiv:2507.17501, Table 5: lr 6e-4, weight decay 0.1, betas (0.9, 0.95), warmup 2000,
cosine to a minimum of 6e-5) at the batch that fits one GPU (the paper's is 480 × 1024 tokens).
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('gpt', optimizer_name='adamw')
  c.total_steps = 10_000
  c.batch_size = 16
  c.eval_every = 1000
  c.checkpoint_every = 1000
  c.log_every = 100
  c.data.seq_len = 1024

  c.model.depth = 12
  c.model.width = 768
  c.model.num_heads = 12
  c.model.block = 'preln'
  # All 12 layers in one scan iteration: 30 ms/step instead of 44 at batch 16 on one H100
  # (benchmarks/README.md), for a compile of ~46 s instead of ~10 s.
  c.model.scan_unroll = 12

  c.optimizer.lr = 6e-4
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 2000
  c.optimizer.min_lr_ratio = 0.1  # 6e-5 / 6e-4 (Qi et al. 2025, Table 5).
  c.optimizer.clip_norm = 1.0
  return c
