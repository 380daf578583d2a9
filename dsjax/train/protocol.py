"""The comparison protocol of `python -m dsjax.sweep`: choose on one split, report on another.

Every arm of a comparison trains the same grid of peak learning rates, each with the same seeds (a seed
draws the initialisation, the data order and the dropout masks, independently of the other seeds). The
learning rate is chosen per arm on the selection split and the chosen runs are reported on a split the
choice never saw, so that the choice's luck does not flatter the arm (the winner's curse of picking the
best of several noisy runs on the data they are scored on):

  * `lr_means`/`select`: an lr's score is the mean over seeds of the selection split's eval loss; a
    diverged member counts as +inf, so an lr with any diverged seed is never preferred over a finite one;
    the selected lr is the argmin (ties, e.g. every lr diverged, go to the smaller lr).
  * `next_lr`/`settled`: a selected lr at the edge of the trained grid says the optimum may lie beyond
    it; the grid is extended by one more lr in that direction (the same ratio as the neighbouring step),
    at most `max_extend` times per direction. An lr still at an edge after that is UNSETTLED.
  * `refine_lrs`: a grid coarse enough to step over an arm's optimum can misjudge which arm is better
    (its best lr may lie far from the grid's points for one arm and close for another). After the grid
    and its extensions, the geometric midpoint is trained on each side of the selected lr whose nearest
    trained lr lies more than a given ratio away, and again around the new selection, until none does.
  * `spread`/`welch_interval`: the report split's metric at the selected lr, as mean, sample sd, min and
    max over seeds, and each arm's difference of means to the baseline arm with a 95% Welch interval;
    `contrast_interval` the same for any linear combination of arms' means (e.g. a difference of
    differences: whether one arm's optimizer penalty is smaller than another's).
  * `fraction_difference_interval`: a difference of two fractions (e.g. of the seeds that leave a loss
    plateau, where each seed either leaves it or stays) with Newcombe's score interval.
  * `seeds_to_resolve`: for an interval that contains zero, the budget a decision would take — at how
    many seeds per arm the interval's half-width, at the measured sds, would equal the measured value.
  * `interval_level`: seeds added because an interval did not decide make a second look at the same
    comparison; judging it again at 95% would find a difference that is not there more often than one
    time in twenty, so a comparison looked at K times is judged at Pocock's nominal level for K looks.

Pure functions of numbers (numpy and scipy), tested against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
from scipy import stats

# How much of the training split the selection split takes where a dataset has only 'train' and 'test'.
VALIDATION_FRACTION_PERCENT = 20

# Pocock (1977), "Group sequential methods in the design and analysis of clinical trials", Biometrika
# 64(2):191–199, Table 1: the two-sided nominal significance level, the same at each of K looks, that
# holds the overall type I error at 0.05 (normal responses, known variance, equal stages).
POCOCK_ALPHA = {1: 0.05, 2: 0.0294, 3: 0.0221, 4: 0.0182, 5: 0.0158}


def default_splits(split_names: Collection[str]) -> dict[str, str]:
  """{'train', 'select', 'report'} splits of a dataset with `split_names`: 'validation' selects and
  'test' reports where both exist; with 'validation' only, its first half selects and its second half
  reports; with 'test' only, the last 20% of 'train' selects (training uses the rest) and 'test'
  reports. Halves and fractions are TFDS slices over the stored examples, so they are deterministic."""
  names = set(split_names)
  if 'train' not in names or not names & {'validation', 'test'}:
    raise ValueError(
      f"the sweep needs a 'train' split and a 'validation' or 'test' split; found {sorted(names)}"
    )
  if {'validation', 'test'} <= names:
    return {'train': 'train', 'select': 'validation', 'report': 'test'}
  if 'validation' in names:
    return {'train': 'train', 'select': 'validation[:50%]', 'report': 'validation[50%:]'}
  keep = 100 - VALIDATION_FRACTION_PERCENT
  return {'train': f'train[:{keep}%]', 'select': f'train[{keep}%:]', 'report': 'test'}


def member_score(loss: float, diverged: bool) -> float:
  """A member's selection score: its eval loss, +inf if it diverged or the loss is not finite."""
  return math.inf if diverged or not math.isfinite(loss) else float(loss)


def lr_means(scores: Mapping[float, Sequence[float]]) -> dict[float, float]:
  """{lr: mean of its members' scores} (+inf when any score is)."""
  return {lr: float(np.mean(np.asarray(s, np.float64))) for lr, s in sorted(scores.items())}


def select(means: Mapping[float, float]) -> float:
  """The lr of the lowest mean; ties to the smaller lr."""
  lrs = sorted(means)
  return lrs[int(np.argmin([means[lr] for lr in lrs]))]


