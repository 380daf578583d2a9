r"""Per-layer sensitivity of a transformer at initialisation (Davis et al. 2021, Catformer, App. B).

  python -m dsjax.sensitivity --config=configs/gpt_preln.py --out=DIR [--draws=8]
      [--config.model.depth=32 --config.model.width=32 --config.model.num_heads=4
       --config.data.seq_len=16 --config.batch_size=4 --config.model.block=postln ...]

Measures, per layer n of N, s_n = N·S[f; θ_n]: the sensitivity of the trunk output f (the final hidden
state the head reads, all tokens of a training batch, dropout off) to layer n's parameters θ_n under
their initial distribution (Catformer, ICML 2021, App. B, Def. 2 and Prop. 5),

    S[f; u] = E‖J_u f·ũ‖² / E‖f‖²,

measured with JVPs as Σ‖J_u f·ũ‖² / Σ‖f‖² over `--draws` draws of (u, ũ, training batch); draw i uses
key_i = fold_in(key(config.seed), i), u is initialised with fold_in(key_i, 0) and ũ = (u' − u'')/√2
from two more initialisations, so ũ has the covariance of the initialisation's random part and
constant-initialised parameters are not perturbed. Its mean over layers is what the DSLM paper (Kedia et
al. 2024, arXiv:2403.09635, §3.5) writes as N·β²/σ²_skip.

Reported normalised, ŝ_n = s_n / S_layer (S_layer the branches' measured sensitivity to their own
parameters, idealised 4), beside three predictions, in this order:
  * composition: the chain rule along the stream (Catformer Prop. 6) with local factors measured on
    the same draws: ℓ_n = S[x_n; θ_n], the layer's input sensitivity g_n for the perturbation that
    arrives, g_f for the trunk's tail; s_n = N·ℓ_n·Π_{m>n} g_m·g_f per draw;
  * local: the same with every input sensitivity 1 (Catformer Prop. 8), N·ℓ_n;
  * idealised (Catformer App. C): from the model's λ, β and norm layout only, ŝ_n = N·(ρ_attn + ρ_ffn)/2
    with ρ = β²V_F/(λ²V_x + β²V_F): Pre-LN mean ½(H_{2N+1} − 1), Post-LN N/2, weighted residual
    (1 − λ²)N, DSLM k.

Writes DIR/sensitivity.json (per layer: s, ŝ, the predictions, the input sensitivity, each branch's ρ
and sensitivity) and DIR/sensitivity.png, and prints the mean and median over layers with jackknife
standard errors over the draws. Cost: N JVPs through N layers per draw (about 0.1 s per draw at depth 8,
6 s at 128, at width 32 on a 2-core CPU). The attention runs on the XLA path, which JAX differentiates
in forward mode, whatever `model.attention` says.

The definitions in full, their premises, the measurements at depths 8, 32 and 128 and why they depart
from the closed forms: docs/sensitivity.md.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import flags, logging
from flax import nnx
from ml_collections import config_flags

from dsjax import models, schemes
from dsjax.train import cli
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import state as state_lib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import matplotlib.ticker  # noqa: E402


def _define_flags():
  # Defined only when run as a program, so that importing dsjax.sensitivity (tests, other tools with
  # flags of the same names, e.g. dsjax.moments) defines no absl flags.
  config_flags.DEFINE_config_file('config', None, 'Path to a config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('out', None, 'Output directory for sensitivity.json and sensitivity.png.')
  flags.DEFINE_integer(
    'draws', 8, 'Independent draws of (parameters, perturbation, training batch).', lower_bound=1
  )
  flags.mark_flags_as_required(['config', 'out'])


# Where the stacked block parameters live (leading depth axis), and where a concatenation trunk keeps
# one subtree per layer.
STACK_PATH = ('trunk', 'stack', 'layers')
LAYER_LIST_PATH = ('trunk', 'layers')
# Layers whose JVPs are evaluated together (vmapped); the rest of the depth is looped over.
LAYER_BATCH = 16
ADDS = ('attn', 'ffn')
# Predictions, in the order they are reported (module docstring).
PREDICTIONS = ('composition', 'local', 'idealised')


# ------------------------------------------------------------------------------------------------
# Parameter trees.
# ------------------------------------------------------------------------------------------------


def _path_keys(path) -> tuple[Any, ...]:
  return tuple(getattr(k, 'key', getattr(k, 'idx', k)) for k in path)


def layer_tangent(direction, n: jax.Array | None, depth: int):
  """`direction` restricted to layer n's parameters (n may be traced), or to every layer's (n None);
  zero elsewhere (embeddings, head, final norm)."""

  def select(path, x):
    keys = _path_keys(path)
    if keys[: len(STACK_PATH)] == STACK_PATH:
      if n is None:
        return x
      at_n = (jnp.arange(depth) == n).astype(x.dtype)
      return x * at_n.reshape((depth,) + (1,) * (x.ndim - 1))
    if keys[: len(LAYER_LIST_PATH)] == LAYER_LIST_PATH and isinstance(keys[len(LAYER_LIST_PATH)], int):
      return x if n is None else x * jnp.asarray(keys[len(LAYER_LIST_PATH)] == n, x.dtype)
    return jnp.zeros_like(x)

  return jax.tree_util.tree_map_with_path(select, direction)


def layer_params(params) -> Any:
  """The stacked block parameters (leading depth axis) of an additive trunk, or None."""
  tree = params
  for key in STACK_PATH:
    if key not in tree:
      return None
    tree = tree[key]
  return tree


def _branch_only(tree, add: str):
  """The entries of one layer's parameter tree that belong to the attention or the FFN add
  (`attn`, `pre_attn_norm`, `branch_attn`, ... vs `ffn`, `pre_ffn_norm`, `branch_ffn`, ...)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x if add in str(_path_keys(path)[0]) else jnp.zeros_like(x), tree
  )


