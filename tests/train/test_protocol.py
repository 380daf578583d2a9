"""The comparison protocol: splits, selection, edge extension and the statistics, against hand-computed
values."""

import math

import numpy as np
import pytest
from scipy import stats

from dsjax.train import protocol


def test_default_splits_per_dataset():
  # python_stdlib, text:GLOB: all three splits.
  assert protocol.default_splits(['train', 'validation', 'test']) == {
    'train': 'train',
    'select': 'validation',
    'report': 'test',
  }
  # python_docs_bytes: validation only, halved.
  assert protocol.default_splits(['train', 'validation']) == {
    'train': 'train',
    'select': 'validation[:50%]',
    'report': 'validation[50%:]',
  }
  # sklearn_digits: test only; the last 20% of train selects.
  assert protocol.default_splits(['train', 'test']) == {
    'train': 'train[:80%]',
    'select': 'train[80%:]',
    'report': 'test',
  }
  with pytest.raises(ValueError, match="needs a 'train' split"):
    protocol.default_splits(['train'])


def test_a_diverged_seed_makes_its_lr_lose_to_any_finite_one():
  scores = {
    1e-3: [protocol.member_score(2.0, False), protocol.member_score(2.2, False)],
    3e-3: [protocol.member_score(1.0, False), protocol.member_score(1.1, True)],  # one seed diverged
    1e-2: [protocol.member_score(float('nan'), False), protocol.member_score(0.5, False)],
  }
  means = protocol.lr_means(scores)
  assert means == {1e-3: pytest.approx(2.1), 3e-3: math.inf, 1e-2: math.inf}
  assert protocol.select(means) == 1e-3


def test_ties_go_to_the_smaller_lr():
  assert protocol.select({1e-2: math.inf, 1e-3: math.inf, 3e-3: math.inf}) == 1e-3
  assert protocol.select({3e-3: 1.0, 1e-3: 1.0}) == 1e-3


def test_edge_extension_steps_by_the_neighbouring_ratio_up_to_max_extend():
  grid = [1e-3, 3e-3, 9e-3]
  # Best at the lower edge: one step of the edge's ratio (3) below it.
  assert protocol.next_lr(grid, grid, 1e-3, max_extend=2) == pytest.approx(1e-3 / 3)
  # Best at the upper edge: above it.
  assert protocol.next_lr(grid, grid, 9e-3, max_extend=2) == pytest.approx(2.7e-2)
  # Inside: settled, nothing to train.
  assert protocol.next_lr(grid, grid, 3e-3, max_extend=2) is None
  assert protocol.settled(grid, 3e-3)
  # Two extensions downwards already: the edge stays UNSETTLED.
  trained = [1e-3 / 9, 1e-3 / 3, *grid]
  assert protocol.next_lr(grid, trained, 1e-3 / 9, max_extend=2) is None
  assert not protocol.settled(trained, 1e-3 / 9)
  # ... but the other direction still has its own two.
  assert protocol.next_lr(grid, trained, 9e-3, max_extend=2) == pytest.approx(2.7e-2)
  assert protocol.next_lr(grid, grid, 1e-3, max_extend=0) is None
  # One lr has no step to extend by.
  assert protocol.next_lr([1e-3], [1e-3], 1e-3, max_extend=2) is None
  assert not protocol.settled([1e-3], 1e-3)


def test_refinement_trains_rounded_midpoints_beside_the_best_lr_where_the_step_is_wider_than_the_ratio():
  means = {1e-3: 1.0, 1e-2: 0.5, 1e-1: 2.0}
  assert protocol.refine_lrs(means, 1.8) == [0.00316, 0.0316]  # √(1e-5), √(1e-3) to 3 digits
  # Steps within the ratio on both sides: nothing.
  assert protocol.refine_lrs({1e-3: 1.0, 1.7e-3: 0.5, 3e-3: 2.0}, 1.8) == []
  # Only the wide side.
  assert protocol.refine_lrs({1e-3: 1.0, 1.7e-3: 0.5, 1e-2: 2.0}, 1.8) == [0.00412]
  # The best at an edge: only the side inside the grid.
  assert protocol.refine_lrs({1e-3: 0.1, 1e-2: 0.5}, 1.8) == [0.00316]
  # Off, or every lr diverged: nothing.
  assert protocol.refine_lrs(means, 0) == []
  assert protocol.refine_lrs({1e-3: math.inf, 1e-2: math.inf}, 1.8) == []
  with pytest.raises(ValueError, match='at least 1.2'):
    protocol.refine_lrs(means, 1.1)


