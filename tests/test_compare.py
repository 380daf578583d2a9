"""experiments/compare.py: contrasts across sweeps, and over the members the independent loop retrained.

Fake sweep folders (results.json, sweep.json) and member JSONs: a contrast is the protocol's interval over
the arms' report values; `--loop` takes the loop's report losses per arm; sweeps and loops reported on
different splits, an arm retrained at two lrs or members of two sweeps are refused.
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax.train import protocol  # noqa: E402
from experiments import compare  # noqa: E402

SPLITS = {'train': 'train', 'select': 'validation[:50%]', 'report': 'validation[50%:]'}


def _sweep(tmp_path, name, values, splits=SPLITS):
  folder = tmp_path / name
  folder.mkdir()
  arms = [{'name': arm, 'settled': True, 'report': {'eval/loss': {'values': v}}} for arm, v in values.items()]
  (folder / 'results.json').write_text(json.dumps({'splits': splits, 'arms': arms}))
  (folder / 'sweep.json').write_text(json.dumps({'splits': splits}))
  return str(folder)


def _loop(tmp_path, sweep, runs, name='loop'):
  folder = tmp_path / name
  folder.mkdir(exist_ok=True)
  for i, (arm, lr, loss) in enumerate(runs):
    run = {'sweep': sweep, 'arm': arm, 'lr': lr, 'seed': i, 'report_loss': loss}
    (folder / f'{arm}_{i}.json').write_text(json.dumps(run))
  return str(folder)


def test_a_contrast_over_sweeps_and_a_loop_is_the_protocols_interval(tmp_path):
  a = _sweep(tmp_path, 'a', {'x': [1.0, 1.1, 1.2], 'y': [2.0, 2.2, 2.1]})
  loop = _loop(tmp_path, a, [('x', 0.1, 1.05), ('x', 0.1, 1.15), ('y', 0.1, 2.0), ('y', 0.1, 2.3)])
  results = compare.gather([f'a={a}'], [f'l={loop}'])
  row = compare.contrast_row(results, 'y − x: a/y - a/x', 'eval/loss')
  want = protocol.contrast_interval([[2.0, 2.2, 2.1], [1.0, 1.1, 1.2]], [1, -1])
  assert f'{want["difference"]:+.4f} | [{want["low"]:+.4f}, {want["high"]:+.4f}]' in row
  assert row.endswith('| – |')  # the interval excludes zero: nothing to resolve
  row = compare.contrast_row(results, 'loop: l/y - l/x', 'eval/loss')
  want = protocol.contrast_interval([[2.0, 2.3], [1.05, 1.15]], [1, -1])
  assert f'{want["difference"]:+.4f} | [{want["low"]:+.4f}, {want["high"]:+.4f}]' in row


def test_a_contrast_containing_zero_names_the_seeds_that_would_resolve_it(tmp_path):
  groups = {'x': [1.0, 1.1, 1.2], 'y': [1.05, 1.25, 1.15]}
  results = compare.gather([f'a={_sweep(tmp_path, "a", groups)}'], [])
  row = compare.contrast_row(results, 'y − x: a/y - a/x', 'eval/loss')
  assert row.endswith(f'| {protocol.seeds_to_resolve([groups["y"], groups["x"]], [1, -1])} |')


def test_a_sweep_grown_after_a_look_is_judged_at_pococks_level(tmp_path):
  groups = {'x': [1.0, 1.1, 1.2, 1.05], 'y': [1.2, 1.35, 1.25, 1.3]}
  a = _sweep(tmp_path, 'a', groups)
  document = json.loads((tmp_path / 'a' / 'results.json').read_text())
  (tmp_path / 'a' / 'results.json').write_text(json.dumps(dict(document, earlier_seeds=[[0, 1]])))
  row = compare.contrast_row(compare.gather([f'a={a}'], []), 'y − x: a/y - a/x', 'eval/loss')
  want = protocol.contrast_interval([groups['y'], groups['x']], [1, -1], level=protocol.interval_level(2))
  assert f'[{want["low"]:+.4f}, {want["high"]:+.4f}]' in row and '(2 looks: a 97.06% interval)' in row
  # An earlier look in another folder, counted by hand (--looks).
  row = compare.contrast_row(compare.gather([f'a={a}'], []), 'y − x: a/y - a/x', 'eval/loss', 3)
  assert '(3 looks: a 97.79% interval)' in row


def test_only_seeds_takes_those_seeds_at_the_lr_selected_with_all_and_is_a_first_look():
  def member(lr, seed, loss):
    return {'lr': lr, 'seed': seed, 'report': {'eval/loss': loss}}

  members = [member(0.1, s, 1.0 + s / 10) for s in range(4)] + [member(0.3, s, 5.0) for s in range(4)]
  arm = {'name': 'x', 'selected_lr': 0.1, 'settled': True, 'members': members, 'report': {'eval/loss': {}}}
  results = {'a': {'splits': SPLITS, 'arms': [arm], 'earlier_seeds': [[0, 1]]}}
  restricted = compare.only_seeds(results, [2, 3])
  assert restricted['a']['arms'][0]['report']['eval/loss'] == protocol.spread([1.2, 1.3])
  assert restricted['a']['earlier_seeds'] == [] and results['a']['earlier_seeds'] == [[0, 1]]
  with pytest.raises(ValueError, match=r'--seeds: arm a/x lacks some of seeds \[3, 4\]'):
    compare.only_seeds(results, [3, 4])


def test_at_lr_takes_every_arm_at_that_lr_and_below_counts_with_fishers_p():
  def member(lr, seed, loss):
    return {'lr': lr, 'seed': seed, 'report': {'eval/loss': loss}}

  def sweep_arm(name, selected, losses_at):
    members = [member(lr, s, x) for lr, xs in losses_at.items() for s, x in enumerate(xs)]
    return {
      'name': name,
      'selected_lr': selected,
      'settled': False,
      'members': members,
      'report': {'eval/loss': {}},
    }

  x = sweep_arm('x', 0.1, {0.1: [2.9, 2.95, 3.1, 2.8], 0.3: [3.2, 3.2, 3.2, 3.2]})
  y = sweep_arm('y', 0.3, {0.1: [3.2, 3.2, 3.1, 3.0], 0.3: [3.2, 2.9, 3.2, 3.2]})
  results = {'a': {'splits': SPLITS, 'arms': [x, y]}}
  moved = compare.at_lr(results, 0.1 * (1 + 1e-9))
  assert [a['report']['eval/loss'] for a in moved['a']['arms']] == [
    protocol.spread([2.9, 2.95, 3.1, 2.8]),
    protocol.spread([3.2, 3.2, 3.1, 3.0]),
  ]
  assert all(a['selected_lr'] == 0.1 and a['settled'] for a in moved['a']['arms'])
  # Three of x's four seeds end below 3.0 against none of y's: all three below-seeds in x's four of eight,
  # p = C(3,3)·C(5,1)/C(8,4) = 5/70; the difference of fractions 3/4 − 0/4 with protocol's Newcombe interval.
  row = compare.below_row(moved, 'x − y: a/x - a/y', 'eval/loss', 3.0)
  ci = protocol.fraction_difference_interval(3, 4, 0, 4)
  assert row == f'| x − y | 3 of 4 | 0 of 4 | +0.750 [{ci["low"]:+.3f}, {ci["high"]:+.3f}] | {5 / 70:.3g} |'
  # Seeds added after an earlier look widen it to Pocock's level, named in the row, as --looks=2 does.
  wide = protocol.fraction_difference_interval(3, 4, 0, 4, protocol.interval_level(2))
  grown = dict(moved, a=dict(moved['a'], earlier_seeds=[[0, 1]]))
  for row in (
    compare.below_row(grown, 'x − y: a/x - a/y', 'eval/loss', 3.0),
    compare.below_row(moved, 'x − y: a/x - a/y', 'eval/loss', 3.0, looks_at_least=2),
  ):
    assert f'[{wide["low"]:+.3f}, {wide["high"]:+.3f}] (2 looks: a 97.06% interval)' in row
  assert '(two arms, +A − B, only)' in compare.below_row(moved, 'x: a/x', 'eval/loss', 3.0)
  with pytest.raises(ValueError, match=r'--lr=0.5: arm a/x has not trained it'):
    compare.at_lr(results, 0.5)


def test_different_splits_two_lrs_and_two_sweeps_are_refused(tmp_path):
  a = _sweep(tmp_path, 'a', {'x': [1.0, 1.1]})
  b = _sweep(tmp_path, 'b', {'x': [1.0, 1.1]}, splits={**SPLITS, 'report': 'test'})
  with pytest.raises(ValueError, match='reported on different splits'):
    compare.gather([f'a={a}'], [f'l={_loop(tmp_path, b, [("x", 0.1, 1.0)], "on_b")}'])
  with pytest.raises(ValueError, match='arm x was retrained at more than one lr'):
    compare.load_loop(f'l={_loop(tmp_path, a, [("x", 0.1, 1.0), ("x", 0.3, 1.0)], "two_lrs")}')
  with pytest.raises(ValueError, match='the members come from different sweeps'):
    compare.load_loop(f'l={_loop(tmp_path, a, [("y", 0.1, 1.0)], "on_b")}')
  with pytest.raises(ValueError, match="the name 'a' is taken"):
    compare.gather([f'a={a}'], [f'a={tmp_path / "two_lrs"}'])
