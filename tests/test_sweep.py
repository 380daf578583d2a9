"""`python -m dsjax.sweep`: the protocol's flow over arms (edge extension, resuming, the outputs) with a
stand-in trainer, and end to end: members equal to `python -m dsjax.main` runs, a killed sweep resumed."""

import json
import math
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

from dsjax import sweep
from dsjax.train import protocol
from tests.helpers import REPO_ROOT, subprocess_env, tiny_config


def _args(out, **overrides):
  args = dict(
    config=tiny_config('gpt'),
    out=str(out),
    lrs='1e-3,3e-3',
    seeds='0,1',
    arm=['a:', 'b:model.depth=3'],
    baseline=None,
    max_extend=2,
    max_members=0,
    refine_ratio=0.0,
    train_split=None,
    select_split=None,
    report_split=None,
  )
  args.update(overrides)
  return types.SimpleNamespace(**args)


class StandInTrainer:
  """population.train with the losses of a known lr curve, lowest at lr 1e-2 (arm 'b' a little higher);
  lr 1 diverges. Records which lrs it was asked for."""

  def __init__(self):
    self.calls = []
    self.seeds = []

  def __call__(self, config, members, *, report_split, **kwargs):
    self.calls.append(sorted({m.lr for m in members}))
    self.seeds.append(sorted({m.seed for m in members}))
    records = []
    for m in members:
      loss = (math.log10(m.lr) + 2) ** 2 + 0.01 * m.seed + 0.1 * (config.model.depth - 2)
      metrics = {'eval/loss': loss if m.lr < 1 else math.nan}
      records.append(
        {
          'lr': m.lr,
          'seed': m.seed,
          'diverged': m.lr >= 1,
          'nonfinite_steps': int(m.lr >= 1),
          'clipped_steps': 0,
          'train_loss': [(config.total_steps, loss)],
          'eval': {config.total_steps: metrics},
          'final': metrics,
          'report': {'eval/loss': loss + 0.5},
        }
      )
    return {'members': records, 'seconds': 0.0}


@pytest.fixture
def trainer(monkeypatch):
  stand_in = StandInTrainer()
  monkeypatch.setattr(sweep.population, 'train', stand_in)
  return stand_in


def test_edge_extension_settles_the_lr_and_the_outputs_say_so(tmp_path, trainer):
  results = sweep.run(sweep.check(_args(tmp_path)))
  # Grid 1e-3, 3e-3: the best is at the top edge twice (3e-3, then 9e-3 of 1e-3, 3e-3, 9e-3); with 2.7e-2
  # it lies inside.
  assert trainer.calls == [[1e-3, 3e-3], [pytest.approx(9e-3)], [pytest.approx(2.7e-2)]] * 2
  for r in results:
    assert r['selected_lr'] == pytest.approx(9e-3) and r['settled']
  b = results[1]
  assert b['report']['eval/loss']['mean'] == pytest.approx((math.log10(9e-3) + 2) ** 2 + 0.005 + 0.6)
  assert b['vs_baseline']['eval/loss']['difference'] == pytest.approx(0.1)
  assert b['changes'] == {'model.depth': 3}
  document = json.loads((tmp_path / 'results.json').read_text())
  member = document['arms'][1]['members'][0]
  assert member['config_diff'] == {
    'data.eval_split': 'validation[:50%]',
    'data.train_split': 'train',
    'model.depth': 3,
    'optimizer.lr': 1e-3,
  }
  summary = (tmp_path / 'summary.md').read_text()
  assert 'selected on `validation[:50%]`' in summary and 'reported on `validation[50%:]`' in summary
  assert '`model.depth=3`' in summary and 'UNSETTLED |' not in summary
  assert (tmp_path / 'lr_curves.png').stat().st_size > 0


def test_an_lr_still_at_the_edge_after_max_extend_is_unsettled(tmp_path, trainer):
  results = sweep.run(sweep.check(_args(tmp_path, max_extend=1, arm=[])))
  assert trainer.calls == [[1e-3, 3e-3], [pytest.approx(9e-3)]]
  assert results[0]['name'] == 'base' and not results[0]['settled']
  assert '| 0.009 UNSETTLED |' in (tmp_path / 'summary.md').read_text()