def test_spread_is_mean_sample_sd_min_max():
  s = protocol.spread([1.0, 2.0, 4.0])
  assert s['n'] == 3 and s['mean'] == pytest.approx(7 / 3)
  assert s['sd'] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
  assert (s['min'], s['max']) == (1.0, 4.0)
  assert protocol.spread([3.0])['sd'] == 0.0


def test_welch_interval_equal_variances_by_hand():
  # a = [1, 2, 3], b = [3, 4, 5]: difference −2, both variances 1, se = √(1/3 + 1/3), df = 4 exactly;
  # t(0.975, 4) = 2.776445 (tables).
  ci = protocol.welch_interval([1, 2, 3], [3, 4, 5])
  half = 2.776445105 * math.sqrt(2 / 3)
  assert ci['difference'] == pytest.approx(-2)
  assert ci['df'] == pytest.approx(4)
  assert (ci['low'], ci['high']) == (pytest.approx(-2 - half), pytest.approx(-2 + half))
  # Two seeds each: a = [1, 3], b = [0, 2]: se = √2, df = 2, t(0.975, 2) = 4.302653.
  ci = protocol.welch_interval([1, 3], [0, 2])
  assert ci['df'] == pytest.approx(2)
  assert ci['high'] - ci['difference'] == pytest.approx(4.302652730 * math.sqrt(2))


def test_welch_interval_unequal_variances():
  # a = [1, 2, 3]: mean 2, s² 1; b = [2, 4, 6, 8]: mean 5, s² 20/3. se² = 1/3 + 5/3 = 2;
  # df = 2² / ((1/3)²/2 + (5/3)²/3) = 4 / (1/18 + 25/27) = 216/53.
  ci = protocol.welch_interval([1, 2, 3], [2, 4, 6, 8])
  assert ci['se'] == pytest.approx(math.sqrt(2))
  assert ci['df'] == pytest.approx(216 / 53)
  half = stats.t.ppf(0.975, 216 / 53) * math.sqrt(2)
  assert (ci['low'], ci['high']) == (pytest.approx(-3 - half), pytest.approx(-3 + half))
  # scipy's own Welch test gives the same interval.
  reference = stats.ttest_ind([1, 2, 3], [2, 4, 6, 8], equal_var=False).confidence_interval(0.95)
  np.testing.assert_allclose([ci['low'], ci['high']], [reference.low, reference.high], rtol=1e-12)


def test_welch_interval_needs_two_seeds_and_allows_no_spread():
  assert protocol.welch_interval([1.0], [1.0, 2.0]) is None
  ci = protocol.welch_interval([1.0, 1.0], [0.5, 0.5])
  assert (ci['low'], ci['difference'], ci['high']) == (0.5, 0.5, 0.5)


def test_fraction_difference_interval_is_newcombes():
  # Newcombe (1998), Table II, method 10 (the hybrid score interval), to the four decimals printed there.
  for (k_a, n_a, k_b, n_b), (low, high) in [
    ((56, 70, 48, 80), (0.0524, 0.3339)),
    ((9, 10, 3, 10), (0.1705, 0.8090)),
    ((0, 10, 0, 20), (-0.1611, 0.2775)),
    ((10, 10, 0, 20), (0.6791, 1.0000)),
  ]:
    ci = protocol.fraction_difference_interval(k_a, n_a, k_b, n_b)
    assert ci['difference'] == pytest.approx(k_a / n_a - k_b / n_b)
    assert (round(ci['low'], 4), round(ci['high'], 4)) == (low, high)
  # Pocock's level for two looks widens it on both sides (statsmodels' `confint_proportions_2indep`,
  # method 'newcomb', gives the same four decimals).
  narrow = protocol.fraction_difference_interval(10, 28, 3, 28)
  wide = protocol.fraction_difference_interval(10, 28, 3, 28, level=0.9706)
  assert (round(narrow['low'], 4), round(narrow['high'], 4)) == (0.0271, 0.4474)
  assert (round(wide['low'], 4), round(wide['high'], 4)) == (0.0015, 0.4672)
  with pytest.raises(ValueError, match='0 <= k <= n'):
    protocol.fraction_difference_interval(3, 2, 0, 2)


