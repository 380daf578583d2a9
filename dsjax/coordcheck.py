r"""The coordinate check: activation and update sizes after 0…K training steps, across widths and depths.

  python -m dsjax.coordcheck --config=configs/gpt_preln.py --widths=32,64,128,256 [--depths=2,8,32]
      --steps=4 --out=DIR [--seeds=0,1] [--lr=3e-3] [--config.model.scheme=mup ...]

The check of Yang & Hu 2021 ("Tensor Programs IV", arXiv:2011.14522) and Yang et al. 2021 ("Tensor
Programs V", arXiv:2203.03466): a parametrisation is right for wide (or deep) models when the size of
every coordinate of every activation, and of its change under training, stays of order one as the width
(or depth) grows. Under μP (`model.scheme='mup'`, Adam) the curves against width are flat; under the
standard parametrisation with a width-independent Adam learning rate the changes grow ∝ width.

For each width w in --widths and depth N in --depths (default: the config's), the config's model with
model.width = w and model.depth = N is built by its method (preparation step included) and trained
--steps = K steps by the project's train step (`dsjax.train.step`) on the config's training data, from
config.seed = each of --seeds. The batches depend on the seed only, so every width and depth sees the
same ones. The learning rate is held at --lr (default optimizer.lr): no warmup, no decay
(optimizer.schedule='constant', warmup_steps=0, total_steps=K); everything else of the optimizer is the
config's. Before the first step and after each step t = 1…K the model is measured on one fixed batch,
the first training batch, by the same instrumented train step with its update dropped (so dropout, if
the config has any, is as in training; the logits are computed without it):

  activation_rms         RMS of the coordinates, sqrt(E[x²]), at every probe site of every layer
                         (`dsjax.instrument`: 'embedding', 'attn_branch', 'attn_residual', 'ffn_branch',
                         'ffn_residual' = the layer output) and of the model's output 'logits'
  activation_change_rms  RMS(logits_t − logits_0): the change of the output on the same batch
  weight_change_rms      RMS over the entries of W_t − W_0, per block matrix (q, k, v, o, ffn1, ffn2) and
                         layer, and of every other matrix (embeddings, head)
  weight_change_op       ‖W_t − W_0‖ from RMS to RMS, sqrt(fan_in/fan_out)·σ_max(W_t − W_0), per block
                         matrix and layer: the most the update can change the RMS of the layer's output
                         per unit RMS of its input (Yang, Simon & Bernstein 2023, arXiv:2310.17813: Θ(1)
                         under μP, ∝ width for Adam at a width-independent learning rate)

The probe exports statistics, not tensors, so the change of an activation is measured at the output
only; inside the model the updates are measured on the weights.

Writes DIR/coordcheck.json ({"settings", "config", "runs": one record per (width, depth, seed) with
every quantity per step and layer, "points": the plotted values, "exponents": the fitted growth
exponents}) and, per quantity, DIR/<quantity>_vs_width.png when --widths has two values or more and
DIR/<quantity>_vs_depth.png when --depths has: x the width (depth) on a log scale, one panel per site
or matrix, one line per step t, one row of panels per depth (width). A plotted value is the RMS over
layers (sqrt of the mean of the squares) averaged over the seeds. It prints the exponent p of a
least-squares fit value ∝ x^p at steps 1 and K: p ≈ 0 flat, p ≈ 1 growing like the width. How to read
the output, and measurements: docs/coordcheck.md.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import flags, logging
from flax import nnx
from ml_collections import config_flags

from dsjax import instrument as instrument_lib
from dsjax import models
from dsjax.instrument import probe as probe_lib
from dsjax.instrument import stats as stats_lib
from dsjax.train import cli
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import matplotlib.ticker  # noqa: E402

RESULT_FILE = 'coordcheck.json'
LOGITS = 'logits'
BLOCK_MATRICES = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')
# Quantity -> whether it is a change from step 0 (zero at t = 0, so plotted from t = 1).
QUANTITIES = {
  'activation_rms': False,
  'activation_change_rms': True,
  'weight_change_rms': True,
  'weight_change_op': True,
}


def _define_flags():
  # Defined only when run as a program, so that importing dsjax.coordcheck (tests, other tools with
  # flags of the same names) defines no absl flags.
  config_flags.DEFINE_config_file('config', None, 'Path to a config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('out', None, 'Output directory for coordcheck.json and the plots.')
  flags.DEFINE_list('widths', None, 'Comma-separated model widths (default: model.width).')
  flags.DEFINE_list('depths', None, 'Comma-separated model depths (default: model.depth).')
  flags.DEFINE_integer('steps', 4, 'Training steps K; the model is measured after 0, 1, …, K of them.')
  flags.DEFINE_list('seeds', None, 'Comma-separated seeds, each its own init and batches (default: seed).')
  flags.DEFINE_float('lr', None, 'Constant learning rate of the K steps (default: optimizer.lr).')
  flags.mark_flags_as_required(['config', 'out'])


# ------------------------------------------------------------------------------------------------
# Checks: every argument and every model of the sweep is checked before anything runs or is written.
# ------------------------------------------------------------------------------------------------


def parse_ints(flag: str, values, default: int, minimum: int) -> list[int]:
  """The integers of a comma-separated flag (`default` when it is not given), sorted; a one-line
  ValueError naming the flag unless they are distinct integers >= minimum."""
  if values is None:
    return [default]
  what = f'{flag} must be a comma-separated list of distinct integers >= {minimum}'
  try:
    numbers = [int(v) for v in values]
  except ValueError:
    raise ValueError(f'{what}, got {",".join(values)!r}') from None
  if not numbers or min(numbers) < minimum or len(set(numbers)) != len(numbers):
    raise ValueError(f'{what}, got {",".join(values)!r}')
  return sorted(numbers)


def point_config(config, width: int, depth: int, seed: int, steps: int, lr: float | None):
  """The config of one model of the sweep: its width, depth and seed, K steps at a constant lr."""
  c = copy.deepcopy(config)
  c.model.width, c.model.depth, c.seed, c.total_steps = width, depth, seed, steps
  c.optimizer.schedule, c.optimizer.warmup_steps = 'constant', 0
  if lr is not None:
    c.optimizer.lr = lr
  return c


def check_args(config, out: str, widths, depths, steps: int, seeds, lr: float | None):
  """One-line ValueErrors naming the flag or the config key; returns (widths, depths, seeds, DatasetInfo).
  Creates --out last, once everything else has passed."""
  widths = parse_ints('--widths', widths, config.model.width, 1)
  depths = parse_ints('--depths', depths, config.model.depth, 1)
  seeds = parse_ints('--seeds', seeds, config.seed, 0)
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f'--steps must be a positive integer, got {steps!r}')
  if lr is not None and not (np.isfinite(lr) and lr > 0):
    raise ValueError(f'--lr must be a positive number, got {lr!r}')
  if len(widths) == 1 and len(depths) == 1:
    raise ValueError(
      f'--widths and --depths give one model (width {widths[0]}, depth {depths[0]}); give two or more '
      'widths or depths to compare'
    )
  for width in widths:
    if width % config.model.num_heads:
      raise ValueError(f'--widths: {width} is not divisible by model.num_heads ({config.model.num_heads})')
  cli.check_output_dir('--out', out)
  history_lib.check_not_a_run('--out', out)
  data_info = None
  for width, depth in itertools.product(widths, depths):
    try:
      data_info = config_lib.validate_single_device_run(
        point_config(config, width, depth, seeds[0], steps, lr), training=True
      )
    except ValueError as e:
      raise ValueError(f'at width {width}, depth {depth}: {e}') from None
  cli.create_output_dir('--out', out)
  return widths, depths, seeds, data_info


# ------------------------------------------------------------------------------------------------
# Training and measurement of one model.
# ------------------------------------------------------------------------------------------------


def first_batches(config, num: int) -> list[dict]:
  """The first `num` training batches of `config.seed` (the same for every width and depth)."""
  pipeline = state_lib.whole_train_batches(config)
  return [jax.device_put(b) for b in itertools.islice(pipeline, num)]


def _logits(graphdef, model_name: str, params, rest, batch) -> jax.Array:
  """The model's output on `batch`, dropout off."""
  return nnx.merge(graphdef, params, rest)(models.model_inputs(model_name, batch))


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def _block_matrices(params) -> dict[str, list[jax.Array]]:
  """{matrix type: its kernels, each (layers, fan_in, fan_out)}: one stacked array for the scanned
  stack, one (1, fan_in, fan_out) array per layer for a trunk whose layers differ in width."""
  layers, stacked = probe_lib.layer_trees(params)
  per_layer = [layers] if stacked else [jax.tree.map(lambda x: x[None], tree) for tree in layers]
  groups = [stats_lib.group_layer_grads(tree) for tree in per_layer]
  return {kind: [leaf for g in groups for leaf in g[kind]] for kind in BLOCK_MATRICES if kind in groups[0]}


