r"""Noci et al.: 1/sqrt(L)-scaled residual branches and a softmax inverse temperature τ, warmed up.

Noci, Anagnostidis, Biggio, Orvieto, Singh & Lucchi 2022, "Signal Propagation in Transformers:
Theoretical Perspectives and the Role of Rank Collapse" (NeurIPS 2022, arXiv:2206.03126): the residual
scaling α² = α̃/L under which the token correlation stays bounded with depth (Lemma 3.2, Eq. 11, and
Theorem 3.3; proofs in Appendix A.3–A.4) and the tempered softmax of Appendix C.2 (Eqs. 45–47), warmed
up as in Appendix C.3.

Definition as implemented, for a stack of L = N layers:

    attention add    Z = α1·S + X              S = softmax(τ/sqrt(d_k) · X W_Q (X W_K)ᵀ) X W_V (·W_O)
    FFN add          X' = α2·Y + Z             Y = ReLU|GeLU MLP of Z
    α1² = α2² = α̃/L  (branch scales; skip scales 1)
    weights          Xavier (`vanilla.xavier_plan`; the paper's analysis: "Xavier or He", variance 1/d
                     for queries, keys and values, which Xavier gives the d×d matrices; the FFN
                     matrices get Xavier's 2/(d + F))
    logits           × τ/sqrt(d_head) (`InitPlan.attn_logit_scale`), during training × min(1, step/W)

τ (`model.noci.tau`) is, by default ('measure'), the temperature of Eq. 47 at which the query/key and
value gradients match at initialisation:

    τ² = d·n·(1 + ρ(n−1)) / (σx⁴·(1−ρ)²·(n+d)·(n−1))

with d = model width (the paper's single-head analysis has d = d_q = d_v), n = the sequence length the
model sees (`dims.seq_len`: every training sequence has that length; the paper uses the average sentence
length), and ρ, σx² the token correlation and variance of the attention input, measured at
initialisation as the paper estimates ρ ("the mean correlation across all pairs of tokens", App. C.2):
a preparation step runs the freshly initialised model (the run's seed, so its weights) on the first
training batch and takes, at every layer's attention input (Pre-LN: the LayerNorm output; Post-LN: the
stream, the previous add's LayerNorm output), the pooled variance and the correlation of the same hidden
unit across token pairs t ≠ t' (`dslm.embedding_moments`). ρ and σx² are the means over the layers, and
one τ follows for all layers, as the paper uses one; its suggestion of a per-layer τ (ρ and σx² change
across layers, App. C.2) is not used. The result ({'tau', 'rho', 'sigma_x2', per-layer values, 'n',
'num_batches'}) is logged when the run starts and saved in the workdir. Other values of `model.noci.tau`:
'formula' (Eq. 47 with ρ = `model.noci.rho` and σx² = 1, no data) or a number (1: the plain softmax).

Warm-up (App. C.3): the paper's translation runs use τ = τ_final·max(1, step/steps_warmup) with
steps_warmup = 1000. As printed that is never below τ_final and grows without bound; a warm-up is meant,
τ = τ_final·min(1, step/steps_warmup), which is what is done here (step: the training steps done, so the
first step runs at τ = 0), over `model.noci.tau_warmup_steps` steps (`InitPlan.attn_logit_warmup_steps`).
Evaluation uses τ_final.

Choices the paper leaves open:
  * The measurement runs with the plain softmax (τ = 1; the weights do not depend on τ) and without
    dropout, on one batch: τ changes the attention outputs and so the later layers' inputs, and the
    measurement is not iterated to a fixed point. A negative measured ρ is taken as 0 (the paper's
    "constant small correlation").
  * The warm-up length: the paper's 1000 steps belong to translation runs of 100k Adam updates. For other
    runs the default is 100 steps, the learning-rate warm-up of configs/gpt_preln.py; set it to the run's
    learning-rate warm-up, or 0 for none.
  * n for a causal model: the paper's analysis is bidirectional; under a causal mask query i sees i+1
    tokens. n is the sequence length all the same.
  * One α̃ for both adds (the paper allows α̃1 ≠ α̃2), default 1.
  * The α are fixed by default; the paper's translation runs train them (App. C.3,
    `model.noci.learnable_alpha = True`).
  * Blocks: Pre-LN (the block the paper finds to propagate correlations better, App. B.1) and Post-LN.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from ml_collections import config_dict

from dsjax import models
from dsjax.models import layers
from dsjax.models.config import boolean, is_number, number
from dsjax.models.plan import ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.dslm import embedding_moments
from dsjax.schemes.vanilla import xavier_plan

TAU_MEASURE = 'measure'
TAU_FORMULA = 'formula'
MEASURE_BATCHES = 1  # the first training batch
# The probe sites that see the stream entering each layer: the stack input, then every layer's output.
STREAM_SITES = ('embedding', 'ffn_residual')


def tau_formula(d: int, n: int, rho: float, sigma_x2: float = 1.0) -> float:
  """τ of Noci et al. 2022, Appendix C.2, Eq. 47: τ² = d·n(1+ρ(n−1)) / (σx⁴(1−ρ)²(n+d)(n−1))."""
  if n < 2:
    raise ValueError(f'the temperature formula needs a sequence length n >= 2, got {n}')
  if not rho < 1:
    raise ValueError(f'the temperature formula needs a token correlation ρ < 1, got {rho:.6g}')
  tau2 = d * n * (1 + rho * (n - 1)) / (sigma_x2**2 * (1 - rho) ** 2 * (n + d) * (n - 1))
  return math.sqrt(tau2)


def measured_tau(prepared: dict[str, Any], dims: ModelDims) -> float:
  """Eq. 47 with the measured ρ (a negative one taken as 0) and σx², for this model's width and length."""
  return tau_formula(dims.width, dims.seq_len, max(float(prepared['rho']), 0.0), float(prepared['sigma_x2']))