def _sum_sq(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x.astype(jnp.float32)))


# ------------------------------------------------------------------------------------------------
# One draw: the measurement and the local factors of the composition, on device.
# ------------------------------------------------------------------------------------------------


def with_xla_attention(config):
  """A copy of `config` whose model runs the XLA attention and the plain norms and GELU. Forward-mode
  derivatives (`jax.linearize`) need functions that JAX differentiates both ways: the fused kernels
  (cuDNN's attention, the TPU's splash, `model.fused_ops`' Pallas kernels) define only a backward pass;
  the XLA attention and the plain math compute the same functions
  (tests/models/test_precision_attention.py, tests/models/test_fused_ops.py)."""
  config = config.copy_and_resolve_references()
  config.model.attention = 'xla'
  config.model.fused_ops = 'none'
  return config


class Measurement:
  """The model of a config and the jitted computations of one draw (module docstring).

  `draw(key, inputs)` returns sums of squares: 'f' ‖f‖²; 'layer' (N,) ‖J_{θ_n} f·ũ_n‖²; 'all'
  ‖J f·ũ‖² with every layer perturbed at once; and, for an additive trunk, per layer (N,) arrays:
  'x', 'y' (‖layer input‖², ‖layer output‖²), 'dx' (the carried perturbation of all earlier layers
  entering the layer), 'dy_in' (its image at the layer output), 'dy_own' (the layer output's JVP for
  its own perturbation); per add b: 'h_b' (branch output F_b before β), 'dh_b' (its JVP for the
  branch's own perturbation), 'bh_b' (β·F_b), 'u_b' (λ·x + β·F_b); and 'xN', 'dxN' at the stack output.
  """

  def __init__(self, config, data_info, prepared=None):
    self.depth = config.model.depth
    config = with_xla_attention(config)

    def build(key):
      return schemes.build_model(config, data_info, nnx.Rngs(params=key), prepared)

    # The structure from an abstract build, the arrays from a jitted one (an eager build of a deep
    # model costs as much as compiling one).
    self.graphdef = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))), nnx.Param, ...)[0]
    self.init = jax.jit(lambda key: nnx.split(build(key), nnx.Param, ...)[1:])
    params, self.rest = self.init(jax.random.key(config.seed))
    self.model = nnx.merge(self.graphdef, params, self.rest)  # Initialised with key(config.seed).
    self.additive = layer_params(params) is not None
    self._measure = jax.jit(self._measure_draw)

  def trunk_output(self, params, inputs, probe=None) -> jax.Array:
    """f: the trunk output of the model with `params` (dropout off)."""
    model = nnx.merge(self.graphdef, params, self.rest)
    extra = () if probe is None else (probe,)
    return model.trunk(model.embed(inputs), None, *extra)

  def parameters_and_direction(self, key):
    """u from fold_in(key, 0); ũ = (u' − u'')/√2 from fold_in(key, 1) and fold_in(key, 2)."""
    params, other, another = (self.init(jax.random.fold_in(key, i))[0] for i in range(3))
    return params, jax.tree.map(lambda a, b: (a - b) / math.sqrt(2.0), other, another)

  def draw(self, key, inputs) -> dict[str, jax.Array]:
    params, direction = self.parameters_and_direction(key)
    return self._measure(params, direction, inputs)

  def _measure_draw(self, params, direction, inputs):
    depth = self.depth
    f, jvp = jax.linearize(lambda p: self.trunk_output(p, inputs), params)
    per_layer = jax.lax.map(
      lambda n: _sum_sq(jvp(layer_tangent(direction, n, depth))),
      jnp.arange(depth),
      batch_size=min(LAYER_BATCH, depth),
    )
    out = {'f': _sum_sq(f), 'layer': per_layer, 'all': _sum_sq(jvp(layer_tangent(direction, None, depth)))}
    if self.additive:
      out.update(self._composition_factors(params, direction, inputs))
    return out

  def stack_input(self, params, inputs) -> jax.Array:
    """The stream entering the first layer (after the embedding and any input norm)."""
    captured = {}

    def probe(site, x, layer):
      del layer
      if site == 'embedding':  # Visited once, before the layers (outside the layer scan).
        captured['x'] = x
      return x

    self.trunk_output(params, inputs, probe)  # Only the capture is used; XLA drops the rest.
    return captured['x']

  def _composition_factors(self, params, direction, inputs) -> dict[str, jax.Array]:
    """One pass over the layers, each through the model's own Block, carrying the JVP of every
    earlier layer's perturbation: the local factors of the chain rule (module docstring)."""
    model = nnx.merge(self.graphdef, params, self.rest)
    block_graphdef, _, block_rest = nnx.split(model.trunk.stack.layers, nnx.Param, ...)

    def layer_step(carry, xs):
      x, dx = carry
      block_params, block_direction, block_state, n = xs

      def run(block_params, x):
        got = {}

        def probe(site, h, layer):
          del layer
          got[site] = h
          return h

        block = nnx.merge(block_graphdef, block_params, block_state)
        parts = {'y': block(x, None, layer=n, probe=probe)}
        scale = block.scales()
        for add, stream in (('attn', x), ('ffn', got['attn_residual'])):
          parts[f'h_{add}'] = got[f'{add}_branch']
          parts[f'bh_{add}'] = scale[f'branch_{add}'] * got[f'{add}_branch']
          parts[f'u_{add}'] = scale[f'skip_{add}'] * stream + parts[f'bh_{add}']
        return parts

      parts, linear = jax.linearize(run, block_params, x)
      from_input = linear(jax.tree.map(jnp.zeros_like, block_params), dx)
      own = {add: linear(_branch_only(block_direction, add), jnp.zeros_like(x)) for add in ADDS}
      dy_own = own['attn']['y'] + own['ffn']['y']
      sums = {
        'x': _sum_sq(x),
        'y': _sum_sq(parts['y']),
        'dx': _sum_sq(dx),
        'dy_in': _sum_sq(from_input['y']),
        'dy_own': _sum_sq(dy_own),
      }
      for add in ADDS:
        sums[f'h_{add}'] = _sum_sq(parts[f'h_{add}'])
        sums[f'dh_{add}'] = _sum_sq(own[add][f'h_{add}'])
        sums[f'bh_{add}'] = _sum_sq(parts[f'bh_{add}'])
        sums[f'u_{add}'] = _sum_sq(parts[f'u_{add}'])
      return (parts['y'], from_input['y'] + dy_own), sums

    x0 = self.stack_input(params, inputs)
    xs = (layer_params(params), layer_params(direction), block_rest, jnp.arange(self.depth))
    (x_n, dx_n), sums = jax.lax.scan(layer_step, (x0, jnp.zeros_like(x0)), xs)
    return {**sums, 'xN': _sum_sq(x_n), 'dxN': _sum_sq(dx_n)}