def _rms(x: jax.Array, axes) -> jax.Array:
  return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=axes))


def weight_changes(params, params0) -> dict[str, dict[str, jax.Array]]:
  """{'weight_change_rms': {matrix: (layers,)}, 'weight_change_op': {block matrix: (layers,)}} of
  W − W0, in float32. Matrices outside the trunk (embeddings, head) count as one layer."""
  delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), params, params0)
  rms, op = {}, {}
  for kind, stacks in _block_matrices(delta).items():
    rms[kind] = jnp.concatenate([_rms(d, (1, 2)) for d in stacks])
    op[kind] = jnp.concatenate(
      [jnp.linalg.matrix_norm(d, ord=2) * np.sqrt(d.shape[1] / d.shape[2]) for d in stacks]
    )
  outside = {key: value for key, value in delta.items() if key != 'trunk'}
  for path, leaf in jax.tree_util.tree_leaves_with_path(outside):
    if leaf.ndim >= 2:
      rms[_path_name(path)] = _rms(leaf, None)[None]
  return {'weight_change_rms': rms, 'weight_change_op': op}


def site_rms(moments) -> dict[str, list[float]]:
  """{site: [RMS of each layer]} from the probe's statistics: sqrt(var + mean²), float32."""
  values: dict[tuple[str, str], dict[int, float]] = {}
  for (_, layer, site, stat), value in instrument_lib.collector.moments_to_records(0, moments):
    values.setdefault((site, stat), {})[layer] = value
  out = {}
  for site in probe_lib.SITES:
    mean, var = values[(site, 'mean')], values[(site, 'var')]
    out[site] = [float(np.sqrt(np.float32(var[n]) + np.float32(mean[n]) ** 2)) for n in sorted(mean)]
  return out