def tau(c, dims: ModelDims, prepared: dict[str, Any] | None = None) -> float:
  """The configured inverse temperature: measured, Eq. 47 with the configured ρ, or the number."""
  if c.tau == TAU_MEASURE:
    if prepared is None:
      raise ValueError(
        "model.noci.tau='measure' needs the measured attention-input moments: pass prepared= to "
        'dsjax.schemes.build_model (the training loop measures them with '
        'dsjax.schemes.preparation_for_run and saves them in the workdir)'
      )
    return measured_tau(prepared, dims)
  if c.tau == TAU_FORMULA:
    return tau_formula(dims.width, dims.seq_len, float(c.rho))
  return float(c.tau)


# ------------------------------------------------------------------------------------------------
# tau='measure': moments of the attention inputs at initialisation (the preparation step).
# ------------------------------------------------------------------------------------------------


def attention_input_moments(
  model: nnx.Module, pre_norm: layers.Norm | None, inputs: Iterable[Any]
) -> dict[str, list[float]]:
  """Per layer, the pooled variance and token correlation of the attention input, averaged over batches.

  `model` must run its layers as a Python loop (`model.scan_layers = False`), without dropout here: a
  probe sees the stream entering layer l (site 'embedding' for l = 0, layer l−1's 'ffn_residual' after
  it), and the attention reads `pre_norm` of it (Pre-LN: a norm with gain 1 and bias 0, as every
  pre-attention norm is built; Post-LN: None, the stream is the previous add's norm output).
  Returns {'var': [...], 'corr_seq': [...], 'num_batches'}, one value per layer.
  """
  graphdef, state = nnx.split(model)
  depth = model.trunk.stack.depth

  def moments(state, x):
    streams = []

    def probe(site, h, layer):
      del layer
      if site in STREAM_SITES:
        streams.append((site, h))
      return h

    nnx.merge(graphdef, state)(x, dropout_key=None, probe=probe)
    sites = [site for site, _ in streams]
    if sites != [STREAM_SITES[0]] + [STREAM_SITES[1]] * depth:
      raise ValueError(
        f'the measurement saw the probe sites {sites}: the stack must run as a Python loop over the '
        'layers (model.scan_layers=False)'
      )
    # The last layer's output feeds no attention.
    stats = [embedding_moments(layers.apply_norm(pre_norm, h)) for _, h in streams[:-1]]
    return jnp.stack([s['var'] for s in stats]), jnp.stack([s['corr_seq'] for s in stats])

  jitted = jax.jit(moments)
  per_batch = [np.asarray(jax.device_get(jitted(state, x)), np.float64) for x in inputs]
  if not per_batch:
    raise ValueError('the attention-input measurement needs at least one batch')
  var, corr = np.mean(per_batch, axis=0)
  return {'var': [float(v) for v in var], 'corr_seq': [float(r) for r in corr], 'num_batches': len(per_batch)}


