r"""The composition rule's one premise, checked layer by layer with plain forward-mode derivatives.

  python experiments/sensitivity_chain_rule.py --config=configs/gpt_preln.py --out=DIR \
      [--draws=4] [--layers=1,32,64,96,124] [--config.model.depth=128 --config.model.block=postln ...]

`dsjax.sensitivity`'s composition prediction (Davis et al. 2021, Catformer, Prop. 6) amplifies layer n's
perturbation through each layer m > n by one energy gain per layer and draw, g_m, measured for the
perturbation that actually arrives there: the sum of every earlier layer's perturbation, carried along.
That is exact only if a perturbation from layer n alone is amplified like that sum. This script measures
both on the same draws (the same keys, parameters, perturbations and batches as `dsjax.sensitivity`):

  own       Π_{m>n} g_m^(n): layer n's own perturbation pushed through every later block alone, with
            `jax.jvp` of the model's Block with respect to its input (no custom rules), one block at a
            time, g = (‖dy‖²/‖y‖²) / (‖dx‖²/‖x‖²);
  carried   Π_{m>n} g_m: the composition's gains (`Measurement.draw`'s 'dy_in', 'y', 'dx', 'x');
  exact     own × ℓ_n × g_f^(n) (the trunk's tail applied to the pushed perturbation) against the
            measured ‖J_{θ_n} f·ũ_n‖² of the draw: the same quantity by two routes, so their ratio is 1
            up to float32 rounding and checks the layer-by-layer push itself.

Writes DIR/chain_rule.json (per draw and layer) and prints, per layer, the ratio own / carried over the
draws. Cost on a 2-core CPU at depth 128, width 32: 28 s for two draws, compilation included.
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

from dsjax import models, sensitivity
from dsjax.models import layers as model_layers
from dsjax.train import cli
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib


def _define_flags():
  # Only when run as a program: importing this module (its test) defines no absl flags.
  config_flags.DEFINE_config_file('config', None, 'Path to a config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('out', None, 'Output directory for chain_rule.json.')
  flags.DEFINE_integer(
    'draws', 4, 'Draws, the first ones of dsjax.sensitivity with the same config.', lower_bound=1
  )
  flags.DEFINE_list(
    'layers', None, 'Layers n whose own perturbation is pushed (default: 5 spread over depth).'
  )
  flags.mark_flags_as_required(['config', 'out'])


def _sum_sq(x) -> float:
  return float(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _relative_gain(dy, y, dx, x) -> float:
  return (_sum_sq(dy) / _sum_sq(y)) / (_sum_sq(dx) / _sum_sq(x))


class BlockByBlock:
  """A measurement's model as a Python loop over its Blocks, and the trunk's tail, each compiled once and
  applied to a draw's parameters."""

  def __init__(self, measurement: sensitivity.Measurement):
    self.graphdef, self.rest, self.depth = measurement.graphdef, measurement.rest, measurement.depth
    stack = measurement.model.trunk.stack.layers
    self.block_graphdef, _, self.block_rest = nnx.split(stack, nnx.Param, ...)
    self._apply = jax.jit(self._apply_block)
    self._own = jax.jit(lambda p, d, x, n: jax.jvp(lambda q: self._apply_block(q, x, n), (p,), (d,))[1])
    self._push = jax.jit(lambda p, x, dx, n: jax.jvp(lambda z: self._apply_block(p, z, n), (x,), (dx,)))
    self._tail = jax.jit(lambda params, x, dx: jax.jvp(lambda z: self._tail_fn(params, z), (x,), (dx,)))

  def _apply_block(self, block_params, x, n):
    block = nnx.merge(self.block_graphdef, block_params, _layer(self.block_rest, n))
    return block(x, None, layer=n)

  def _tail_fn(self, params, x):
    trunk = nnx.merge(self.graphdef, params, self.rest).trunk  # Its last line: final norm, output scale.
    return model_layers.apply_norm(trunk.final_norm, x) * trunk.output_scale[...]

  def inputs_of_every_layer(self, params, x0):
    block_params, xs = sensitivity.layer_params(params), [x0]
    for n in range(self.depth):
      xs.append(self._apply(_layer(block_params, n), xs[-1], n))
    return xs

  def push_own(self, params, direction, xs, n: int):
    """Layer n's own perturbation pushed alone through the later blocks: its energy relative to the layer
    output, its per-layer gains, and the trunk output's tangent."""
    block_params = sensitivity.layer_params(params)
    dx = self._own(_layer(block_params, n), _layer(sensitivity.layer_params(direction), n), xs[n], n)
    own_energy = _sum_sq(dx) / _sum_sq(xs[n + 1])
    gains = []
    for m in range(n + 1, self.depth):
      y, dy = self._push(_layer(block_params, m), xs[m], dx, m)
      gains.append(_relative_gain(dy, y, dx, xs[m]))
      dx = dy
    _, df = self._tail(params, xs[-1], dx)
    return own_energy, np.asarray(gains), df