def train_and_measure(config, data_info, batches) -> dict[str, Any]:
  """Trains the config's model len(batches) steps and measures it after each (module docstring).

  One instrumented train step (`dsjax.train.step`, `dsjax.instrument`) both trains, on batch t, and
  measures, on the fixed batch, whose updated state is dropped: its per-site statistics are those of
  the model as it stands (dropout as configured, with the step's key). Returns {'train_loss': [K],
  'loss': [K + 1] (on the fixed batch), 'nonfinite_steps', quantity: {series: [per step t: [per
  layer]]}}."""
  prepared = state_lib.method_preparation(config, data_info)
  setup = state_lib.make_setup(config, data_info, prepared)
  train_step = jax.jit(
    step_lib.make_train_step(
      setup.graphdef,
      setup.tx,
      step_lib.LOSSES[config.model.name],
      config.seed,
      setup.schedule,
      config.model.dropout > 0 or config.model.attn_dropout > 0,
      instrument=True,
      on_nonfinite=config.on_nonfinite,
      microbatches=config.microbatches,
    )
  )
  logits_of = jax.jit(functools.partial(_logits, setup.graphdef, config.model.name))
  changes = jax.jit(weight_changes)
  state = jax.jit(setup.create_state)()
  params0 = state['params']
  record: dict[str, Any] = {'train_loss': [], 'loss': [], **{q: {} for q in QUANTITIES}}
  logits0 = None
  for t in range(len(batches) + 1):
    if t:
      state, metrics = train_step(state, batches[t - 1])
      record['train_loss'].append(float(metrics['train/loss']))
    _, measured = train_step(state, batches[0])
    logits = np.asarray(logits_of(state['params'], state['rest'], batches[0]), np.float32)
    logits0 = logits if logits0 is None else logits0
    per_step = {
      'activation_rms': {
        **site_rms(jax.device_get(measured['moments'])),
        LOGITS: [float(np.sqrt(np.mean(np.square(logits))))],
      },
      'activation_change_rms': {LOGITS: [float(np.sqrt(np.mean(np.square(logits - logits0))))]},
      **jax.tree.map(lambda x: [float(v) for v in x], jax.device_get(changes(state['params'], params0))),
    }
    for quantity, by_series in per_step.items():
      for series, values in by_series.items():
        record[quantity].setdefault(series, []).append(values)
    record['loss'].append(float(measured['train/loss']))
  record['nonfinite_steps'] = int(state['nonfinite_steps'])
  return record


# ------------------------------------------------------------------------------------------------
# Summary: the plotted values and their growth exponents.
# ------------------------------------------------------------------------------------------------


def layer_rms(values) -> float:
  """One number for a site or matrix: the RMS over its layers (None where one is not finite)."""
  v = np.asarray(values, np.float64)
  return float(np.sqrt(np.mean(np.square(v)))) if np.all(np.isfinite(v)) else None


