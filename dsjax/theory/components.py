"""Closed-form moments of every transformer component (DSLM, Kedia et al. 2024, Appendices A–C).

Every component is a function

    f(x: Stats, g: GradStats, **params) -> (Stats of the output, GradStats of the input gradient)

where `x` describes one element of the input tensor (mean, variance, correlation between two tokens at the
same hidden index `corr_seq`, correlation between two hidden units of the same token `corr_hidden`) and
`g` describes one element of the gradient arriving at the output (variance and token correlation; its
mean is 0). Tensors are laid out (tokens, hidden); the statistics are expectations over inputs, weights,
dropout masks and injected gradients, all Gaussian (weights zero-mean, biases zero, norm gains one), as in
Appendix L.2.

Forms. Where the paper gives a full and a simplified formula both are available (`exact=` / `form=`).
Where the paper's "full" formula is itself an approximation that simulation shows to be visibly off, a
more exact form derived here is the default and the paper's formula stays available:

* `layernorm(exact=True)`: finite-d corrections from the randomness of the per-token standard deviation
  (the paper divides by the population std): r_out = r·(1 − (1−r²)/(2(d−1))) instead of r·(1 − 1/d),
  gradient variance ×(d−2)/(d−3).
* `softmax(exact=True)`: E[P²] etc. by one-dimensional quadrature of the Laplace representation
  1/Z^k = ∫ t^{k−1} e^{−tZ} dt/(k−1)!, exact for Gaussian equicorrelated logits at any length (the paper's
  log-normal sum approximation, `form='lognormal'`, is off by up to ~5% at L = 300).
* `attention_head(form='exact')`: the paper's Appendix A.8 forward formula with the exact softmax second
  moment, the dropout-on-probabilities term of the shared component and the chi-square spread of the
  per-query logit variance; the backward adds what Appendix A.8 leaves out — the query and key paths
  (gradient through the softmax) and the non-uniform attention in the value path. See
  `_attention_moments` for the derivation. The paper's formulas are `form='paper'` (Appendix A.8) and
  `form='simple'` (Table 1).
* `causal=True` attention: position t attends to t+1 keys; every sum over keys and queries is done per
  position and averaged (derivation in `_attention_moments`). Not in the paper.

Block formulas (`attention_block`, `ffn_block`) do not include the block's own LayerNorm: pass the
LayerNorm output statistics (`layernorm(...)`), as `dsjax.theory.model` does.

Accuracy: `python -m dsjax.theory.verify` checks every component against simulation. Its results, the
paper's formulas on the same simulations, and two corrections to the paper's attention-block summary
(Table 2 / Appendix B.1: the block's output dropout decorrelates the incoming gradient, and the block's
input-gradient token correlation is ≈ 1) are in docs/theory.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import numpy as np

__all__ = [
  'Stats',
  'GradStats',
  'linear',
  'dropout',
  'relu',
  'gelu',
  'layernorm',
  'softmax',
  'attention_head',
  'attention_block',
  'ffn_block',
  'embedding_corr',
  'embedding',
  'relu_corr',
  'softmax_moments',
  'ATTENTION_FORMS',
]

ATTENTION_FORMS = ('exact', 'paper', 'simple')


# ----------------------------------------------------------------------------------------------------
# Statistics and argument checks.


def _check_finite(name: str, value) -> float:
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f'{name} must be finite, got {value}')
  return value


def _check_positive(name: str, value) -> float:
  value = _check_finite(name, value)
  if value <= 0:
    raise ValueError(f'{name} must be > 0, got {value}')
  return value


def _check_corr(name: str, value) -> float:
  value = _check_finite(name, value)
  if not -1.0 <= value <= 1.0:
    raise ValueError(f'{name} must be a correlation in [-1, 1], got {value}')
  return value


def _check_prob(name: str, value) -> float:
  value = _check_finite(name, value)
  if not 0.0 <= value < 1.0:
    raise ValueError(f'{name} must be a probability in [0, 1), got {value}')
  return value


def _check_fraction(name: str, value) -> float:
  value = _check_finite(name, value)
  if not 0.0 <= value <= 1.0:
    raise ValueError(f'{name} must be in [0, 1], got {value}')
  return value


def _check_size(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or int(value) != value:
    raise ValueError(f'{name} must be an integer, got {value!r}')
  value = int(value)
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}')
  return value


def _check_type(name: str, value, cls):
  if not isinstance(value, cls):
    raise ValueError(f'{name} must be a {cls.__name__}, got {type(value).__name__}')
  return value


@dataclasses.dataclass(frozen=True)
class Stats:
  """Forward statistics of one element of a (tokens, hidden) tensor.

  mean, var: of one element. corr_seq: correlation of two elements with the same hidden index and
  different tokens (r^l in the paper). corr_hidden: same token, different hidden indices (r^d).
  """

  mean: float = 0.0
  var: float = 1.0
  corr_seq: float = 0.0
  corr_hidden: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, 'mean', _check_finite('Stats.mean', self.mean))
    object.__setattr__(self, 'var', _check_positive('Stats.var', self.var))
    object.__setattr__(self, 'corr_seq', _check_corr('Stats.corr_seq', self.corr_seq))
    object.__setattr__(self, 'corr_hidden', _check_corr('Stats.corr_hidden', self.corr_hidden))

  @property
  def second_moment(self) -> float:
    return self.var + self.mean**2

  @property
  def cov_seq(self) -> float:
    return self.corr_seq * self.var

  @property
  def cov_hidden(self) -> float:
    return self.corr_hidden * self.var


@dataclasses.dataclass(frozen=True)
class GradStats:
  """Statistics of one element of the gradient w.r.t. a tensor (mean 0): variance, token correlation."""

  var: float = 1.0
  corr_seq: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, 'var', _check_positive('GradStats.var', self.var))
    object.__setattr__(self, 'corr_seq', _check_corr('GradStats.corr_seq', self.corr_seq))

  @property
  def cov_seq(self) -> float:
    return self.corr_seq * self.var


def _stats(mean, var, cov_seq, cov_hidden=0.0) -> Stats:
  var = float(var)
  clip = lambda c: float(np.clip(c / var, -1.0, 1.0))
  return Stats(mean=float(mean), var=var, corr_seq=clip(cov_seq), corr_hidden=clip(cov_hidden))


def _grad(var, cov_seq) -> GradStats:
  var = float(var)
  return GradStats(var=var, corr_seq=float(np.clip(cov_seq / var, -1.0, 1.0)))


def _check_inputs(x, g):
  _check_type('x', x, Stats)
  _check_type('g', g, GradStats)


def _chain(x: Stats, g: GradStats, layers: Sequence[Callable]) -> tuple[Stats, GradStats]:
  """Composes components: forward through `layers` in order, the gradient back in reverse order.

  A component's forward statistics never depend on `g`, and its backward needs the statistics of its
  own input, so the forward pass runs first (with a placeholder gradient) and records every input.
  """
  inputs, h = [], x
  for layer in layers:
    inputs.append(h)
    h, _ = layer(h, GradStats())
  for layer, h_in in zip(reversed(layers), reversed(inputs)):
    _, g = layer(h_in, g)
  return h, g


# ----------------------------------------------------------------------------------------------------
# Elementwise and linear components (Appendices A.2–A.6). These are exact for Gaussian inputs except
# where noted.


def linear(x: Stats, g: GradStats, *, d_in: int, d_out: int, w_var: float) -> tuple[Stats, GradStats]:
  """y = x·W, W: (d_in, d_out) with i.i.d. N(0, w_var) entries (Appendix A.2).

  var_out = d_in·w_var·(s2 + mu²); the input mean becomes part of the token covariance,
  r_out = (r·s2 + mu²)/(s2 + mu²); distinct output units are uncorrelated. Backward: d_out·w_var·g2,
  token correlation unchanged.
  """
  _check_inputs(x, g)
  d_in, d_out = _check_size('d_in', d_in), _check_size('d_out', d_out)
  w_var = _check_positive('w_var', w_var)
  second = x.second_moment
  out = _stats(0.0, d_in * w_var * second, d_in * w_var * (x.cov_seq + x.mean**2))
  return out, _grad(d_out * w_var * g.var, d_out * w_var * g.cov_seq)


def dropout(x: Stats, g: GradStats, *, p: float) -> tuple[Stats, GradStats]:
  """Inverted dropout with drop probability p (Appendix A.3).

  mean unchanged, var = (s2 + p·mu²)/(1−p), covariances unchanged (independent masks); backward
  var g2/(1−p), covariance unchanged, i.e. the gradient correlation becomes (1−p)·rg.
  """
  _check_inputs(x, g)
  p = _check_prob('p', p)
  var = (x.var + p * x.mean**2) / (1 - p)
  return _stats(x.mean, var, x.cov_seq, x.cov_hidden), _grad(g.var / (1 - p), g.cov_seq)


def relu_corr(r, exact: bool = True):
  """Correlation of ReLU outputs of two zero-mean Gaussians with correlation r (Appendix A.4).

  exact: (π·r + sqrt(1−r²) − r·acos(r) − 1)/(π − 1); otherwise the paper's fit 0.7·r + 0.3·r².
  """
  r = np.clip(np.asarray(r, np.float64), -1.0, 1.0)
  if not exact:
    return 0.7 * r + 0.3 * r**2
  return (np.pi * r + np.sqrt(1 - r**2) - r * np.arccos(r) - 1) / (np.pi - 1)


def _require_zero_mean(x: Stats, name: str):
  if x.mean != 0.0:
    raise ValueError(
      f"x.mean must be 0 for {name} (the paper's formulas assume a zero-mean input, "
      f'Appendices A.4/A.5); got {x.mean}'
    )


def relu(x: Stats, g: GradStats, *, exact: bool = True) -> tuple[Stats, GradStats]:
  """ReLU of a zero-mean Gaussian input (Appendix A.4).

  mean = sqrt(s2/(2π)), var = s2·(π−1)/(2π), r_out = relu_corr(r) (exact or the paper's polynomial fit,
  applied to both the token and the hidden correlation). Backward: var g2/2, token correlation
  (1/2 + asin(r)/π)·rg (the two tokens' units are active together with probability 1/4 + asin(r)/(2π)).
  """
  _check_inputs(x, g)
  _require_zero_mean(x, 'relu')
  s2 = x.var
  out = Stats(
    mean=math.sqrt(s2 / (2 * math.pi)),
    var=s2 * (math.pi - 1) / (2 * math.pi),
    corr_seq=float(relu_corr(x.corr_seq, exact)),
    corr_hidden=float(relu_corr(x.corr_hidden, exact)),
  )
  grad_corr = (0.5 + math.asin(x.corr_seq) / math.pi) * g.corr_seq
  return out, GradStats(var=g.var / 2, corr_seq=grad_corr)


def _gelu_cov(s2: float, r: float) -> float:
  """Cov(GeLU(x), GeLU(y)) for zero-mean Gaussians of variance s2 and correlation r (Appendix A.5)."""
  mean = s2 / math.sqrt(2 * math.pi * (s2 + 1))
  a = s2 / (1 + s2)
  root = math.sqrt((s2 + 1) ** 2 - (r * s2) ** 2)
  second = (s2 / 4) * (
    r
    + (2 / math.pi) * r * math.asin(r * a)
    + (2 / math.pi) * s2 * (s2 * (1 - r**2) + 1 + r**2) / ((s2 + 1) * root)
  )
  return second - mean**2


def _gelu_grad_factor(s2: float, r: float) -> float:
  """E[GeLU'(x)·GeLU'(y)] for zero-mean Gaussians of variance s2 and correlation r (Appendix A.5)."""
  a = s2 / (1 + s2)
  rs = r * s2
  return (
    0.25
    + math.asin(r * a) / (2 * math.pi)
    + r
    * s2
    * ((s2 + 1) * (2 * s2 + 3) - 2 * rs**2)
    / (2 * math.pi * (s2 + 1) * ((s2 + 1) ** 2 - rs**2) ** 1.5)
  )


def gelu(x: Stats, g: GradStats) -> tuple[Stats, GradStats]:
  """Exact GeLU, x·Φ(x), of a zero-mean Gaussian input (Appendix A.5; all forms are exact).

  With a = s2/(1+s2): mean = s2/sqrt(2π(s2+1)), var = (s2/2π)(π/2 − a + asin(a) + 2a/sqrt(1+2s2));
  the covariance and gradient formulas are in `_gelu_cov` and `_gelu_grad_factor`.
  """
  _check_inputs(x, g)
  _require_zero_mean(x, 'gelu')
  s2 = x.var
  mean = s2 / math.sqrt(2 * math.pi * (s2 + 1))
  var = _gelu_cov(s2, 1.0)
  out = _stats(mean, var, _gelu_cov(s2, x.corr_seq), _gelu_cov(s2, x.corr_hidden))
  grad_var = g.var * _gelu_grad_factor(s2, 1.0)
  grad_cov = g.cov_seq * _gelu_grad_factor(s2, x.corr_seq)
  return out, _grad(grad_var, grad_cov)


def gelu_second_moment(s2: float) -> float:
  """E[GeLU(x)²] for x ~ N(0, s2): what a following Linear layer sees."""
  s2 = _check_positive('s2', s2)
  return _gelu_cov(s2, 1.0) + s2**2 / (2 * math.pi * (s2 + 1))


def layernorm(
  x: Stats, g: GradStats, *, d: int, exact: bool = True, random_fraction: float | None = None
) -> tuple[Stats, GradStats]:
  """LayerNorm over d hidden units, gain 1, bias 0 (Appendix A.6); hidden units assumed independent.

  Output: mean 0, var 1, hidden correlation −1/(d−1) (the d outputs sum to zero). The input mean is
  removed, so only the centred token correlation r matters.

  exact=False is the paper: r_out = r·(1 − 1/d), gradient var g2/s2, gradient correlation rg (large d,
  the per-token std treated as the constant sqrt(s2)).

  exact=True (default) keeps the randomness of the per-token std σ̂ (σ̂² = s2·χ²_{d−1}/d): the output of
  a token is its centred input rescaled to norm sqrt(d), so the token correlation is the mean cosine of
  two Gaussian vectors with correlation r in d−1 dimensions, r·(1 − (1−r²)/(2(d−1))) to O(1/d²); the
  backward projects out 1 and x̂ (trace d−2) and E[1/σ̂²] = d/(s2(d−3)), so var_g = g2·(d−2)/(s2(d−3));
  the gradient covariance uses tr(P_t P_s) = d−3+cos²θ and E[1/(σ̂_t σ̂_s)] to second order.

  random_fraction=ρ (exact=True only) is the Post-LN residual add λ·x + β·h instead: x is the previous
  LayerNorm's output (per-token norm exactly sqrt(d), share 1 − ρ of s2) and h a Gaussian branch (share
  ρ = β²·var(h)/s2), and the gradient arriving here came through the next LayerNorm, whose x̂ equals
  this one's to O(β): it is already orthogonal to 1 and to x. Then the centred σ̂² has relative variance
  v = (4ρ(1−ρ) + 2ρ²)/d (the λβ·x·h cross term and the branch's χ²) and mean s2·(1 − ρ/d), and the
  projection removes a share ρ/d of the gradient (its component along h):
      var_g = g2/s2·(1 + (4ρ − 2ρ²)/d),   cov_g = cov/s2·(1 + (3ρ − 2ρ²)/d)   (to O(1/d)).
  The variance is the expansion; the covariance's second-order term was checked by simulation rather
  than derived in full (tests/theory/test_components.py, d = 32 and 64, ρ = 0.02–0.5). A 192-layer DSLM
  Post-LN stack has ρ ≈ β² = 0.01: the Gaussian form (1/(d−3) per norm) over-predicts the gradient at
  layer 1 ~4.5× ((254/253)^384, measured with `dsjax.moments`); this form is within a few per cent
  (dsjax/instrument/README.md). ρ = 1 is not the Gaussian case: there the gradient is isotropic.
  """
  _check_inputs(x, g)
  d = _check_size('d', d, minimum=4 if exact else 2)
  s2, r = x.var, x.corr_seq
  if not exact:
    out = Stats(mean=0.0, var=1.0, corr_seq=r * (1 - 1 / d), corr_hidden=-1 / (d - 1))
    return out, GradStats(var=g.var / s2, corr_seq=g.corr_seq)
  n = d - 1
  out = Stats(mean=0.0, var=1.0, corr_seq=r * (1 - (1 - r**2) / (2 * n)), corr_hidden=-1 / n)
  if random_fraction is not None:  # Post-LN add (docstring).
    rho = _check_fraction('random_fraction', random_fraction)
    return out, _grad(
      g.var / s2 * (1 + (4 * rho - 2 * rho**2) / d), g.cov_seq / s2 * (1 + (3 * rho - 2 * rho**2) / d)
    )
  grad_var = g.var * (d - 2) / (s2 * (d - 3))
  mean_cos2 = r**2 + (1 - r**2) * (1 - 2 * r**2) / n
  grad_cov = g.cov_seq / s2 * (d - 3 + mean_cos2) / n * (1 + (3 + r**2) / (2 * n))
  return out, _grad(grad_var, grad_cov)


# ----------------------------------------------------------------------------------------------------
# Softmax (Appendix A.7) and its exact moments.

_V_POINTS = 600
_GH_Z, _GH_W = np.polynomial.hermite.hermgauss(96)
_GH_LOGW = np.log(_GH_W / np.sqrt(np.pi))


def _logsumexp(a: np.ndarray, axis: int = -1) -> np.ndarray:
  peak = np.max(a, axis=axis, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  with np.errstate(divide='ignore'):  # all terms −inf: the sum is 0, its log −inf
    return np.log(np.sum(np.exp(a - peak), axis=axis)) + np.squeeze(peak, axis)


def _log_psi(k: int, t: np.ndarray, sigma: float) -> np.ndarray:
  """log E[e^{kδ}·exp(−t·e^δ)], δ ~ N(0, σ²), by Gauss–Hermite quadrature (t: any shape)."""
  delta = math.sqrt(2.0) * sigma * _GH_Z
  return _logsumexp(_GH_LOGW + k * delta - t[..., None] * np.exp(delta))


@functools.lru_cache(maxsize=4096)
def _softmax_moments_cached(sigma2: float, n_values: tuple[int, ...], full: bool) -> tuple[np.ndarray, ...]:
  n = np.asarray(n_values, np.float64)
  if sigma2 == 0.0:
    return 1 / n**2, 1 / n**4, (1 / n**2) * (1 - 1 / n) ** 2
  sigma = math.sqrt(sigma2)
  # Laplace representation: 1/Z^k = ∫_0^∞ t^{k−1} e^{−tZ} dt/(k−1)!, Z = Σ_j e^{δ_j}; the keys are i.i.d.,
  # so E[e^{2δ_1}·e^{−tZ}] = ψ2(t)·φ(t)^{n−1} with ψk(t) = E[e^{kδ} e^{−t e^δ}], φ = ψ0. Integrate over
  # v = log t on one grid that covers every n (the mass sits near t ≈ 1/Z ≈ e^{−σ²/2}/n).
  v = np.linspace(-math.log(n.max()) - sigma2 / 2 - 25.0, 8.0 + 10.0 * sigma, _V_POINTS)
  t = np.exp(v)
  dv = v[1] - v[0]
  lp0 = np.minimum(_log_psi(0, t, sigma), 0.0)
  lp2 = _log_psi(2, t, sigma)
  nn = n[:, None]
  integral = lambda logf: np.exp(_logsumexp(logf) + math.log(dv))
  single = n == 1
  # E[P_1²] = ∫ t ψ2 φ^{n−1} dt.
  m2 = np.where(single, 1.0, integral(2 * v + lp2 + (nn - 1) * lp0))
  if not full:
    return m2, None, None
  lp1 = _log_psi(1, t, sigma)
  # E[P_1² P_2²] = ∫ t³/6 ψ2² φ^{n−2} dt (n ≥ 2).
  m22 = integral(4 * v - math.log(6) + 2 * lp2 + np.maximum(nn - 2, 0) * lp0)
  # E[P_1²(1−P_1)²] = E[e^{2δ_1} R² / Z⁴], R = Z − e^{δ_1}; E[R² e^{−tR}] = (φ^{n−1})''.
  with np.errstate(divide='ignore'):
    log_a = np.log(np.maximum((nn - 1) * (nn - 2), 0)) + 2 * lp1 + np.maximum(nn - 3, 0) * lp0
    log_b = np.log(np.maximum(nn - 1, 0)) + lp2 + np.maximum(nn - 2, 0) * lp0
  m2q = integral(4 * v - math.log(6) + lp2 + np.logaddexp(log_a, log_b))
  return m2, np.where(single, 0.0, m22), np.where(single, 0.0, m2q)


def softmax_moments(sigma2: float, n) -> dict[str, np.ndarray]:
  """Exact moments of P = softmax(ℓ) over n i.i.d. N(0, sigma2) logits (quadrature, any n ≥ 1).

  Returns E[P_1²] ('m2'), E[P_1²·P_2²] ('m22') and E[P_1²·(1−P_1)²] ('m2q'), arrays over `n`.
  """
  m2, m22, m2q = _softmax_moments_raw(sigma2, n, full=True)
  return {'m2': m2, 'm22': m22, 'm2q': m2q}


def _softmax_moments_raw(sigma2: float, n, full: bool):
  sigma2 = _check_finite('sigma2', sigma2)
  if sigma2 < 0:
    raise ValueError(f'sigma2 must be >= 0, got {sigma2}')
  n_arr = np.atleast_1d(np.asarray(n))
  if np.any(n_arr < 1):
    raise ValueError(f'n must be >= 1, got {n}')
  key = tuple(int(v) for v in n_arr.ravel())
  values = _softmax_moments_cached(round(sigma2, 15), key, full)
  shape = np.shape(n)
  return tuple(None if v is None else v.reshape(shape) for v in values)


def _over_many_n(exact: Callable[[np.ndarray], np.ndarray], n) -> np.ndarray:
  """`exact(values)` at every n: computed at each distinct n when there are at most 48 (cheap enough),
  else at a few dozen nodes and interpolated in 1/n — for functions of n that are smooth in 1/n."""
  n = np.asarray(n)
  unique = np.unique(n)
  if unique.size <= 48:
    return exact(unique)[np.searchsorted(unique, n)]
  nodes = np.unique(np.concatenate([np.arange(1, 17), np.geomspace(16, unique.max(), 40).round()])).astype(
    int
  )
  # np.interp needs increasing abscissae: 1/n decreases with n, so reverse.
  return np.interp(1.0 / n, (1.0 / nodes)[::-1], exact(nodes)[::-1])


def _softmax_e2(sigma2: float, n) -> np.ndarray:
  """n²·E[P²] for n i.i.d. N(0, sigma2) logits: the spread of attention weights (1 when uniform).

  For many different n (causal attention) it is computed exactly at a few dozen n and interpolated in
  1/n elsewhere; n²E[P²] is a smooth function of 1/n.
  """
  return _over_many_n(
    lambda values: values.astype(np.float64) ** 2 * _softmax_moments_raw(sigma2, values, full=False)[0], n
  )


def _softmax_key_weight(sigma2: float, n) -> np.ndarray:
  """n²·E[P_1²·|e_1 − P|²] = n²·(E[P_1²(1−P_1)²] + (n−1)·E[P_1²P_2²]) for n i.i.d. N(0, sigma2) logits.

  The weight of one query in the gradient through its logits: ∂ℓ_u = P_u·(a_u − Σ_s P_s·a_s), whose
  square averages to E[P_u²·|e_u − P|²]·E[a²] for i.i.d. zero-mean a. It is 0 for n = 1 (a constant
  softmax) and tends to n²E[P²] for large n. Interpolated in 1/n for many different n, as `_softmax_e2`.
  """

  def exact(values):
    m = softmax_moments(sigma2, values)
    return values.astype(np.float64) ** 2 * (m['m2q'] + (values - 1) * m['m22'])

  return _over_many_n(exact, n)


SOFTMAX_FORMS = ('quadrature', 'lognormal', 'simple')


def softmax(
  x: Stats, g: GradStats, *, length: int, exact: bool = True, form: str | None = None
) -> tuple[Stats, GradStats]:
  """Softmax over `length` entries, each N(mean, s2) with pairwise correlation x.corr_seq (Appendix A.7).

  Here "tokens" are the entries along the softmax axis; g.corr_seq is the correlation of the incoming
  gradient between entries. Only the independent part of the entries matters (a shared part cancels),
  so everything is a function of σ² = s2·(1 − r). Output mean is 1/L; the outputs and the input
  gradients both sum to zero (or one) exactly, so their correlations are −1/(L−1).

  Forms (`exact=True` → 'quadrature', `exact=False` → 'simple'; `form=` picks any):
    'quadrature': exact for Gaussian logits (`softmax_moments`): var = E[P²] − 1/L²,
        grad var = (1 − rg)·g2·(E[P²(1−P)²] + (L−1)·E[P_1²P_2²]).
    'lognormal' (paper, "full"): var = (e^{σz²} − 1)e^{2σz²}/S², σz² = σ²L/(L−1),
        S = (L−1)e^{σ²} + 1; grad var = g2·(var + 1/L²) (J ≈ diag(P), rg = 0 assumed).
    'simple' (paper, Table 1): var = (e^{σ²} − 1)/L², grad var = g2·e^{σ²}/L².
  """
  _check_inputs(x, g)
  length = _check_size('length', length, minimum=2)
  if form is None:
    form = 'quadrature' if exact else 'simple'
  if form not in SOFTMAX_FORMS:
    raise ValueError(f'form must be one of {SOFTMAX_FORMS}, got {form!r}')
  L = length
  sigma2 = x.var * (1 - x.corr_seq)
  if form == 'quadrature':
    mom = softmax_moments(sigma2, L)
    var = float(mom['m2']) - 1 / L**2
    grad_var = (1 - g.corr_seq) * g.var * (float(mom['m2q']) + (L - 1) * float(mom['m22']))
  elif form == 'lognormal':
    sz2 = sigma2 * L / (L - 1)
    s_sum = (L - 1) * math.exp(sigma2) + 1
    var = math.expm1(sz2) * math.exp(2 * sz2) / s_sum**2
    grad_var = g.var * (var + 1 / L**2)
  else:
    var = math.expm1(sigma2) / L**2
    grad_var = g.var * math.exp(sigma2) / L**2
  if var <= 0 or grad_var <= 0:
    raise ValueError(f'softmax input has no spread (s2·(1−r) = {sigma2}); its output is constant')
  anti = -1 / (L - 1)
  return Stats(mean=1 / L, var=var, corr_seq=anti), GradStats(var=grad_var, corr_seq=anti)


# ----------------------------------------------------------------------------------------------------
# Attention (Appendices A.8, B.1) and its causal variant.


def _query_spread(sl2: float, c2: float, q2: float, d_head: int) -> tuple[float, float]:
  """(σ_eff², e^κ) of `_attention_moments`' form='exact' ("Spread over queries" there): the logit
  variance at which the softmax moments are taken, and the shared-key factor between two queries."""
  b = sl2 / d_head
  rho = c2 / q2 if q2 > 0 else 0.0
  if 2 * b >= 1:
    raise ValueError(
      f'attention logits too large for the moment formulas (logit variance {sl2:.3g} '
      f'>= d_head/2 = {d_head / 2}): the softmax is saturated'
    )
  # E[e^{σℓ²X}] over X ~ χ²_{d_head}/d_head equals e^{σ_eff²}: the softmax moments are evaluated at
  # σ_eff² (exact for n = 1 and for n → ∞, smooth in between).
  sl2_eff = -0.5 * d_head * math.log1p(-2 * b)
  e_kappa = math.exp(-0.5 * d_head * math.log((1 - b * rho) ** 2 - b**2))
  return sl2_eff, e_kappa


def _query_output_var(c2, tau2, sd2, e2, n, p):
  """E[(Σ_s A_ts x_s)²] per input coordinate for a query over n keys (form='exact', docstring below)."""
  return c2 * (1 + p * e2 / (n * (1 - p))) + tau2 * (n - 1) / n + e2 * (sd2 + 4 * tau2) / (n * (1 - p))


def _attention_moments(
  x: Stats,
  g: GradStats,
  *,
  d_in: int,
  d_head: int,
  length: int,
  p: float,
  qk_prod: float,
  v_var: float,
  causal: bool,
  form: str,
) -> tuple[float, float, float, float]:
  """(var_out, cov_out, var_gin, cov_gin) of one head O = Drop_p(softmax(X Wq Wkᵀ Xᵀ/sqrt(d_head))) X Wv.

  Notation. Tokens x_t = m + δ_t: m is shared by all tokens (per hidden unit: the input mean plus a
  N(0, r·s2) part), δ_t ~ N(0, σδ²·I), σδ² = (1−r)·s2. q2 = s2 + mu², c2 = r·s2 + mu² (second moment and
  token covariance of the input). M = Wq Wkᵀ/sqrt(d_head) has uncorrelated entries of variance qk_prod.
  The logits of query t are ℓ_ts = u_t·δ_s + const with u_t = x_t M, so over the keys they are i.i.d.
  N(0, σℓ²): σℓ² = σδ²·U, U = E‖u_t‖² = qk_prod·d_in²·q2; two queries share κ = σδ²·Uc of it,
  Uc = E[u_t·u_t'] = qk_prod·d_in²·c2. A ∈ {0, P/(1−p)} is the attention matrix after dropout;
  e2(n) = n²·E[P²] over n keys (exact quadrature; e^{σℓ²} in the paper).

  Forward (Appendix A.8, generalised). Σ_s A_ts x_s = a_t·m + Σ_s A_ts δ_s, a_t = Σ_s A_ts. Softmax
  weighting tilts the Gaussian δ_s to mean σδ²·u_t (the "τ²" terms, per coordinate τ² = σδ⁴·U/d_in),
  so per input coordinate
    E[(Σ_s A_ts x_s)²] = c2·(1 + p·e2/(n(1−p))) + τ²·(n−1)/n + e2·(σδ² + 4τ²)/(n(1−p)),
  and two queries t ≠ t' (sharing the keys s ≤ min) have
    E[(Σ A_ts x_s)(Σ A_t's x_s)] = c2 + τc²·(1 − 1/n_max) + e^κ·(σδ² + 2τ² + 2τc²)/n_max.
  The value projection multiplies both by d_in·v_var. The paper has the same without the p·e2 shared
  term and with e^{σℓ²} for e2.

  Backward. With h_t = g_t Wvᵀ (E[h_t·h_t'] ∝ ρ_tt' = 1 or rg) the input gradient of token u is
    value path  V_u = Σ_t A_tu h_t,
    query path  Q_u = Σ_s ∂ℓ_us·x_s Mᵀ = Cov_{P_u}(ξ·h_u·x, x)·Mᵀ (a softmax-weighted covariance),
    key path    K_u = Σ_t ∂ℓ_tu·u_t, ∂ℓ_tu = P_tu·h_t·(ξ_tu x_u − Σ_s P_ts ξ_ts x_s).
  Per coordinate and in units of d_head·v_var·g2 (S1(u) = Σ_{t∋u} e2(n_t)/n_t², S2(u) =
  Σ_{t≠t'∋u} 1/(n_t n_t'); bidirectional: S1 = e2/L, S2 = (L−1)/L):
    V = S1/(1−p) + rg·e^κ·S2                      (paper: e2 = 1, κ = 0)
    Q = qk_prod·d_in·σδ²·[σδ²·c_n² + k2(n)·d_in·(p·c2 + σδ²)/(n(1−p))],  c_n = 1 − e2(n)/n,
        because the tilted keys are Gaussian with covariance σδ²·I, so Cov_P(h·δ, δ) → σδ²·h: a
        deterministic query gradient σδ²·h_u Mᵀ that the paper misses (it dominates the value path
        when rg = 0 and L ≫ d_in), plus a fluctuation over the n keys;
    K = U·(p·c2 + σδ²)·S1k/(1−p) + rg·κ·e^κ·S2k,  S1k(u) = Σ_{t∋u} k2(n_t)/n_t², S2k as S2 with each
        query's 1/n_t replaced by (1 − 1/n_t)/n_t.
  k2(n) = n²·E[P_u²·|e_u − P|²] (`_softmax_key_weight`) weighs a query in its logit gradient
  ∂ℓ_u = P_u·(a_u − Σ_s P_s a_s): it is 0 for a query that sees one key (a constant softmax) and tends to
  e2(n) for many keys. Weighting by e2(n) alone (and by c_n·e2(n) in Q), the first query included,
  over-predicts where queries see few keys: by 14–42% of a causal head's input-gradient variance at
  L = 16–32, d_in = 32–64, logit variance ~0.9, against a Monte Carlo in plain jnp and jax.vjp
  (`experiments/dslm_position_theory.py`, 'weighting' in its results; the weight used here is held to
  sampling in tests/theory/test_components.py).
  Cross terms between the three paths are O(1/d_in) or O(1/L) relative and dropped. Token covariance
  (u ≠ u'): V from Σ_t E[P_tu P_tu'] = (n−e2)/(n²(n−1)) per shared query plus rg/(n_t n_t'); Q from
  the shared mean part rg·σδ⁴·c_n c_n' and the fluctuation over shared keys; K ≈ 0.

  Causal (not in the paper): query t sees n_t = t+1 keys and key u is seen by the queries t ≥ u, so
  n → n_t in the forward terms, S1(u) and S2(u) are suffix sums over t ≥ u, two queries share
  min(n_t, n_t') keys (hence the 1/n_max above) and two keys share the queries t ≥ max(u, u'). Every
  statistic is averaged over positions (over ordered pairs of positions for covariances). Position 0
  sees only itself: its output is ξ·x_0 Wv exactly, and the formulas give that (e2(1) = 1, c_1 = 0).

  Spread over queries (form='exact'): ‖x_t Wq‖² is a sum of d_head squares, so the logit variance of a
  query is σℓ²·χ²_{d_head}/d_head: E[e^{σℓ²}] → (1 − 2b)^{−d_head/2} and e^κ → ((1 − bρ)² −
  b²)^{−d_head/2} with b = σℓ²/d_head, ρ = c2/q2 (moment generating functions of a chi-square and of the
  product of two correlated Gaussian vectors). The softmax moments are taken at σ_eff² =
  −(d_head/2)·log(1 − 2b), which reproduces the first.
  """
  s2, mu, r = x.var, x.mean, x.corr_seq
  g2, rg = g.var, g.corr_seq
  L = length
  q2 = s2 + mu**2
  c2 = r * s2 + mu**2
  sd2 = (1 - r) * s2
  U = qk_prod * d_in**2 * q2
  Uc = qk_prod * d_in**2 * c2
  sl2 = sd2 * U
  kappa = sd2 * Uc
  tau2 = sd2**2 * U / d_in
  tauc2 = sd2**2 * Uc / d_in
  proj_f = d_in * v_var  # forward value projection
  unit_b = d_head * v_var * g2  # backward value projection and the incoming gradient

  if form == 'simple':
    # Table 1: attention averages the tokens; softmax ≈ 1/L for the gradient.
    if c2 <= 0:
      raise ValueError(
        "form='simple' needs correlated tokens (x.corr_seq > 0 or x.mean != 0): the "
        'simplified attention output is r·s2'
      )
    var_out = proj_f * c2
    var_g = unit_b * (rg + 1 / (L * (1 - p)))
    cov_g = unit_b * (rg + 1 / L)
    return var_out, var_out, var_g, cov_g

  exact = form == 'exact'
  if exact:
    sl2_eff, e_kappa = _query_spread(sl2, c2, q2, d_head)
    e2_of = lambda n: _softmax_e2(sl2_eff, n)
  else:
    # Appendix A.8: e^{σℓ²} in the forward; the backward treats the softmax as the constant 1/L.
    e_kappa = 1.0
    e2_of = lambda n: np.full(np.shape(n), math.exp(sl2))

  # The value path's n²·E[P²]: exact, or 1 in the paper's backward (softmax = the constant 1/n).
  e2_backward = (lambda e2: e2) if exact else (lambda e2: 1.0)

  if not causal:
    n = float(L)
    e2 = float(e2_of(L))
    if exact:
      var_pre = _query_output_var(c2, tau2, sd2, e2, n, p)
      cov_pre = c2 + tauc2 * (1 - 1 / n) + e_kappa * (sd2 + 2 * tau2 + 2 * tauc2) / n
    else:
      # Appendix A.8 verbatim (mu = 0 there; c2 generalises r·s2).
      var_pre = c2 + tau2 * (n - 1) / n + e2 * (sd2 + 4 * tau2) / (n * (1 - p))
      cov_pre = c2 + (sd2 + 2 * tau2) / n
    s1, s2_pairs = e2_backward(e2) / n, (n - 1) / n
    v_path = s1 / (1 - p) + rg * e_kappa * s2_pairs
    v_cov = (n - e2_backward(e2)) / (n * (n - 1)) + rg * (n - 1) / n
    if not exact:
      return proj_f * var_pre, proj_f * cov_pre, unit_b * v_path, unit_b * v_cov
    c_n = 1 - e2 / n
    w_key = float(_softmax_key_weight(sl2_eff, L)) / n**2
    q_path = qk_prod * d_in * sd2 * (sd2 * c_n**2 + n * w_key * d_in * (p * c2 + sd2) / (1 - p))
    k_path = U * (p * c2 + sd2) * n * w_key / (1 - p) + rg * kappa * e_kappa * s2_pairs * (1 - 1 / n) ** 2
    q_cov = rg * qk_prod * d_in * sd2**2 * (c_n**2 + e_kappa * d_in / n)
    return (proj_f * var_pre, proj_f * cov_pre, unit_b * (v_path + q_path + k_path), unit_b * (v_cov + q_cov))

  # Causal: position t = 0..L−1 sees n_t = t+1 keys.
  pos = np.arange(L)
  n = (pos + 1).astype(np.float64)
  e2 = np.asarray(e2_of(pos + 1), np.float64)
  pairs = L * (L - 1)

  def mean_over_pairs_of_max(f):
    # Average of f(max(u, u')) over ordered pairs u ≠ u': position v is the larger one v times (×2).
    return 2 * np.sum(f * pos) / pairs

  def mean_over_pairs_of_product(f):
    return (np.sum(f) ** 2 - np.sum(f**2)) / pairs

  if exact:
    var_pre = _query_output_var(c2, tau2, sd2, e2, n, p)
    cov_pre = c2 + mean_over_pairs_of_max(tauc2 * (1 - 1 / n) + e_kappa * (sd2 + 2 * tau2 + 2 * tauc2) / n)
  else:
    var_pre = c2 + tau2 * (n - 1) / n + e2 * (sd2 + 4 * tau2) / (n * (1 - p))
    cov_pre = c2 + mean_over_pairs_of_max((sd2 + 2 * tau2) / n)
  var_out = proj_f * float(np.mean(var_pre))
  cov_out = proj_f * float(cov_pre)

  # Key u collects from the queries t ≥ u: suffix sums over t.
  suffix = lambda f: np.cumsum(f[::-1])[::-1]
  inv_n = 1 / n
  s1 = suffix(e2_backward(e2) / n**2)
  sum_inv = suffix(inv_n)
  s2_pairs = sum_inv**2 - suffix(inv_n**2)
  v_path = s1 / (1 - p) + rg * e_kappa * s2_pairs
  # Covariance of keys u ≠ u': queries t ≥ max(u, u') see both keys.
  shared = suffix(np.where(n > 1, (n - e2_backward(e2)) / (n**2 * np.maximum(n - 1, 1)), 0.0))
  v_cov = mean_over_pairs_of_max(shared) + rg * (
    mean_over_pairs_of_product(sum_inv) - mean_over_pairs_of_max(suffix(inv_n**2))
  )
  if not exact:
    return var_out, cov_out, unit_b * float(np.mean(v_path)), unit_b * float(v_cov)
  c_n = 1 - e2 / n
  w_key = _softmax_key_weight(sl2_eff, pos + 1) / n**2
  q_path = qk_prod * d_in * sd2 * (sd2 * c_n**2 + n * w_key * d_in * (p * c2 + sd2) / (1 - p))
  key_mean = (1 - inv_n) * inv_n  # a query's mean weight on the key path: 0 for the first query
  k_pairs = suffix(key_mean) ** 2 - suffix(key_mean**2)
  k_path = U * (p * c2 + sd2) * suffix(w_key) / (1 - p) + rg * kappa * e_kappa * k_pairs
  q_cov = (
    rg
    * qk_prod
    * d_in
    * sd2**2
    * (mean_over_pairs_of_product(c_n) + e_kappa * d_in * mean_over_pairs_of_max(inv_n))
  )
  var_g = unit_b * float(np.mean(v_path + q_path + k_path))
  cov_g = unit_b * float(v_cov + q_cov)
  return var_out, cov_out, var_g, cov_g


def _check_form(form: str) -> str:
  if form not in ATTENTION_FORMS:
    raise ValueError(f'form must be one of {ATTENTION_FORMS}, got {form!r}')
  return form


def _head(x: Stats, g: GradStats, *, d_in, d_head, length, p, qk_prod, v_var, causal, form):
  var_out, cov_out, var_g, cov_g = _attention_moments(
    x, g, d_in=d_in, d_head=d_head, length=length, p=p, qk_prod=qk_prod, v_var=v_var, causal=causal, form=form
  )
  return _stats(0.0, var_out, cov_out), _grad(var_g, cov_g)


def attention_head(
  x: Stats,
  g: GradStats,
  *,
  d_in: int,
  d_head: int,
  length: int,
  p: float,
  qk_var: float,
  v_var: float,
  causal: bool = False,
  form: str = 'exact',
) -> tuple[Stats, GradStats]:
  """One attention head with value projection, O = Drop_p(softmax(X Wq Wkᵀ Xᵀ/sqrt(d_head)))·X Wv.

  X: (length, d_in) with the statistics `x`; Wq, Wk, Wv: (d_in, d_head); dropout p on the attention
  probabilities. qk_var is the variance of the entries of Wq and of Wk (the moments depend on them only
  through the product q_var·k_var = qk_var²). causal=True: token t attends to tokens 0..t only; the
  returned statistics are averages over positions.

  Forms: 'exact' (default; derivation in `_attention_moments`), 'paper' (Appendix A.8 with the value
  projection: forward ×d_in·v_var, backward ×d_head·v_var, softmax treated as 1/L in the backward),
  'simple' (Table 1: var ≈ r·s2·d_in·v_var, r_out ≈ 1). The paper's gradient formula ignores the
  gradient through the softmax; its error reaches tens of percent when the incoming gradient is
  uncorrelated across tokens and L ≫ d_in (Table 21: 44.5% at the 99th percentile).
  """
  _check_inputs(x, g)
  d_in, d_head = _check_size('d_in', d_in), _check_size('d_head', d_head)
  length = _check_size('length', length, minimum=2)
  p = _check_prob('p', p)
  qk_var, v_var = _check_positive('qk_var', qk_var), _check_positive('v_var', v_var)
  return _head(
    x,
    g,
    d_in=d_in,
    d_head=d_head,
    length=length,
    p=p,
    qk_prod=qk_var**2,
    v_var=v_var,
    causal=bool(causal),
    form=_check_form(form),
  )


def attention_block(
  x: Stats,
  g: GradStats,
  *,
  d: int,
  num_heads: int,
  length: int,
  p: float,
  q_var: float,
  k_var: float,
  v_var: float,
  o_var: float,
  attn_p: float | None = None,
  causal: bool = False,
  form: str = 'exact',
) -> tuple[Stats, GradStats]:
  """Multi-head attention → output projection (d→d, o_var) → Dropout(p) (Appendix B.1, Table 2).

  `num_heads` heads of width d/num_heads, each reading all d inputs; `attn_p` is the dropout on the
  attention probabilities (None: p, as in the paper's block). The block's LayerNorm is not included.
  Heads have independent weights and receive uncorrelated slices of the gradient, so their input
  gradients add. Simplified (form='simple', large L): var_out = C1·r·s2 with C1 = d²·v_var·o_var/(1−p),
  r_out = 1−p, var_gin = C1·(1−p)·rg·g2 and rg_in ≈ 1 (the paper's Table 2 has C1·rg·g2 and 1−p: it
  omits that the output dropout turns rg into (1−p)·rg on the way in).
  """
  _check_inputs(x, g)
  d, num_heads = _check_size('d', d), _check_size('num_heads', num_heads)
  if d % num_heads:
    raise ValueError(f'num_heads must divide d, got d={d}, num_heads={num_heads}')
  length = _check_size('length', length, minimum=2)
  p = _check_prob('p', p)
  attn_p = p if attn_p is None else _check_prob('attn_p', attn_p)
  q_var, k_var = _check_positive('q_var', q_var), _check_positive('k_var', k_var)
  v_var, o_var = _check_positive('v_var', v_var), _check_positive('o_var', o_var)
  form = _check_form(form)
  d_head = d // num_heads

  def heads(h: Stats, gh: GradStats):
    out, g_in = _head(
      h,
      gh,
      d_in=d,
      d_head=d_head,
      length=length,
      p=attn_p,
      qk_prod=q_var * k_var,
      v_var=v_var,
      causal=bool(causal),
      form=form,
    )
    # Concatenated heads are uncorrelated across hidden units; their input gradients add up.
    return (
      dataclasses.replace(out, corr_hidden=0.0),
      GradStats(var=num_heads * g_in.var, corr_seq=g_in.corr_seq),
    )

  return _chain(
    x,
    g,
    [
      heads,
      functools.partial(linear, d_in=d, d_out=d, w_var=o_var),
      functools.partial(dropout, p=p),
    ],
  )


def ffn_block(
  x: Stats,
  g: GradStats,
  *,
  d: int,
  hidden: int,
  p: float,
  w1_var: float,
  w2_var: float,
  activation: str = 'relu',
  exact: bool = True,
) -> tuple[Stats, GradStats]:
  """Linear (d→hidden, w1_var) → ReLU|GeLU → Linear (hidden→d, w2_var) → Dropout(p) (Appendix B.2).

  The block's LayerNorm is not included. With ReLU: var_out = d·hidden·w1_var·w2_var·s2/(2(1−p)), which
  is C2·s2 with C2 = 2d²·w1_var·w2_var/(1−p) for hidden = 4d; r_out = (1−p)·(r + (sqrt(1−r²) −
  r·acos(r))/π) (exact=False: through the ReLU polynomial fit); var_gin = C2·g2 and
  rg_in = (1−p)·(1/2 + asin(r)/π)·rg. GeLU uses Appendix A.5 (its own constants, not C2).
  """
  _check_inputs(x, g)
  d, hidden = _check_size('d', d), _check_size('hidden', hidden)
  p = _check_prob('p', p)
  w1_var, w2_var = _check_positive('w1_var', w1_var), _check_positive('w2_var', w2_var)
  if activation == 'relu':
    act = functools.partial(relu, exact=exact)
  elif activation == 'gelu':
    act = gelu
  else:
    raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
  return _chain(
    x,
    g,
    [
      functools.partial(linear, d_in=d, d_out=hidden, w_var=w1_var),
      act,
      functools.partial(linear, d_in=hidden, d_out=d, w_var=w2_var),
      functools.partial(dropout, p=p),
    ],
  )


# ----------------------------------------------------------------------------------------------------
# Embeddings (Appendix A.1).


def embedding_corr(
  *,
  vocab_size: int,
  num_tables: int,
  segment_table: bool | None = None,
  seq_len: int | None = None,
  exact: bool = False,
) -> float:
  """Token correlation of the sum of `num_tables` equal-variance embedding lookups (Appendix A.1).

  Tables, in order: word (Zipf-distributed tokens), position (unique per token: correlation 0), then a
  segment table (two segments split uniformly at random) if `segment_table` (default: num_tables ≥ 3,
  i.e. BERT). The correlation of the sum is the average over tables.

  Word table: two tokens hit the same row with probability Σ_i p_i², p_i ∝ 1/i:
    exact=False (paper): π²/(6·ln²|V|); exact=True: Σ_{i≤V} i⁻² / H_V² (H_V the harmonic number).
  Segment table: 2/3 for long sequences; (2L/3 − 1)/(L − 1) when seq_len is given.
  BERT, |V| = 32000, three tables: 0.227 (measured 0.221). GPT (word + position): r_word/2.
  """
  vocab_size = _check_size('vocab_size', vocab_size, minimum=2)
  num_tables = _check_size('num_tables', num_tables)
  if seq_len is not None:
    seq_len = _check_size('seq_len', seq_len, minimum=2)
  if segment_table is None:
    segment_table = num_tables >= 3
  if segment_table and num_tables < 2:
    raise ValueError('num_tables must be >= 2 when there is a segment table (word + segment)')
  if exact:
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
    r_word = float(np.sum(ranks**-2) / np.sum(1 / ranks) ** 2)
  else:
    r_word = math.pi**2 / (6 * math.log(vocab_size) ** 2)
  r_segment = 0.0
  if segment_table:
    r_segment = 2 / 3 if seq_len is None else (2 * seq_len / 3 - 1) / (seq_len - 1)
  return (r_word + r_segment) / num_tables


def embedding(
  *,
  vocab_size: int,
  num_tables: int,
  table_var: float,
  p: float = 0.0,
  segment_table: bool | None = None,
  seq_len: int | None = None,
  exact: bool = False,
) -> Stats:
  """Statistics of the summed embeddings after the embedding dropout: var K·table_var/(1−p), r·(1−p)."""
  table_var = _check_positive('table_var', table_var)
  r = embedding_corr(
    vocab_size=vocab_size, num_tables=num_tables, segment_table=segment_table, seq_len=seq_len, exact=exact
  )
  out, _ = dropout(Stats(var=num_tables * table_var, corr_seq=r), GradStats(), p=p)
  return out
