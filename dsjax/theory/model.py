"""Moments through a whole transformer stack (Kedia et al. 2024, §3.5 and Appendices E–G, M).

`propagate` chains the component formulas of `dsjax.theory.components` through the stack a dsjax model
config describes (`dsjax.models.transformer`): per layer an attention residual add and an FFN residual
add,

    Pre-LN  (block='preln'):  x ← λ·x + β·Drop(f(LN(x)))         then a final LN (final_norm=True)
    Post-LN (block='postln'): x ← LN(λ·x + β·Drop(f(x)))         no final LN by default

with per-layer λ/β for each add, per-layer weight variances and dropout on the embedding, on the
attention probabilities and on every branch output. It returns the forward variance, mean and token
correlation of the residual stream and the variance and token correlation of the gradient w.r.t. it,
after every residual add. Skip and branch are uncorrelated at initialisation (the branch ends in a
zero-mean projection), so variances and covariances add (Appendix E).

The other helpers are the DSLM recipe (§3.5): residual scales, the correlation of the stream entering
each layer (the recurrence of Appendix M), the FFN weight variance giving a unit-variance FFN output
(for GeLU from Appendix A.5, not the ReLU constant), and the rank-collapse fixed point of Appendix F.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import numpy as np
from scipy import optimize

from dsjax.theory import components as C
from dsjax.theory.components import GradStats, Stats

BLOCKS = ('preln', 'postln')
WEIGHT_NAMES = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')


@dataclasses.dataclass(frozen=True)
class Propagation:
  """Predicted moments after every residual add (arrays of length 2·depth).

  Site 2n is the attention add of layer n (0-based), site 2n+1 its FFN add (= the output of layer n).
  Every statistic is of the residual stream *after* the add: for Pre-LN the sum λ·x + β·h, for Post-LN
  the output of the LayerNorm that follows the add (the stream the next block reads). These are the
  dsjax probe sites 'attn_residual' (2n) and 'ffn_residual' (2n+1); the `branch_*` arrays are the probe
  sites 'attn_branch'/'ffn_branch' (Drop(f(·)) before the β scale). `grad_*` is the gradient w.r.t.
  the stream at the site, propagated down from `output_grad` at the top of the stack.
  """

  var: np.ndarray
  mean: np.ndarray
  corr_seq: np.ndarray
  grad_var: np.ndarray
  grad_corr_seq: np.ndarray
  branch_var: np.ndarray
  branch_corr_seq: np.ndarray
  pre_norm_var: np.ndarray  # Post-LN: λ·x + β·h before its LayerNorm (= var for Pre-LN)
  stream_in: Stats  # stream entering layer 0 (embedding after its dropout)
  stream_in_grad: GradStats  # gradient w.r.t. stream_in
  embedding_grad: GradStats  # gradient w.r.t. the embedding before its dropout
  output: Stats  # top of the stack (after the final norm, if any)
  output_grad: GradStats

  @property
  def depth(self) -> int:
    return len(self.var) // 2

  # Per layer: the layer output (FFN add) — what dsjax.instrument records per layer.
  @property
  def layer_var(self) -> np.ndarray:
    return self.var[1::2]

  @property
  def layer_corr_seq(self) -> np.ndarray:
    return self.corr_seq[1::2]

  @property
  def layer_grad_var(self) -> np.ndarray:
    return self.grad_var[1::2]

  @property
  def layer_grad_corr_seq(self) -> np.ndarray:
    return self.grad_corr_seq[1::2]


def _per_layer(name: str, value, depth: int) -> np.ndarray:
  arr = np.asarray(value, np.float64)
  if arr.ndim == 0:
    arr = np.full(depth, float(arr))
  if arr.shape != (depth,):
    raise ValueError(f'{name} must be a scalar or have shape ({depth},), got shape {arr.shape}')
  if not np.all(np.isfinite(arr)):
    raise ValueError(f'{name} must be finite, got {arr}')
  return arr


def xavier_weight_vars(width: int, mlp_ratio: int = 4) -> dict[str, float]:
  """Glorot variances 2/(fan_in + fan_out) of the six block matrices (dsjax 'vanilla' scheme)."""
  d, f = width, mlp_ratio * width
  return dict(q=1 / d, k=1 / d, v=1 / d, o=1 / d, ffn1=2 / (d + f), ffn2=2 / (d + f))


def _add(x: Stats, h: Stats, skip: float, branch: float) -> Stats:
  """λ·x + β·h for uncorrelated x and h: means, variances and covariances add."""
  var = skip**2 * x.var + branch**2 * h.var
  cov_seq = skip**2 * x.cov_seq + branch**2 * h.cov_seq
  cov_hidden = skip**2 * x.cov_hidden + branch**2 * h.cov_hidden
  return C._stats(skip * x.mean + branch * h.mean, var, cov_seq, cov_hidden)  # pylint: disable=protected-access


def _add_grads(skip: float, g: GradStats, g_branch: GradStats | None) -> GradStats:
  """Gradient w.r.t. x of λ·x + β·f(x): λ·g plus the branch's input gradient (uncorrelated)."""
  var, cov = skip**2 * g.var, skip**2 * g.cov_seq
  if g_branch is not None:
    var, cov = var + g_branch.var, cov + g_branch.cov_seq
  return C._grad(var, cov)  # pylint: disable=protected-access


