"""Per-layer moment statistics, reduced to scalars on device (pure `jnp`, safe under jit/scan/grad).

Definitions follow the signal-propagation theory (notation of Kedia et al. 2024, Appendices A and O):
every element of an activation tensor x_BLD is treated as a draw from one distribution with mean μ and
variance σ², and correlations are Pearson correlations *about that mean*:

    corr_seq    (r^l)  corr(x[b, t, i], x[b, t', i])   same example, same hidden index, tokens t ≠ t'
    corr_hidden (r^d)  corr(x[b, t, i], x[b, t, j])    same example, same token, hidden indices i ≠ j

Both are computed in O(B·L·D) without forming the L×L or D×D matrices: for centred values c,
Σ_{t≠t'} c_t·c_t' = (Σ_t c_t)² − Σ_t c_t². μ and σ² are the moments over all B·L·D elements (the
theory's expectation is over inputs *and* weight draws; within one tensor the pooled moments are its
estimator). This is the same convention as `dsjax.theory`'s `corr_seq` / `corr_hidden`.

Numerics. Every statistic is computed in float32 whatever the dtype of the probed tensor (bfloat16
activations and gradients are cast before any arithmetic; the cast fuses into the reductions). Element
and pair counts enter as Python floats, never Python ints: B·L·D·(L−1) is 1.3e10 already for GPT-small
at batch 16 × 1024, and a Python int operand of a `jnp` operation is converted to int32, which raises
OverflowError past 2^31 − 1.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FORWARD_STATS = ('mean', 'var', 'corr_seq', 'corr_hidden', 'max_abs')
GRAD_STATS = ('grad_var', 'grad_corr_seq')

# Weight types of a block whose per-layer gradient norms are recorded, and the quantiles of |g|.
WEIGHT_TYPES = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2', 'norms')
GRAD_QUANTILES = {'p50': 0.5, 'p90': 0.9, 'p99': 0.99, 'p99.9': 0.999}
DISTRIBUTION_STATS = tuple(f'grad_abs_{q}' for q in GRAD_QUANTILES) + ('grad_kurtosis', 'grad_tail_ratio')


# The statistics are computed in two stages: `forward_sums` / `grad_sums`, the one pass over the tensor
# (sums over tokens and over hidden units, of squares, the max), and `forward_stats_of_sums` /
# `grad_stats_of_sums`, the few small reductions of those partial sums to scalars. Inside the layer
# scan the instrumentation (`probe.py`) keeps each layer's partial sums and finishes all layers at once
# after the loop: on a GPU every small reduction is a kernel launch of its own, per site and layer.
#
# Raw, unshifted moments keep the pass to one read of x: float32 var = Σx²/n − mean² loses
# ~(mean/std)²·1e-7 relative accuracy, negligible for activations and gradients (|mean| ≲ std).
# Whole-tensor sums are taken in two stages (over tokens, then over the B·D partial sums), which keeps
# float32 rounding at the level of sums of L and of B·D terms rather than of B·L·D.


def _reduce_together(operands: tuple[jax.Array, ...], maxima: int, axis: int) -> tuple[jax.Array, ...]:
  """Sums over `axis` of each of `operands`, the last `maxima` of them maxima instead. On a GPU in one
  (variadic) reduction: one read of the input and one kernel, where XLA does not always fuse several
  reductions of the same tensor (benchmarks/README.md, "Compiled for a GPU on the CPU"). Elsewhere as
  separate reductions: XLA's CPU backend runs the variadic one ~2× slower than two plain ones (Σx and
  Σx²: 0.55 against 0.27 ms for 32×128×128 float32 on 2 cores)."""
  num_sums = len(operands) - maxima

  def variadic(*xs):
    def combine(a, b):
      return tuple(x + y for x, y in zip(a[:num_sums], b[:num_sums])) + tuple(
        jax.lax.max(x, y) for x, y in zip(a[num_sums:], b[num_sums:])
      )

    return jax.lax.reduce(xs, (0.0,) * len(xs), combine, (axis,))

  def separate(*xs):
    return tuple(x.sum(axis) for x in xs[:num_sums]) + tuple(x.max(axis) for x in xs[num_sums:])

  return jax.lax.platform_dependent(*operands, cuda=variadic, rocm=variadic, default=separate)


def _sum_and_sum_sq(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Σx and Σx² over `axis`, together (`_reduce_together`)."""
  return _reduce_together((x, x * x), 0, axis)


