r"""Noci et al.: 1/sqrt(L)-scaled residual branches and a softmax inverse temperature τ.

Noci, Anagnostidis, Biggio, Orvieto, Singh & Lucchi 2022, "Signal Propagation in Transformers:
Theoretical Perspectives and the Role of Rank Collapse" (NeurIPS 2022, arXiv:2206.03126): the residual
scaling α² = α̃/L under which the token correlation stays bounded with depth (Lemma 3.2, Eq. 11, and
Theorem 3.3; proofs in Appendix A.3–A.4) and the tempered softmax of Appendix C.2 (Eqs. 45–47).

Definition as implemented, for a stack of L = N layers:

    attention add    Z = α1·S + X              S = softmax(τ/sqrt(d_k) · X W_Q (X W_K)ᵀ) X W_V (·W_O)
    FFN add          X' = α2·Y + Z             Y = ReLU|GeLU MLP of Z
    α1² = α2² = α̃/L  (branch scales; skip scales 1)
    weights          Xavier (`vanilla.xavier_plan`; the paper's analysis: "Xavier or He", variance 1/d
                     for queries, keys and values, which Xavier gives the d×d matrices; the FFN
                     matrices get Xavier's 2/(d + F))
    logits           × τ/sqrt(d_head) (`InitPlan.attn_logit_scale`)

τ is `model.noci.tau`: a number (default 1, the plain softmax) or 'formula', Eq. 47 — the temperature at
which the query/key and value gradients match at initialisation:

    τ² = d·n·(1 + ρ(n−1)) / (σx⁴·(1−ρ)²·(n+d)·(n−1))

with d = model width (the paper's single-head analysis has d = d_q = d_v), n = the sequence length the
model sees (`dims.seq_len`; the paper uses the average sentence length), σx² = 1 (attention reads a
LayerNorm output: in Pre-LN its own, in Post-LN the previous add's, except at layer 0) and
ρ = `model.noci.rho`, the token correlation of the attention input.

Choices the paper leaves open:
  * ρ defaults to 0. The paper sets τ "assuming a constant small correlation between tokens" (App. C.3,
    verified in its Fig. 15); 0 is that assumption's limit and needs no data. It then gives
    τ² = d·n/((n+d)(n−1)), → n/(n−1) ≈ 1 for d ≫ n. A measured or theory-predicted correlation can be
    set instead.
  * One α̃ for both adds (the paper allows α̃1 ≠ α̃2), default 1.
  * The α are fixed by default; the paper's translation runs train them (App. C.3,
    `model.noci.learnable_alpha = True`).
  * The paper warms τ up to τ_final over the first 1000 steps of its translation runs (App. C.3); the
    logit scale here is a fixed constant of the model, so there is no warm-up.
  * Blocks: Pre-LN (the block the paper finds to propagate correlations better, App. B.1) and Post-LN.
"""

from __future__ import annotations

import math

import ml_collections
from ml_collections import config_dict

from dsjax.models.config import boolean, is_number, number
from dsjax.models.plan import ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

TAU_FORMULA = 'formula'


def tau_formula(d: int, n: int, rho: float, sigma_x2: float = 1.0) -> float:
  """τ of Noci et al. 2022, Appendix C.2, Eq. 47: τ² = d·n(1+ρ(n−1)) / (σx⁴(1−ρ)²(n+d)(n−1))."""
  if n < 2:
    raise ValueError(f'the temperature formula needs a sequence length n >= 2, got {n}')
  tau2 = d * n * (1 + rho * (n - 1)) / (sigma_x2**2 * (1 - rho) ** 2 * (n + d) * (n - 1))
  return math.sqrt(tau2)


def tau(c, dims: ModelDims) -> float:
  """The configured inverse temperature: the number, or Eq. 47 for this model's width and length."""
  if c.tau == TAU_FORMULA:
    return tau_formula(dims.width, dims.seq_len, float(c.rho))
  return float(c.tau)


class Noci(Scheme):
  name = 'noci'
  paper = (
    'Noci et al. 2022, Signal Propagation in Transformers: Theoretical Perspectives and the Role '
    'of Rank Collapse (NeurIPS 2022, arXiv:2206.03126), Thm. 3.3, App. C.2'
  )
  summary = 'branch scales α = sqrt(α̃/N) at both adds (skip 1); attention logits × τ/sqrt(d_head)'
  blocks = ('preln', 'postln')

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.alpha_tilde = 1.0  # α² = α̃/L at both adds (paper Lemma 3.2: α̃1, α̃2 ∈ R, depth-independent)
    c.learnable_alpha = False  # the paper's translation runs train α1, α2 (App. C.3)
    # Softmax inverse temperature: a number (1 = plain softmax) or 'formula' (App. C.2, Eq. 47). A
    # FieldReference of type object so that both a string and a number can be set.
    c.tau = config_dict.FieldReference(1.0, field_type=object)
    c.rho = 0.0  # token correlation ρ in Eq. 47 (paper: "a constant small correlation")
    return c

  def validate(self, m):
    super().validate(m)
    c = m.noci
    number('model.noci.alpha_tilde', c.alpha_tilde, low=0, low_open=True)
    boolean('model.noci.learnable_alpha', c.learnable_alpha)
    if not (c.tau == TAU_FORMULA or (is_number(c.tau) and c.tau > 0)):
      raise ValueError(f"model.noci.tau must be a number > 0 or '{TAU_FORMULA}', got {c.tau!r}")
    number('model.noci.rho', c.rho, low=0, high=1, high_open=True)

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
      attn_logit_scale=tau(c, dims) / math.sqrt(dims.head_dim),
    )


SCHEME = Noci()
