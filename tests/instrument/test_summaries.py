"""The TensorBoard summaries of the instrumentation: histograms of any finite values, the layer images."""

import io

import numpy as np
import pytest
from matplotlib import colormaps
from PIL import Image

from dsjax.instrument import summaries
from dsjax.instrument.probe import ACTIVATION_STATS


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


def test_a_layer_image_is_the_viridis_map_of_each_columns_range():
  """Each statistic's column scaled to its own range over the layers (log10 for variances), coloured as
  matplotlib's viridis colours it, a non-finite cell black; each cell _CELL_WIDTH pixels wide."""
  depth = 6
  table_NS = np.random.default_rng(0).uniform(0.5, 4.0, (depth, len(ACTIVATION_STATS)))
  table_NS[2, 1] = np.nan
  value = summaries._image('tag', table_NS)
  pixels = np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string)))
  rows = summaries._IMAGE_HEIGHT // depth
  assert pixels.shape == (depth * rows, len(ACTIVATION_STATS) * summaries._CELL_WIDTH, 3)
  for k, stat in enumerate(ACTIVATION_STATS):
    column = np.log10(table_NS[:, k]) if stat in summaries.LOG_STATS else table_NS[:, k]
    finite = np.isfinite(column)
    unit = (column - column[finite].min()) / (column[finite].max() - column[finite].min())
    expected = (colormaps['viridis'](np.nan_to_num(unit))[:, :3] * 255).astype(np.uint8)
    expected[~finite] = 0
    np.testing.assert_array_equal(pixels[::rows, k * summaries._CELL_WIDTH], expected, err_msg=stat)