def forward_sums(x_BLD: jax.Array, sample_rows: int = 0) -> dict[str, jax.Array]:
  """The pass over an activation tensor (B, L, D) its statistics come from, all float32: per (example,
  hidden unit) the sums of x and x² over the tokens `take_rows` keeps (all of them for sample_rows 0),
  (B, D); per kept (example, token) the sum over hidden units, (B, K); and per (example, token) of all
  tokens max |x| over hidden units, (B, L): the whole tensor's even when sampled (a sample's maximum
  underestimates it, and the stability monitor's growth and bound flags read it)."""
  x_BLD = x_BLD.astype(jnp.float32)
  rows_BKD = take_rows(x_BLD, sample_rows)
  sum_BD, sum_sq_BD = _sum_and_sum_sq(rows_BKD, 1)
  # Over hidden units, plain reductions: XLA fuses them into the norms' own reductions of the tensor.
  sum_BK, max_abs_BL = rows_BKD.sum(2), jnp.abs(x_BLD).max(2)
  return {'sum_BD': sum_BD, 'sum_sq_BD': sum_sq_BD, 'sum_BK': sum_BK, 'max_abs_BL': max_abs_BL}


def grad_sums(g_BLD: jax.Array, sample_rows: int = 0) -> dict[str, jax.Array]:
  """`forward_sums` of a loss gradient (B, L, D): the sums of g and g² over the kept tokens, (B, D)."""
  sum_BD, sum_sq_BD = _sum_and_sum_sq(take_rows(g_BLD.astype(jnp.float32), sample_rows), 1)
  return {'sum_BD': sum_BD, 'sum_sq_BD': sum_sq_BD}


class _Moments:
  """Mean, variance and pair correlations of a tensor from its partial sums over `tokens` (K) tokens per
  example: sum_BD, sum_sq_BD of shape (..., B, D), any leading axes (e.g. layers and sites) batched."""

  def __init__(self, sums: dict[str, jax.Array], tokens: int):
    b, d = sums['sum_BD'].shape[-2:]
    self.n = float(b * tokens * d)  # a float: see the module docstring, "Numerics"
    self.sum = sums['sum_BD'].sum((-2, -1))
    self.sum_sq = sums['sum_sq_BD'].sum((-2, -1))

  @property
  def mean(self) -> jax.Array:
    return self.sum / self.n

  @property
  def var(self) -> jax.Array:
    return jnp.maximum(self.sum_sq / self.n - self.mean**2, 0.0)

  def pair_corr(self, group_sums: jax.Array, group_size: int) -> jax.Array:
    """Correlation over pairs i ≠ j inside groups of `group_size` elements with sums `group_sums`
    (..., B, groups).

    With c = x − mean: Σ_{i≠j} c_i·c_j = (Σ_i c_i)² − Σ_i c_i², summed over groups and divided by the
    number of ordered pairs n·(group_size − 1) (a float: it passes 2^31 at real sizes).
    """
    if group_size < 2:
      return jnp.zeros(self.sum.shape, jnp.float32)
    centred_sums = group_sums - float(group_size) * self.mean[..., None, None]
    num_pairs = self.n * float(group_size - 1)
    cov = ((centred_sums * centred_sums).sum((-2, -1)) - self.n * self.var) / num_pairs
    return _safe_ratio(cov, self.var)


