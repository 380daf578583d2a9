"""experiments/dnt_independent.py: its summaries read the runs of the independent loop (whose training is
tested in tests/test_independent_loop.py) and of `dsjax.main`."""

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from experiments import dnt_independent  # noqa: E402


def _write_runs(tmp_path, runs: list[dict]) -> list[str]:
  """Each run as a JSON, as the script writes it: their paths."""
  paths = []
  for run in runs:
    paths.append(str(tmp_path / f'{run["study"]}_{run["arm"]}_{run["seed"]}.json'))
    with open(paths[-1], 'w') as f:
      json.dump(run, f)
  return paths


def test_the_summary_sets_the_loops_side_by_side(tmp_path):
  runs = [
    {
      'study': 'bytes',
      'arm': arm,
      'lr': 0.01,
      'seed': seed,
      'train_loss': [[50, base + 1.0], [100, base + 0.5]],
      'report_loss': base + 0.01 * seed,
      'sweep_member': {'train_loss': [[50, base + 1.0], [100, base + 0.5 + 1e-4]], 'report_loss': base},
    }
    for arm, base in (('preln', 2.0), ('dnt', 1.8))
    for seed in range(3)
  ]
  table = dnt_independent.summary(_write_runs(tmp_path, runs))
  assert '| dnt | 0.01 | 2 | 100 of 100 | 1.8200 | 1.8000 | 1.00e-04 (2) |' in table
  assert '| 100 | 2.5000 | 2.5001 | 2.3000 | 2.3001 | -0.2000 | -0.2000 |' in table
  assert 'DNT − Pre-LN at lr 0.01, independent loop: -0.2000' in table
  assert 'DNT − Pre-LN at lr 0.01, dsjax sweep: -0.2000 [-0.2000, -0.2000]' in table
  assert 'Report loss, DNT − Pre-LN: -0.2000 independent loop, -0.2000 dsjax sweep' in table


def test_a_run_cut_short_is_compared_on_its_logged_losses_only(tmp_path):
  """`--steps`: the sweep's member trained on; the logged losses both have are compared, and only the
  sweep's report losses give a contrast. JSONs of two studies are not summarised together."""
  runs = [
    {
      'study': 'stdlib',
      'arm': arm,
      'lr': 0.01,
      'seed': seed,
      'train_loss': [[50, base + 1.0]],
      'steps': 50,
      'total_steps': 1000,
      'report_loss': None,
      'sweep_member': {
        'train_loss': [[50, base + 1.02], [100, base]],
        'report_loss': base - 0.5 + 0.1 * seed,
      },
    }
    for arm, base in (('preln', 3.0), ('dnt', 2.5))
    for seed in range(2)
  ]
  paths = _write_runs(tmp_path, runs)
  table = dnt_independent.summary(paths)
  assert '| preln | 0.01 | 0 | 50 of 1000 | – | 2.5000 | 2.00e-02 (1) |' in table
  assert '| 50 | 4.0000 | 4.0200 | 3.5000 | 3.5200 | -0.5000 | -0.5000 |' in table
  assert 'DNT − Pre-LN at lr 0.01, dsjax sweep: -0.5000' in table
  assert 'independent loop:' not in table  # no report losses of its own
  assert 'Report loss, DNT − Pre-LN' not in table
  with pytest.raises(ValueError, match='different studies'):
    dnt_independent.summary([*paths, *_write_runs(tmp_path, [{**runs[0], 'study': 'bytes'}])])