def propagate(
  *,
  depth: int,
  width: int,
  num_heads: int,
  seq_len: int,
  dropout: float = 0.0,
  attn_dropout: float | None = None,
  activation: str = 'relu',
  block: str = 'preln',
  causal: bool = False,
  skip_scale_attn=1.0,
  branch_scale_attn=1.0,
  skip_scale_ffn=1.0,
  branch_scale_ffn=1.0,
  weight_vars: Mapping[str, object] | None = None,
  mlp_ratio: int = 4,
  final_norm: bool | None = None,
  input: Stats = Stats(),  # pylint: disable=redefined-builtin
  output_grad: GradStats = GradStats(),
  embedding_dropout: bool = True,
  form: str = 'exact',
) -> Propagation:
  """Predicted moments of the residual stream and its gradient after every residual add.

  Args:
    depth, width, num_heads, seq_len, mlp_ratio: the stack (FFN hidden = mlp_ratio·width).
    dropout: p on the embedding (if `embedding_dropout`) and on every branch output.
    attn_dropout: p on the attention probabilities; None means `dropout` (the paper's block).
    activation: 'relu' | 'gelu'. block: 'preln' | 'postln'. causal: GPT (True) or ViT/BERT attention.
    skip_scale_attn, branch_scale_attn, skip_scale_ffn, branch_scale_ffn: λ and β of the two adds,
      scalars or arrays of length depth.
    weight_vars: variances (not standard deviations) of the six block matrices, {'q','k','v','o','ffn1',
      'ffn2'} -> scalar or (depth,) array; None: Xavier (`xavier_weight_vars`).
    final_norm: LayerNorm after the stack; None: True for Pre-LN, False for Post-LN.
    input: statistics of the embedding output (before the embedding dropout), e.g.
      `components.embedding(...)`, or measured (ViT: corr ≈ 0.46, Appendix H).
    output_grad: statistics of the gradient arriving at the top (the final norm's output if any).
    form: 'exact' (default), 'paper' (Appendix A.8 attention, the paper's LayerNorm) or 'simple'
      (Tables 1–2: attention var r·s2, ReLU polynomial fit).
  """
  depth = C._check_size('depth', depth)  # pylint: disable=protected-access
  d = C._check_size('width', width)  # pylint: disable=protected-access
  heads = C._check_size('num_heads', num_heads)  # pylint: disable=protected-access
  L = C._check_size('seq_len', seq_len, minimum=2)  # pylint: disable=protected-access
  ratio = C._check_size('mlp_ratio', mlp_ratio)  # pylint: disable=protected-access
  p = C._check_prob('dropout', dropout)  # pylint: disable=protected-access
  attn_p = p if attn_dropout is None else C._check_prob('attn_dropout', attn_dropout)  # pylint: disable=protected-access
  if block not in BLOCKS:
    raise ValueError(f'block must be one of {BLOCKS}, got {block!r}')
  if activation not in ('relu', 'gelu'):
    raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
  if form not in C.ATTENTION_FORMS:
    raise ValueError(f'form must be one of {C.ATTENTION_FORMS}, got {form!r}')
  C._check_type('input', input, Stats)  # pylint: disable=protected-access
  C._check_type('output_grad', output_grad, GradStats)  # pylint: disable=protected-access
  if d % heads:
    raise ValueError(f'num_heads must divide width, got width={d}, num_heads={heads}')
  if final_norm is None:
    final_norm = block == 'preln'
  hidden = ratio * d
  weight_vars = xavier_weight_vars(d, ratio) if weight_vars is None else dict(weight_vars)
  missing = set(WEIGHT_NAMES) - set(weight_vars)
  if missing:
    raise ValueError(f'weight_vars is missing {sorted(missing)}')
  w = {name: _per_layer(f'weight_vars[{name!r}]', weight_vars[name], depth) for name in WEIGHT_NAMES}
  for name, arr in w.items():
    if np.any(arr <= 0):
      raise ValueError(f'weight_vars[{name!r}] must be > 0, got {arr}')
  skip_a = _per_layer('skip_scale_attn', skip_scale_attn, depth)
  branch_a = _per_layer('branch_scale_attn', branch_scale_attn, depth)
  skip_f = _per_layer('skip_scale_ffn', skip_scale_ffn, depth)
  branch_f = _per_layer('branch_scale_ffn', branch_scale_ffn, depth)

  exact_ln = form == 'exact'
  exact_relu = form != 'simple'
  norm = lambda x, g: C.layernorm(x, g, d=d, exact=exact_ln)

  def post_norm(k, branch, s, g):
    """The LayerNorm after Post-LN add k (0-based over the 2·depth adds). Between the first and the last
    add its skip input is a LayerNorm output (fixed per-token norm) and its gradient came through the
    next LayerNorm: `components.layernorm(random_fraction=ρ)` with ρ the branch share of s. The first
    add's skip is the embedding, and the last norm's gradient comes from the head: the Gaussian form."""
    if k == 0 or k == n_sites - 1 or not exact_ln:
      return norm(s, g)
    rho = min(1.0, branch**2 * branch_out[k].var / s.var)
    return C.layernorm(s, g, d=d, exact=True, random_fraction=rho)

  def attention(n):
    def f(x, g):
      return C.attention_block(
        x,
        g,
        d=d,
        num_heads=heads,
        length=L,
        p=p,
        q_var=w['q'][n],
        k_var=w['k'][n],
        v_var=w['v'][n],
        o_var=w['o'][n],
        attn_p=attn_p,
        causal=causal,
        form=form,
      )

    return f

  def ffn(n):
    def f(x, g):
      return C.ffn_block(
        x,
        g,
        d=d,
        hidden=hidden,
        p=p,
        w1_var=w['ffn1'][n],
        w2_var=w['ffn2'][n],
        activation=activation,
        exact=exact_relu,
      )

    return f

  # Each residual add: (branch function, λ, β). Pre-LN: the branch includes its LayerNorm.
  adds = []
  for n in range(depth):
    adds.append((attention(n), skip_a[n], branch_a[n]))
    adds.append((ffn(n), skip_f[n], branch_f[n]))

  def branch_of(f):
    if block == 'postln':
      return f
    return lambda x, g: C._chain(x, g, [norm, f])  # pylint: disable=protected-access

  # Forward: record the input of every add (x), its branch output (h) and the pre-norm sum (s).
  x = input
  if embedding_dropout:
    x, _ = C.dropout(x, GradStats(), p=p)
  stream_in = x
  n_sites = 2 * depth
  site_in, site_sum, branch_out, stream = [], [], [], []
  for f, skip, branch in adds:
    h, _ = branch_of(f)(x, GradStats())
    s = _add(x, h, skip, branch)
    site_in.append(x)
    branch_out.append(h)
    site_sum.append(s)
    x = norm(s, GradStats())[0] if block == 'postln' else s  # ρ only changes the backward
    stream.append(x)
  output = norm(x, GradStats())[0] if final_norm else x

  # Backward from the top.
  g = output_grad
  if final_norm:
    _, g = norm(x, g)
  grads = [None] * n_sites
  for k in reversed(range(n_sites)):
    f, skip, branch = adds[k]
    grads[k] = g
    if block == 'postln':
      _, g = post_norm(k, branch, site_sum[k], g)
    g_branch = None
    if branch != 0:
      _, g_branch = branch_of(f)(site_in[k], GradStats(var=branch**2 * g.var, corr_seq=g.corr_seq))
    g = _add_grads(skip, g, g_branch)
  stream_in_grad = g
  embedding_grad = C.dropout(input, g, p=p)[1] if embedding_dropout else g

  arr = lambda values: np.asarray(values, np.float64)
  return Propagation(
    var=arr([s.var for s in stream]),
    mean=arr([s.mean for s in stream]),
    corr_seq=arr([s.corr_seq for s in stream]),
    grad_var=arr([g.var for g in grads]),
    grad_corr_seq=arr([g.corr_seq for g in grads]),
    branch_var=arr([h.var for h in branch_out]),
    branch_corr_seq=arr([h.corr_seq for h in branch_out]),
    pre_norm_var=arr([s.var for s in site_sum]),
    stream_in=stream_in,
    stream_in_grad=stream_in_grad,
    embedding_grad=embedding_grad,
    output=output,
    output_grad=output_grad,
  )