def _safe_ratio(num: jax.Array, den: jax.Array) -> jax.Array:
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def forward_stats_of_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """mean, var, corr_seq (r^l), corr_hidden (r^d) and max |x| from `forward_sums` (leading axes
  batched)."""
  tokens, width = sums['sum_BK'].shape[-1], sums['sum_BD'].shape[-1]
  m = _Moments(sums, tokens)
  return {
    'mean': m.mean,
    'var': m.var,
    'corr_seq': m.pair_corr(sums['sum_BD'], tokens),
    'corr_hidden': m.pair_corr(sums['sum_BK'], width),
    'max_abs': sums['max_abs_BL'].max((-2, -1)),
  }


def grad_stats_of_sums(sums: dict[str, jax.Array], tokens: int) -> dict[str, jax.Array]:
  """grad_var and grad_corr_seq (r^l) from `grad_sums` over `tokens` kept tokens per example."""
  m = _Moments(sums, tokens)
  return {'grad_var': m.var, 'grad_corr_seq': m.pair_corr(sums['sum_BD'], tokens)}


def forward_stats(x_BLD: jax.Array, sample_rows: int = 0) -> dict[str, jax.Array]:
  """mean, var, corr_seq (r^l), corr_hidden (r^d) and max |x| of an activation tensor (B, L, D).

  `sample_rows` > 0: all but max |x| from the fixed subset of rows `take_rows` picks; max |x| stays
  the whole tensor's."""
  return forward_stats_of_sums(forward_sums(x_BLD, sample_rows))


def grad_stats(g_BLD: jax.Array, sample_rows: int = 0) -> dict[str, jax.Array]:
  """Variance and token correlation (r^l) of the loss gradient w.r.t. an activation tensor (B, L, D),
  from the rows `take_rows` picks with `sample_rows` > 0 (the same rows as the activation's)."""
  b, l, _ = g_BLD.shape
  return grad_stats_of_sums(grad_sums(g_BLD, sample_rows), sample_positions_per_example(b, l, sample_rows))


# ------------------------------------------------------------------------------------------------
# Row samples (instrument.sample_rows).
# ------------------------------------------------------------------------------------------------

# The sample is a function of the tensor's shape alone: drawn once, from this seed, at trace time, and
# the same at every step, in every layer and site of that shape, and for an activation and its gradient.
SAMPLE_SEED = 0


@functools.cache
def _sampled_positions(rows: int, positions: int, count: int) -> np.ndarray:
  """(rows, count) int32: for each row, `count` distinct positions of `positions`, sorted, from
  SAMPLE_SEED. Each row's set is a uniform random subset, and the rows are drawn in groups of
  positions // count that split one random permutation of the positions between them: within a group
  every position is taken at most once, and over rows·count ≥ positions every position is taken
  (nearly) equally often. A statistic that one position dominates (the first token's gradient in a
  causal model) is then sampled at that position's true weight, where independent draws per row would
  take it a random number of times."""
  rng = np.random.default_rng([SAMPLE_SEED, rows, positions, count])
  group = positions // count
  out = np.empty((rows, count), np.int32)
  for start in range(0, rows, group):
    permutation = rng.permutation(positions)
    for k, row in enumerate(range(start, min(start + group, rows))):
      out[row] = np.sort(permutation[k * count : (k + 1) * count])
  return out


def _take_along_1(x: jax.Array, count: int) -> jax.Array:
  """x (R, P, C) → (R, count, C): the `_sampled_positions` of axis 1, row by row (a gather whose row
  axis is a batching axis, so a mesh that splits it gathers on each device its own rows)."""
  index = _sampled_positions(x.shape[0], x.shape[1], count)
  return jnp.take_along_axis(x, jnp.asarray(index)[:, :, None], axis=1)


