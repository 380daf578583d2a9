"""Training-loop tests: mesh equivalence, bitwise resume, both optimizers on both models, bad input."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsjax.train import loop
from dsjax.train import sharding as sharding_lib
from dsjax.train.checkpoint import Checkpointer
from tests.helpers import REPO_ROOT, tiny_config


def _train_losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


def _quiet(config):
  config.log_every = 1
  return config


@pytest.mark.slow  # The mesh tests of test_sharding.py cover the step; this one adds the whole loop.
def test_one_device_and_eight_device_mesh_give_the_same_losses(tmp_path):
  assert jax.device_count() == 8, 'conftest sets 8 simulated CPU devices'
  results = {}
  for name, shape, devices in [('one', (1, 1, 1), jax.devices()[:1]), ('eight', (2, 2, 2), jax.devices())]:
    config = _quiet(tiny_config('gpt', dropout=0.1, depth=2, width=32, num_heads=4))
    config.total_steps = 3
    config.mesh.shape = shape
    final = loop.train_and_evaluate(config, str(tmp_path / name), devices=devices)
    results[name] = (_train_losses(tmp_path / name), final)
  (losses_1, final_1), (losses_8, final_8) = results['one'], results['eight']
  assert sorted(losses_1) == [1, 2, 3]
  for step in losses_1:
    np.testing.assert_allclose(losses_8[step], losses_1[step], rtol=2e-5)
  np.testing.assert_allclose(final_8['eval/loss'], final_1['eval/loss'], rtol=2e-5)


@pytest.mark.slow  # tests/e2e/test_reliability.py resumes bit-exactly after SIGTERM, kill -9 and corruption.
def test_resume_after_interruption_is_bitwise_exact(tmp_path):
  config = _quiet(tiny_config('vit', dropout=0.1))
  config.total_steps, config.checkpoint_every, config.keep_checkpoints = 4, 2, 5
  straight = tmp_path / 'straight'
  loop.train_and_evaluate(config, str(straight))
  # Simulate a run killed after step 3: only the step-2 checkpoint survives.
  resumed = tmp_path / 'resumed'
  os.makedirs(resumed / 'checkpoints')
  shutil.copytree(straight / 'checkpoints' / '2', resumed / 'checkpoints' / '2')
  loop.train_and_evaluate(config, str(resumed))

  states = []
  for d in (straight, resumed):
    ckpt = Checkpointer(str(d), keep=5)
    state, data_state = ckpt.restore_step(4)
    states.append((jax.tree.leaves(state), data_state))
    ckpt.close()
  (leaves_a, data_a), (leaves_b, data_b) = states
  assert data_a == data_b
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _train_losses(resumed)[4] == _train_losses(straight)[4]


@pytest.mark.parametrize(
  'model_name,optimizer',
  [
    ('gpt', 'adamw'),
    ('vit', 'msgdw'),
    pytest.param('vit', 'adamw', marks=pytest.mark.slow),
    pytest.param('gpt', 'msgdw', marks=pytest.mark.slow),
  ],
)
def test_both_optimizers_train_both_models(tmp_path, model_name, optimizer):
  config = tiny_config(model_name, block='dnt')
  config.optimizer.name = optimizer
  config.optimizer.lr = 3e-3 if optimizer == 'adamw' else 0.05
  config.batch_size = 32
  config.total_steps, config.eval_every, config.checkpoint_every, config.log_every = 40, 40, 40, 1
  loop.train_and_evaluate(config, str(tmp_path))
  losses = _train_losses(tmp_path)
  first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (38, 39, 40)])
  assert last < 0.9 * first, (first, last)


@pytest.mark.parametrize(
  'override,key',
  [
    (('model', 'width', 30), 'model.width'),
    (('model', 'depth', 0), 'model.depth'),
    (('optimizer', 'lr', -1.0), 'optimizer.lr'),
    (('model', 'block', 'sandwich'), 'model.block'),
    (('optimizer', 'name', 'sgd'), 'optimizer.name'),
    (('data', 'name', 'no_such_dataset'), 'no_such_dataset'),
    (('mesh', 'shape', (3, 1, 1)), 'mesh.shape'),
    (('mesh', 'shape', (1, 1, 8)), 'model.num_heads'),  # 4 heads over 8 tensor shards
  ],
)
def test_bad_config_fails_before_anything_is_written(tmp_path, override, key):
  config = tiny_config('vit')
  section, name, value = override
  config[section][name] = value
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match=key.replace('.', r'\.')) as err:
    loop.train_and_evaluate(config, str(workdir))
  assert '\n' not in str(err.value)
  assert not workdir.exists()


# Slow (18 s): dsjax.main's bad values and mistyped keys run by default in tests/e2e/test_cli_errors.py.
@pytest.mark.slow
def test_cli_rejects_bad_values_and_mistyped_keys_in_one_line(tmp_path):
  root = REPO_ROOT
  base = [sys.executable, '-m', 'dsjax.main', '--config=configs/vit_dnt.py', f'--workdir={tmp_path}/w']
  bad_value = subprocess.run(base + ['--config.model.num_heads=5'], cwd=root, capture_output=True, text=True)
  assert bad_value.returncode == 2
  error_lines = [l for l in bad_value.stderr.splitlines() if l.startswith('dsjax.main: error:')]
  assert len(error_lines) == 1 and 'model.width' in error_lines[0] and 'model.num_heads' in error_lines[0]
  typo = subprocess.run(base + ['--config.model.detph=4'], cwd=root, capture_output=True, text=True)
  assert typo.returncode != 0 and 'detph' in typo.stderr
  assert not os.path.exists(f'{tmp_path}/w')


def test_a_checkpoint_saved_on_a_mesh_restores_onto_one_device(tmp_path):
  """`restore_model` (dsjax.export, dsjax.moments --checkpoint) reads a run saved on 8 devices in a
  process that has one: every array lands on that device."""
  config = _quiet(tiny_config('gpt', depth=2, width=32, num_heads=4))
  config.total_steps, config.checkpoint_every, config.mesh.shape = 2, 2, (2, 2, 2)
  loop.train_and_evaluate(config, str(tmp_path / 'run'), devices=jax.devices())
  restore = f"""
