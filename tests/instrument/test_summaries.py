"""The TensorBoard summaries of the instrumentation: histograms of any finite values."""

import numpy as np
import pytest

from dsjax.instrument import summaries


@pytest.mark.parametrize(
  'values',
  [
    np.array([1.94734394e18]),  # one layer's variance of a run about to turn non-finite
    np.array([3.0, 3.0, 3.0]),
    np.array([1e18, np.nextafter(1e18, 2e18)]),
    np.array([0.0]),
    np.array([np.nan, 2.0, np.inf, 5.0]),
  ],
)
def test_histogram_of_a_narrow_or_single_value_range(values):
  value = summaries._histogram('tag', values)
  finite = values[np.isfinite(values)]
  assert value.histo.num == finite.size
  assert sum(value.histo.bucket) == finite.size
  assert value.histo.min == finite.min() and value.histo.max == finite.max()


def test_histogram_of_spread_values_and_of_none():
  value = summaries._histogram('tag', np.arange(100.0))
  assert value.histo.num == 100 and len(value.histo.bucket) == 30
  assert summaries._histogram('tag', np.array([np.nan])) is None
