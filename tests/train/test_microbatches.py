"""Gradient accumulation inside the train step: `microbatches` = M gives the update of the one big batch.

Without dropout a step with M = 4 must match the step with M = 1 — loss, gradient norm and the
parameters after one AdamW update — up to float32 rounding (the sums are taken in another order), with
and without a mask that leaves the microbatches different counts (one of them none): on ViT through the
plain step, on GPT through the instrumented step, whose moments are defined on microbatch 0
(`step.accumulate_microbatches`) and must still arrive exactly once per site. Four compilations of a
tiny model: most of the time here is XLA's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import instrument as instrument_lib
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

BATCH = 8
TOL = dict(rtol=1e-5, atol=1e-5)
# Microbatch m of 4 holds rows m and m + 4: microbatch 0 is all masked, 1 half, 2 and 3 not at all.
MASK = jnp.array([0, 0, 1, 1, 0, 1, 1, 1], jnp.float32)


def _setup(model_name):
  """The step maker (AdamW, no dropout), the initial state and a batch with an all-ones mask (so that
  the masked batch reuses the compiled steps)."""
  config = tiny_config(model_name)
  config.optimizer.warmup_steps = 0
  # AdamW's first update is lr · g / (|g| + eps) per element: with the default eps = 1e-8 it turns the
  # float32 rounding of near-zero gradient elements (~1e-7 absolute for either summation order, and
  # more where the GELU is recomputed in the backward pass) into update differences of order lr; with
  # eps = 1e-5 they stay below 1e-5 (at eps = 1e-6 one ViT element differed by 1.4e-5).
  config.optimizer.eps = 1e-5
  setup = state_lib.make_setup(config, TEXT_INFO if model_name == 'gpt' else IMAGE_INFO)
  state = jax.jit(setup.create_state)()
  keys = jax.random.split(jax.random.key(3), 2)
  if model_name == 'gpt':
    batch = {'tokens': jax.random.randint(keys[0], (BATCH, config.data.seq_len + 1), 0, 256)}
  else:
    batch = {
      'image': jax.random.normal(keys[0], (BATCH, 8, 8, 1)),
      'label': jax.random.randint(keys[1], (BATCH,), 0, 10),
    }
  batch['mask'] = jnp.ones((BATCH,), jnp.float32)
  make = lambda **kw: jax.jit(
    step_lib.make_train_step(
      setup.graphdef,
      setup.tx,
      step_lib.LOSSES[model_name],
      config.seed,
      setup.schedule,
      use_dropout=False,
      **kw,
    )
  )
  return make, state, batch


def _assert_same_update(step_4, step_1, state, batch):
  new_4, metrics_4 = step_4(state, batch)
  new_1, metrics_1 = step_1(state, batch)
  for name in ('train/loss', 'train/grad_norm'):
    np.testing.assert_allclose(metrics_4[name], metrics_1[name], **TOL, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), new_4['params'], new_1['params'])
  return metrics_4


def test_microbatches_give_the_update_of_the_whole_batch():
  make, state, batch = _setup('vit')
  step_4, step_1 = make(microbatches=4), make()
  for mask in (batch['mask'], MASK):
    _assert_same_update(step_4, step_1, state, {**batch, 'mask': mask})


def test_each_microbatch_draws_its_own_dropout_masks():
  key = step_lib.dropout_key_for_step(0, jnp.asarray(5))
  keys = [step_lib.microbatch_dropout_key(key, i) for i in range(4)]
  masks = [np.asarray(jax.random.bernoulli(k, 0.5, (64,))) for k in [key, *keys]]
  assert all(not np.array_equal(a, b) for n, a in enumerate(masks) for b in masks[n + 1 :])
  assert step_lib.microbatch_dropout_key(None, 2) is None  # no dropout, no key


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
@pytest.mark.parametrize('per_site', [True, False])
def test_instrumented_microbatches_measure_microbatch_0_against_the_whole_batch(per_site):
  """M = 4 with the per-site statistics sent to a receiver (a callback per site, or the table in one
  callback per step): the update is the whole batch's; every site's statistics arrive exactly once
  and are those of microbatch 0's rows under the whole batch's loss — the statistics of a step on a
  batch made of four copies of those rows (the duplicates change no forward statistic, and give the
  rows the whole batch's share of the mean)."""
  make, state, batch = _setup('gpt')
  collector = instrument_lib.Collector()
  step_4 = make(microbatches=4, instrument=True, moments_receiver=collector, moments_per_site=per_site)
  step_1 = make(instrument=True)
  metrics = _assert_same_update(step_4, step_1, state, batch)
  collector.add(1, metrics['moments'])  # the weight statistics (of the gradient just compared)
  jax.effects_barrier()
  collector.flush()
  assert collector.num_duplicates == 0

  copies = jax.tree.map(lambda x: jnp.concatenate([x[::4]] * 4), batch)  # rows 0, 4, 0, 4, …
  table = np.asarray(step_1(state, copies)[1]['moments']['activations'])  # (depth + 1, sites, statistics)
  names = instrument_lib.FORWARD_STATS + instrument_lib.GRAD_STATS
  expected = {
    (row - 1, site, stat): table[row, i, j]
    for row in range(table.shape[0])
    for i, site in enumerate(instrument_lib.SITES)
    for j, stat in enumerate(names)
    if (row == 0) == (site == 'embedding')
  }
  records = [r for r in collector.records if r['step'] == 1 and not r['site'].startswith('weight/')]
  delivered = {(r['layer'], r['site'], r['stat']): r['value'] for r in records}
  assert len(delivered) == len(records) and delivered.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_allclose(delivered[key], value, rtol=1e-4, atol=1e-12, err_msg=str(key))
  _assert_same_update(step_4, step_1, state, {**batch, 'mask': MASK})


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
