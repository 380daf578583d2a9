"""Gradient accumulation inside the train step: `microbatches` = M gives the update of the one big batch.

Without dropout a step with M = 4 must match the step with M = 1 — loss, gradient norm and the
parameters after one AdamW update — up to float32 rounding (the sums are taken in another order), with
and without a mask that leaves the microbatches different counts (one of them none). With the
instrumentation on, the moments are defined on microbatch 0 (`step.accumulate_microbatches`) and still
arrive exactly once per site.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.train import config as config_lib
from dsjax.train import step as step_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

BATCH = 8
TOL = dict(rtol=1e-5, atol=1e-5)
# Microbatch m of 4 holds rows m and m + 4: microbatch 0 is all masked, 1 half, 2 and 3 not at all.
MASK = (0, 0, 1, 1, 0, 1, 1, 1)


@functools.cache
def _setup(model_name):
  """The jitted step maker, the initial state and a batch (with an all-ones mask, so that the masked
  batch reuses the compiled steps)."""
  config = tiny_config(model_name)
  model = schemes.build_model(config, TEXT_INFO if model_name == 'gpt' else IMAGE_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = params.to_pure_dict(), rest.to_pure_dict()
  # AdamW's first update is lr · g / (|g| + eps) per element: with the default eps = 1e-8 it turns the
  # float32 rounding of near-zero gradient elements (~1e-7 absolute for either summation order,
  # measured) into update differences of up to 5e-4; eps = 1e-6 keeps them below 1e-5.
  tx = optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)
  state = {'params': params, 'rest': rest, 'opt_state': tx.init(params), 'step': jnp.zeros((), jnp.int32),
           'nonfinite_steps': jnp.zeros((), jnp.int32)}
  keys = jax.random.split(jax.random.key(3), 2)
  if model_name == 'gpt':
    batch = {'tokens': jax.random.randint(keys[0], (BATCH, config.data.seq_len + 1), 0, 256)}
  else:
    batch = {'image': jax.random.normal(keys[0], (BATCH, 8, 8, 1)),
             'label': jax.random.randint(keys[1], (BATCH,), 0, 10)}
  batch['mask'] = jnp.ones((BATCH,), jnp.float32)

  @functools.cache
  def make(microbatches=1, instrument=False, moments_receiver=None):
    return jax.jit(step_lib.make_train_step(
        graphdef, tx, step_lib.LOSSES[model_name], 0, optax.constant_schedule(1e-3), use_dropout=False,
        instrument=instrument, moments_receiver=moments_receiver, microbatches=microbatches))
  return make, state, batch


def _masked(batch):
  return {**batch, 'mask': jnp.array(MASK, jnp.float32)}


@pytest.mark.parametrize('model_name,masked', [('gpt', False), ('vit', False), ('gpt', True)])
def test_microbatches_give_the_update_of_the_whole_batch(model_name, masked):
  make, state, batch = _setup(model_name)
  batch = _masked(batch) if masked else batch
  new_1, metrics_1 = make()(state, batch)
  new_4, metrics_4 = make(microbatches=4)(state, batch)
  for name in ('train/loss', 'train/grad_norm'):
    np.testing.assert_allclose(metrics_4[name], metrics_1[name], **TOL, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), new_4['params'], new_1['params'])


def test_instrumented_microbatches_measure_microbatch_0_against_the_whole_batch():
  """With M = 4 and the per-site statistics sent to a receiver: the update is still the whole batch's;
  every site's statistics arrive exactly once and are those of microbatch 0's rows — forward
  statistics of their activations, gradient statistics of the whole batch's loss at them, i.e. those of
  a step on the two rows alone (a mean over a quarter of the tokens) with the gradient scaled by 1/4."""
  make, state, batch = _setup('gpt')
  collector = instrument_lib.Collector()
  new_4, micro = make(microbatches=4, instrument=True, moments_receiver=collector.receive)(state, batch)
  new_1, whole = make()(state, batch)
  np.testing.assert_allclose(micro['train/loss'], whole['train/loss'], **TOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), new_4['params'], new_1['params'])
  collector.add(1, micro['moments'])  # the weight statistics (of the gradient just compared)
  jax.effects_barrier()
  collector.flush()
  assert collector.num_duplicates == 0

  _, alone = make(instrument=True)(state, jax.tree.map(lambda x: x[::4], batch))
  table = np.asarray(alone['moments']['activations'])  # (depth + 1, sites, statistics)
  names = instrument_lib.FORWARD_STATS + instrument_lib.GRAD_STATS
  expected = {(layer - 1, site, stat): table[layer, i, j] * (1 / 16 if stat == 'grad_var' else 1)
              for layer in range(table.shape[0]) for i, site in enumerate(instrument_lib.SITES)
              for j, stat in enumerate(names) if (layer == 0) == (site == 'embedding')}
  delivered = {(r['layer'], r['site'], r['stat']): r['value'] for r in collector.records
               if not r['site'].startswith('weight/')}
  assert len(delivered) == len([r for r in collector.records if not r['site'].startswith('weight/')])
  assert delivered.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_allclose(delivered[key], value, rtol=1e-4, atol=1e-12, err_msg=str(key))


def test_microbatches_must_divide_the_per_device_batch():
  config = tiny_config('gpt')
  config.microbatches = 4
  config.mesh.shape = (2, 2, 2)  # 8 rows over data × fsdp = 4: 2 rows per device
  with pytest.raises(ValueError, match=r'^microbatches \(4\) must divide the per-device batch') as err:
    config_lib.validate_config(config, num_devices=8)
  assert '\n' not in str(err.value)
  config.microbatches = 2
  config_lib.validate_config(config, num_devices=8)
  config.microbatches = 0
  with pytest.raises(ValueError, match='microbatches'):
    config_lib.validate_config(config, num_devices=8)