def _layer(tree, n):
  return jax.tree.map(lambda a: a[n], tree)


def measure_draw(measurement, chain: BlockByBlock, key, inputs, layers) -> list[dict]:
  """Per layer n in `layers`, on draw `key`: own and carried gain products and the check of the push."""
  params, direction = measurement.parameters_and_direction(key)
  sums = jax.device_get(measurement.draw(key, inputs))
  xs = chain.inputs_of_every_layer(params, measurement.stack_input(params, inputs))
  carried_above = sensitivity.gain_above({k: np.asarray(v, np.float64) for k, v in sums.items()})
  f2 = float(sums['f'])
  rows = []
  for n in layers:
    own_energy, gains, df = chain.push_own(params, direction, xs, n)
    own, carried = float(np.prod(gains)), float(carried_above[n])
    rows.append(
      {
        'layer': n,
        'own_gain_product': own,
        'carried_gain_product': carried,
        'own_over_carried': own / carried,
        'own_energy': own_energy,
        'pushed_over_measured': (_sum_sq(df) / f2) / (float(sums['layer'][n]) / f2),
      }
    )
  return rows


def main(argv):
  del argv
  args = flags.FLAGS
  config = sensitivity.with_xla_attention(args.config)
  data_info = config_lib.validate_single_device_run(config, training=False)
  depth = config.model.depth
  layers = (
    [int(n) for n in args.layers]
    if args.layers
    else sorted({1, depth // 4, depth // 2, 3 * depth // 4, depth - 4})
  )
  if not all(0 <= n < depth - 1 for n in layers):
    raise ValueError(f'--layers must lie in [0, {depth - 2}] (a later layer must exist), got {layers}')
  os.makedirs(args.out, exist_ok=True)
  measurement = sensitivity.Measurement(config, data_info, state_lib.method_preparation(config, data_info))
  chain = BlockByBlock(measurement)
  base = jax.random.key(config.seed)
  draws = []
  for i, batch in enumerate(itertools.islice(state_lib.whole_train_batches(config), args.draws)):
    inputs = models.model_inputs(config.model.name, batch)
    draws.append(measure_draw(measurement, chain, jax.random.fold_in(base, i), inputs, layers))
    print(
      f'draw {i}: own / carried '
      + ', '.join(f'n={r["layer"]}: {r["own_over_carried"]:.3g}' for r in draws[-1])
    )
  ratio = np.array([[r['own_over_carried'] for r in d] for d in draws])
  check = np.array([[r['pushed_over_measured'] for r in d] for d in draws])
  summary = {
    'own_over_carried_min': float(ratio.min()),
    'own_over_carried_max': float(ratio.max()),
    'own_over_carried_geomean': float(np.exp(np.mean(np.log(ratio)))),
    'own_over_carried_log10_sd': float(np.std(np.log10(ratio))),
    'pushed_over_measured_max_abs_err': float(np.max(np.abs(check - 1))),
  }
  print(sensitivity.describe(config, args.draws))
  print(
    f'own / carried gain product over {len(draws)} draws × layers {layers}: '
    f'min {summary["own_over_carried_min"]:.3g}, max {summary["own_over_carried_max"]:.3g}, '
    f'geometric mean {summary["own_over_carried_geomean"]:.3g}, '
    f'sd of log10 {summary["own_over_carried_log10_sd"]:.2g}; '
    f'pushed / measured: max |error| {summary["pushed_over_measured_max_abs_err"]:.2g}'
  )
  with open(os.path.join(args.out, 'chain_rule.json'), 'w') as f:
    json.dump(
      {
        'config': json.loads(config.to_json_best_effort()),
        'layers': layers,
        'summary': summary,
        'draws': draws,
      },
      f,
      indent=1,
    )


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