def test_max_members_trains_the_grid_in_groups_of_whole_lrs(tmp_path, trainer):
  args = _args(tmp_path, lrs='1e-3,3e-3,1e-2,3e-2', max_members=5, arm=[])
  results = sweep.run(sweep.check(args))
  # 2 seeds per lr: groups of 2 lrs (4 members); the best, 1e-2, is inside, so nothing is extended.
  assert trainer.calls == [[1e-3, 3e-3], [1e-2, 3e-2]]
  assert results[0]['selected_lr'] == 1e-2 and results[0]['settled']
  assert sweep.lr_groups([1, 2, 3], num_seeds=2, max_members=0) == [[1, 2, 3]]
  assert sweep.lr_groups([1, 2, 3], num_seeds=2, max_members=3) == [[1], [2], [3]]
  with pytest.raises(ValueError, match=r'--max_members must be 0 or at least the number of seeds \(2'):
    sweep.check(_args(tmp_path / 'other', max_members=1))
  assert not (tmp_path / 'other').exists()


def test_refinement_halves_the_steps_around_the_best_lr_until_they_are_within_the_ratio(tmp_path, trainer):
  args = _args(tmp_path, lrs='1e-3,1e-1', max_extend=0, refine_ratio=1.8, max_members=4, arm=[])
  results = sweep.run(sweep.check(args))
  # The curve's minimum is 1e-2: found between the grid's two lrs, then its ×3.16 steps halved once more,
  # each round's lrs (2 seeds each) together within max_members.
  assert trainer.calls == [[1e-3, 1e-1], [1e-2], [0.00316, 0.0316], [0.00562, 0.0178]]
  assert results[0]['selected_lr'] == 1e-2 and results[0]['settled']
  assert 'within ×1.8 of it' in (tmp_path / 'summary.md').read_text()
  assert json.loads((tmp_path / 'results.json').read_text())['refine_ratio'] == 1.8
  assert sweep.arm_finished(str(tmp_path), 'base', [1e-3, 1e-1], [0, 1], 0, refine_ratio=1.8)
  assert not sweep.arm_finished(str(tmp_path), 'base', [1e-3, 1e-1], [0, 1], 0, refine_ratio=1.5)
  assert not sweep.arm_finished(str(tmp_path), 'base', [1e-3, 1e-1], [0, 1, 2], 0, refine_ratio=1.8)
  trainer.calls.clear()
  sweep.run(sweep.check(args))
  assert trainer.calls == []
  with pytest.raises(ValueError, match=r'--refine_ratio must be 0 \(off\) or at least 1.2, got 1.1'):
    sweep.check(_args(tmp_path / 'other', refine_ratio=1.1))
  assert not (tmp_path / 'other').exists()


def test_a_diverged_lr_is_never_selected(tmp_path, trainer):
  results = sweep.run(sweep.check(_args(tmp_path, lrs='1e-2,1', max_extend=0, arm=[])))
  assert results[0]['selected_lr'] == 1e-2
  assert results[0]['lr_means']['1.000000e+00'] == math.inf


def test_a_rerun_trains_nothing_finished_and_refuses_another_sweep(tmp_path, trainer, caplog):
  sweep.run(sweep.check(_args(tmp_path)))
  files = {p: p.stat().st_mtime_ns for p in (tmp_path / 'arms').rglob('*.json')}
  trainer.calls.clear()
  with caplog.at_level('INFO'):
    sweep.run(sweep.check(_args(tmp_path)))
  assert trainer.calls == []
  assert 'arm a: lr 0.001, 0.003, 0.009, 0.027 finished earlier, skipped' in caplog.text
  assert {p: p.stat().st_mtime_ns for p in (tmp_path / 'arms').rglob('*.json')} == files
  with pytest.raises(ValueError, match='holds another sweep'):
    sweep.run(sweep.check(_args(tmp_path, lrs='1e-3,1e-2')))
  plain = tiny_config('gpt', attention='plain')  # another form of the same math resumes too
  sweep.run(sweep.check(_args(tmp_path, config=plain)))
  assert trainer.calls == []


def test_stop_before_an_arm_keeps_what_finished_and_a_rerun_resumes(tmp_path, trainer):
  assert sweep.run(sweep.check(_args(tmp_path)), stop_before=lambda arm: arm.name == 'b') is None
  assert os.listdir(tmp_path / 'arms') == ['a'] and not (tmp_path / 'results.json').exists()
  trainer.calls.clear()
  results = sweep.run(sweep.check(_args(tmp_path)))
  assert [r['name'] for r in results] == ['a', 'b']
  assert trainer.calls == [[1e-3, 3e-3], [pytest.approx(9e-3)], [pytest.approx(2.7e-2)]]  # b's only


