r"""DeepScaleLM ViT (Post-LN) on the embedded 8×8 digits, input correlation measured on the data.

Command (2-core CPU, no network):

  python -m dsjax.main --config=configs/vit_dslm.py --workdir=/tmp/vit_dslm

Expected runtime: 5m13s wall on the 2-core CPU (2026-12-03).
Expected result: test accuracy 0.997 (299/300; eval loss 0.0258) after 1500 steps (measured 2026-12-03,
seed 0; 0.993 with the previous input pipeline, another training order). Logged input moments of the
embedded digits: variance 0.982 (the design value before the embedding dropout: 1 − p = 0.9), token
correlation −0.026.

The paper's recipe for vision (Kedia et al. 2024, arXiv:2403.09635, Appendix H): the patch embedding is a
Linear of the normalised pixels, and the token correlation of the embedded input is measured on real
batches before the model is built (`model.dslm.input_corr = 'measure'`; the run logs it and writes
`scheme_preparation.json`, which `dsjax.moments` and `dsjax.export` reuse). On these digits it is ≈ −0.03
(the constant border pixels sit below the pooled mean), which the full init cannot use (its V/O variance
∝ 1/sqrt(r); it raises), so this config uses the simple init of the paper's §4 runs; with images like
ImageNet (r ≈ 0.46) `--config.model.dslm.init=full` uses the measured value. The position table is the
learned one, whose variance DSLM sets; the paper's own ViT runs used a fixed 2D sin-cos table and no
dropout (Appendix N, Table 26): `--config.model.pos_embedding=sincos2d --config.model.dropout=0` (the
patch term then takes what the table leaves of the input variance; the result above is this config's).
Same parameter count as `configs/vit_preln.py` (6 × 128) spent on 24 layers × width 64.
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('vit', optimizer_name='adamw')
  c.total_steps = 1500
  c.batch_size = 128
  c.eval_every = 500
  c.checkpoint_every = 500
  c.log_every = 100

  c.model.depth = 24
  c.model.width = 64
  c.model.num_heads = 4
  c.model.patch_size = 2
  c.model.block = 'postln'
  c.model.pos_embedding = 'learned'  # DSLM sets its variance; the paper's sincos2d: see the docstring
  c.model.dropout = 0.1
  c.model.scheme = 'dslm'
  c.model.dslm.init = 'simple'  # the paper's §4 runs; see the docstring for why not 'full' here
  c.model.dslm.input_corr = 'measure'

  c.optimizer.lr = 1e-3  # AdamW ViT settings of configs/vit_preln.py
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 100
  # Cosine to 0, as the result above was measured (the default is the paper's minimum, Qi et al. 2025
  # Table 4: 1e-8).
  c.optimizer.min_lr_ratio = 0.0
  return c
