r"""Bamboo (Xue et al. 2023): the deeper-narrower counterpart of configs/gpt_preln.py, vanilla Pre-LN.

Command (2-core CPU, no network):

  python -m dsjax.main --config=configs/gpt_bamboo.py --workdir=/tmp/gpt_bamboo

Expected runtime: 4m59s wall on the 2-core CPU (2026-12-03, with short test runs sharing it at times),
the two evaluations and checkpoints included.
Expected result: eval loss 1.924 nats/byte (2.776 bits/byte, perplexity 6.85) at step 1000 (2.101 at step
500; measured 2026-12-03, seed 0), against the 3.144-nat unigram entropy of the validation split;
configs/gpt_preln.py, the 4-layer shape with the same block parameters, reached 1.694. One seed each and
one lr: no comparison of the shapes (experiments/README.md §4 compares depths at constant N·d² with a
sweep per arm).

Xue et al. 2023, "A Study on Transformer Configuration and Training Objective" (ICML 2023,
arXiv:2205.10505) propose "Bamboo": for a given parameter budget, use deeper and narrower transformers
than the conventional configuration. The network and its initialisation stay vanilla (Pre-LN, Xavier;
`model.scheme='bamboo'` is exactly that plan, dsjax/schemes/bamboo.py). Here the shape of
configs/gpt_preln.py (4 layers of width 128, 4 heads of 32) becomes 16 layers of width 64 (2 heads of
32, the same head width): 12·d²·N = 786,432 block weights in both, so the same number of block
parameters and matrix FLOPs per token; everything else (data, sequence length, batch, AdamW, schedule,
1000 steps) is that config's, so the two results compare the shapes. The paper pairs the shape with
masked-autoencoder training (its finding is that this objective alleviates the over-smoothing of deep
narrow models); this config trains it on next-byte prediction.
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('gpt', optimizer_name='adamw')
  c.total_steps = 1000
  c.batch_size = 32
  c.eval_every = 500
  c.checkpoint_every = 500
  c.log_every = 100
  c.data.seq_len = 128

  c.model.depth = 16  # 4× deeper than configs/gpt_preln.py ...
  c.model.width = 64  # ... and 2× narrower: the same 12·d²·N block parameters
  c.model.num_heads = 2  # head width 32, as in configs/gpt_preln.py
  c.model.block = 'preln'
  c.model.scheme = 'bamboo'

  c.optimizer.lr = 6e-4  # as configs/gpt_preln.py
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 100
  c.optimizer.clip_norm = 1.0
  # Cosine to 0, as the result above was measured (the default is the paper's minimum, Qi et al. 2025,
  # arXiv:2507.17501, Table 5: 6e-5).
  c.optimizer.min_lr_ratio = 0.0
  return c