def test_a_rerun_with_more_seeds_adds_them_at_every_lr_the_arms_have(tmp_path, trainer, caplog):
  sweep.run(sweep.check(_args(tmp_path)))
  trainer.calls.clear()
  trainer.seeds.clear()
  with caplog.at_level('INFO'):
    results = sweep.run(sweep.check(_args(tmp_path, seeds='0,1,2')))
  # Only seed 2, at the grid's lrs and at the extensions the first run trained, in one population per arm.
  assert trainer.calls == [[1e-3, 3e-3, pytest.approx(9e-3), pytest.approx(2.7e-2)]] * 2
  assert trainer.seeds == [[2]] * 2
  assert 'arm a: adding seeds 2 at lr 0.001, 0.003, 0.009, 0.027' in caplog.text
  for r in results:
    assert r['report']['eval/loss']['n'] == 3 and r['selected_lr'] == pytest.approx(9e-3)
    assert sorted({m['seed'] for m in r['members']}) == [0, 1, 2]
  record = json.loads((tmp_path / 'arms' / 'a' / 'lr_1.000000e-03.json').read_text())
  assert [m['seed'] for m in record['members']] == [0, 1, 2]
  assert [m['members_trained_together'] for m in record['members']] == [4, 4, 4]  # 4 lrs of seed 2
  assert record['members_trained_together'] == 4  # the lr's first population: 2 lrs × 2 seeds
  assert json.loads((tmp_path / 'sweep.json').read_text())['seeds'] == [0, 1, 2]
  document = json.loads((tmp_path / 'results.json').read_text())
  assert document['seeds'] == [0, 1, 2] and document['earlier_seeds'] == [[0, 1]]
  # A second look at the same comparisons: Pocock's level for 2 looks, not 95%.
  assert document['interval_level'] == pytest.approx(0.9706)
  interval = results[1]['vs_baseline']['eval/loss']
  groups = [r['report']['eval/loss']['values'] for r in (results[1], results[0])]
  at_95 = protocol.welch_interval(*groups)
  assert interval['difference'] == pytest.approx(0.1) and interval['low'] < at_95['low'] < 0.1
  summary = (tmp_path / 'summary.md').read_text()
  assert 'with a 97.06% Welch interval' in summary and "Pocock's level for 2 looks" in summary
  assert '(seeds 0, 1)' in summary
  trainer.calls.clear()
  sweep.run(sweep.check(_args(tmp_path, seeds='0,1,2')))
  sweep.run(sweep.check(_args(tmp_path, seeds='2,1,0')))  # the same seeds in another order
  assert trainer.calls == []
  assert json.loads((tmp_path / 'sweep.json').read_text())['earlier_seeds'] == [[0, 1]]  # no new look
  with pytest.raises(ValueError, match=r'--seeds=0,2 leaves out seeds \[1\] that --out=.* holds'):
    sweep.run(sweep.check(_args(tmp_path, seeds='0,2')))


def test_train_arms_leaves_the_other_arms_as_they_are(tmp_path, trainer):
  sweep.run(sweep.check(_args(tmp_path)))
  trainer.calls.clear()
  trainer.seeds.clear()
  assert sweep.run(sweep.check(_args(tmp_path, seeds='0,1,2')), train_arms={'b'}) is None
  assert trainer.seeds == [[2]]  # b's seed 2 only; a keeps seeds 0, 1
  for arm, seeds in (('a', [0, 1]), ('b', [0, 1, 2])):
    for record in sweep.finished_lrs(str(tmp_path), arm).values():
      assert [m['seed'] for m in record['members']] == seeds
  assert json.loads((tmp_path / 'results.json').read_text())['seeds'] == [0, 1]  # not rewritten
  trainer.calls.clear()
  results = sweep.run(sweep.check(_args(tmp_path, seeds='0,1,2')))
  assert trainer.calls == [[1e-3, 3e-3, pytest.approx(9e-3), pytest.approx(2.7e-2)]]  # a's seed 2
  assert [r['report']['eval/loss']['n'] for r in results] == [3, 3]


def test_at_seeds_keeps_the_lrs_holding_every_seed_with_only_those_members():
  records = {
    1e-3: {'lr': 1e-3, 'members': [{'seed': 0}, {'seed': 1}, {'seed': 2}]},
    1e-2: {'lr': 1e-2, 'members': [{'seed': 0}, {'seed': 1}]},
  }
  assert sweep.at_seeds(records, [0, 1]) == {
    1e-3: {'lr': 1e-3, 'members': [{'seed': 0}, {'seed': 1}]},
    1e-2: {'lr': 1e-2, 'members': [{'seed': 0}, {'seed': 1}]},
  }
  assert list(sweep.at_seeds(records, [0, 2])) == [1e-3]
  assert sweep.missing_seeds(records[1e-2], [0, 1, 2, 3]) == [2, 3]


