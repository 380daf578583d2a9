r"""L-DNT (Qi et al. 2025, arXiv:2507.17501) byte-level GPT on the embedded Python documentation, mSGDW.

Command (2-core CPU, no network):

  python -m dsjax.main --config=configs/gpt_dnt.py --workdir=/tmp/gpt_dnt

Expected runtime: 3m30s wall on a 2-core CPU (2026-11-27, the two evaluations and checkpoints included;
6m35s on 2026-11-24 while a second training run shared the cores for about two minutes).
Expected result: eval loss 1.358 nats/byte (1.959 bits/byte, perplexity 3.89) at step 1000 (measured
2026-11-27, seed 0, with this code and with that of commit 5a474ed, equal to the last digit; 1.377 with
an earlier input pipeline, whose training order differed), against a unigram byte entropy of the
validation split of 3.144 nats (4.536 bits).
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('gpt', optimizer_name='msgdw')
  c.total_steps = 1000
  c.batch_size = 32
  c.eval_every = 500
  c.checkpoint_every = 500
  c.log_every = 100
  c.data.seq_len = 128

  c.model.depth = 4
  c.model.width = 128
  c.model.num_heads = 4
  c.model.block = 'dnt'
  c.model.dnt_setting = 'S5'
  c.model.norm = 'rmsnorm'

  # DNT mSGDW GPT: lr 1.0, wd 1e-4, momentum 0.9 (Qi et al. 2025, Tables 3, 5).
  c.optimizer.lr = 1.0
  c.optimizer.weight_decay = 1e-4
  c.optimizer.warmup_steps = 0
  c.optimizer.clip_norm = 1.0
  # Cosine to 0, as the result above was measured (the default is the paper's minimum, Qi et al. 2025
  # Table 5: 6e-5).
  c.optimizer.min_lr_ratio = 0.0
  return c
