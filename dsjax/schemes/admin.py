r"""ADMIN: Post-LN with a learnable, profiled skip weight ω per residual add.

Liu, Liu, Gao, Chen & Han 2020, "Understanding the Difficulty of Training Transformers" (EMNLP 2020,
arXiv:2004.08249), Admin (adaptive model initialisation).

Definition as implemented. The 2N residual sub-layers of an N-layer stack are counted in order
k = 0, 1, ..., 2N−1 (attention of layer 0, FFN of layer 0, attention of layer 1, ...); F_k is the branch
of sub-layer k and x_k its input (x_0 = the embedded input after its dropout, x_k = the LayerNorm output
of sub-layer k−1):

    every residual add (Post-LN)   x_{k+1} = LN(x_k ⊙ ω_k + F_k(x_k))     ω_k ∈ R^d learnable (never
                                                                        weight-decayed), branch scale 1
    initial ω (every entry)        ω_0 = 1,  ω_k² = Var[x_0] + Σ_{j<k} Var[F_j(x_j)]  for k ≥ 1
    weights                        Xavier (`vanilla.xavier_plan`), untouched by the method

The skip term ω_k·x_k then has variance Var[x_0] + Σ_{j<k} Var[F_j]: the stack input counts as the 0-th
term of the paper's sum, as the authors' profiling code does. Why, and the choices the paper leaves open
(one profiling pass with ω = 1, four batches, Post-LN only): docs/methods.md, "ADMIN".

`model.admin.omega` picks where the variances come from:

  'profile' (default, the paper's Admin): a data-dependent preparation step. A provisional model — the
      same config and seed, so exactly the final model's weights, but ω = 1 everywhere and the layers
      run as a Python loop (`model.scan_layers = False`) — is run on `PROFILE_BATCHES` real training
      batches (with dropout, as in training); a probe records Var[x_0] (site 'embedding') and Var[F_k]
      (sites 'attn_branch', 'ffn_branch'), pooled over all elements of the batch and averaged over
      batches. The result ({'omega_sq': [2N floats], 'input_var', 'branch_var': [2N floats],
      'num_batches'}) is saved by the trainer in the workdir and read back on resume.
  'closed_form': the same formula with the variances `dsjax.theory.model.propagate` predicts for this
      Post-LN model with ω = 1 at initialisation (Xavier weights, the model's dropout, activation,
      causal mask, heads and length; the input variance from the embedding stds, unit-variance pixels for
      ViT; the input token correlation `model.admin.input_corr`). No profiling pass: the expected value
      of the profile.
  'log': the layer-independent closed form of the authors' later `admin-torch` package,
      ω = sqrt((n+1)/ln(n+1) − 1) for n = 2N residual sub-layers, every sub-layer alike. It is a
      different choice, not the expectation of the profile: it bounds the output change by O(log n),
      while the profile (every ω_k² summing all earlier branch variances) grows ω_k² linearly in k.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from ml_collections import config_dict

from dsjax import models, theory
from dsjax.models.config import is_number, one_of
from dsjax.models.plan import WEIGHT_KEYS, InitPlan, ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

OMEGA_MODES = ('profile', 'closed_form', 'log')
PROFILE_BATCHES = 4  # training batches the profile averages over
INPUT_SITE = 'embedding'  # the probe site of the stack input x_0
BRANCH_SITES = ('attn_branch', 'ffn_branch')  # the probe sites of F_k (sub-layer k: BRANCH_SITES[k % 2])
SKIP = ResidualScale(learnable=True, vector=True)


# ------------------------------------------------------------------------------------------------
# ω from variances.
# ------------------------------------------------------------------------------------------------


def omega_sq_from_variances(input_var: float, branch_var) -> np.ndarray:
  """ω_0² = 1 and ω_k² = Var[x_0] + Σ_{j<k} Var[F_j] for k = 1..len(branch_var)−1 (module docstring).

  Both say Var[ω_k·x_k] = Var[x_0] + Σ_{j<k} Var[F_j]: x_0 has variance Var[x_0], the later x_k are
  LayerNorm outputs of variance 1."""
  branch_var = np.asarray(branch_var, np.float64)
  omega_sq = float(input_var) + np.concatenate([[0.0], np.cumsum(branch_var)[:-1]])
  omega_sq[0] = 1.0
  return omega_sq


def log_omega_sq(num_sublayers: int) -> float:
  """ω² = (n+1)/ln(n+1) − 1 for n residual sub-layers (the `admin-torch` default, O(log n))."""
  n = num_sublayers
  return (n + 1) / math.log(n + 1) - 1


# ------------------------------------------------------------------------------------------------
# 'profile': the preparation step.
# ------------------------------------------------------------------------------------------------


def profile_variances(
  apply: Callable[..., Any], params, inputs: Iterable[Any], num_sublayers: int, seed: int = 0
) -> dict[str, Any]:
  """Var[x_0] and Var[F_k] of a stack, measured by a probe, averaged over the batches of `inputs`.

  `apply(params, x, dropout_key, probe)` runs the stack once, calling `probe(site, tensor, layer)` with
  site 'embedding' for its input and then 'attn_branch', 'ffn_branch' alternately for its branches (in
  order: a Python loop over the layers, as `model.scan_layers = False` runs them). Variances are pooled
  over all elements of a batch. Returns {'omega_sq', 'input_var', 'branch_var', 'num_batches'}.
  """
  expected = [INPUT_SITE] + [BRANCH_SITES[k % 2] for k in range(num_sublayers)]

  def variances(params, x, key):
    recorded = []

    def probe(site, h, layer):
      del layer
      if site == INPUT_SITE or site in BRANCH_SITES:
        recorded.append((site, jnp.var(h.astype(jnp.float32))))
      return h

    apply(params, x, key, probe)
    sites = [site for site, _ in recorded]
    if sites != expected:
      raise ValueError(
        f'the profiling pass saw the probe sites {sites}, expected {expected} (the '
        'stack must run as a Python loop over the layers: model.scan_layers=False)'
      )
    return jnp.stack([v for _, v in recorded])

  jitted = jax.jit(variances)
  base_key = jax.random.key(seed)
  per_batch = [
    np.asarray(jax.device_get(jitted(params, x, jax.random.fold_in(base_key, i))), np.float64)
    for i, x in enumerate(inputs)
  ]
  if not per_batch:
    raise ValueError('the ADMIN profile needs at least one batch')
  mean = np.mean(per_batch, axis=0)
  input_var, branch_var = float(mean[0]), mean[1:]
  return {
    'omega_sq': [float(v) for v in omega_sq_from_variances(input_var, branch_var)],
    'input_var': input_var,
    'branch_var': [float(v) for v in branch_var],
    'num_batches': len(per_batch),
  }


def provisional_plan(m, dims: ModelDims) -> InitPlan:
  """The ADMIN plan with ω = 1 at every add: the model the profile runs (same weights as the final one)."""
  return _plan(m, dims, np.ones(2 * dims.depth))


def profile(config, data_info, inputs: Iterable[Any]) -> dict[str, Any]:
  """The preparation step of omega='profile' on model inputs of real batches (module docstring)."""
  provisional = copy.deepcopy(config)  # Keeps field types (input_corr may hold a string or a number).
  with provisional.unlocked():
    provisional.model.scan_layers = False
  dims = models.model_dims(provisional.model, data_info, seq_len=provisional.data.seq_len)
  model = models.build_model(
    provisional.model,
    data_info,
    provisional_plan(provisional.model, dims),
    nnx.Rngs(params=config.seed),
    seq_len=provisional.data.seq_len,
  )
  graphdef, state = nnx.split(model)
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0

  def apply(state, x, key, probe):
    return nnx.merge(graphdef, state)(x, dropout_key=key if use_dropout else None, probe=probe)

  return profile_variances(apply, state, inputs, 2 * dims.depth, seed=config.seed)


# ------------------------------------------------------------------------------------------------
# 'closed_form': the expected profile from dsjax.theory.
# ------------------------------------------------------------------------------------------------


def input_stats(m, dims: ModelDims, plan: InitPlan) -> theory.Stats:
  """Variance and token correlation of the embedded input (before its dropout) under `plan`.

  GPT: token + position table, uncorrelated: σ_in² + σ_pos². ViT: the patch embedding of unit-variance
  pixels (the input pipeline normalises them) has variance input_dim·σ_in²; plus the position table
  (learned: σ_pos²; sincos2d: 1/2); a CLS token is a zero row among seq_len.
  """
  if dims.kind == 'gpt':
    var = plan.input_std**2 + plan.pos_std**2
  else:
    pos_var = plan.pos_std**2 if m.pos_embedding == 'learned' else 0.5
    var = dims.input_dim * plan.input_std**2 + pos_var
    if m.pooling == 'cls':
      var *= (dims.seq_len - 1) / dims.seq_len
  corr = m.admin.input_corr
  if corr == 'zipf':
    corr = theory.components.embedding_corr(vocab_size=dims.input_dim, num_tables=dims.num_embedding_tables)
  return theory.Stats(var=float(var), corr_seq=float(corr))


def theory_variances(m, dims: ModelDims) -> tuple[float, np.ndarray]:
  """(Var[x_0], Var[F_k] for k < 2N) that `dsjax.theory` predicts for the ω = 1 model at initialisation."""
  plan = provisional_plan(m, dims)
  prop = theory.model.propagate(
    depth=dims.depth,
    width=dims.width,
    num_heads=dims.num_heads,
    seq_len=dims.seq_len,
    dropout=m.dropout,
    attn_dropout=m.attn_dropout,
    activation=m.activation,
    block='postln',
    causal=dims.kind == 'gpt',
    mlp_ratio=dims.mlp_hidden // dims.width,
    weight_vars={k: np.asarray(plan.layer[k], np.float64) ** 2 for k in WEIGHT_KEYS},
    input=input_stats(m, dims, plan),
    embedding_dropout=True,
  )
  return float(prop.stream_in.var), np.asarray(prop.branch_var, np.float64)


# ------------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------------


def _plan(m, dims: ModelDims, omega_sq) -> InitPlan:
  n = dims.depth
  omega = np.sqrt(np.asarray(omega_sq, np.float64))
  base = xavier_plan(m, dims)
  layer = {**base.layer, 'skip_attn': per_layer(n, omega[0::2]), 'skip_ffn': per_layer(n, omega[1::2])}
  return xavier_plan(m, dims, layer=layer, skip=SKIP)


def omega_sq(m, dims: ModelDims, prepared: dict[str, Any] | None = None) -> np.ndarray:
  """The initial ω_k², k = 0..2N−1, of `model.admin.omega`."""
  mode, num = m.admin.omega, 2 * dims.depth
  if mode == 'log':
    return np.full(num, log_omega_sq(num))
  if mode == 'closed_form':
    input_var, branch_var = theory_variances(m, dims)
    return omega_sq_from_variances(input_var, branch_var)
  if prepared is None:
    raise ValueError(
      "model.admin.omega='profile' needs the profiling result: pass prepared= to "
      'dsjax.schemes.build_model (the training loop runs the profile with '
      'dsjax.schemes.preparation_for_run and saves it in the workdir)'
    )
  values = np.asarray(prepared['omega_sq'], np.float64)
  if values.shape != (num,):
    raise ValueError(
      f'the ADMIN profile has {values.size} values of ω², the model has {num} residual '
      f'sub-layers (model.depth={dims.depth}); profile this model again'
    )
  return values


class Admin(Scheme):
  name = 'admin'
  paper = (
    'Liu et al. 2020, Understanding the Difficulty of Training Transformers (EMNLP 2020, '
    'arXiv:2004.08249), Admin'
  )
  summary = (
    'Post-LN LN(x⊙ω + F(x)), learnable vector ω per add; ω_k² = Var[x_0] + Σ_{j<k} Var[F_j] '
    '(ω_0 = 1) from a profiling pass (or its closed form)'
  )
  blocks = ('postln',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.omega = 'profile'  # 'profile' (the paper's Admin: measured on real batches) | 'closed_form'
    # (dsjax.theory's expected profile) | 'log' (admin-torch's
    # sqrt((n+1)/ln(n+1) − 1), n = 2N)
    # closed_form only: token correlation of the embedded input. 'zipf' (GPT: Kedia et al. 2024,
    # App. A.1) or a number (ViT default 0: patch embeddings of the digits are nearly uncorrelated).
    c.input_corr = config_dict.FieldReference('zipf' if model_name == 'gpt' else 0.0, field_type=object)
    return c

  def validate(self, m):
    super().validate(m)
    c = m.admin
    one_of('model.admin.omega', c.omega, OMEGA_MODES)
    corr = c.input_corr
    if not (corr == 'zipf' or (is_number(corr) and -1 <= corr <= 1)):
      raise ValueError(f"model.admin.input_corr must be 'zipf' or a number in [-1, 1], got {corr!r}")
    if m.name == 'vit' and corr == 'zipf':
      raise ValueError(
        "model.admin.input_corr='zipf' estimates the correlation of token lookups (GPT); "
        'for ViT give a number'
      )

  def init_plan(self, m, dims, prepared=None):
    return _plan(m, dims, omega_sq(m, dims, prepared))

  def needs_preparation(self, m):
    return m.admin.omega == 'profile'

  def prepare(self, config, data_info, inputs):
    return profile(config, data_info, itertools.islice(inputs, PROFILE_BATCHES))


SCHEME = Admin()