# ------------------------------------------------------------------------------------------------
# The idealised model (Catformer App. C) from the residual scales and the norm layout.
# ------------------------------------------------------------------------------------------------


def residual_layout(
  scales: dict[str, Any], normed_branch: dict[str, bool], post_norm: dict[str, bool]
) -> dict[str, Any]:
  """λ², β² per layer and add (mean over the entries of vector scales) from `scales` (skip_attn,
  branch_attn, skip_ffn, branch_ffn: arrays with a leading depth axis), and per add whether its branch
  output is normalised (a pre- or mid-norm) and whether a norm follows the add (Post-LN)."""
  mean_sq = lambda v: (np.asarray(v, np.float64) ** 2).reshape(np.shape(v)[0], -1).mean(1)
  layout: dict[str, Any] = {}
  for add in ADDS:
    layout[f'skip2_{add}'] = mean_sq(scales[f'skip_{add}'])
    layout[f'branch2_{add}'] = mean_sq(scales[f'branch_{add}'])
    layout[f'normed_branch_{add}'] = bool(normed_branch[add])
    layout[f'post_norm_{add}'] = bool(post_norm[add])
  return layout


def model_layout(model) -> dict[str, Any] | None:
  """`residual_layout` of a model's stacked blocks; None for a trunk without them."""
  stack = getattr(getattr(model.trunk, 'stack', None), 'layers', None)
  if stack is None:
    return None
  has = lambda name: getattr(stack, name) is not None
  return residual_layout(
    stack.scales(),
    {add: has(f'pre_{add}_norm') or has(f'mid_{add}_norm') for add in ADDS},
    {add: has(f'post_{add}_norm') for add in ADDS},
  )