def test_contrast_interval_with_two_groups_is_welch():
  a, b = [1.0, 1.2, 0.9], [0.5, 0.9, 0.4, 0.6]
  contrast = protocol.contrast_interval([a, b], [1, -1])
  welch = protocol.welch_interval(a, b)
  for key in ('difference', 'low', 'high', 'se', 'df'):
    assert contrast[key] == pytest.approx(welch[key], rel=1e-12)


def test_contrast_interval_difference_of_differences_by_hand():
  # Four groups of 3 with sample variances 0.01, 0.04, 0.01, 0.04: the interaction (a − b) − (c − d).
  a, b, c, d = [1.0, 1.1, 1.2], [2.0, 2.2, 2.4], [0.0, 0.1, 0.2], [0.5, 0.7, 0.9]
  out = protocol.contrast_interval([a, b, c, d], [1, -1, -1, 1])
  se2 = (0.01 + 0.04 + 0.01 + 0.04) / 3
  df = se2**2 / (2 * (0.01 / 3) ** 2 / 2 + 2 * (0.04 / 3) ** 2 / 2)
  assert out['difference'] == pytest.approx((1.1 - 2.2) - (0.1 - 0.7))
  assert out['se'] == pytest.approx(math.sqrt(se2))
  assert out['df'] == pytest.approx(df)
  half = stats.t.ppf(0.975, df) * math.sqrt(se2)
  assert out['low'] == pytest.approx(out['difference'] - half)
  assert protocol.contrast_interval([a, [1.0]], [1, -1]) is None


def _with_mean_and_sd(n, mean, sd):
  """n values whose mean and sample sd are exactly `mean` and `sd`."""
  z = np.linspace(-1.0, 1.0, n)
  return mean + sd * (z - z.mean()) / z.std(ddof=1)


@pytest.mark.parametrize('sds', [(0.008, 0.008), (0.02, 0.005)])
def test_seeds_to_resolve_is_where_an_interval_at_the_measured_sds_first_excludes_zero(sds):
  a, b = _with_mean_and_sd(12, 1.9458, sds[0]), _with_mean_and_sd(12, 1.9435, sds[1])
  n = protocol.seeds_to_resolve([a, b], [1, -1])
  assert n > 12

  def excludes_zero(k):
    out = protocol.welch_interval(_with_mean_and_sd(k, 1.9458, sds[0]), _with_mean_and_sd(k, 1.9435, sds[1]))
    return out['low'] > 0

  assert excludes_zero(n) and not excludes_zero(n - 1)


def test_seeds_to_resolve_of_a_weighted_contrast_and_where_there_is_nothing_to_resolve():
  groups = [_with_mean_and_sd(3, m, 0.05) for m in (2.0, 1.9, 2.1, 2.05)]  # penalty: 0.1 − 0.05 = +0.05
  weights = [1, -1, -1, 1]
  n = protocol.seeds_to_resolve(groups, weights)
  wider = protocol.contrast_interval([_with_mean_and_sd(n - 1, g.mean(), 0.05) for g in groups], weights)
  narrow = protocol.contrast_interval([_with_mean_and_sd(n, g.mean(), 0.05) for g in groups], weights)
  assert wider['low'] <= 0 < narrow['low']
  assert protocol.seeds_to_resolve([[1.0, 1.1, 1.2], [2.0, 2.1, 2.2]], [1, -1]) is None  # excludes zero
  assert protocol.seeds_to_resolve([[1.0, 1.2], [1.2, 1.0]], [1, -1]) is None  # a difference of 0
  assert protocol.seeds_to_resolve([[1.0], [1.1, 1.2]], [1, -1]) is None  # one seed
  assert protocol.seeds_to_resolve([[1.0, float('nan'), 1.2], [1.1, 1.2, 1.3]], [1, -1]) is None
  assert protocol.seeds_to_resolve([[1.0, 1.0], [1.0, 1.0]], [1, -1]) is None  # no spread


