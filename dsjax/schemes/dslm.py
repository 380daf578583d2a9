r"""DeepScaleLM (DSLM): theory-derived initialisation and λ/β residual scaling.

Kedia et al. 2024, "Transformers Get Stable: An End-to-End Signal Propagation Theory for Language
Models" (ICML 2024, arXiv:2403.09635), §3.5, Appendices E and M. Every number below comes from
`dsjax.theory`; this module only decides which number goes into which weight.

For a stack of N layers (one layer = attention add + FFN add), width d, dropout p, K embedding tables:

    residual adds (both of every layer)   x ← λ·x + β·Drop(f(·)),  β² = k/N^α,  λ² = 1 − β²    (§3.5)
    each embedding table                  σe² = input_var·(1−p)/K          → model input variance
                                                                             input_var (= 1) after
                                                                             the embedding dropout
                                          (ViT with sincos2d: the patch term input_var·(1−p) − 1/2)
    both FFN matrices                     σf² = theory.model.ffn_unit_weight_var → FFN block output
                                          variance 1; ReLU, hidden 4d: (1/d)·sqrt((1−p)/2); GeLU is
                                          solved from the GeLU moments (Appendix A.5), not the ReLU value
    queries, keys                         1/d (reference code)
    values, output projection   full:     per layer n, attention block output variance 1 for an input
                                          of correlation r_n (the recurrence below): the paper's Table 2
                                          C1·r_n = 1, i.e. (1/d)·sqrt((1−p)/r_n) (attention_var='table2',
                                          default), or from the exact attention moments of
                                          `dsjax.theory` for this model's causal mask, length and heads
                                          ('exact'; equal to Table 2 for long bidirectional sequences)
                                simple:   σf² (the paper's §4 experiments all use this; Appendix E.5)
    final hidden state × s                s = 1/sqrt(d) ('sqrt_d', paper) or 1/sqrt(σe²·d)
                                          ('sqrt_embed_var_d', reference code: 1/sqrt(0.3·d))
    untied head                           σe² (the token table's variance): an untied head then sees
                                          exactly the logit statistics of a tied one
    biases 0, norm gains 1                (the model's defaults)

The weight variances are `theory.model.dslm_weight_vars`, λ and β `theory.model.dslm_residual_scales`; r_n,
the correlation of the stream entering layer n, is `theory.model.dslm_layer_correlations`, starting from the
embedded input's token correlation times (1−p). GPT sums a token and a learned position table (K = 2), its
token correlation from Zipf's law (Appendix A.1), measured, or a number. ViT's patch embedding is a Linear
of unit-variance pixels, so its kernel variance σe²/(P²·C) gives the patch term the variance σe² of one
table (K = 2 with the learned position table). With the fixed sincos2d table (mean square 1/2, the paper's
ViT, Appendix N) the patch term takes the rest: σe² = input_var·(1−p) − 1/2. `input_corr='measure'` is a
preparation step (`measure_input_moments`): a depth-1 provisional model with the same seed (exactly the
final embedding weights) embeds a few real batches; the measured token correlation starts the recurrence,
the measured variance is logged and saved as a check. Details and reasons: docs/theory.md, "DeepScaleLM".
"""

from __future__ import annotations

import copy
import itertools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from ml_collections import config_dict

from dsjax import models, theory
from dsjax.models.config import boolean, is_number, number, one_of
from dsjax.models.plan import InitPlan, ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme

INITS = ('full', 'simple')
OUTPUT_SCALES = ('sqrt_d', 'sqrt_embed_var_d')
INPUT_CORR_MODES = ('zipf', 'measure')
MEASURE_BATCHES = 4  # training batches the input correlation is measured on