def test_an_arm_with_an_lr_lacking_added_seeds_is_not_finished(tmp_path, trainer):
  sweep.run(sweep.check(_args(tmp_path)))  # a: 1e-3, 3e-3 and the extensions 9e-3, 2.7e-2, seeds 0, 1
  assert sweep.arm_finished(str(tmp_path), 'a', [1e-3, 3e-3], [0, 1], 2)
  # Seed 2 added at every lr but the extension 2.7e-2 (a run cut off): the arm is not finished at 0-2,
  # even though the lrs holding seed 2 would settle the protocol by themselves.
  for name in os.listdir(tmp_path / 'arms' / 'a'):
    if not name.startswith('lr_2.7'):
      path = tmp_path / 'arms' / 'a' / name
      record = json.loads(path.read_text())
      record['members'].append(dict(record['members'][-1], seed=2))
      path.write_text(json.dumps(record))
  assert not sweep.arm_finished(str(tmp_path), 'a', [1e-3, 3e-3], [0, 1, 2], 2)
  assert sweep.arm_finished(str(tmp_path), 'a', [1e-3, 3e-3], [0, 1], 2)
  trainer.calls.clear()
  trainer.seeds.clear()
  sweep.run(sweep.check(_args(tmp_path, seeds='0,1,2')), train_arms={'a'})
  assert trainer.seeds[0] == [2] and trainer.calls[0] == [pytest.approx(2.7e-2)]  # the lr lacking it


# ------------------------------------------------------------------------------------------------
# End to end: the command itself.
# ------------------------------------------------------------------------------------------------

TINY = [
  '--config=configs/gpt_preln.py',
  '--config.model.depth=2',
  '--config.model.width=32',
  '--config.model.num_heads=2',
  '--config.model.scan_unroll=1',
  '--config.data.seq_len=32',
  '--config.batch_size=8',
  '--config.eval_batch_size=64',
  '--config.total_steps=4',
  '--config.eval_every=2',
  '--config.log_every=2',
  '--config.optimizer.warmup_steps=1',
]


def _env():
  return subprocess_env(JAX_PLATFORMS='cpu')


def _command(tool: str, *args: str) -> list[str]:
  return [sys.executable, '-m', f'dsjax.{tool}', *TINY, *args]


def _members(out) -> dict[tuple[str, float, int], dict]:
  document = json.loads((out / 'results.json').read_text())
  return {(a['name'], m['lr'], m['seed']): m for a in document['arms'] for m in a['members']}


@pytest.mark.slow  # ~2 min on 2 cores: one sweep, then two dsjax.main runs.
def test_members_are_the_runs_of_dsjax_main(tmp_path):
  out = tmp_path / 'sweep'
  arms = ['--arm=pre:', '--arm=post:model.block=postln']
  subprocess.run(
    _command('sweep', '--lrs=1e-3,3e-3', '--seeds=0,1', *arms, '--max_extend=0', f'--out={out}'),
    cwd=REPO_ROOT,
    env=_env(),
    check=True,
    capture_output=True,
  )
  members = _members(out)
  assert len(members) == 8 and len({m['select']['eval/loss'] for m in members.values()}) == 8
  # One member of each arm, lr and seed, on the selection split and on the report split.
  for (arm, lr, seed), split, key in (
    (('pre', 1e-3, 0), 'validation[:50%]', 'select'),
    (('post', 3e-3, 1), 'validation[50%:]', 'report'),
  ):
    workdir = tmp_path / f'{arm}_{lr}_{seed}'
    block = ['--config.model.block=postln'] if arm == 'post' else []
    subprocess.run(
      _command(
        'main',
        *block,
        f'--config.optimizer.lr={lr}',
        f'--config.seed={seed}',
        '--config.data.train_split=train',
        f'--config.data.eval_split={split}',
        f'--workdir={workdir}',
      ),
      cwd=REPO_ROOT,
      env=_env(),
      check=True,
      capture_output=True,
    )
    lines = (workdir / 'metrics.jsonl').read_text().splitlines()
    final = [json.loads(line) for line in lines if 'eval/loss' in line][-1]
    np.testing.assert_allclose(members[arm, lr, seed][key]['eval/loss'], final['eval/loss'], atol=2e-5)
  summary = (out / 'summary.md').read_text()
  assert summary.count(' UNSETTLED |') == 2 and '`model.block=postln`' in summary