def test_interval_level_is_pococks_for_up_to_five_looks_then_bonferroni():
  assert protocol.interval_level(1) == 0.95
  assert protocol.interval_level(2) == pytest.approx(0.9706)
  assert protocol.interval_level(5) == pytest.approx(0.9842)
  assert protocol.interval_level(10) == pytest.approx(0.995)
  # Pocock's constant two-sided boundary for 2 looks is z = 2.178: the nominal level is its tail.
  assert 2 * stats.norm.sf(2.178) == pytest.approx(1 - protocol.interval_level(2), abs=1e-4)
  with pytest.raises(ValueError, match='looks must be at least 1, got 0'):
    protocol.interval_level(0)


def _contrast_rejects(groups_GSN, weights, level):
  """Whether the Welch–Satterthwaite interval of Σ w_g · mean(group g) at `level` excludes zero, per
  simulation (vectorized, apart from the protocol)."""
  n = groups_GSN.shape[2]
  parts_GS = np.stack([w * w * g.var(axis=1, ddof=1) / n for g, w in zip(groups_GSN, weights)])
  se2_S = parts_GS.sum(axis=0)
  df_S = se2_S**2 / (parts_GS**2 / (n - 1)).sum(axis=0)
  value_S = sum(w * g.mean(axis=1) for g, w in zip(groups_GSN, weights))
  return np.abs(value_S) / np.sqrt(se2_S) > stats.t.ppf(0.5 + level / 2, df_S)


def _rejects(a_SN, b_SN, level):
  """Whether the Welch interval of mean(a) − mean(b) at `level` excludes zero, per simulation."""
  return _contrast_rejects(np.stack([a_SN, b_SN]), [1, -1], level)


def test_a_second_look_at_pococks_level_holds_the_false_findings_near_one_in_twenty():
  # No difference between the arms; 3 seeds per arm looked at, then 3 more added and looked at again.
  rng = np.random.default_rng(0)
  a_SN, b_SN = rng.normal(size=(2, 20_000, 6))
  first = _rejects(a_SN[:, :3], b_SN[:, :3], 0.95)
  naive = first | _rejects(a_SN, b_SN, 0.95)
  pocock = first | _rejects(a_SN, b_SN, protocol.interval_level(2))
  assert first.mean() == pytest.approx(0.037, abs=0.004)  # Welch at 3 seeds is conservative
  assert naive.mean() == pytest.approx(0.071, abs=0.005)  # the figures interval_level's docstring quotes
  assert pocock.mean() == pytest.approx(0.056, abs=0.005)
  # A third look after 3 more seeds: each look at Pocock's level for the looks so far drifts further up.
  a_more_SN, b_more_SN = rng.normal(size=(2, 20_000, 3))
  a_SN, b_SN = np.concatenate([a_SN, a_more_SN], axis=1), np.concatenate([b_SN, b_more_SN], axis=1)
  third = pocock | _rejects(a_SN, b_SN, protocol.interval_level(3))
  naive_third = naive | _rejects(a_SN, b_SN, 0.95)
  assert third.mean() == pytest.approx(0.066, abs=0.005)
  assert naive_third.mean() == pytest.approx(0.098, abs=0.006)


def test_looks_at_3_12_and_24_seeds_of_a_difference_of_differences():
  # The error rates experiments/README.md §1 quotes for the ViT's mSGDW penalty (4 arms, no true
  # difference): looks at 3 and 12 seeds judged at 95%, the third at 24 seeds at Pocock's level for 3
  # looks (or at 95%), and the seeds 12-23 alone at 95%.
  rng = np.random.default_rng(0)
  groups_GSN = rng.normal(size=(4, 20_000, 24))
  weights = [1, -1, -1, 1]
  first_two = _contrast_rejects(groups_GSN[:, :, :3], weights, 0.95) | _contrast_rejects(
    groups_GSN[:, :, :12], weights, 0.95
  )
  assert first_two.mean() == pytest.approx(0.078, abs=0.004)
  third = first_two | _contrast_rejects(groups_GSN, weights, protocol.interval_level(3))
  assert third.mean() == pytest.approx(0.090, abs=0.004)
  assert (first_two | _contrast_rejects(groups_GSN, weights, 0.95)).mean() == pytest.approx(0.110, abs=0.004)
  assert _contrast_rejects(groups_GSN[:, :, 12:], weights, 0.95).mean() == pytest.approx(0.052, abs=0.004)