def next_lr(grid: Sequence[float], trained: Collection[float], best: float, max_extend: int) -> float | None:
  """The lr to train next when `best` lies at an edge of the `trained` lrs: one step beyond that edge,
  with the ratio of the edge's neighbouring step, unless the edge has been extended past the original
  `grid` `max_extend` times already (or fewer than two lrs give no step). None: nothing to train."""
  lrs = sorted(trained)
  if len(lrs) < 2 or lrs[0] < best < lrs[-1]:
    return None
  if best == lrs[0]:
    extended = sum(lr < min(grid) for lr in lrs)
    return lrs[0] * (lrs[0] / lrs[1]) if extended < max_extend else None
  extended = sum(lr > max(grid) for lr in lrs)
  return lrs[-1] * (lrs[-1] / lrs[-2]) if extended < max_extend else None


# Refined lrs are rounded to this many significant digits, so that they can be typed as a grid again.
REFINE_DIGITS = 3
# The smallest refinement ratio: with rounding to 3 digits, a midpoint's own steps then stay below it.
MIN_REFINE_RATIO = 1.2


def refine_ratio_allowed(ratio: float) -> bool:
  """0 (off), or a ratio at least `MIN_REFINE_RATIO`."""
  return ratio == 0 or ratio >= MIN_REFINE_RATIO


def refine_lrs(means: Mapping[float, float], ratio: float) -> list[float]:
  """The lrs to train next to narrow the step around the selected lr of `means` ({lr: mean score}): on
  each side whose nearest trained lr lies more than `ratio` times away from it, their geometric
  midpoint, rounded to `REFINE_DIGITS` significant digits; no side beyond an edge. [] for `ratio` 0
  (off), or when the selected lr's mean is not finite (every lr diverged: nothing to narrow down)."""
  if not refine_ratio_allowed(ratio):
    raise ValueError(f'the refinement ratio must be 0 (off) or at least {MIN_REFINE_RATIO}, got {ratio}')
  if ratio == 0:
    return []
  best = select(means)
  if not math.isfinite(means[best]):
    return []
  lrs = sorted(means)
  i = lrs.index(best)
  neighbours = lrs[max(i - 1, 0) : i] + lrs[i + 1 : i + 2]
  return [
    float(f'{math.sqrt(best * lr):.{REFINE_DIGITS}g}')
    for lr in neighbours
    if max(lr, best) / min(lr, best) > ratio
  ]


def settled(trained: Collection[float], best: float) -> bool:
  """Whether `best` has a trained lr on both sides."""
  return min(trained) < best < max(trained)