def config(model_name: str) -> ml_collections.ConfigDict:
  """`model.dslm`: the method's constants with the paper's defaults (§3.5, Appendix M)."""
  d = ml_collections.ConfigDict()
  d.init = 'simple'  # 'simple': V/O like the FFN (all of the paper's §4 runs) | 'full': V/O per
  # layer from the correlation recurrence (paper §3.5 item 3, Fig. 15)
  d.attention_var = 'table2'  # full init only. 'table2': the paper's V/O, C1·r_n = 1 (Table 2;
  # assumes bidirectional attention over long sequences) | 'exact': V/O
  # give attention-block output variance 1 by dsjax.theory's attention
  # moments (causal mask, L, heads); 4.3× smaller V·O at layer 0 of a
  # causal byte-level GPT (theory.model.dslm_weight_vars,
  # experiments/dslm_results.md for the measured trade-off)
  d.k = 2.0  # β² = k/N^alpha, λ² = 1 − β² at both adds of every layer (paper: k = 2)
  d.alpha = 1.0  # α = 1: gradient change and sensitivity independent of depth (Appendix G)
  d.learnable_beta = False  # paper Table 13: a learnable β is worse than the fixed one
  d.output_scale = 'sqrt_d'  # final hidden state × 1/sqrt(d) (paper) | 'sqrt_embed_var_d':
  # × 1/sqrt(σe²·d) (reference code: 1/sqrt(0.3·d), σe² = 0.3 for BERT)
  # Token correlation of the embedded input, start of the recurrence: 'zipf' (paper's estimate for
  # text, Appendix A.1), 'measure' (on real batches, the paper's way for vision/speech, Appendix H) or
  # a number. A FieldReference of type object so that both a string and a number can be set.
  d.input_corr = config_dict.FieldReference('measure' if model_name == 'vit' else 'zipf', field_type=object)
  d.input_var = 1.0  # variance of the model input after the embedding dropout (paper: 1)
  return d


# ------------------------------------------------------------------------------------------------
# Config checks (run by dsjax.schemes.validate before anything is built).
# ------------------------------------------------------------------------------------------------


def validate_config(model_config) -> None:
  """One-line ValueErrors for the `model.dslm` keys and the model settings DSLM cannot work with."""
  m, c = model_config, model_config.dslm
  if m.block not in theory.model.BLOCKS:
    raise ValueError(
      f"model.block must be one of {list(theory.model.BLOCKS)} with model.scheme='dslm' "
      f'(DSLM scales the residual adds of a Pre-LN or Post-LN stack), got {m.block!r}'
    )
  one_of('model.dslm.init', c.init, INITS)
  one_of('model.dslm.attention_var', c.attention_var, theory.model.ATTENTION_VARS)
  one_of('model.dslm.output_scale', c.output_scale, OUTPUT_SCALES)
  number('model.dslm.k', c.k, low=0, low_open=True)
  number('model.dslm.alpha', c.alpha, low=0)
  boolean('model.dslm.learnable_beta', c.learnable_beta)
  number('model.dslm.input_var', c.input_var, low=0, low_open=True)
  corr = c.input_corr
  if not (corr in INPUT_CORR_MODES or (is_number(corr) and 0 < corr <= 1)):
    raise ValueError(
      f'model.dslm.input_corr must be one of {list(INPUT_CORR_MODES)} or a number in (0, 1], got {corr!r}'
    )
  if m.name == 'vit' and corr == 'zipf':
    raise ValueError(
      "model.dslm.input_corr='zipf' estimates the correlation of token lookups (GPT); "
      "for ViT use 'measure' (the paper's way for images, Appendix H) or a number"
    )
  summed = c.input_var * (1.0 - m.dropout)
  if m.name == 'vit' and m.pos_embedding == 'sincos2d' and summed <= models.vit.SINCOS_MEAN_SQUARE:
    raise ValueError(
      f'model.dslm.input_var·(1 − model.dropout) must exceed 1/2 with model.pos_embedding=sincos2d '
      f'(the fixed table has mean square 1/2; the patch term takes the rest), got {summed:.4g}'
    )
  beta2 = theory.model.dslm_beta2(m.depth, c.k, c.alpha)
  if not beta2 < 1:
    raise ValueError(
      f'model.dslm.k / model.depth**model.dslm.alpha must be < 1 (β² = k/N^α, λ² = 1 − β²), '
      f'got {beta2:.4g} with k={c.k}, alpha={c.alpha}, depth={m.depth}'
    )


