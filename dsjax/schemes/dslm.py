r"""DeepScaleLM (DSLM): theory-derived initialisation and λ/β residual scaling.

Seed 000 (Kedia et al. 2024) §3.5, Appendices E and M; the recipe is SPEC.md §2. Every number below
comes from `dsjax.theory`; this module only decides which number goes into which weight.

For a stack of N layers (one layer = attention add + FFN add), width d, dropout p, K embedding tables:

    residual adds (both of every layer)   x ← λ·x + β·Drop(f(·)),  β² = k/N^α,  λ² = 1 − β²    (§3.5)
    each embedding table                  σe² = input_var·(1−p)/K          → model input variance
                                                                             input_var (= 1) after
                                                                             the embedding dropout
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

The weight variances are `theory.model.dslm_weight_vars` and λ, β `theory.model.dslm_residual_scales`.
r_n is the correlation of the residual stream *entering* layer n (`theory.model.dslm_layer_correlations`),
starting from the token correlation of the embedded input times (1−p) (the embedding dropout). The
reference code uses this value; the paper's pseudocode (Fig. 15) may read one layer later — SPEC §2.

The embedded input, per model:
  * GPT: token table + learned position table, K = 2. Token correlation: Zipf's law over the vocabulary
    (`theory.components.embedding_corr`, Appendix A.1), measured on real batches, or a number.
  * ViT: the patch embedding is a Linear (P²·C → d) of the pixels, which the input pipeline normalises
    to zero mean and unit variance; a Linear's output variance is d_in·σw²·E[x²] (Appendix A.2), so a
    kernel variance σe²/(P²·C) gives the patch term the variance σe² of one "table". With the learned
    position table that makes K = 2. The fixed sincos table (variance 1/2, strongly correlated
    neighbours) does not fit the recipe and is rejected. The token correlation of images has no closed
    form: measure it (the paper measured 0.46 on ImageNet, Appendix H) or give a number. A CLS token
    (zero-initialised by the model) is one zero row among L+1; 'measure' sees it.

`input_corr='measure'`: `measure_input_moments` embeds a few real batches with a provisional model and
returns the variance and token correlation of the summed embeddings (before the embedding dropout),
with the statistics of `dsjax.instrument.stats` (the theory's `Stats` convention). The provisional model
has depth 1 and the same seed: its embedding weights are drawn before the trunk and with stds that do not
depend on depth, so they are exactly the final model's. The measured variance is logged and saved
(`input_moments.json`) as a check of the embedding init; the recurrence of `dsjax.theory` starts from
variance 1 (the design value, λ² + β² = 1 keeps it there) and takes only the correlation.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os

import numpy as np

from dsjax import theory
from dsjax.schemes.base import InitPlan, ModelDims, per_layer

INITS = ('full', 'simple')
OUTPUT_SCALES = ('sqrt_d', 'sqrt_embed_var_d')
INPUT_CORR_MODES = ('zipf', 'measure')
BLOCKS = theory.model.BLOCKS  # the blocks whose residual adds DSLM scales
INPUT_MOMENTS_FILE = 'input_moments.json'


# ------------------------------------------------------------------------------------------------
# Config checks (also called by dsjax.validate, so a bad key fails before anything is built).
# ------------------------------------------------------------------------------------------------

def validate_config(model_config) -> None:
  """One-line ValueErrors for the `model.dslm` keys and the model settings DSLM cannot work with."""
  from dsjax.validate import one_of  # Deferred: dsjax.validate imports the schemes.
  m, c = model_config, model_config.dslm
  if m.block not in BLOCKS:
    raise ValueError(f"model.block must be one of {list(BLOCKS)} with model.scheme='dslm' (DSLM scales "
                     f'the residual adds of a Pre-LN or Post-LN stack), got {m.block!r}')
  one_of('model.dslm.init', c.init, INITS)
  one_of('model.dslm.attention_var', c.attention_var, theory.model.ATTENTION_VARS)
  one_of('model.dslm.output_scale', c.output_scale, OUTPUT_SCALES)
  if not _is_number(c.k) or c.k <= 0:
    raise ValueError(f'model.dslm.k must be a number > 0, got {c.k!r}')
  if not _is_number(c.alpha) or c.alpha < 0:
    raise ValueError(f'model.dslm.alpha must be a number >= 0, got {c.alpha!r}')
  if not isinstance(c.learnable_beta, bool):
    raise ValueError(f'model.dslm.learnable_beta must be True or False, got {c.learnable_beta!r}')
  if not _is_number(c.input_var) or c.input_var <= 0:
    raise ValueError(f'model.dslm.input_var must be a number > 0, got {c.input_var!r}')
  corr = c.input_corr
  if not (corr in INPUT_CORR_MODES or (_is_number(corr) and 0 < corr <= 1)):
    raise ValueError(f'model.dslm.input_corr must be one of {list(INPUT_CORR_MODES)} or a number in '
                     f'(0, 1], got {corr!r}')
  if m.name == 'vit' and corr == 'zipf':
    raise ValueError("model.dslm.input_corr='zipf' estimates the correlation of token lookups (GPT); "
                     "for ViT use 'measure' (the paper's way for images, Appendix H) or a number")
  if m.name == 'vit' and m.pos_embedding != 'learned':
    raise ValueError(f"model.pos_embedding must be 'learned' with model.scheme='dslm' (DSLM sets the "
                     f'position table variance; sincos2d has a fixed variance of 1/2), got {m.pos_embedding!r}')
  beta2 = theory.model.dslm_beta2(m.depth, c.k, c.alpha)
  if not beta2 < 1:
    raise ValueError(f'model.dslm.k / model.depth**model.dslm.alpha must be < 1 (β² = k/N^α, λ² = 1 − β²), '
                     f'got {beta2:.4g} with k={c.k}, alpha={c.alpha}, depth={m.depth}')


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------------

def embedding_table_var(model_config, dims: ModelDims) -> float:
  """σe² = input_var·(1−p)/K: K equal tables, then the embedding dropout (×1/(1−p)) → input_var."""
  return model_config.dslm.input_var * (1.0 - model_config.dropout) / dims.num_embedding_tables


def input_corr(model_config, dims: ModelDims, input_moments: dict[str, float] | None = None) -> float:
  """Token correlation r^l of the summed embeddings *before* the embedding dropout (the recurrence's start).

  Measured (`input_moments['corr_seq']`) for input_corr='measure', the Zipf estimate for 'zipf' (GPT),
  or the configured number.
  """
  c = model_config.dslm
  if c.input_corr == 'measure':
    if input_moments is None:
      raise ValueError("model.dslm.input_corr='measure' needs the measured input moments: pass "
                       'input_moments= to build_model (the training loop measures them with '
                       'dsjax.schemes.dslm.input_moments_for_run and saves input_moments.json in the workdir)')
    return float(input_moments['corr_seq'])
  if c.input_corr == 'zipf':
    # Word table with Zipf-distributed tokens, position table uncorrelated; the sum averages (App. A.1).
    return theory.components.embedding_corr(vocab_size=dims.input_dim, num_tables=dims.num_embedding_tables)
  return float(c.input_corr)


def init_plan(model_config, dims: ModelDims, input_moments: dict[str, float] | None = None) -> InitPlan:
  """The DSLM InitPlan (module docstring; SPEC §2)."""
  validate_config(model_config)
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
    raise ValueError(f"model.dslm.init='full' needs a positive token correlation of the embedded input, "
                     f'got {corr:.4g} (model.dslm.input_corr={c.input_corr!r}); use '
                     f"model.dslm.init='simple' or give model.dslm.input_corr as a positive number")
  weight_vars = theory.model.dslm_weight_vars(
      n, d, p, corr, k=c.k, alpha=c.alpha, activation=model_config.activation,
      mlp_ratio=dims.mlp_hidden // d, simple=simple, attention_var=c.attention_var,
      num_heads=dims.num_heads, seq_len=dims.seq_len, causal=dims.kind == 'gpt',
      attn_dropout=model_config.attn_dropout)

  if c.output_scale == 'sqrt_d':
    output_scale = 1.0 / math.sqrt(d)
  else:
    output_scale = 1.0 / math.sqrt(table_var * d)

  layer = {name: per_layer(n, np.sqrt(var)) for name, var in weight_vars.items()}
  layer.update(skip_attn=skip, branch_attn=branch, skip_ffn=skip, branch_ffn=branch)
  return InitPlan(distribution=model_config.init_distribution, layer=layer,
                  input_std=math.sqrt(input_var), pos_std=math.sqrt(table_var),
                  head_std=math.sqrt(table_var), output_scale=output_scale,
                  learnable_skip_scale=False, learnable_branch_scale=c.learnable_beta)


# ------------------------------------------------------------------------------------------------
# input_corr='measure': moments of the embedded input on real batches.
# ------------------------------------------------------------------------------------------------

def needs_measured_input(model_config) -> bool:
  return model_config.scheme == 'dslm' and model_config.dslm.input_corr == 'measure'


def measure_input_moments(config, data_info, batches) -> dict[str, float]:
  """Variance and token correlation r^l of the summed embeddings (before dropout), averaged over batches.

  Uses a provisional model with the run's seed and depth 1, whose embedding weights are the final
  model's (they are drawn first, with depth-independent stds), and the statistics of
  `dsjax.instrument.stats.forward_stats` (pooled mean; r^l = same hidden index, different tokens).
  """
  import jax
  from flax import nnx
  from dsjax import models
  from dsjax.instrument import stats as stats_lib
  from dsjax.train import step as step_lib

  provisional = copy.deepcopy(config)  # Keeps field types (input_corr may hold a string or a number).
  with provisional.unlocked():
    # One layer (with β² = k < 1 so that it is a valid DSLM stack), simple init, a fixed correlation:
    # none of these touches the embedding.
    provisional.model.depth = 1
    provisional.model.dslm.k, provisional.model.dslm.alpha = 0.5, 1.0
    provisional.model.dslm.init = 'simple'
    provisional.model.dslm.input_corr = 0.5
  model = models.build_model(provisional, data_info, nnx.Rngs(params=config.seed))
  embed_stats = jax.jit(lambda inputs: stats_lib.forward_stats(model.embed(inputs)))
  per_batch = [jax.device_get(embed_stats(step_lib.model_inputs(config.model.name, b))) for b in batches]
  if not per_batch:
    raise ValueError('measure_input_moments needs at least one batch')
  mean = lambda key: float(np.mean([s[key] for s in per_batch]))
  return {'var': mean('var'), 'corr_seq': mean('corr_seq'), 'mean': mean('mean'),
          'num_batches': len(per_batch)}


def input_moments_for_run(config, data_info, workdir: str | None = None, *, write: bool = True,
                          num_batches: int = 4) -> dict[str, float] | None:
  """The measured input moments a run needs (None unless model.dslm.input_corr='measure').

  Reads `workdir/input_moments.json` when it exists (a resumed run, `dsjax.export`, `dsjax.moments`),
  else measures on the first `num_batches` training batches — the same rows on every host — and
  writes the file (when `write`).
  """
  if not needs_measured_input(config.model):
    return None
  path = None if workdir is None else os.path.join(workdir, INPUT_MOMENTS_FILE)
  if path is not None and os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  import itertools
  from dsjax import data as data_lib
  pipeline = data_lib.make_pipeline(config.data, global_batch_size=config.batch_size, seed=config.seed,
                                    process_index=0, process_count=1, train=True)
  moments = measure_input_moments(config, data_info, itertools.islice(pipeline, num_batches))
  if path is not None and write:
    os.makedirs(workdir, exist_ok=True)
    with open(path, 'w') as f:
      json.dump(moments, f, indent=1)
  return moments