# ----------------------------------------------------------------------------------------------------
# DeepScaleLM (paper §3.5, Appendix M).


def dslm_beta2(depth: int, k: float = 2.0, alpha: float = 1.0) -> float:
  """β² = k/N^α (paper §3.5 "Choice of scaling parameters"; α = 1, k = 2 by default)."""
  return float(k) / float(depth) ** float(alpha)


def dslm_residual_scales(depth: int, k: float = 2.0, alpha: float = 1.0) -> tuple[float, float]:
  """(λ, β) with β² = k/N^α and λ² = 1 − β² (both adds of every layer; Appendix G for α)."""
  depth = C._check_size('depth', depth)  # pylint: disable=protected-access
  k = C._check_positive('k', k)  # pylint: disable=protected-access
  alpha = C._check_finite('alpha', alpha)  # pylint: disable=protected-access
  beta2 = dslm_beta2(depth, k, alpha)
  if beta2 >= 1:
    raise ValueError(f'k/depth^alpha must be < 1 (λ² = 1 − β² > 0), got {beta2}')
  return math.sqrt(1 - beta2), math.sqrt(beta2)


@functools.lru_cache(maxsize=64)  # A GeLU solve; dslm_weight_vars needs it twice per call.
def _pre_activation_var(activation: str, p: float, mlp_ratio: float, input_var: float) -> float:
  """Pre-activation variance s1 = d·w_var·input_var when both FFN matrices have variance w_var and the
  FFN block output has variance 1."""
  # Output var = hidden·w_var·E[act(z)²]/(1−p) with z ~ N(0, s1) and hidden·w_var = mlp_ratio·s1/input_var.
  target = (1 - p) * input_var / mlp_ratio
  if activation == 'relu':
    return math.sqrt(2 * target)  # s1·(s1/2) = target
  if activation == 'gelu':
    return optimize.brentq(
      lambda s1: s1 * C.gelu_second_moment(s1) - target, 1e-12, 1e6, xtol=1e-15, rtol=1e-14
    )
  raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")