import os
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
os.environ['JAX_PLATFORMS'] = 'cpu'
import jax
from flax import nnx
from dsjax import data
from dsjax.train import checkpoint
from tests.helpers import tiny_config
config = tiny_config('gpt', depth=2, width=32, num_heads=4)
config.total_steps = 2
info = data.dataset_info(config.data)
model = checkpoint.restore_model(config, info, {str(tmp_path / 'run')!r}, '--checkpoint')
leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
assert jax.device_count() == 1 and all(x.devices() == {{jax.devices()[0]}} for x in leaves)
print('restored', sum(x.size for x in leaves))
"""
  root = REPO_ROOT
  result = subprocess.run([sys.executable, '-c', restore], cwd=root, capture_output=True, text=True)
  assert result.returncode == 0 and 'restored' in result.stdout, result.stderr[-2000:]


def test_a_check_failing_after_the_lock_leaves_the_workdir_as_found(tmp_path, monkeypatch):
  """The sharding check runs after the lock is taken, Orbax's checkpoint directory is created and the
  method's preparation (DSLM's input measurement) is computed: when it fails, none of them stays."""
  monkeypatch.delitem(sharding_lib.AXIS_RULES, 'mlp')
  config = tiny_config('gpt', scheme='dslm', depth=4)
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match="logical axis 'mlp' has no rule"):
    loop.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
  os.makedirs(workdir / 'notes')  # A workdir that existed keeps what it had.
  with pytest.raises(ValueError, match="logical axis 'mlp' has no rule"):
    loop.train_and_evaluate(config, str(workdir))
  assert sorted(os.listdir(workdir)) == ['notes']