def idealised(layout: dict[str, Any], depth: int) -> np.ndarray:
  """ŝ_n of the idealised model (module docstring): N·(ρ_attn + ρ_ffn)/2 per layer."""
  var, rho = 1.0, np.zeros((depth, len(ADDS)))
  for n in range(depth):
    for j, add in enumerate(ADDS):
      branch_var = 1.0 if layout[f'normed_branch_{add}'] else var
      skip2, branch2 = layout[f'skip2_{add}'][n], layout[f'branch2_{add}'][n]
      total = skip2 * var + branch2 * branch_var
      rho[n, j] = branch2 * branch_var / total if total > 0 else 0.0
      var = 1.0 if layout[f'post_norm_{add}'] else total
  return depth * rho.mean(1)


# ------------------------------------------------------------------------------------------------
# Aggregation over draws.
# ------------------------------------------------------------------------------------------------


def _ratio(num, den):
  num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
  return np.divide(num, den, out=np.full(np.broadcast(num, den).shape, np.nan), where=den > 0)


def gain_above(draw: dict[str, np.ndarray]) -> np.ndarray:
  """Π_{m>n} g_m per layer n for one draw: the composition's amplification of layer n's perturbation by
  the layers above, each layer's input sensitivity g_m measured for the carried perturbation (1 where
  none arrives, i.e. at layer 0)."""
  gain = np.where(
    draw['dx'] > 0, _ratio(_ratio(draw['dy_in'], draw['y']), _ratio(draw['dx'], draw['x'])), 1.0
  )
  return np.append(np.cumprod(gain[::-1])[::-1][1:], 1.0)