def ffn_unit_weight_var(
  d: int, hidden: int, p: float, activation: str = 'relu', input_var: float = 1.0
) -> float:
  """Variance of both FFN matrices that makes the FFN block output variance 1 (§3.5, Appendix M).

  The block is Linear(d→hidden) → act → Linear(hidden→d) → Dropout(p) applied to an input of variance
  `input_var` (1 after a LayerNorm). ReLU: (1/sqrt(d·hidden))·sqrt(2(1−p)/input_var), i.e.
  (1/d)·sqrt((1−p)/2) for hidden = 4d. GeLU: solved from the exact GeLU second moment (Appendix A.5).
  """
  d, hidden = C._check_size('d', d), C._check_size('hidden', hidden)  # pylint: disable=protected-access
  p = C._check_prob('p', p)  # pylint: disable=protected-access
  input_var = C._check_positive('input_var', input_var)  # pylint: disable=protected-access
  s1 = _pre_activation_var(activation, p, hidden / d, input_var)
  return s1 / (d * input_var)


def _ffn_output_corr(r: float, s1: float, p: float, activation: str, exact: bool) -> float:
  """Token correlation of the FFN block output for an input of correlation r (pre-activation var s1)."""
  x, g = Stats(var=s1, corr_seq=float(np.clip(r, -1, 1))), GradStats()
  act = C.relu(x, g, exact=exact)[0] if activation == 'relu' else C.gelu(x, g)[0]
  # The second Linear turns the activation mean into covariance; dropout scales it by (1 − p).
  return (1 - p) * (act.cov_seq + act.mean**2) / act.second_moment