# ------------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------------


def embedding_table_var(model_config, dims: ModelDims) -> float:
  """σe², the token table's (GPT) or patch term's (ViT) variance, so that the embedded input has variance
  input_var after the embedding dropout (×1/(1−p)): input_var·(1−p)/K for K equal tables; with ViT's fixed
  sincos2d table, what its mean square of 1/2 leaves of input_var·(1−p)."""
  summed = model_config.dslm.input_var * (1.0 - model_config.dropout)
  if dims.kind == 'vit' and model_config.pos_embedding == 'sincos2d':
    return summed - models.vit.SINCOS_MEAN_SQUARE
  return summed / dims.num_embedding_tables


def input_corr(model_config, dims: ModelDims, input_moments: dict[str, float] | None = None) -> float:
  """Token correlation r^l of the summed embeddings *before* the embedding dropout (the recurrence's start).

  Measured (`input_moments['corr_seq']`) for input_corr='measure', the Zipf estimate for 'zipf' (GPT),
  or the configured number.
  """
  c = model_config.dslm
  if c.input_corr == 'measure':
    if input_moments is None:
      raise ValueError(
        "model.dslm.input_corr='measure' needs the measured input moments: pass "
        'prepared= to dsjax.schemes.build_model (the training loop measures them with '
        'dsjax.schemes.preparation_for_run and saves them in the workdir)'
      )
    return float(input_moments['corr_seq'])
  if c.input_corr == 'zipf':
    # Word table with Zipf-distributed tokens, position table uncorrelated; the sum averages (App. A.1).
    return theory.components.embedding_corr(vocab_size=dims.input_dim, num_tables=dims.num_embedding_tables)
  return float(c.input_corr)


def init_plan(model_config, dims: ModelDims, input_moments: dict[str, float] | None = None) -> InitPlan:
  """The DSLM InitPlan (module docstring)."""
  c, p = model_config.dslm, model_config.dropout
  n, d = dims.depth, dims.width
  if dims.mlp_hidden % d:
    raise ValueError(f'DSLM needs an integer model.mlp_ratio, got FFN width {dims.mlp_hidden} for d={d}')

  lam, beta = theory.model.dslm_residual_scales(n, c.k, c.alpha)
  skip, branch = per_layer(n, lam), per_layer(n, beta)

  table_var = embedding_table_var(model_config, dims)
  # ViT: a Linear of unit-second-moment pixels (module docstring); GPT: a lookup table.
  input_var = table_var / dims.input_dim if dims.kind == 'vit' else table_var

  # q, k: 1/d; ffn1, ffn2: unit FFN output (GeLU from its own moments); v, o: full or simple init.
  simple = c.init == 'simple'
  corr = 0.0 if simple else input_corr(model_config, dims, input_moments)
  if not simple and corr <= 0:
    # σv² = σo² ∝ 1/sqrt(r_0): the recipe's attention variance C1·r·s2 assumes correlated tokens.
    raise ValueError(
      f"model.dslm.init='full' needs a positive token correlation of the embedded input, "
      f'got {corr:.4g} (model.dslm.input_corr={c.input_corr!r}); use '
      f"model.dslm.init='simple' or give model.dslm.input_corr as a positive number"
    )
  weight_vars = theory.model.dslm_weight_vars(
    n,
    d,
    p,
    corr,
    k=c.k,
    alpha=c.alpha,
    activation=model_config.activation,
    mlp_ratio=dims.mlp_hidden // d,
    simple=simple,
    attention_var=c.attention_var,
    num_heads=dims.num_heads,
    seq_len=dims.seq_len,
    causal=dims.kind == 'gpt',
    attn_dropout=model_config.attn_dropout,
  )

  if c.output_scale == 'sqrt_d':
    output_scale = 1.0 / math.sqrt(d)
  else:
    output_scale = 1.0 / math.sqrt(table_var * d)

  layer = {name: per_layer(n, np.sqrt(var)) for name, var in weight_vars.items()}
  layer.update(skip_attn=skip, branch_attn=branch, skip_ffn=skip, branch_ffn=branch)
  return InitPlan(
    distribution=model_config.init_distribution,
    layer=layer,
    input_std=math.sqrt(input_var),
    pos_std=math.sqrt(table_var),
    head_std=math.sqrt(table_var),
    output_scale=output_scale,
    branch=ResidualScale(learnable=c.learnable_beta),
  )