def aggregate(draws: list[dict[str, np.ndarray]], depth: int, layout) -> dict[str, Any]:
  """Per-layer sensitivities and predictions from the per-draw sums of squares (ratios of sums over
  draws, as the definition's expectations)."""
  total = lambda key: np.sum([d[key] for d in draws], axis=0)
  f2 = total('f')
  s = depth * _ratio(total('layer'), f2)
  result = {'s': s, 'total': float(_ratio(total('all'), f2)), 'total_from_layers': float(np.sum(s) / depth)}
  if 'y' not in draws[0]:
    return result

  branch = {add: _ratio(total(f'dh_{add}'), total(f'h_{add}')) for add in ADDS}
  rho = {add: _ratio(total(f'bh_{add}'), total(f'u_{add}')) for add in ADDS}
  normaliser = float(sum(np.nanmean(branch[add]) for add in ADDS))
  # Per draw: the chain-rule prediction of the output's tangent energy for layer n's perturbation.
  predicted = []
  for d in draws:
    own = _ratio(d['dy_own'], d['y'])
    tail = float(_ratio(_ratio(d['all'], d['f']), _ratio(d['dxN'], d['xN']))) if d['dxN'] > 0 else 1.0
    above = gain_above(d)
    predicted.append(own * above * tail * d['f'])
  composition = depth * _ratio(np.sum(predicted, axis=0), f2)
  local = depth * _ratio(total('dy_own'), total('y'))
  input_gain = np.where(
    total('dx') > 0, _ratio(_ratio(total('dy_in'), total('y')), _ratio(total('dx'), total('x'))), np.nan
  )
  result.update(
    normaliser=normaliser,
    branch_sensitivity=branch,
    rho=rho,
    input_sensitivity=input_gain,
    predicted={
      'composition': composition / normaliser,
      'local': local / normaliser,
      'idealised': idealised(layout, depth),
    },
  )
  return result


# ------------------------------------------------------------------------------------------------
# The run: model, data, JSON, figure, summary.
# ------------------------------------------------------------------------------------------------


def _stats(values) -> dict[str, float]:
  values = np.asarray(values, np.float64)
  return {'mean': float(np.mean(values)), 'median': float(np.median(values))}


def _num(v) -> float | None:
  return None if v is None or not np.isfinite(v) else float(v)


def measure(config, num_draws: int) -> tuple[list[dict[str, np.ndarray]], dict[str, Any] | None]:
  """`Measurement.draw` on `num_draws` draws (host arrays), and the model's residual layout."""
  if isinstance(num_draws, bool) or not isinstance(num_draws, int) or num_draws < 1:
    raise ValueError(f'--draws must be a positive integer, got {num_draws!r}')
  # The run's config checks (of the attention it will run); the measurement runs on one device without
  # a mesh, so not mesh.shape.
  config = with_xla_attention(config)
  data_info = config_lib.validate_single_device_run(config, training=False)
  prepared = state_lib.method_preparation(config, data_info)
  measurement = Measurement(config, data_info, prepared)
  pipeline = state_lib.whole_train_batches(config)
  base = jax.random.key(config.seed)
  per_draw = []
  for i, batch in enumerate(itertools.islice(pipeline, num_draws)):
    inputs = models.model_inputs(config.model.name, batch)
    sums = measurement.draw(jax.random.fold_in(base, i), inputs)
    per_draw.append(jax.tree.map(lambda a: np.asarray(a, np.float64), jax.device_get(sums)))
    logging.info(
      'draw %d/%d: Σ_n S[f; θ_n] = %.4g',
      i + 1,
      num_draws,
      float(np.sum(per_draw[-1]['layer']) / per_draw[-1]['f']),
    )
  return per_draw, model_layout(measurement.model)


def layer_rows(agg: dict[str, Any], depth: int) -> list[dict[str, Any]]:
  rows = []
  for n in range(depth):
    row: dict[str, Any] = {'layer': n, 's': float(agg['s'][n])}
    if 'normaliser' in agg:
      row['s_normalised'] = _num(agg['s'][n] / agg['normaliser'])
      row['predicted'] = {name: _num(agg['predicted'][name][n]) for name in PREDICTIONS}
      row['input_sensitivity'] = _num(agg['input_sensitivity'][n])
      for add in ADDS:
        row[add] = {
          'rho': _num(agg['rho'][add][n]),
          'branch_sensitivity': _num(agg['branch_sensitivity'][add][n]),
        }
    rows.append(row)
  return rows