def dslm_layer_correlations(
  depth: int,
  dropout: float,
  input_corr: float,
  *,
  k: float = 2.0,
  alpha: float = 1.0,
  activation: str = 'relu',
  mlp_ratio: int = 4,
  exact: bool = True,
  embedding_dropout: bool = True,
) -> np.ndarray:
  """r_n: token correlation of the stream entering layer n (n = 0..depth−1) in a DSLM model (Appendix M).

  Every block output has variance 1 and the stream keeps variance 1 (λ² + β² = 1). The attention block
  outputs correlation (1−p) (tokens averaged, then dropout); the FFN block outputs
  (1−p)·(r + (sqrt(1−r²) − r·acos(r))/π) for ReLU (exact=False: the polynomial fit) and the Appendix A.5
  equivalent for GeLU at its DSLM pre-activation variance. After each add the correlation is the
  variance-weighted average (Appendix F):
      r ← (λ²·r·var + β²·r_block)/(λ²·var + β²),   var ← λ²·var + β².
  `input_corr` is the correlation of the embedding output before its dropout (Zipf estimate
  `components.embedding_corr` or measured); the stream starts at input_corr·(1−p). r_n is the value
  *entering* layer n: the reference code's "before layer n", which the DSLM init of layer n uses.
  """
  depth = C._check_size('depth', depth)  # pylint: disable=protected-access
  p = C._check_prob('dropout', dropout)  # pylint: disable=protected-access
  r = C._check_corr('input_corr', input_corr)  # pylint: disable=protected-access
  lam, beta = dslm_residual_scales(depth, k, alpha)
  lam2, beta2 = lam**2, beta**2
  s1 = _pre_activation_var(activation, p, mlp_ratio, 1.0)
  if embedding_dropout:
    r *= 1 - p
  var = 1.0
  corrs = np.empty(depth)
  for n in range(depth):
    corrs[n] = r
    r = (lam2 * r * var + beta2 * (1 - p)) / (lam2 * var + beta2)
    var = lam2 * var + beta2
    r_ffn = _ffn_output_corr(r, s1, p, activation, exact)
    r = (lam2 * r * var + beta2 * r_ffn) / (lam2 * var + beta2)
    var = lam2 * var + beta2
  return corrs


ATTENTION_VARS = ('table2', 'exact')


def dslm_weight_vars(
  depth: int,
  width: int,
  dropout: float,
  input_corr: float,
  *,
  k: float = 2.0,
  alpha: float = 1.0,
  activation: str = 'relu',
  mlp_ratio: int = 4,
  simple: bool = False,
  embedding_dropout: bool = True,
  attention_var: str = 'table2',
  num_heads: int | None = None,
  seq_len: int | None = None,
  causal: bool = False,
  attn_dropout: float | None = None,
) -> dict[str, np.ndarray]:
  """DSLM weight variances per layer (§3.5, App. M): q = k = 1/d; ffn1 = ffn2 = `ffn_unit_weight_var`;
  v = o per layer for a unit attention-block output (full init) or the FFN variance (simple init).

  Full init, `attention_var`:
    'table2': the paper's simplified attention variance C1·r_n (Table 2) = 1 → v = o = (1/d)·sqrt((1−p)/r_n).
      It assumes bidirectional attention over a long sequence.
    'exact': the output variance of `components.attention_block` (exact softmax moments, causal or not,
      the given num_heads / seq_len / attn_dropout, q = k = 1/d) for an input of variance 1 and
      correlation r_n, with v = o = 1/d, is var_n; the block is linear in v·o, so v = o = (1/d)/sqrt(var_n).
      For bidirectional attention over long sequences var_n → r_n/(1−p), i.e. 'table2'. Causal attention
      at small r keeps a (1−r)·Σ_t P_t² term (early queries see few tokens) that Table 2 drops: for
      192 layers, d 256, L 128, 4 heads and the Zipf byte correlation, the exact V·O is 4.3× below Table 2's
      at layer 0 (4.6× with attention dropout p).
  """
  d = C._check_size('width', width)  # pylint: disable=protected-access
  p = C._check_prob('dropout', dropout)  # pylint: disable=protected-access
  if attention_var not in ATTENTION_VARS:
    raise ValueError(f'attention_var must be one of {ATTENTION_VARS}, got {attention_var!r}')
  ffn_var = ffn_unit_weight_var(d, mlp_ratio * d, p, activation)
  if simple:
    vo = np.full(depth, ffn_var)
  else:
    r_n = dslm_layer_correlations(
      depth,
      p,
      input_corr,
      k=k,
      alpha=alpha,
      activation=activation,
      mlp_ratio=mlp_ratio,
      embedding_dropout=embedding_dropout,
    )
    if attention_var == 'table2':
      vo = np.sqrt((1 - p) / r_n) / d
    else:
      if num_heads is None or seq_len is None:
        raise ValueError("attention_var='exact' needs num_heads and seq_len")
      unit_var = np.array(
        [
          C.attention_block(
            Stats(var=1.0, corr_seq=float(r)),
            GradStats(),
            d=d,
            num_heads=num_heads,
            length=seq_len,
            p=p,
            q_var=1 / d,
            k_var=1 / d,
            v_var=1 / d,
            o_var=1 / d,
            attn_p=attn_dropout,
            causal=causal,
          )[0].var
          for r in r_n
        ]
      )
      vo = 1 / (d * np.sqrt(unit_var))
  ones = np.ones(depth)
  return dict(q=ones / d, k=ones / d, v=vo, o=vo.copy(), ffn1=ffn_var * ones, ffn2=ffn_var * ones)


