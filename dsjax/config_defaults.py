"""The full default config that `configs/*.py` start from. Every key a run reads is defined here.

Config files override what they need and document the command, runtime and result; a run locks the
config (`lock_config=True`) so that a mistyped override (`--config.model.detph=4`) fails at once.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def base_config(model_name: str, optimizer_name: str = 'adamw') -> ml_collections.ConfigDict:
  from dsjax.data import config as data_config
  from dsjax.train.optimizers import default_optimizer_config

  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 1000
  c.batch_size = 128              # global, over all processes and devices
  c.eval_every = 200              # steps; the final step is always evaluated
  c.eval_batch_size = 256
  c.checkpoint_every = 500        # steps; the final step is always saved
  c.keep_checkpoints = 2
  c.log_every = 50

  c.model = m = ml_collections.ConfigDict()
  m.name = model_name             # 'vit' | 'gpt'
  m.depth = 6                     # N layers; a layer = attention add + FFN add
  m.width = 128                   # d
  m.num_heads = 4
  m.mlp_ratio = 4                 # FFN hidden = mlp_ratio · d
  m.block = 'preln'               # 'preln' | 'postln' | 'dnt'
  m.dnt_setting = 'S5'            # DNT norm placement S1–S5 (seed 004 §3, SPEC §3); used when block='dnt'
  m.final_norm = config_dict.placeholder(bool)  # None: the block's default (preln/dnt on, postln off)
  m.norm = 'layernorm'            # 'layernorm' | 'rmsnorm'
  m.norm_eps = 1e-6
  m.activation = 'gelu'           # 'gelu' (exact, x·Φ(x)) | 'relu'
  m.dropout = 0.0                 # embedding and every branch output
  m.attn_dropout = 0.0            # attention probabilities
  m.use_bias = True
  m.scheme = 'vanilla'            # initialisation + residual scaling method (dsjax.schemes)
  m.init = 'xavier'               # vanilla scheme: 'xavier' | 'gpt2' (N(0, 0.02²))
  m.init_distribution = 'normal'  # 'normal' | 'truncated_normal' | 'uniform'
  m.remat = 'none'                # 'none' | 'full' | a jax.checkpoint_policies name
  # ViT only.
  m.patch_size = 2
  m.pos_embedding = 'learned'     # 'learned' | 'sincos2d'
  m.pooling = 'gap'               # 'gap' | 'cls'
  # GPT only.
  m.tie_embeddings = False
  # DeepScaleLM (model.scheme='dslm'; seed 000 §3.5 and Appendix M, SPEC §2; see dsjax/schemes/dslm.py).
  m.dslm = d = ml_collections.ConfigDict()
  d.init = 'simple'               # 'simple': V/O like the FFN (all of the paper's §4 runs) | 'full': V/O per
                                  # layer from the correlation recurrence (paper §3.5 item 3, Fig. 15)
  d.attention_var = 'table2'      # full init only. 'table2': the paper's V/O, C1·r_n = 1 (Table 2;
                                  # assumes bidirectional attention over long sequences) | 'exact': V/O
                                  # give attention-block output variance 1 by dsjax.theory's attention
                                  # moments (causal mask, L, heads); 4.3× smaller V·O at layer 0 of a
                                  # causal byte-level GPT (theory.model.dslm_weight_vars,
                                  # experiments/dslm_results.md for the measured trade-off)
  d.k = 2.0                       # β² = k/N^alpha, λ² = 1 − β² at both adds of every layer (paper: k = 2)
  d.alpha = 1.0                   # α = 1: gradient change and sensitivity independent of depth (Appendix G)
  d.learnable_beta = False        # paper Table 13: a learnable β is worse than the fixed one
  d.output_scale = 'sqrt_d'       # final hidden state × 1/sqrt(d) (paper) | 'sqrt_embed_var_d':
                                  # × 1/sqrt(σe²·d) (reference code: 1/sqrt(0.3·d), σe² = 0.3 for BERT)
  # Token correlation of the embedded input, start of the recurrence: 'zipf' (paper's estimate for
  # text, Appendix A.1), 'measure' (on real batches, the paper's way for vision/speech, Appendix H) or
  # a number. A FieldReference of type object so that both a string and a number can be set.
  d.input_corr = config_dict.FieldReference('measure' if model_name == 'vit' else 'zipf', field_type=object)
  d.input_var = 1.0               # variance of the model input after the embedding dropout (paper: 1)

  c.optimizer = default_optimizer_config(optimizer_name, family=model_name)

  # Embedded offline defaults: 8×8 handwritten digits (ViT), Python's documentation as bytes (GPT).
  c.data = data_config.get_config('sklearn_digits' if model_name == 'vit' else 'python_docs_bytes')

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)       # (data, fsdp, tensor); -1 = all remaining devices

  c.instrument = ml_collections.ConfigDict()
  c.instrument.every = 0          # steps between per-layer moment records; 0 = off (no callbacks compiled)
  c.instrument.delivery = 'return'  # 'return': statistics returned from the jitted step | 'callback':
                                  # jax.debug.callback per site from inside the layer scan (see
                                  # dsjax/instrument/README.md for why 'return' is the default)
  return c