@pytest.mark.slow  # ~1 min on 2 cores.
def test_a_killed_sweep_resumes_after_its_finished_arm(tmp_path):
  out = tmp_path / 'sweep'
  command = _command('sweep', '--lrs=1e-3', '--seeds=0', '--arm=a:', '--arm=b:model.depth=3', f'--out={out}')
  proc = subprocess.Popen(command, cwd=REPO_ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
  for line in proc.stderr:  # Killed as soon as arm a is written, while arm b compiles.
    if 'arm a: lr 0.001 finished' in line:
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  arm_a = out / 'arms' / 'a' / 'lr_1.000000e-03.json'
  written = (arm_a.read_bytes(), arm_a.stat().st_mtime_ns)
  assert not (out / 'arms' / 'b').exists() and not (out / 'results.json').exists()

  rerun = subprocess.run(command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr
  assert 'arm a: lr 0.001 finished earlier, skipped' in rerun.stderr
  assert 'arm a: step' not in rerun.stderr and 'arm b: step' in rerun.stderr
  assert (arm_a.read_bytes(), arm_a.stat().st_mtime_ns) == written
  assert set(a for a, _, _ in _members(out)) == {'a', 'b'}


@pytest.mark.slow  # ~1 min on 2 cores: three small sweeps.
def test_seeds_added_later_equal_the_seeds_trained_together(tmp_path):
  def sweep_to(out, seeds):
    args = ('--lrs=1e-3,3e-3', f'--seeds={seeds}', '--max_extend=0', f'--out={out}')
    subprocess.run(_command('sweep', *args), cwd=REPO_ROOT, env=_env(), check=True, capture_output=True)

  sweep_to(tmp_path / 'grown', '0')
  sweep_to(tmp_path / 'grown', '0,1')
  sweep_to(tmp_path / 'together', '0,1')
  grown, together = _members(tmp_path / 'grown'), _members(tmp_path / 'together')
  assert sorted(grown) == sorted(together) and len(grown) == 4
  for key, member in together.items():  # populations of 2 and 4 members: equal up to rounding
    for split in ('select', 'report'):
      np.testing.assert_allclose(grown[key][split]['eval/loss'], member[split]['eval/loss'], atol=2e-5)


def test_the_summary_names_the_seeds_that_would_resolve_an_interval_containing_zero():
  def arm(name, values):
    report = {
      'eval/loss': {
        'n': len(values),
        'mean': np.mean(values),
        'sd': np.std(values, ddof=1),
        'min': min(values),
        'max': max(values),
        'values': values,
      }
    }
    return {
      'name': name,
      'changes': {},
      'lrs': [0.1],
      'lr_means': {'1.000000e-01': 1.0},
      'selected_lr': 0.1,
      'settled': True,
      'report': report,
    }

  results = [arm('a', [1.0, 1.1, 1.2]), arm('b', [1.05, 1.25, 1.15]), arm('c', [2.0, 2.1, 2.2])]
  sweep.compare(results, 'a')
  seeds = protocol.seeds_to_resolve([[1.05, 1.25, 1.15], [1.0, 1.1, 1.2]], [1, -1])
  assert results[1]['vs_baseline']['eval/loss']['seeds_to_resolve'] == seeds
  assert results[2]['vs_baseline']['eval/loss']['seeds_to_resolve'] is None  # excludes zero
  splits = {'train': 'train', 'select': 'validation[:50%]', 'report': 'validation[50%:]'}
  text = sweep.summary('python -m dsjax.sweep …', results, 'a', splits, [0, 1, 2], [0.1], 10)
  assert text.rstrip().endswith(f'that difference is the true one): b eval/loss: {seeds}.')


def test_a_key_added_to_the_config_since_a_sweep_started_resumes_it_at_its_default():
  defaults = {'model': {'depth': 4, 'matmul_cast': 'none'}, 'seed': 0}
  recorded = {'model': {'depth': 16}, 'seed': 0}
  at_default = {'model': {'depth': 16, 'matmul_cast': 'none'}, 'seed': 0}
  changed = {'model': {'depth': 16, 'matmul_cast': 'float8_e4m3fn'}, 'seed': 0}
  assert sweep.with_keys_added_since(recorded, at_default, defaults) == at_default
  assert sweep.with_keys_added_since(recorded, changed, defaults) == recorded