# ----------------------------------------------------------------------------------------------------
# Rank collapse (Appendix F).


def block_constants(
  width: int, dropout: float, v_var: float, o_var: float, ffn1_var: float, ffn2_var: float, mlp_ratio: int = 4
) -> tuple[float, float]:
  """(C1, C2) of Appendix E/F: attention var_out = C1·r·s2, ReLU FFN var_out = C2·s2.

  C1 = d²·v_var·o_var/(1−p); C2 = d·hidden·ffn1_var·ffn2_var/(2(1−p)) (= 2d²·…/(1−p) for hidden 4d).
  """
  d = C._check_size('width', width)  # pylint: disable=protected-access
  p = C._check_prob('dropout', dropout)  # pylint: disable=protected-access
  for name, value in dict(v_var=v_var, o_var=o_var, ffn1_var=ffn1_var, ffn2_var=ffn2_var).items():
    C._check_positive(name, value)  # pylint: disable=protected-access
  hidden = mlp_ratio * d
  return d * d * v_var * o_var / (1 - p), d * hidden * ffn1_var * ffn2_var / (2 * (1 - p))


def stable_correlation(
  c1: float = 2.2, c2: float = 0.4, dropout: float = 0.1, exact: bool = False
) -> tuple[float, float]:
  """Fixed points (r_max, rg_max) of the token correlation of the stream and of its gradient (App. F).

  After many layers the stream correlation is the variance-weighted average of the attention output
  (1−p) and the FFN output (1−p)·f(r):
      r = [C1(1−p) + C2(1−p)·f(r)]/(C1 + C2),  f(r) = 1/π + r/2 + (1/2 − 1/π)r²  (exact: the ReLU form)
      rg = [C1(1−p) + C2(1−p)(1/2 + asin(r)/π)·rg]/(C1 + C2).
  The paper's Xavier constants C1 = 2.2, C2 = 0.4 with p = 0.1 give ≈ 0.88 and ≈ 0.87 (0.886 and 0.863
  to three digits). Without dropout the attention term pushes r to 1 (rank collapse).
  """
  c1, c2 = C._check_positive('c1', c1), C._check_positive('c2', c2)  # pylint: disable=protected-access
  p = C._check_prob('dropout', dropout)  # pylint: disable=protected-access

  def f(r):
    if exact:
      return r + (math.sqrt(max(0.0, 1 - r * r)) - r * math.acos(min(1.0, r))) / math.pi
    return 1 / math.pi + r / 2 + (0.5 - 1 / math.pi) * r * r

  r = 0.5
  for _ in range(10_000):
    r_new = (c1 * (1 - p) + c2 * (1 - p) * f(r)) / (c1 + c2)
    if abs(r_new - r) < 1e-14:
      break
    r = r_new
  r = min(r_new, 1.0)
  gain = c2 * (1 - p) * (0.5 + math.asin(r) / math.pi) / (c1 + c2)
  rg = c1 * (1 - p) / (c1 + c2) / (1 - gain)
  return r, min(rg, 1.0)
