"""experiments/member_independent.py: a sweep's member retrained by the independent loop, beside the sweep's.

A real tiny `dsjax.sweep` (two arms, one lr, two seeds, dropout and the linear schedule); each member
retrained by the loop has the sweep's training and report losses to float32 rounding. A config other than
the sweep's base, an arm, lr or seed the sweep lacks is refused before anything is written; the summary's
intervals are the protocol's; a `dsjax.main` run of the member sits beside the sweep's and the loop's.
"""

import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import sweep  # noqa: E402
from dsjax.train import loop, protocol  # noqa: E402
from experiments import member_independent  # noqa: E402
from tests.helpers import REPO_ROOT, subprocess_env, tiny_config  # noqa: E402

LR = 3e-3


def _base():
  c = tiny_config('gpt', dropout=0.1)
  c.optimizer.schedule, c.optimizer.min_lr_ratio = 'linear', 0.01
  c.optimizer.warmup_steps, c.total_steps, c.log_every = 1, 4, 2
  c.eval_every = c.checkpoint_every = 4
  return c


@pytest.fixture(scope='module')
def tiny_sweep(tmp_path_factory):
  out = tmp_path_factory.mktemp('sweep')
  args = types.SimpleNamespace(
    config=_base(),
    out=str(out),
    lrs=f'{LR}',
    seeds='0,1',
    arm=['vanilla:', 'rezero:model.scheme=rezero,model.block=nonorm'],
    baseline='vanilla',
    max_extend=0,
    max_members=0,
    refine_ratio=0.0,
    train_split=None,
    select_split=None,
    report_split=None,
  )
  sweep.run(sweep.check(args))
  return str(out)


@pytest.mark.parametrize('arm', ['vanilla', 'rezero'])
def test_a_member_retrained_by_the_loop_has_the_sweeps_losses(tiny_sweep, arm):
  config, described, record = member_independent.prepare(_base(), tiny_sweep, arm, LR, 1)
  run = member_independent.retrain(config, described, record, tiny_sweep, arm)
  np.testing.assert_allclose(
    [loss for _, loss in run['train_loss']], [loss for _, loss in record['train_loss']], rtol=1e-5
  )
  np.testing.assert_allclose(run['report_loss'], record['report']['eval/loss'], rtol=1e-5)
  assert (run['arm'], run['lr'], run['seed']) == (arm, LR, 1)


@pytest.mark.parametrize(
  'arm,lr,seed,message',
  [
    ('other', LR, 0, "--arm=other: the sweep's arms are vanilla, rezero"),
    ('vanilla', 1e-2, 0, '--arm=vanilla --lr=0.01: the sweep has no such arm or lr'),
    ('vanilla', LR, 5, '--seed=5: not among the seeds'),
  ],
)
def test_a_member_the_sweep_lacks_is_refused(tiny_sweep, arm, lr, seed, message):
  with pytest.raises(ValueError, match='^' + re.escape(message)):
    member_independent.prepare(_base(), tiny_sweep, arm, lr, seed)


def test_another_base_config_is_refused_in_one_line_and_nothing_is_written(tiny_sweep, tmp_path):
  out = tmp_path / 'run.json'
  command = [
    sys.executable,
    'experiments/member_independent.py',
    '--config=experiments/configs/dslm_bert.py:4x64',
    f'--sweep={tiny_sweep}',
    '--arm=vanilla',
    f'--lr={LR}',
    '--seed=0',
    f'--out={out}',
  ]
  env = subprocess_env(JAX_PLATFORMS='cpu')
  result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "--config: not the sweep's base config; the member differs from it in" in result.stderr
  assert 'Traceback' not in result.stderr
  assert not out.exists()


def _run(arm, seed, loop, member):
  return {
    'sweep': 's',
    'arm': arm,
    'lr': 0.01,
    'seed': seed,
    'train_loss': [[50, loop + 1]],
    'report_loss': loop,
    'sweep_member': {'train_loss': [[50, member + 1]], 'report_loss': member},
  }


def test_the_summary_sets_each_run_beside_its_member_and_gives_the_protocols_intervals():
  base = [_run('dslm', s, 2.0 + 0.01 * s, 2.0 + 0.01 * s + 1e-4) for s in range(3)]
  arm = [_run('tfixup', s, 1.9 + 0.02 * s, 1.9 + 0.02 * s) for s in range(3)]
  table = member_independent.summary(base + arm, 'dslm')
  assert '| dslm | 0.01 | 0 | 2.0000 | 2.0001 | -1.0e-04 | 1.0e-04 (1) |' in table
  loop = protocol.welch_interval([r['report_loss'] for r in arm], [r['report_loss'] for r in base])
  assert f'| tfixup | 0.01 | 0, 1, 2 | {member_independent._interval(loop)} |' in table
  with pytest.raises(ValueError, match='different sweeps'):
    member_independent.summary([*base, {**arm[0], 'sweep': 'other'}], 'dslm')
  assert 'Welch' not in member_independent.summary(arm, None)
  with pytest.raises(ValueError, match='--baseline=dslm: needs runs of that arm at one lr, found 0 lrs'):
    member_independent.summary(arm, 'dslm')
  with pytest.raises(ValueError, match='appears in more than one JSON'):
    member_independent.summary([*arm, arm[0]], None)


def test_replicas_set_the_sweep_dsjax_main_and_the_loop_side_by_side(tiny_sweep, tmp_path):
  config, described, record = member_independent.prepare(_base(), tiny_sweep, 'rezero', LR, 0)
  run = member_independent.retrain(config, described, record, tiny_sweep, 'rezero')
  config.log_every, config.data.eval_split = 1, described['splits']['report']
  loop.train_and_evaluate(config, str(tmp_path / 'main'), devices=jax.devices()[:1])
  table = member_independent.replicas([(run, str(tmp_path / 'main'))])
  row = next(line for line in table.splitlines() if line.startswith('| rezero |'))
  sweep_loss, main_loss, loop_loss = (float(x) for x in row.split('|')[4:7])
  np.testing.assert_allclose([main_loss, loop_loss], sweep_loss, atol=1e-4)
  with pytest.raises(ValueError, match='not the member rezero at lr 0.003, seed 1'):
    member_independent.replicas([({**run, 'seed': 1}, str(tmp_path / 'main'))])


def test_another_methods_section_may_differ_but_the_members_own_may_not(tiny_sweep):
  base = _base()
  base.model.rezero.init = 0.5  # read by ReZero only: not the vanilla member's concern
  member_independent.prepare(base, tiny_sweep, 'vanilla', LR, 0)
  with pytest.raises(
    ValueError, match="not the sweep's base config; the member differs from it in model.rezero.init"
  ):
    member_independent.prepare(base, tiny_sweep, 'rezero', LR, 0)