# ------------------------------------------------------------------------------------------------
# input_corr='measure': moments of the embedded input on real batches (the preparation step).
# ------------------------------------------------------------------------------------------------


def needs_measured_input(model_config) -> bool:
  return model_config.dslm.input_corr == 'measure'


def embedding_moments(x_BLD: jax.Array) -> dict[str, jax.Array]:
  """Pooled mean, variance and token correlation r^l (same hidden index, tokens t ≠ t') of x_BLD.

  Σ_{t≠t'} c_t·c_t' = (Σ_t c_t)² − Σ_t c_t² for centred values c, so no L×L matrix is formed."""
  x_BLD = x_BLD.astype(jnp.float32)
  c_BLD = x_BLD - x_BLD.mean()
  var = (c_BLD**2).mean()
  pair_sum = (c_BLD.sum(1) ** 2).sum() - (c_BLD**2).sum()
  corr_seq = pair_sum / (c_BLD.size * (x_BLD.shape[1] - 1)) / jnp.maximum(var, 1e-30)
  return {'mean': x_BLD.mean(), 'var': var, 'corr_seq': corr_seq}


def measure_input_moments(config, data_info, inputs) -> dict[str, float]:
  """Variance and token correlation r^l of the summed embeddings (before dropout), averaged over batches.

  `inputs`: model inputs of real batches. Uses a provisional model with the run's seed and depth 1, whose
  embedding weights are the final model's (they are drawn first, with depth-independent stds).
  """
  provisional = copy.deepcopy(config)  # Keeps field types (input_corr may hold a string or a number).
  with provisional.unlocked():
    # One layer (with β² = k < 1 so that it is a valid DSLM stack), simple init, a fixed correlation:
    # none of these touches the embedding.
    provisional.model.depth = 1
    provisional.model.dslm.k, provisional.model.dslm.alpha = 0.5, 1.0
    provisional.model.dslm.init = 'simple'
    provisional.model.dslm.input_corr = 0.5
  seq_len = provisional.data.seq_len
  plan = init_plan(provisional.model, models.model_dims(provisional.model, data_info, seq_len=seq_len))
  model = models.build_model(
    provisional.model, data_info, plan, nnx.Rngs(params=config.seed), seq_len=seq_len
  )
  embed_stats = jax.jit(lambda x: embedding_moments(model.embed(x)))
  per_batch = [jax.device_get(embed_stats(x)) for x in inputs]
  if not per_batch:
    raise ValueError('measure_input_moments needs at least one batch')
  mean = lambda key: float(np.mean([s[key] for s in per_batch]))
  return {
    'var': mean('var'),
    'corr_seq': mean('corr_seq'),
    'mean': mean('mean'),
    'num_batches': len(per_batch),
  }


class DSLM(Scheme):
  name = 'dslm'
  paper = 'Kedia et al. 2024, Transformers Get Stable (ICML 2024, arXiv:2403.09635), §3.5, App. E, M'
  summary = (
    'theory-derived weight variances (embeddings, FFN, V/O per layer); λ² = 1 − k/N, β² = k/N at '
    'both adds; output × 1/sqrt(d)'
  )
  blocks = theory.model.BLOCKS

  def config(self, model_name):
    return config(model_name)

  def validate(self, m):
    validate_config(m)

  def init_plan(self, m, dims, prepared=None):
    return init_plan(m, dims, prepared)

  def needs_preparation(self, m):
    return needs_measured_input(m)

  def prepare(self, config, data_info, inputs):
    return measure_input_moments(config, data_info, itertools.islice(inputs, MEASURE_BATCHES))


SCHEME = DSLM()