def spread(values: Sequence[float]) -> dict[str, float | int | list[float]]:
  """n, mean, sample sd (ddof 1; 0 for one value), min, max and the values."""
  v = np.asarray(values, np.float64)
  return {
    'n': int(v.size),
    'mean': float(v.mean()),
    'sd': float(v.std(ddof=1)) if v.size > 1 else 0.0,
    'min': float(v.min()),
    'max': float(v.max()),
    'values': v.tolist(),
  }


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict[str, float] | None:
  """mean(a) − mean(b) with its `level` confidence interval by Welch's t (unequal variances; degrees of
  freedom by the Welch–Satterthwaite equation), for independent samples a and b; None when either has
  fewer than two values. Identical values on both sides give a zero-width interval."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.size < 2 or b.size < 2:
    return None
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  difference, se = float(a.mean() - b.mean()), float(math.sqrt(va + vb))
  if se == 0.0:
    return {'difference': difference, 'low': difference, 'high': difference, 'se': 0.0, 'df': math.inf}
  df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return {'difference': difference, 'low': difference - half, 'high': difference + half, 'se': se, 'df': df}


def contrast_interval(
  groups: Sequence[Sequence[float]], weights: Sequence[float], level: float = 0.95
) -> dict[str, float] | None:
  """Σ_i weights_i · mean(groups_i) with its `level` confidence interval for independent groups, the
  Welch–Satterthwaite way: se² = Σ w_i² s_i²/n_i, df = se⁴ / Σ (w_i² s_i²/n_i)²/(n_i − 1). With
  weights (1, −1) it is `welch_interval`. None when a group has fewer than two values."""
  if len(groups) != len(weights):
    raise ValueError(f'{len(groups)} groups but {len(weights)} weights')
  arrays = [np.asarray(g, np.float64) for g in groups]
  if any(g.size < 2 for g in arrays):
    return None
  parts = [w * w * g.var(ddof=1) / g.size for g, w in zip(arrays, weights)]
  value = float(sum(w * g.mean() for g, w in zip(arrays, weights)))
  se = float(math.sqrt(sum(parts)))
  if se == 0.0:
    return {'difference': value, 'low': value, 'high': value, 'se': 0.0, 'df': math.inf}
  df = sum(parts) ** 2 / sum(p * p / (g.size - 1) for p, g in zip(parts, arrays) if p > 0)
  half = float(stats.t.ppf(0.5 + level / 2, df)) * se
  return {'difference': value, 'low': value - half, 'high': value + half, 'se': se, 'df': df}


def fraction_difference_interval(
  k_a: int, n_a: int, k_b: int, n_b: int, level: float = 0.95
) -> dict[str, float]:
  """k_a/n_a − k_b/n_b, the difference of two independent fractions (e.g. of seeds that leave a loss
  plateau), with its `level` interval by Newcombe's hybrid score method: each fraction's Wilson score
  interval, combined as a square root of summed squares on each side (Newcombe 1998, "Interval estimation
  for the difference between independent proportions: comparison of eleven methods", Statistics in
  Medicine 17:873–890, method 10). In Newcombe's simulations it keeps close to its nominal coverage at
  fractions near 0 or 1 and at a few dozen per group, where the Wald interval does not; its ends are kept
  inside [−1, 1]."""
  if not (0 <= k_a <= n_a and 0 <= k_b <= n_b and n_a > 0 and n_b > 0):
    raise ValueError(f'fractions need 0 <= k <= n and n > 0, got {k_a}/{n_a} and {k_b}/{n_b}')
  p_a, p_b = k_a / n_a, k_b / n_b
  wilson_a = stats.binomtest(k_a, n_a).proportion_ci(confidence_level=level, method='wilson')
  wilson_b = stats.binomtest(k_b, n_b).proportion_ci(confidence_level=level, method='wilson')
  difference = p_a - p_b
  low = difference - math.hypot(p_a - wilson_a.low, wilson_b.high - p_b)
  high = difference + math.hypot(wilson_a.high - p_a, p_b - wilson_b.low)
  return {'difference': difference, 'low': max(-1.0, low), 'high': min(1.0, high)}


def interval_level(looks: int) -> float:
  """The confidence level at which a comparison is judged at its `looks`-th look, seeds having been
  added after each earlier one: 0.95 at the first, Pocock's nominal level up to 5 looks, Bonferroni's
  1 − 0.05/looks beyond. Each look is judged at the level for the looks so far (the first at 0.95, not at
  Pocock's level), and Welch's t with small stages is not Pocock's setting, so the overall error is above
  0.05 and grows with the looks, though well below judging every look at 0.95: simulated with 3, 6 and 9
  seeds per arm (tests/train/test_protocol.py), 0.056 after two looks (0.071 at 0.95 throughout) and
  0.066 after three (0.098)."""
  if looks < 1:
    raise ValueError(f'looks must be at least 1, got {looks}')
  return 1.0 - POCOCK_ALPHA.get(looks, 0.05 / looks)


def _half_width(parts: Sequence[float], n: int, level: float) -> float:
  """contrast_interval's half-width with every group at n values and w_i² s_i² given as `parts`."""
  se2 = sum(parts) / n
  df = se2**2 / sum((p / n) ** 2 / (n - 1) for p in parts if p > 0)
  return float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(se2)


def seeds_to_resolve(
  groups: Sequence[Sequence[float]], weights: Sequence[float], level: float = 0.95
) -> int | None:
  """The seeds per group (every group at that many) at which `contrast_interval`'s half-width, with each
  group's sample sd as measured, falls below the measured value's size: if that value were the true one,
  such a rerun would exclude zero about half the time (more seeds, more often). The budget a "not
  resolved" verdict names; from three seeds per arm the sds, and so this number, are rough (a factor of
  two either way is common). None when the interval already excludes zero, or cannot be narrowed to it
  (a value of 0, groups without spread, a group with fewer than two values or a non-finite one)."""
  interval = contrast_interval(groups, weights, level)
  if interval is None or not all(math.isfinite(interval[k]) for k in ('difference', 'se')):
    return None
  if interval['se'] == 0.0 or interval['low'] > 0 or interval['high'] < 0:
    return None
  value = abs(interval['difference'])
  if value == 0.0:
    return None
  parts = [w * w * float(np.var(np.asarray(g, np.float64), ddof=1)) for g, w in zip(groups, weights)]
  low, high = 1, 2
  while _half_width(parts, high, level) >= value:  # the half-width falls as n grows: bracket, bisect
    low, high = high, 2 * high
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if _half_width(parts, middle, level) >= value else (low, middle)
  return high