def sample_positions_per_example(batch: int, seq_len: int, sample_rows: int) -> int:
  """Token positions `take_rows` keeps in each example: sample_rows / batch, at least 2 (a pair for
  corr_seq), at most seq_len (then the whole tensor). sample_rows 0: all."""
  if not sample_rows:
    return seq_len
  return min(seq_len, max(2, sample_rows // batch))


def take_rows(x_BLD: jax.Array, sample_rows: int) -> jax.Array:
  """About `sample_rows` (b, t) rows of x (B, L, D), as (B, K, D): every example keeps K =
  `sample_positions_per_example` of its token positions, a fixed random subset of its own, the subsets
  balanced over the positions (`_sampled_positions`).

  All examples of the batch contribute (so on a mesh every device's shard of the batch does, and no
  example's shift dominates), with whole rows of D (corr_hidden, r^d, needs them). corr_seq (r^l)
  averages over pairs of distinct sampled positions of one example: each example's subset is uniform,
  so every pair t ≠ t' is equally likely and the expectation is the whole tensor's. x itself for
  sample_rows 0 or K = L."""
  b, l, _ = x_BLD.shape
  count = sample_positions_per_example(b, l, sample_rows)
  return x_BLD if count >= l else _take_along_1(x_BLD, count)


# ------------------------------------------------------------------------------------------------
# Weight gradients.
# ------------------------------------------------------------------------------------------------


def _path_names(path) -> tuple[str, ...]:
  names = []
  for entry in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return tuple(names)


def weight_type(names: tuple[str, ...]) -> str | None:
  """The WEIGHT_TYPES entry of a stacked block parameter at `names` (path below the layer stack).

  Matrices are identified by their kernel (q/k/v/o/ffn1/ffn2); every parameter of any norm in the
  block (pre/mid/post norms and QKNorm; gains and biases) counts as 'norms'. Dense biases and learnable
  residual scales are not recorded.
  """
  if any(n.endswith('_norm') for n in names):
    return 'norms'
  if len(names) >= 2 and names[-1] == 'kernel' and names[-2] in WEIGHT_TYPES:
    return names[-2]
  return None


def group_layer_grads(layer_grads: Any) -> dict[str, list[jax.Array]]:
  """Stacked (depth, ...) gradient leaves of the layer stack, grouped by weight type."""
  groups: dict[str, list[jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(layer_grads):
    kind = weight_type(_path_names(path))
    if kind is not None:
      groups.setdefault(kind, []).append(leaf)
  return groups


# |g| quantiles come from a histogram of log2|g| with 1/32-octave bins over the 40 octaves below the
# largest |g| (one O(n) pass; a sort of every gradient entry costs ~20× more on CPU). Interpolating
# inside a bin, a quantile is accurate to well under the bin width (2.2%); smaller values (and zeros)
# land in an underflow bin and read as 0.
#
# Counting. Each histogram is counted in int32 over at most _MAX_CHUNK elements (a count cannot wrap)
# and the chunks' counts are added, and cumulated, in float32: exact up to 2^24 elements in all; beyond,
# each cumulative count is off by at most (number of bins)·2^−24 ≈ 8e-5 of the total, a shift of the
# quantile's rank far inside the 1% accuracy above. (int32 cumulative counts wrap past 2^31 − 1 elements,
# which one weight type of a large model has.)
#
# Contention. A scatter-add of many entries into few bins serialises on atomic updates of the same
# addresses on a GPU; there entry i is counted in copy i mod _HISTOGRAM_COPIES of the histogram, and the
# copies are summed (at most 1024 × 1281 int32). On the CPU the scatter is a sequential loop, for which
# one small histogram is fastest (the copies double its time there).
_BINS_PER_OCTAVE = 32
_OCTAVES = 40
_MAX_CHUNK = 2**30
_HISTOGRAM_COPIES = 1024
_MIN_ENTRIES_PER_COPY = 2**12


def _leaves(g: jax.Array | Sequence[jax.Array]) -> list[jax.Array]:
  return list(g) if isinstance(g, (list, tuple)) else [g]


def _flat_chunks(leaves: list[jax.Array]) -> list[jax.Array]:
  """The leaves flattened and cut into static slices of at most _MAX_CHUNK elements (no copies: the
  slices of a reshape fuse into their consumers)."""
  chunks = []
  for leaf in leaves:
    flat = leaf.reshape(-1)
    chunks += [flat[start : start + _MAX_CHUNK] for start in range(0, flat.size, _MAX_CHUNK)]
  return chunks


def _layer_power_sums(leaf: jax.Array) -> dict[str, jax.Array]:
  """Per layer (the leading axis; a leaf without one is one layer) Σg, Σg², Σg³, Σg⁴ and max |g|, in
  float32. Everything `distribution_stats` needs but the histogram, and the per-layer norms, from one
  pass over the leaf: on a GPU one (variadic) reduction, where the centred moments took a pass each and
  every pass two kernels. Per-layer sums first, then their total: float32 rounding of sums of one
  layer's entries and of `depth` partial sums."""
  g_NM = leaf.astype(jnp.float32)
  g_NM = g_NM.reshape(g_NM.shape[0], -1) if g_NM.ndim >= 2 else g_NM[None]
  g2_NM = g_NM * g_NM
  operands = (g_NM, g2_NM, g2_NM * g_NM, g2_NM * g2_NM, jnp.abs(g_NM))
  names = ('s1', 's2', 's3', 's4', 'max_abs')
  return dict(zip(names, _reduce_together(operands, 1, 1)))


def _bin_counts(index: jax.Array, copies: int) -> jax.Array:
  """int32 counts of the bin indices `index` (1-D, values in [0, 1281)), from `copies` interleaved
  histograms (entry i counted in copy i mod copies)."""
  length = _BINS_PER_OCTAVE * _OCTAVES + 1
  if copies == 1:
    return jnp.bincount(index, length=length)
  copy = jnp.arange(index.size, dtype=jnp.int32) % copies
  return jnp.bincount(copy * length + index, length=copies * length).reshape(copies, length).sum(0)


def _histogram(leaves: list[jax.Array], top: jax.Array) -> jax.Array:
  """float32 counts of |g| over all entries of `leaves` (absolute values, float32) in the log bins below
  `top`, ascending: index 0 the underflow bin, the last index the largest values."""
  num_bins = _BINS_PER_OCTAVE * _OCTAVES
  safe_top = jnp.where(top > 0, top, 1.0)
  counts_ascending = jnp.zeros(num_bins + 1, jnp.float32)
  for abs_g in _flat_chunks(leaves):
    # Bin 0 holds the largest values; bin num_bins is the underflow bin.
    depth = -jnp.log2(jnp.maximum(abs_g / safe_top, 2.0 ** -(_OCTAVES + 1)))
    bins = jnp.minimum(jnp.floor(depth * _BINS_PER_OCTAVE), num_bins).astype(jnp.int32)
    copies = max(1, min(_HISTOGRAM_COPIES, abs_g.size // _MIN_ENTRIES_PER_COPY))
    counts_ascending += jax.lax.platform_dependent(
      num_bins - bins,
      cpu=functools.partial(_bin_counts, copies=1),
      default=functools.partial(_bin_counts, copies=copies),
    ).astype(jnp.float32)
  return counts_ascending


def _histogram_quantiles(
  counts_ascending: jax.Array, top: jax.Array, total: jax.Array, probs: tuple[float, ...]
) -> jax.Array:
  """The quantiles at `probs` of `_histogram`s (..., bins) of `total` (...) entries below `top` (...),
  (..., len(probs)); any leading axes batched (the weight types, finished together: on a GPU each of
  these few small operations is a kernel launch, per histogram)."""
  num_bins = _BINS_PER_OCTAVE * _OCTAVES
  safe_top = jnp.where(top > 0, top, 1.0)[..., None]
  cumulative = jnp.cumsum(counts_ascending, axis=-1)
  rank = jnp.asarray(probs, jnp.float32) * total[..., None]
  # First bin reaching the rank. 'compare_all' (a few thousand comparisons) rather than the default
  # binary-search loop, whose every iteration is a device-to-host round trip on a GPU (XLA while loop):
  # the 7 weight types' searches left the H100 idle ~2.6 ms per step at GPT-2-small size.
  search = functools.partial(jnp.searchsorted, method='compare_all')
  for _ in range(cumulative.ndim - 1):
    search = jax.vmap(search)
  k = jnp.clip(search(cumulative, rank), 0, num_bins)
  count_k = jnp.take_along_axis(counts_ascending, k, axis=-1)
  below = jnp.take_along_axis(cumulative, k, axis=-1) - count_k
  within = jnp.clip((rank - below) / jnp.maximum(count_k, 1.0), 0.0, 1.0)
  # Ascending index k covers |g| in top·2^(−(num_bins − k + 1)/B) .. top·2^(−(num_bins − k)/B).
  log2_value = (k - num_bins - 1 + within) / _BINS_PER_OCTAVE
  return jnp.where(k > 0, safe_top * jnp.exp2(log2_value), 0.0) * (top > 0)[..., None]


def abs_quantiles(
  g: jax.Array | Sequence[jax.Array], probs: tuple[float, ...], top: jax.Array | None = None
) -> jax.Array:
  """Approximate quantiles of |g| at `probs`, over all entries of `g` (an array, or a list of arrays
  taken together without concatenating them), from a log-binned histogram below `top`, max |g| (taken
  here if not given)."""
  leaves = [jnp.abs(leaf.astype(jnp.float32)) for leaf in _leaves(g)]
  if top is None:
    top = functools.reduce(jnp.maximum, [leaf.max() for leaf in leaves])
  total = jnp.float32(sum(leaf.size for leaf in leaves))
  return _histogram_quantiles(_histogram(leaves, top), top, total, probs)


class _Distribution(NamedTuple):
  """What one weight type's heavy-tail summary is finished from: the raw moments E g^k (k = 1..4), max
  |g|, the |g| histogram and the number of entries; float32, with leading axes when stacked."""

  raw_moments: jax.Array  # (..., 4)
  top: jax.Array
  counts_ascending: jax.Array  # (..., bins)
  total: jax.Array


def _distribution_of(
  g: jax.Array | Sequence[jax.Array], power_sums: Sequence[dict[str, jax.Array]] | None = None
) -> _Distribution:
  """The one pass over all entries of `g` (`_layer_power_sums`, unless given) and the histogram pass."""
  leaves = _leaves(g)
  sums = power_sums if power_sums is not None else [_layer_power_sums(leaf) for leaf in leaves]
  n = float(sum(leaf.size for leaf in leaves))  # a float: it passes 2^31 for large models
  raw_moments = jnp.stack([sum(s[k].sum() for s in sums) / n for k in ('s1', 's2', 's3', 's4')])
  top = functools.reduce(jnp.maximum, [s['max_abs'].max() for s in sums])
  counts = _histogram([jnp.abs(leaf.astype(jnp.float32)) for leaf in leaves], top)
  return _Distribution(raw_moments, top, counts, jnp.float32(n))


def _finish_distribution(d: _Distribution) -> dict[str, jax.Array]:
  """`distribution_stats` from a `_Distribution`, any leading axes batched."""
  e1, e2, e3, e4 = (d.raw_moments[..., k] for k in range(4))
  var = jnp.maximum(e2 - e1 * e1, 0.0)
  fourth = jnp.maximum(e4 - 4.0 * e1 * e3 + 6.0 * e1 * e1 * e2 - 3.0 * e1**4, 0.0)
  qs = _histogram_quantiles(d.counts_ascending, d.top, d.total, tuple(GRAD_QUANTILES.values()))
  out = {f'grad_abs_{name}': qs[..., i] for i, name in enumerate(GRAD_QUANTILES)}
  out['grad_kurtosis'] = _safe_ratio(fourth, var * var)
  out['grad_tail_ratio'] = _safe_ratio(out['grad_abs_p99.9'], out['grad_abs_p50'])
  return out


def distribution_stats(
  g: jax.Array | Sequence[jax.Array], power_sums: Sequence[dict[str, jax.Array]] | None = None
) -> dict[str, jax.Array]:
  """Heavy-tail summary of one weight type's gradient entries (DNT, Qi et al. 2025, Fig. 1).

  Quantiles of |g| (`abs_quantiles`), the kurtosis E[(g−μ)⁴]/σ⁴ (3 for a Gaussian, not the excess)
  and the tail ratio p99.9(|g|) / median(|g|) (≈ 4.9 for a Gaussian). `g`: an array or a list of
  arrays (all entries pooled; nothing is concatenated); `power_sums`: their `_layer_power_sums`, if
  already taken. The central moments come from the raw ones, μ₄ = E g⁴ − 4μ·E g³ + 6μ²·E g² − 3μ⁴,
  whose cancellation in float32 costs a relative error of order 1e-7·(1 + μ²/σ²)² in the kurtosis:
  nothing for gradients, whose |μ| ≲ σ.
  """
  return _finish_distribution(_distribution_of(g, power_sums))


def take_layer_rows(leaf: jax.Array, rows_per_layer: int) -> jax.Array:
  """A fixed sample of a (layers, ..., C) weight(-gradient) leaf's rows, `rows_per_layer` of each layer's
  rows of C entries (the leaf viewed as (layers, R, C)), drawn once per layer (`_sampled_positions`):
  every layer contributes its share, whatever its gradient's scale. The leaf itself for 0, for as many
  rows as it has, and for a leaf of one row per layer (a norm's gain)."""
  if not rows_per_layer or leaf.ndim < 3:
    return leaf
  view = leaf.reshape(leaf.shape[0], -1, leaf.shape[-1])
  return leaf if rows_per_layer >= view.shape[1] else _take_along_1(view, rows_per_layer)


def weight_grad_stats(
  layer_grads: Any, stacked: bool = True, sample_rows: int = 0
) -> dict[str, dict[str, jax.Array]]:
  """Gradient statistics of the block parameters, per weight type.

  `layer_grads` is the gradient of the layer stack (leaves of shape (depth, ...)), or with
  `stacked=False` a sequence of per-layer gradient trees (layers of different widths, e.g. a
  concatenation residual). Returns {weight_type: {'grad_norm': (depth,) per-layer norms,
  **distribution_stats (scalars)}}, all float32 whatever the gradients' dtype.

  `sample_rows` > 0: the distribution statistics of each leaf read about `sample_rows` of its rows,
  spread evenly over the layers (`take_layer_rows`); the per-layer norms stay exact.
  """
  per_layer = [layer_grads] if stacked else [jax.tree.map(lambda x: x[None], t) for t in layer_grads]
  groups = [group_layer_grads(tree) for tree in per_layer]
  num_layers = sum(jax.tree.leaves(tree)[0].shape[0] for tree in per_layer)
  rows_per_layer = max(1, sample_rows // num_layers) if sample_rows else 0
  sq_norms, distributions = {}, {}
  for kind in groups[0]:
    # One pass over each leaf for its per-layer norms and, unsampled, its distribution statistics.
    sums = [[_layer_power_sums(leaf.reshape(leaf.shape[0], -1)) for leaf in g[kind]] for g in groups]
    sq_norms[kind] = jnp.concatenate([sum(s['s2'] for s in group_sums) for group_sums in sums])
    leaves = [leaf for g in groups for leaf in g[kind]]
    if rows_per_layer:
      distributions[kind] = _distribution_of([take_layer_rows(leaf, rows_per_layer) for leaf in leaves])
    else:
      distributions[kind] = _distribution_of(leaves, [s for group_sums in sums for s in group_sums])
  if not distributions:
    return {}
  # All weight types finished together, stacked on a leading axis: on a GPU each small operation of the
  # finishing is a kernel, once rather than once per type.
  finished = _finish_distribution(jax.tree.map(lambda *xs: jnp.stack(xs), *distributions.values()))
  finished['grad_norm'] = jnp.sqrt(jnp.stack(list(sq_norms.values())))
  return {kind: {name: v[i] for name, v in finished.items()} for i, kind in enumerate(distributions)}