def _sweep_member_and_run(
  tmp_path, arm: str, lr: float, seeds_and_losses, member_losses=((100, 3.0),), train_loss=lambda step: 3.0
) -> list[str]:
  """The sweep's arm at lr (its logged training losses; report loss per seed) and a dsjax.main workdir per
  seed (training loss per step; its report loss)."""
  arm_dir = tmp_path / 'sweep' / 'arms' / arm
  arm_dir.mkdir(parents=True, exist_ok=True)
  members = [
    {'seed': seed, 'train_loss': [list(m) for m in member_losses], 'report': {'eval/loss': sweep}}
    for seed, sweep, _ in seeds_and_losses
  ]
  (arm_dir / f'lr_{lr:e}.json').write_text(json.dumps({'members': members}))
  workdirs = []
  for seed, _, run in seeds_and_losses:
    workdir = tmp_path / f'{arm}{seed}'
    workdir.mkdir()
    config = {
      'seed': seed,
      'total_steps': 100,
      'model': {'dnt_setting': dnt_independent.SETTINGS[arm]},
      'optimizer': {'lr': lr},
      'data': {'eval_split': 'test'},
    }
    (workdir / 'config.json').write_text(json.dumps(config))
    records = [{'step': s, 'train/loss': train_loss(s)} for s in range(1, 101)]
    records[-1]['eval/loss'] = run
    (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    workdirs.append(str(workdir))
  return workdirs


def test_the_dsjax_summary_sets_float32_runs_beside_the_sweep(tmp_path, monkeypatch):
  """`--summarize_dsjax`: a dsjax.main workdir logged every step, averaged over the sweep member's
  windows; per seed the differences from the member, and over seeds the paired interval."""
  workdirs = _sweep_member_and_run(
    tmp_path,
    'dnt',
    0.09,
    [(seed, 2.5 + 0.1 * seed, 2.5 + 0.1 * seed + shift) for seed, shift in ((0, -0.01), (1, -0.03))],
    member_losses=((50, 4.0), (100, 3.0)),
    train_loss=lambda s: (4.0 if s <= 50 else 3.0) + (0.02 if s % 2 else -0.02),
  )
  study = dnt_independent.STUDIES['stdlib']
  monkeypatch.setitem(
    dnt_independent.STUDIES, 'stdlib', dataclasses.replace(study, sweep=str(tmp_path / 'sweep'))
  )
  table = dnt_independent.dsjax_summary(workdirs)
  config_path = os.path.join(workdirs[-1], 'config.json')
  with open(config_path) as f:
    config = json.load(f)
  with open(config_path, 'w') as f:
    json.dump({**config, 'data': {'eval_split': 'validation'}}, f)
  with pytest.raises(ValueError, match="evaluated on 'validation', not 'test'"):
    dnt_independent.dsjax_summary(workdirs)
  assert study.splits['report'] == 'test'
  assert '| dnt | 0.09 | 0 | +0.0000 (2) |  | 2.4900 | 2.5000 | -0.0100 |' in table
  assert '| dnt | 0.09 | 1 | +0.0000 (2) |  | 2.5700 | 2.6000 | -0.0300 |' in table
  # Paired: mean −0.02, sd 0.0141, t(0.975, 1) = 12.706, half-width 12.706 · 0.0141 / √2 = 0.1271.
  assert (
    'over 2 seeds: -0.0200 ± 0.0141 (sd), 95% interval [-0.1471, +0.1071], range [-0.0300, -0.0100]' in table
  )


def test_the_dsjax_summary_gives_dnt_minus_preln_by_the_runs_and_by_the_sweep(tmp_path, monkeypatch):
  """With both arms at two or more seeds, the gap's Welch interval, by the runs and by the sweep."""
  dnt = _sweep_member_and_run(tmp_path, 'dnt', 0.09, [(0, 2.5, 2.4), (1, 2.6, 2.5)])
  preln = _sweep_member_and_run(tmp_path, 'preln', 0.01, [(0, 3.2, 3.1), (1, 3.4, 3.3)])
  study = dnt_independent.STUDIES['stdlib']
  monkeypatch.setitem(
    dnt_independent.STUDIES, 'stdlib', dataclasses.replace(study, sweep=str(tmp_path / 'sweep'))
  )
  table = dnt_independent.dsjax_summary(dnt + preln)
  # Runs: means 2.45 and 3.2, variances 0.005 and 0.02, se² = 0.0025 + 0.01; df by Welch-Satterthwaite.
  expected = dnt_independent.protocol.welch_interval([2.4, 2.5], [3.1, 3.3])
  assert expected['difference'] == pytest.approx(-0.75)
  assert f'- run: -0.7500 [{expected["low"]:+.4f}, {expected["high"]:+.4f}]' in table
  sweep = dnt_independent.protocol.welch_interval([2.5, 2.6], [3.2, 3.4])
  assert f'- sweep: -0.7500 [{sweep["low"]:+.4f}, {sweep["high"]:+.4f}]' in table
  assert 'DNT at lr 0.09 (seeds 0, 1) − Pre-LN at lr 0.01 (seeds 0, 1)' in table
  assert 'Welch' not in dnt_independent.dsjax_summary(dnt + preln[:1])


def test_step_by_step_finds_where_two_runs_part(tmp_path):
  """`--step_by_step`: two runs of one member logged every step (a loop's JSON, a dsjax.main workdir):
  the first step that differs and the largest difference per span of steps; another member, or a loop
  logged less often, is refused."""
  workdir, other = (
    _sweep_member_and_run(tmp_path / name, 'preln', 0.01, [(0, 3.2, 3.1)], train_loss=loss)[0]
    for name, loss in (('a', lambda s: 3.0), ('b', lambda s: 3.0 + 1e-3 * (s > 90)))
  )
  # Equal for 40 steps, then 1e-6 growing tenfold every 20 steps.
  losses = [[s, 3.0 + (0 if s <= 40 else 1e-6 * 10 ** ((s - 41) // 20))] for s in range(1, 101)]
  run = {'arm': 'preln', 'lr': 0.01, 'seed': 0, 'train_loss': losses, 'study': 'stdlib'}
  path = _write_runs(tmp_path, [run])[0]
  table = dnt_independent.step_by_step(path, workdir, windows=5)
  assert 'the loop − dsjax.main, training loss at each of 100 steps; first step that differs: 41' in table
  assert '| 1–20 | +0.00e+00 | 1 |' in table
  assert '| 41–60 | +1.00e-06 | 41 |' in table
  assert '| 81–100 | +1.00e-04 | 81 |' in table
  both = dnt_independent.step_by_step(other, workdir, windows=10)
  assert 'dsjax.main − dsjax.main' in both and 'first step that differs: 91' in both
  assert '| 91–100 | +1.00e-03 | 91 |' in both
  with pytest.raises(ValueError, match='not the same arm'):
    dnt_independent.step_by_step(_write_runs(tmp_path, [{**run, 'seed': 1, 'study': 'x'}])[0], workdir)
  coarse = {**run, 'train_loss': losses[49::50], 'study': 'y'}
  with pytest.raises(ValueError, match='not every step'):
    dnt_independent.step_by_step(_write_runs(tmp_path, [coarse])[0], workdir)


def test_replicas_set_runs_of_one_member_beside_the_sweeps_seeds(tmp_path, monkeypatch):
  """`--replicas`: runs of one member that differ only in rounding (a loop's JSON, dsjax.main workdirs),
  their spread, and the sweep's member of that seed and its spread over seeds; a run cut short is left
  out."""
  workdirs = [
    _sweep_member_and_run(tmp_path / name, 'preln', 0.01, [(0, 3.2, report)])[0]
    for name, report in (('a', 3.1), ('b', 3.3))
  ]
  study = dnt_independent.STUDIES['stdlib']
  monkeypatch.setitem(
    dnt_independent.STUDIES, 'stdlib', dataclasses.replace(study, sweep=str(tmp_path / 'a' / 'sweep'))
  )
  loop_run = {'arm': 'preln', 'lr': 0.01, 'seed': 0, 'train_loss': [[100, 3.0]], 'report_loss': 3.2}
  cut = {**loop_run, 'seed': 1, 'report_loss': None}
  paths = _write_runs(tmp_path, [{**loop_run, 'study': 'stdlib'}, {**cut, 'study': 'x'}])
  table = dnt_independent.replicas([*workdirs, *paths])
  assert 'preln at lr 0.01, seed 0: report loss of 3 runs' in table
  assert f'| {os.path.normpath(workdirs[1])} | 3.3000 |' in table
  assert 'these runs: 3.2000 ± 0.1000 (sd), range 3.1000–3.3000' in table
  assert 'the sweep: seed 0 3.2000; its 1 seeds 3.2000 ± 0.0000 (sd)' in table
  assert 'seed 1' not in table
