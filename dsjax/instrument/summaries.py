"""TensorBoard histograms and images of one instrumented step's records (beside the scalars the
`Collector` writes), so that the shape over depth and its change over steps can be seen at a glance:

  * `moments_hist/<site>/<stat>`: a histogram of the per-layer values of each site's statistic
    (log10 of variances and max |x|, which span decades over depth);
  * `weight_grad_norm_hist/<type>`: the per-layer gradient norms of each weight type (log10);
  * `grad_abs/<type>`: the distribution of |g| over a weight type's entries, from its measured quantiles
    (half the mass below p50, 40% to p90, 9% to p99, 0.9% to p99.9; the top 0.1% is not measured);
  * `moments_image/<site>`: an image of layer (rows, layer 0 on top) × statistic (columns, in
    `probe.ACTIVATION_STATS` order), each column scaled to its own range over the layers (log10 where
    the histograms use it), in the viridis colour map.
"""

from __future__ import annotations

import collections

import numpy as np
from matplotlib import colormaps
from tensorboardX import summary as tb_summary
from tensorboardX.proto.summary_pb2 import Summary

from dsjax.instrument import stats as stats_lib
from dsjax.instrument.probe import ACTIVATION_STATS, LAYER_SITES

LOG_STATS = ('var', 'grad_var', 'max_abs', 'grad_norm')
# Mass of |g| between successive measured quantiles (stats.GRAD_QUANTILES: 0.5, 0.9, 0.99, 0.999).
_QUANTILE_MASS = np.diff([0.0] + list(stats_lib.GRAD_QUANTILES.values()))
_CELL_WIDTH = 12  # pixels per statistic column
_IMAGE_HEIGHT = 192  # target pixels over all layers (each layer at least 1)


def _log10(values: np.ndarray) -> np.ndarray:
  with np.errstate(divide='ignore', invalid='ignore'):
    return np.log10(values)


def _scaled(stat: str, values: np.ndarray) -> tuple[str, np.ndarray]:
  """(tag suffix, values) of a statistic as plotted: log10 for scale-like statistics."""
  return ('log10', _log10(values)) if stat in LOG_STATS else ('value', values)


def _histogram(tag: str, values: np.ndarray) -> Summary.Value | None:
  """A histogram proto of the finite values, binned here over an explicit range: numpy cannot bin a
  range narrower than the values' float spacing (one layer, or equal values, at 1e18 say), so such a
  range is widened by a millionth of the values' magnitude."""
  values = np.asarray(values, np.float64)
  values = values[np.isfinite(values)]
  if values.size == 0:
    return None
  low, high = float(values.min()), float(values.max())
  pad = 1e-6 * max(abs(low), abs(high), 1e-30)
  if high - low <= pad:
    low, high = low - pad, high + pad
  counts, edges = np.histogram(values, bins=min(30, values.size), range=(low, high))
  with np.errstate(over='ignore'):
    sum_squares = float(np.sum(values * values))
  return tb_summary.histogram_raw(
    tag,
    min=float(values.min()),
    max=float(values.max()),
    num=float(values.size),
    sum=float(values.sum()),
    sum_squares=sum_squares,
    bucket_limits=edges[1:].tolist(),
    bucket_counts=counts.astype(np.float64).tolist(),
  ).value[0]


def _quantile_histogram(tag: str, quantiles: np.ndarray) -> Summary.Value | None:
  """A histogram proto of |g| from its quantiles (counts per mille of the entries)."""
  if not np.all(np.isfinite(quantiles)) or quantiles[-1] <= 0:
    return None
  counts = _QUANTILE_MASS * 1000.0
  centres = (np.concatenate([[0.0], quantiles[:-1]]) + quantiles) / 2
  return tb_summary.histogram_raw(
    tag,
    min=0.0,
    max=float(quantiles[-1]),
    num=float(counts.sum()),
    sum=float((counts * centres).sum()),
    sum_squares=float((counts * centres**2).sum()),
    bucket_limits=[float(q) for q in quantiles],
    bucket_counts=[float(c) for c in counts],
  ).value[0]


def _image(tag: str, table_NS: np.ndarray) -> Summary.Value:
  """A layer × statistic image, each column min–max scaled (non-finite cells black)."""
  cols = []
  for k, stat in enumerate(ACTIVATION_STATS):
    col = _scaled(stat, table_NS[:, k])[1]
    finite = np.isfinite(col)
    lo, hi = (col[finite].min(), col[finite].max()) if finite.any() else (0.0, 1.0)
    cols.append(np.where(finite, (col - lo) / (hi - lo) if hi > lo else 0.5, np.nan))
  unit = np.stack(cols, axis=1)
  rgb = colormaps['viridis'](np.nan_to_num(unit, nan=0.0))[..., :3]
  rgb[~np.isfinite(unit)] = 0.0
  rows = max(1, _IMAGE_HEIGHT // max(1, unit.shape[0]))
  pixels = np.repeat(np.repeat(rgb, rows, axis=0), _CELL_WIDTH, axis=1)
  return tb_summary.image(tag, (pixels * 255).astype(np.uint8), dataformats='HWC').value[0]


def step_summary(records: list[dict]) -> list[Summary.Value]:
  """The histograms and images of one step's records (`Collector` records of that step)."""
  layer_values: dict[tuple[str, str], dict[int, float]] = collections.defaultdict(dict)
  for r in records:
    if r['layer'] >= 0:
      layer_values[(r['site'], r['stat'])][r['layer']] = r['value']
  values = []
  for (site, stat), by_layer in sorted(layer_values.items()):
    per_layer = np.array([by_layer[n] for n in sorted(by_layer)], np.float64)
    if site.startswith('weight/'):
      kind = site.split('/', 1)[1]
      values.append(_histogram(f'weight_grad_norm_hist/{kind}/log10', _log10(per_layer)))
    else:
      suffix, scaled = _scaled(stat, per_layer)
      values.append(_histogram(f'moments_hist/{site}/{stat}/{suffix}', scaled))
  whole = {(r['site'], r['stat']): r['value'] for r in records if r['layer'] < 0}
  for site in sorted({s for s, _ in whole if s.startswith('weight/')}):
    quantiles = [whole.get((site, f'grad_abs_{q}')) for q in stats_lib.GRAD_QUANTILES]
    if None not in quantiles:
      values.append(_quantile_histogram(f'grad_abs/{site.split("/", 1)[1]}', np.array(quantiles)))
  for site in LAYER_SITES:
    columns = [layer_values.get((site, stat), {}) for stat in ACTIVATION_STATS]
    depth = max((len(c) for c in columns), default=0)
    if depth:
      table_NS = np.array([[c.get(n, np.nan) for c in columns] for n in range(depth)], np.float64)
      values.append(_image(f'moments_image/{site}', table_NS))
  return [v for v in values if v is not None]