def _headline(agg: dict[str, Any]) -> dict[str, float]:
  """The summary statistics whose jackknife errors are reported."""
  out = {'s_mean': np.mean(agg['s']), 's_median': np.median(agg['s'])}
  if 'normaliser' in agg:
    measured, composition = agg['s'] / agg['normaliser'], agg['predicted']['composition']
    out.update(
      normalised_mean=np.mean(measured),
      normalised_median=np.median(measured),
      composition_mean=np.mean(composition),
      composition_median=np.median(composition),
    )
    out.update(
      ratio_mean=out['normalised_mean'] / out['composition_mean'],
      ratio_median=out['normalised_median'] / out['composition_median'],
    )
  return {k: float(v) for k, v in out.items()}


def jackknife(draws: list[dict[str, np.ndarray]], depth: int, layout) -> dict[str, float]:
  """Leave-one-draw-out standard errors of `_headline` (NaN with a single draw)."""
  if len(draws) < 2:
    return {k: float('nan') for k in _headline(aggregate(draws, depth, layout))}
  samples = [_headline(aggregate(draws[:i] + draws[i + 1 :], depth, layout)) for i in range(len(draws))]
  d = len(draws)
  return {
    k: float(
      np.sqrt(
        (d - 1) / d * np.sum((np.array([s[k] for s in samples]) - np.mean([s[k] for s in samples])) ** 2)
      )
    )
    for k in samples[0]
  }


def summarize(agg: dict[str, Any], errors: dict[str, float]) -> dict[str, Any]:
  """Means and medians over layers, with jackknife standard errors over draws ('*_stderr')."""
  head = _headline(agg)
  with_error = lambda key, stat: {stat: head[f'{key}_{stat}'], f'{stat}_stderr': errors[f'{key}_{stat}']}
  summary: dict[str, Any] = {
    's': {**with_error('s', 'mean'), **with_error('s', 'median')},
    # Σ_n S[f; θ_n] and the same from one JVP perturbing every layer at once (equal in expectation:
    # independent perturbations of disjoint parameter groups add, Catformer Prop. 5).
    'total_sensitivity': {'sum_over_layers': agg['total_from_layers'], 'all_layers_at_once': agg['total']},
  }
  if 'normaliser' in agg:
    summary['normaliser'] = {
      'layer': agg['normaliser'],
      **{add: float(np.nanmean(agg['branch_sensitivity'][add])) for add in ADDS},
    }
    summary['s_normalised'] = {**with_error('normalised', 'mean'), **with_error('normalised', 'median')}
    summary['predicted'] = {name: _stats(agg['predicted'][name]) for name in PREDICTIONS}
    summary['measured_over_composition'] = {**with_error('ratio', 'mean'), **with_error('ratio', 'median')}
  return summary


def plot(rows, path: str, title: str):
  layers = np.array([r['layer'] for r in rows])
  normalised = 's_normalised' in rows[0]
  fig, axes = plt.subplots(
    1, 2 if normalised else 1, figsize=(13 if normalised else 7, 4.5), constrained_layout=True, squeeze=False
  )
  ax = axes[0, 0]
  key = 's_normalised' if normalised else 's'
  measured = np.array([r[key] for r in rows])
  ax.plot(layers, measured, 'o', ms=3, label='measured')
  curves = [measured]
  if normalised:
    for name, style in zip(PREDICTIONS, ('-', '--', ':')):
      values = np.array([np.nan if r['predicted'][name] is None else r['predicted'][name] for r in rows])
      ax.plot(layers, values, style, lw=1.5, label=f'{name}')
      curves.append(values)
  both = np.concatenate(curves)
  both = both[np.isfinite(both) & (both > 0)]
  if both.size and both.max() / both.min() > 10:
    ax.set_yscale('log')
    # Plain '1e-06' tick labels: the default mathtext ones have hit pyparsing's recursion limit.
    ax.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xlabel('layer n')
  ax.set_ylabel('ŝ_n = N·S[f; θ_n] / S_layer' if normalised else 's_n = N·S[f; θ_n]')
  ax.set_title('per-layer sensitivity')
  ax.grid(alpha=0.3, which='both')
  ax.legend()
  if normalised:
    ax = axes[0, 1]
    ax.plot(
      layers,
      [np.nan if r['input_sensitivity'] is None else r['input_sensitivity'] for r in rows],
      '-',
      label='input sensitivity g_n (idealised: 1)',
    )
    for add in ADDS:
      ax.plot(
        layers,
        [r[add]['branch_sensitivity'] for r in rows],
        '--',
        label=f'{add} branch own sensitivity (idealised: 2)',
      )
    ax.set_xlabel('layer n')
    ax.set_title('local factors')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def describe(config, num_draws: int) -> str:
  m = config.model
  inputs = f'seq {config.data.seq_len}' if m.name == 'gpt' else f'patch {m.patch_size}'
  return (
    f'{m.name} {m.block} scheme={m.scheme}, depth {m.depth}, d {m.width}, {m.activation}, {inputs}, '
    f'batch {config.batch_size}, {num_draws} draws'
  )