def measure(config, data_info, inputs: Iterable[Any]) -> dict[str, Any]:
  """The preparation step of tau='measure' (module docstring): ρ, σx² and the τ of Eq. 47 they give."""
  provisional = copy.deepcopy(config)  # Keeps field types (tau may hold a string or a number).
  with provisional.unlocked():
    # The same weights as the final model (τ is not drawn; the layers are created alike), the plain
    # softmax, the layers in a Python loop so that the probe sees them in order.
    provisional.model.noci.tau = 1.0
    provisional.model.scan_layers = False
  m, seq_len = provisional.model, provisional.data.seq_len
  dims = models.model_dims(m, data_info, seq_len=seq_len)
  model = models.build_model(
    m, data_info, SCHEME.init_plan(m, dims), nnx.Rngs(params=config.seed), seq_len=seq_len
  )
  pre_norm = layers.Norm(dims.width, kind=m.norm, eps=m.norm_eps) if m.block == 'preln' else None
  per_layer_moments = attention_input_moments(model, pre_norm, inputs)
  result = {
    'rho': float(np.mean(per_layer_moments['corr_seq'])),
    'sigma_x2': float(np.mean(per_layer_moments['var'])),
    'rho_per_layer': per_layer_moments['corr_seq'],
    'sigma_x2_per_layer': per_layer_moments['var'],
    'n': dims.seq_len,
    'num_batches': per_layer_moments['num_batches'],
  }
  return {'tau': measured_tau(result, dims), **result}


class Noci(Scheme):
  name = 'noci'
  paper = (
    'Noci et al. 2022, Signal Propagation in Transformers: Theoretical Perspectives and the Role '
    'of Rank Collapse (NeurIPS 2022, arXiv:2206.03126), Thm. 3.3, App. C.2–C.3'
  )
  summary = (
    'branch scales α = sqrt(α̃/N) at both adds (skip 1); attention logits × τ/sqrt(d_head), τ from '
    'Eq. 47 with the measured token correlation, warmed up'
  )
  blocks = ('preln', 'postln')

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.alpha_tilde = 1.0  # α² = α̃/L at both adds (paper Lemma 3.2: α̃1, α̃2 ∈ R, depth-independent)
    c.learnable_alpha = False  # the paper's translation runs train α1, α2 (App. C.3)
    # Softmax inverse temperature: 'measure' (App. C.2, Eq. 47 with ρ and σx² of the attention inputs
    # measured at initialisation on the first training batch), 'formula' (Eq. 47 with ρ = rho, σx² = 1)
    # or a number (1 = plain softmax). A FieldReference of type object so that both a string and a
    # number can be set.
    c.tau = config_dict.FieldReference(TAU_MEASURE, field_type=object)
    c.rho = 0.0  # 'formula' only: token correlation ρ in Eq. 47 (paper: "a constant small correlation")
    # τ rises as min(1, step/tau_warmup_steps) (App. C.3: 1000 steps of a 100k-step translation run);
    # the paper leaves other runs open: 100 is the learning-rate warm-up of configs/gpt_preln.py. 0: none.
    c.tau_warmup_steps = 100
    return c

  def validate(self, m):
    super().validate(m)
    c = m.noci
    number('model.noci.alpha_tilde', c.alpha_tilde, low=0, low_open=True)
    boolean('model.noci.learnable_alpha', c.learnable_alpha)
    if not (c.tau in (TAU_MEASURE, TAU_FORMULA) or (is_number(c.tau) and c.tau > 0)):
      raise ValueError(
        f"model.noci.tau must be '{TAU_MEASURE}', '{TAU_FORMULA}' or a number > 0, got {c.tau!r}"
      )
    number('model.noci.rho', c.rho, low=0, high=1, high_open=True)
    warmup = c.tau_warmup_steps
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
      raise ValueError(f'model.noci.tau_warmup_steps must be an integer >= 0, got {warmup!r}')

  def init_plan(self, m, dims: ModelDims, prepared=None):
    c, n = m.noci, dims.depth
    alpha = per_layer(n, math.sqrt(c.alpha_tilde / n))
    base = xavier_plan(m, dims)
    layer = {**base.layer, 'branch_attn': alpha, 'branch_ffn': alpha.copy()}
    return xavier_plan(
      m,
      dims,
      layer=layer,
      branch=ResidualScale(learnable=c.learnable_alpha),
      attn_logit_scale=tau(c, dims, prepared) / math.sqrt(dims.head_dim),
      attn_logit_warmup_steps=c.tau_warmup_steps,
    )

  def needs_preparation(self, m):
    return m.noci.tau == TAU_MEASURE

  def prepare(self, config, data_info, inputs):
    return measure(config, data_info, itertools.islice(inputs, MEASURE_BATCHES))


SCHEME = Noci()
