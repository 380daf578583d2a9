"""Every registered method (`model.scheme`) trains, instruments, checkpoints, resumes and is measured.

The tests walk `dsjax.schemes.SCHEMES`, so a new method file is covered without touching this file.
Each method runs on its natural block (the first of `Scheme.blocks`) at a tiny size. A method's own plan,
built model, config checks and training runs are tested in `tests/schemes/test_<method>.py`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from dsjax import data as data_lib
from dsjax import moments, schemes
from dsjax.train import config as config_lib
from dsjax.train import loop
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from tests.schemes.common import registry_config

NAMES = sorted(schemes.SCHEMES)


def test_registry_lists_every_method_with_its_paper():
  assert {'vanilla', 'dslm'} <= set(NAMES)
  for row in schemes.table():
    assert row['paper'] and row['summary'] and row['blocks'], row
  config = config_lib.base_config('gpt')
  for name in NAMES:
    config.model.scheme = name
    config.model.block = schemes.SCHEMES[name].blocks[0]
    # The published defaults are valid (the base config is no training run: its schedule is not checked).
    config_lib.validate_config(config, num_devices=1, training=False)


# Every method on GPT; on ViT the plain and DSLM models by default, every method with `-m slow`.
THREE_STEP_CASES = [
  pytest.param(
    name,
    model_name,
    marks=pytest.mark.slow if (model_name == 'vit' and name not in (schemes.PLAIN, 'dslm')) else (),
  )
  for name in NAMES
  for model_name in ('gpt', 'vit')
]


@pytest.mark.parametrize('name,model_name', THREE_STEP_CASES)
def test_every_method_trains_three_steps(name, model_name):
  """The trainer's own pieces (config checks, the method's preparation step on real batches, the train
  state, the jitted step) for 3 steps, instrumented on GPT (its compilation dominates, so ViT runs the
  plain step); the full loop with evaluation, checkpoints and resume runs for every method in the slow
  test below."""
  instrument = model_name == 'gpt'
  config = registry_config(name, model_name)
  config_lib.validate_config(config, num_devices=1)
  info = data_lib.dataset_info(config.data)
  config_lib.validate_against_data(config, info)
  prepared = state_lib.method_preparation(config, info)
  setup = state_lib.make_setup(config, info, prepared)
  train_step = jax.jit(
    step_lib.make_train_step(
      setup.graphdef,
      setup.tx,
      step_lib.LOSSES[model_name],
      config.seed,
      setup.schedule,
      use_dropout=False,
      instrument=instrument,
    )
  )
  state = jax.jit(setup.create_state)()
  batches = data_lib.make_pipeline(
    config.data,
    global_batch_size=config.batch_size,
    seed=config.seed,
    process_index=0,
    process_count=1,
    train=True,
  )
  losses = []
  for _, batch in zip(range(3), batches):
    state, metrics = train_step(state, jax.device_put(batch))
    losses.append(float(metrics['train/loss']))
    if instrument:
      table = np.asarray(metrics['moments']['activations'])  # (depth + 1, sites, statistics)
      assert table.shape[0] == config.model.depth + 1 and np.isfinite(table).all()
  assert np.isfinite(losses).all() and int(state['step']) == 3


# ~40 s a method. The default run covers the loop (evaluation, checkpoints, resume, moments files) for
# vanilla, DSLM, ADMIN and Catformer in tests/train/test_train.py, test_instrument.py and the method tests.
@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_every_method_resumes_and_is_measured(name, tmp_path):
  """Two GPT runs (the second resumes from the checkpoint of step 2), then the moments CLI's measurement
  of the checkpoint against the theory (or its word that it cannot predict this method)."""
  workdir, out = str(tmp_path / 'run'), str(tmp_path / 'moments')
  config = registry_config(name, 'gpt', total_steps=2)
  config.eval_every = config.checkpoint_every = 2
  loop.train_and_evaluate(config, workdir)
  config.total_steps = 3
  final = loop.train_and_evaluate(config, workdir)  # Resumes from step 2.
  assert np.isfinite(final['eval/loss'])
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    assert [json.loads(line)['step'] for line in f][-1] == 3
  result = moments.run(config, out, num_batches=1, checkpoint=workdir)
  assert len(result['layers']) == config.model.depth
  assert os.path.exists(os.path.join(out, 'moments.png'))
  # Either the theory predicts this method (an error summary) or the output says why not.
  assert result['summary'] or result['settings']['theory'].startswith('not covered')
