"""experiments/independent_loop.py: the plain reference, `jax.grad` and optax train a member as dsjax does.

A tiny GPT trained by `dsjax.main` and by the loop from the same initial weights, batches and dropout keys:
the logged training losses agree to float32 rounding — DNT's S1 and S5 with AdamW and a cosine, ReZero
(no norm, a learnable residual weight) with dropout and the linear schedule, DNT with mSGDW. The loop's
schedule is dsjax's, update by update; what the loop does not implement is refused in one line.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax.train import loop, optimizers  # noqa: E402
from experiments import independent_loop  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402


def _linear_config(**model):
  c = tiny_config('gpt', **model)
  c.optimizer.schedule, c.optimizer.min_lr_ratio = 'linear', 0.01
  c.optimizer.warmup_steps, c.total_steps, c.log_every = 2, 6, 1
  return c


def _dnt(setting):
  c = tiny_config('gpt', block='dnt', dnt_setting=setting, norm='rmsnorm', activation='gelu')
  c.optimizer.warmup_steps, c.total_steps, c.log_every = 2, 6, 1
  return c


def _rezero_with_dropout():
  c = _linear_config(block='nonorm', dropout=0.1)
  c.model.scheme = 'rezero'
  return c


def _msgdw():
  """DNT's optimizer, no warm-up and a cosine (DNT Table 5), with decay on the weight matrices."""
  c = tiny_config('gpt', block='dnt', dnt_setting='S5', norm='rmsnorm')
  c.optimizer.update(name='msgdw', lr=0.3, momentum=0.9, nesterov=False, weight_decay=0.01, clip_norm=1.0)
  c.optimizer.warmup_steps, c.total_steps, c.log_every = 0, 6, 1
  return c


# DNT's S1 slow (~13 s): its layout against dsjax is in tests/test_plain_reference.py.
@pytest.mark.parametrize(
  'make_config',
  [
    pytest.param(lambda: _dnt('S1'), marks=pytest.mark.slow),
    lambda: _dnt('S5'),
    _rezero_with_dropout,
    _msgdw,
  ],
  ids=['dnt_S1', 'dnt_S5', 'rezero_dropout_linear', 'msgdw'],
)
def test_the_loop_trains_as_dsjax(tmp_path, make_config):
  c = make_config()
  loop.train_and_evaluate(c, str(tmp_path / 'run'), devices=jax.devices()[:1])
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    logged = [r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r]
  ours = independent_loop.train(c, 'validation[50%:]')
  np.testing.assert_allclose([loss for _, loss in ours['train_loss']], logged, rtol=1e-5)
  assert np.isfinite(ours['report_loss'])
  # The first steps of the same run (the schedule still the whole run's), and no report loss.
  first = independent_loop.train(c, 'validation[50%:]', steps=3)
  np.testing.assert_allclose([loss for _, loss in first['train_loss']], logged[:3], rtol=1e-5)
  assert (first['steps'], first['total_steps'], first['report_loss']) == (3, 6, None)


@pytest.mark.parametrize('schedule,warmup', [('linear', 3), ('linear', 0), ('cosine', 3), ('cosine', 0)])
def test_the_schedule_is_dsjaxs_update_by_update(schedule, warmup):
  c = _linear_config()
  c.optimizer.schedule, c.optimizer.warmup_steps, c.total_steps = schedule, warmup, 20
  ours, dsjax_lr = independent_loop.learning_rate(c), optimizers.make_schedule(c.optimizer, c.total_steps)
  steps = np.arange(25)
  np.testing.assert_allclose([float(ours(t)) for t in steps], [float(dsjax_lr(t)) for t in steps], rtol=2e-5)


@pytest.mark.parametrize(
  'change,message',
  [
    (lambda c: c.optimizer.update(name='lion'), "optimizer.name='lion' (adamw or msgdw)"),
    (lambda c: c.optimizer.update(init_lr_ratio=0.1), 'optimizer.init_lr_ratio=0.1'),
    (lambda c: c.update(microbatches=2), 'microbatches=2'),
    (lambda c: c.optimizer.update(name='msgdw', nesterov=True), 'optimizer.nesterov=True'),
    (lambda c: c.model.update(dtype='bfloat16'), "model.dtype='bfloat16'"),
    (lambda c: c.model.update(param_dtype='bfloat16'), "model.param_dtype='bfloat16'"),
  ],
)
def test_an_optimizer_the_loop_lacks_is_refused(change, message):
  c = _linear_config()
  change(c)
  with pytest.raises(ValueError, match='the independent loop does not implement') as e:
    independent_loop.check_supported(c)
  assert message in str(e.value)


def test_per_parameter_learning_rates_are_refused():
  c = _linear_config(block='preln')
  c.model.scheme = 'mup'
  with pytest.raises(ValueError, match='per-parameter lr multipliers'):
    independent_loop.initial_model(c)


@pytest.mark.parametrize('off', [None, 0.0])
def test_no_clip_norm_means_no_clipping_as_in_dsjax(off):
  c = _linear_config()
  c.optimizer.warmup_steps, c.optimizer.clip_norm = 0, off
  params, grads = {'kernel': jnp.ones((2, 2))}, {'kernel': jnp.full((2, 2), 100.0)}
  updates = []
  for clip_norm in (off, 1e9):  # clipping at 0 would zero the gradient, leaving the weight decay only
    c.optimizer.clip_norm = clip_norm
    tx = independent_loop.make_optimizer(c)
    updates.append(np.asarray(tx.update(grads, tx.init(params), params)[0]['kernel']))
  np.testing.assert_allclose(updates[0], updates[1])