def summary_points(runs, steps: int) -> list[dict[str, Any]]:
  """Per quantity, series, step, width and depth: the layer RMS (`layer_rms`), mean over seeds."""
  points = []
  groups: dict[tuple, list[float]] = {}
  for run in runs:
    for quantity in QUANTITIES:
      for series, per_step in run[quantity].items():
        for t in range(steps + 1):
          key = (quantity, series, t, run['width'], run['depth'])
          groups.setdefault(key, []).append(layer_rms(per_step[t]))
  for (quantity, series, t, width, depth), values in groups.items():
    finite = [v for v in values if v is not None]
    value = float(np.mean(finite)) if len(finite) == len(values) else None
    points.append(
      {
        'quantity': quantity,
        'series': series,
        'step': t,
        'width': width,
        'depth': depth,
        'value': value,
        'seed_values': values,
      }
    )
  return points


def _curves(points, against: str):
  """{(quantity, series, step, value of the other axis): ([x], [y])}, sorted by x."""
  other = 'depth' if against == 'width' else 'width'
  curves: dict[tuple, tuple[list, list]] = {}
  for p in sorted(points, key=lambda p: p[against]):
    xs, ys = curves.setdefault((p['quantity'], p['series'], p['step'], p[other]), ([], []))
    xs.append(p[against])
    ys.append(p['value'])
  return curves


def growth_exponents(points, against: str) -> list[dict[str, Any]]:
  """The exponent p of the least-squares fit log y = a + p·log x of each curve against `against`
  (None where a value is missing, zero or not finite)."""
  other = 'depth' if against == 'width' else 'width'
  out = []
  for (quantity, series, t, fixed), (xs, ys) in _curves(points, against).items():
    if QUANTITIES[quantity] and t == 0:
      continue
    ok = len(xs) >= 2 and all(y is not None and y > 0 for y in ys)
    p = float(np.polyfit(np.log(xs), np.log(ys), 1)[0]) if ok else None
    out.append(
      {'quantity': quantity, 'series': series, 'step': t, 'against': against, other: fixed, 'exponent': p}
    )
  return out


# ------------------------------------------------------------------------------------------------
# Plots.
# ------------------------------------------------------------------------------------------------


def _series_order(points, quantity: str) -> list[str]:
  names = {p['series'] for p in points if p['quantity'] == quantity}
  known = list(probe_lib.SITES) + [LOGITS] + list(BLOCK_MATRICES)
  return [n for n in known if n in names] + sorted(names - set(known))


def _log_y_axis(ax):
  """A log y axis spanning at least a factor 4 (a flat curve looks flat, not like magnified noise),
  labelled on its minor ticks too when it spans less than a factor 10."""
  values = np.concatenate([line.get_ydata() for line in ax.get_lines()]).astype(float)
  values = values[np.isfinite(values)]
  if not values.size:
    return
  low, high = values.min(), values.max()
  if high < 4 * low:
    centre = np.sqrt(low * high)
    ax.set_ylim(centre / 2, centre * 2)
  bottom, top = ax.get_ylim()
  # Plain '%.3g' labels: the default mathtext ones have hit pyparsing's recursion limit (dsjax.moments).
  label = matplotlib.ticker.FuncFormatter(lambda v, _: f'{v:.3g}')
  ax.yaxis.set_major_formatter(label)
  ax.yaxis.set_minor_formatter(label if top < 10 * bottom else matplotlib.ticker.NullFormatter())
  ax.tick_params(axis='y', which='both', labelsize=7)


def plot(points, quantity: str, against: str, steps: int, path: str, title: str):
  """One panel per series (columns) and per value of the other axis (rows); one line per step t."""
  other = 'depth' if against == 'width' else 'width'
  curves = _curves([p for p in points if p['quantity'] == quantity], against)
  series = _series_order(points, quantity)
  rows = sorted({key[3] for key in curves})
  first = 1 if QUANTITIES[quantity] else 0
  colours = plt.cm.viridis(np.linspace(0, 0.9, steps + 1))
  fig, axes = plt.subplots(
    len(rows),
    len(series),
    figsize=(3.2 * len(series), 2.7 * len(rows)),
    squeeze=False,
    constrained_layout=True,
  )
  for (r, fixed), (c, name) in itertools.product(enumerate(rows), enumerate(series)):
    ax = axes[r, c]
    for t in range(first, steps + 1):
      xs, ys = curves[(quantity, name, t, fixed)]
      ys = [np.nan if y is None or y <= 0 else y for y in ys]
      ax.plot(xs, ys, 'o-', ms=3, lw=1.2, color=colours[t], label=f't={t}')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(sorted({x for key, (xs, _) in curves.items() for x in xs}))
    _log_y_axis(ax)
    ax.set_title(f'{name} ({other} {fixed})', fontsize=9)
    ax.set_xlabel(against)
    ax.grid(alpha=0.3, which='both')
  axes[0, 0].legend(fontsize=7)
  fig.suptitle(f'{quantity}: {title}')
  fig.savefig(path, dpi=100)
  plt.close(fig)