def run(config, out: str, num_draws: int) -> dict[str, Any]:
  """Measures, writes DIR/sensitivity.json and DIR/sensitivity.png; returns the JSON content."""
  # Before the measurement (which checks the rest), by creating it: removed again if the program fails.
  history_lib.check_not_a_run('--out', out)
  cli.create_output_dir('--out', out)
  per_draw, layout = measure(config, num_draws)
  depth = config.model.depth
  agg = aggregate(per_draw, depth, layout)
  result = {
    'config': json.loads(config.to_json_best_effort()),
    'draws': num_draws,
    'definition': {
      'f': 'trunk output (final hidden state before the head), all tokens, dropout off',
      'perturbation': "(u' - u'')/sqrt(2) from two more initialisations; constant-initialised "
      'parameters get none',
      's': 'N * S[f; theta_n], N = model.depth',
      's_normalised': "s / normaliser.layer (own-parameter sensitivity of a layer's two branches)",
    },
    'summary': summarize(agg, jackknife(per_draw, depth, layout)),
    'layers': layer_rows(agg, depth),
  }
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'sensitivity.json'), 'w') as f:
    json.dump(result, f, indent=1)
  plot(result['layers'], os.path.join(out, 'sensitivity.png'), describe(config, num_draws))
  return result


def format_summary(result) -> str:
  s = result['summary']
  pm = lambda d, stat: f'{d[stat]:.4g} ± {d[stat + "_stderr"]:.2g}'
  lines = [
    f'per-layer sensitivity s_n = N·S[f; θ_n]: mean {pm(s["s"], "mean")}, median {pm(s["s"], "median")} '
    f'(± jackknife standard error over draws)',
    f'Σ_n S[f; θ_n] = {s["total_sensitivity"]["sum_over_layers"]:.4g} '
    f'(one JVP over all layers: {s["total_sensitivity"]["all_layers_at_once"]:.4g})',
  ]
  if 'normaliser' in s:
    norm = s['normaliser']
    lines.append(
      f'normalised ŝ_n = s_n / {norm["layer"]:.3f} (branch own-parameter sensitivity: attention '
      f'{norm["attn"]:.3f}, FFN {norm["ffn"]:.3f}; idealised 2 + 2)'
    )
    lines.append(f'  {"":12s} {"mean":>16s} {"median":>16s}')
    measured = s['s_normalised']
    lines.append(f'  {"measured":12s} {pm(measured, "mean"):>16s} {pm(measured, "median"):>16s}')
    notes = {
      'composition': 'chain rule, measured local factors',
      'local': 'input sensitivity 1',
      'idealised': 'unit variances: the closed forms',
    }
    for name in PREDICTIONS:
      p = s['predicted'][name]
      lines.append(f'  {name:12s} {p["mean"]:16.4g} {p["median"]:16.4g}   ({notes[name]})')
    ratio = s['measured_over_composition']
    lines.append(f'  measured / composition: mean {pm(ratio, "mean")}, median {pm(ratio, "median")}')
  return '\n'.join(lines)


def main(argv):
  del argv
  args = flags.FLAGS
  result = run(args.config, args.out, args.draws)
  print(describe(args.config, args.draws))
  print(format_summary(result))
  print(f'wrote {os.path.join(args.out, "sensitivity.json")} and sensitivity.png')


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