def describe(config, lr: float | None) -> str:
  m = config.model
  inputs = f'seq {config.data.seq_len}' if m.name == 'gpt' else f'patch {m.patch_size}'
  return (
    f'{m.name} {m.block} scheme={m.scheme}, {inputs}, batch {config.batch_size}, '
    f'{config.optimizer.name} lr {config.optimizer.lr if lr is None else lr}'
  )


# ------------------------------------------------------------------------------------------------
# The run.
# ------------------------------------------------------------------------------------------------


def run(
  config, out: str, widths=None, depths=None, steps: int = 4, seeds=None, lr: float | None = None
) -> dict[str, Any]:
  """Checks, trains and measures every (width, depth, seed), writes DIR/coordcheck.json and the plots;
  returns the JSON content. `widths`, `depths`, `seeds`: lists of strings or integers, or None."""
  as_strings = lambda v: None if v is None else [str(x) for x in v]
  widths, depths, seeds, data_info = check_args(
    config, out, as_strings(widths), as_strings(depths), steps, as_strings(seeds), lr
  )
  runs = []
  for seed in seeds:
    batches = first_batches(point_config(config, widths[0], depths[0], seed, steps, lr), steps)
    for width, depth in itertools.product(widths, depths):
      start = time.perf_counter()
      record = train_and_measure(point_config(config, width, depth, seed, steps, lr), data_info, batches)
      runs.append({'width': width, 'depth': depth, 'seed': seed, **record})
      logging.info(
        'width %d, depth %d, seed %d: loss %.4f -> %.4f, %.1f s',
        width,
        depth,
        seed,
        record['loss'][0],
        record['loss'][-1],
        time.perf_counter() - start,
      )
  points = summary_points(runs, steps)
  sweeps = [axis for axis, values in (('width', widths), ('depth', depths)) if len(values) > 1]
  result = {
    'settings': {
      'widths': widths,
      'depths': depths,
      'steps': steps,
      'seeds': seeds,
      'lr': config.optimizer.lr if lr is None else lr,
      'schedule': 'constant, no warmup',
      'measured_on': 'the first training batch of each seed, dropout off, after t = 0..steps steps',
      'plotted_value': 'RMS over layers, mean over seeds',
    },
    'config': json.loads(config.to_json_best_effort()),
    'runs': runs,
    'points': points,
    'exponents': [e for axis in sweeps for e in growth_exponents(points, axis)],
  }
  with open(os.path.join(out, RESULT_FILE), 'w') as f:
    json.dump(result, f)
  for quantity, axis in itertools.product(QUANTITIES, sweeps):
    plot(points, quantity, axis, steps, os.path.join(out, f'{quantity}_vs_{axis}.png'), describe(config, lr))
  return result


def format_exponents(result) -> str:
  """A table of the growth exponents at steps 1 and K, one line per quantity, series and curve."""
  steps = result['settings']['steps']
  lines = []
  by_key: dict[tuple, dict[int, float]] = {}
  for e in result['exponents']:
    other = 'depth' if e['against'] == 'width' else 'width'
    key = (e['against'], other, e[other], e['quantity'], e['series'])
    by_key.setdefault(key, {})[e['step']] = e['exponent']
  fmt = lambda p: '     —' if p is None else f'{p:+6.2f}'
  header = None
  for (against, other, fixed, quantity, series), by_step in by_key.items():
    if header != (against, fixed):
      header = (against, fixed)
      lines.append(f'value ∝ {against}^p at {other} {fixed}:{"":10s}  p(t=1)  p(t={steps})')
    lines.append(f'  {quantity:22s} {series:14s} {fmt(by_step.get(1))}  {fmt(by_step.get(steps))}')
  return '\n'.join(lines)


def main(argv):
  del argv
  args = flags.FLAGS
  result = run(args.config, args.out, args.widths, args.depths, args.steps, args.seeds, args.lr)
  print(describe(args.config, args.lr))
  print(format_exponents(result))
  print(f'wrote {os.path.join(args.out, RESULT_FILE)} and the plots')


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
