"""The GPU experiments' script (experiments/gpu_decisive.py): its sizes, its verdicts, and — at a tiny size on
the CPU — a run that stops within its time budget and resumes where it stopped."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import types

import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import schemes  # noqa: E402
from experiments import gpu_decisive  # noqa: E402
from experiments.gpu_decisive import configs  # noqa: E402  (experiments/configs/gpu_stdlib.py)
from tests.helpers import REPO_ROOT, TEXT_INFO, subprocess_env  # noqa: E402


@pytest.mark.parametrize('plan', gpu_decisive.PLANS, ids=lambda p: p.name)
def test_every_sweep_trains_20_tokens_per_non_embedding_parameter(plan):
  c = configs.get_config(plan.config_arg)
  model = nnx.eval_shape(lambda: schemes.build_model(c, TEXT_INFO, nnx.Rngs(params=0), None))
  non_embedding = gpu_decisive.non_embedding_params(model)
  assert (
    c.model.tie_embeddings
    and non_embedding >= configs.non_embedding_params(c.model.depth, c.model.width) - 1024
  )
  tokens = c.total_steps * c.batch_size * c.data.seq_len
  assert tokens >= configs.TOKENS_PER_PARAM * non_embedding
  # 4,096-token BPE: python_stdlib's train split is ~8.5M tokens (docs/data.md): at most 4 epochs.
  assert tokens <= 4 * 8.4e6


def test_depth_shapes_hold_n_d2_and_the_head_dimension():
  shapes = [configs.get_config(p.config_arg).model for p in gpu_decisive.PLANS if p.name.startswith('depth')]
  assert len({m.depth * m.width**2 for m in shapes}) == 1
  assert {m.width // m.num_heads for m in shapes} == {configs.HEAD_DIM}


def test_claims_name_arms_of_the_plan():
  arms = {p.name: {a.split(':')[0] for a in p.arms} for p in gpu_decisive.PLANS}
  for label, terms, _, _ in gpu_decisive.CLAIMS:
    for _, sweep_name, arm in terms:
      assert arm in arms[sweep_name], label
    assert sum(w for w, _, _ in terms) == 0, label  # a difference: no overall level


@pytest.mark.parametrize(
  'low, high, sign, expected',
  [
    (-0.3, -0.1, -1, 'reproduced'),
    (0.1, 0.3, -1, 'not reproduced'),
    (-0.1, 0.2, -1, 'not resolved'),
    (0.1, 0.3, 1, 'reproduced'),
    (float('nan'), 0.3, 1, 'not resolved'),
  ],
)
def test_verdict_rule(low, high, sign, expected):
  assert gpu_decisive.verdict({'low': low, 'high': high}, sign) == expected


def _run(out, *flags):
  return subprocess.run(
    [sys.executable, 'experiments/gpu_decisive.py', f'--out={out}', *flags],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    env=subprocess_env(),
  )


def test_bad_only_is_one_line_and_writes_nothing(tmp_path):
  out = tmp_path / 'out'
  result = _run(out, '--only=depth_4x128,nope')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
    "gpu_decisive.py: error: --only: ['nope'] are not sweeps (or SWEEP/ARM) of the plan; choose from "
    'depth_4x128 (vanilla_postln/dslm_postln/vanilla_preln/dslm_preln), depth_64x32 '
    '(vanilla_postln/dslm_postln/vanilla_preln/dslm_preln), depth_16x64 '
    '(vanilla_postln/dslm_postln/vanilla_preln/dslm_preln), dnt_adamw (preln/dnt), dnt_msgdw (preln/dnt)'
  ]
  assert not out.exists()
  result = _run(out, '--seeds=0,0')
  assert result.returncode == 2 and not out.exists()
  assert result.stderr.strip().splitlines() == [
    "gpu_decisive.py: error: --seeds must be distinct non-negative integers separated by commas, got '0,0'"
  ]


def test_only_names_sweeps_or_arms_of_a_sweep():
  assert gpu_decisive.parse_only([]) == dict.fromkeys(p.name for p in gpu_decisive.PLANS)
  only = ['depth_64x32/dslm_preln', 'depth_64x32/vanilla_preln', 'dnt_msgdw', 'dnt_msgdw/dnt']
  assert gpu_decisive.parse_only(only) == {'depth_64x32': {'dslm_preln', 'vanilla_preln'}, 'dnt_msgdw': None}
  with pytest.raises(ValueError, match=r"--only: \['depth_64x32/dnt'\] are not sweeps"):
    gpu_decisive.parse_only(['depth_64x32/dnt'])


def test_an_arm_whose_added_seeds_need_an_extension_not_yet_trained_is_judged_at_its_earlier_seeds(tmp_path):
  # Seeds 0, 1 select 3e-3 inside the grid; seed 2 added at every lr moves the best to the edge 1e-2,
  # whose extension (3e-2) has not been trained: at 0-2 the arm is unfinished, at 0-1 it is finished.
  losses = {1e-3: [2.0, 2.0, 2.0], 3e-3: [1.0, 1.0, 9.0], 1e-2: [1.5, 1.5, 0.0]}
  for lr, by_seed in losses.items():
    path = tmp_path / 'arms' / 'a' / f'lr_{lr:.6e}.json'
    path.parent.mkdir(parents=True, exist_ok=True)
    members = [
      {'lr': lr, 'seed': s, 'diverged': False, 'select': {'eval/loss': x}, 'report': {'eval/loss': x}}
      for s, x in enumerate(by_seed)
    ]
    path.write_text(json.dumps({'lr': lr, 'members': members}))
  (tmp_path / 'sweep.json').write_text(json.dumps({'seeds': [0, 1, 2], 'earlier_seeds': [[0, 1]]}))
  checked = types.SimpleNamespace(out=str(tmp_path), lrs=[1e-3, 3e-3, 1e-2], max_extend=2)
  arm = gpu_decisive.arm_at_most_seeds(checked, types.SimpleNamespace(name='a', changes={}))
  assert arm['selected_lr'] == 3e-3 and arm['report']['eval/loss']['n'] == 2 and arm['looks'] == 1


def test_the_flops_left_count_the_seeds_an_arm_lacks(tmp_path):
  def record(lr, seeds):
    path = tmp_path / 'arms' / 'a' / f'lr_{lr:.6e}.json'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({'lr': lr, 'members': [{'seed': s} for s in seeds]}))

  checked = types.SimpleNamespace(out=str(tmp_path), lrs=[1e-3, 1e-2, 1e-1], seeds=[0, 1, 2, 3])
  size = {'tokens_per_member': 10, 'flops_per_token': 100}
  assert gpu_decisive.arm_flops_left(checked, 'a', size) == 12 * 1000  # nothing trained
  record(1e-3, [0, 1, 2])
  record(1e-2, [0, 1, 2, 3])
  record(1.0, [0, 1])  # an extension beyond the grid, trained with the earlier seeds
  assert gpu_decisive.arm_flops_left(checked, 'a', size) == (1 + 0 + 4 + 2) * 1000


def test_the_plan_counts_each_arm_at_the_seeds_it_will_hold(tmp_path, monkeypatch):
  # Arm 'vanilla_postln' trained with seeds 0-2; --seeds=0-5 with --only naming 'dslm_postln' grows only
  # that one: the plan counts 3 seeds for the first and 6 for the second; the Pre-LN arms, not started,
  # are counted at the sweep's seeds (those they will be trained with).
  plan = next(p for p in gpu_decisive.PLANS if p.name == 'depth_16x64')
  path = tmp_path / plan.name / 'arms' / 'vanilla_postln' / 'lr_1.000000e-03.json'
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps({'lr': 1e-3, 'members': [{'seed': s} for s in range(3)]}))
  seeds = list(range(6))
  held = gpu_decisive.seeds_of_arms(str(tmp_path), plan, seeds, {'dslm_postln'})
  assert held['vanilla_postln'] == [0, 1, 2] and held['dslm_postln'] == seeds
  assert gpu_decisive.seeds_of_arms(str(tmp_path), plan, seeds, None)['vanilla_postln'] == seeds
  counts = {'params': 1000, 'non_embedding_params': 600, 'vocab_size': 10}  # no tokenizer needed
  monkeypatch.setattr(gpu_decisive, 'param_counts', lambda config: counts)
  size = gpu_decisive.sizes(plan, configs.get_config(plan.config_arg), 10**7, seeds, held)
  members = len(plan.lrs) * (3 + 6 * (len(plan.arms) - 1))
  assert sum(size['members_per_arm'].values()) == members
  assert size['flops'] == members * size['tokens_per_member'] * size['flops_per_token']
  assert gpu_decisive.members_text(size['members_per_arm']).startswith(f'({len(plan.lrs) * 3} + ')
  assert gpu_decisive.members_text({'a': 15, 'b': 15}) == '2 × 15'


def _small_texts(directory):
  """Small modules of the standard library: a corpus of a few hundred KB that tokenizes in seconds."""
  directory.mkdir()
  stdlib = sysconfig.get_paths()['stdlib']
  for name in sorted(os.listdir(stdlib)):
    path = os.path.join(stdlib, name)
    if name.endswith('.py') and os.path.getsize(path) < 12_000:
      shutil.copy(path, directory)
  return f'--data=text:{directory}/*.py'


def test_the_plan_is_printed_and_written_first(tmp_path):
  out = tmp_path / 'out'
  result = _run(out, '--tiny', '--plan_only', _small_texts(tmp_path / 'texts'))
  assert result.returncode == 0, result.stderr[-2000:]
  plan = json.loads((out / 'plan.json').read_text())
  assert [r['sweep'] for r in plan['sweeps']] == [p.name for p in gpu_decisive.PLANS]
  assert '| depth_64x32 | 6×32 |' in result.stdout  # the tiny shapes
  assert (out / 'tokenizer' / 'tokenizer.json').exists() and not (out / 'depth_4x128').exists()


def test_summarize_trains_nothing(tmp_path):
  out = tmp_path / 'out'
  result = _run(out, '--tiny', '--summarize', _small_texts(tmp_path / 'texts'))
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'nothing trained' in result.stdout
  decisive = json.loads((out / 'decisive.json').read_text())
  assert decisive['arms'] == [] and decisive['unigram_loss']['test'] > 0
  assert not (out / 'depth_4x128').exists()


@pytest.mark.slow  # ~80 s: a tokenizer, two arms of 12 tiny members each, trained in two calls
def test_tiny_run_stops_within_its_budget_and_resumes(tmp_path):
  out = tmp_path / 'out'
  flags = ('--tiny', _small_texts(tmp_path / 'texts'), '--only=dnt_adamw')

  first = _run(out, *flags, '--budget_s=1')  # the first arm (speed unknown) runs, the second would not fit
  assert first.returncode == 0, first.stderr[-2000:]
  assert 'Stopped within the budget' in first.stdout
  assert os.listdir(out / 'dnt_adamw' / 'arms') == ['preln']
  [trained] = json.loads((out / 'dnt_adamw' / 'trained_preln.json').read_text())  # one record per call
  assert trained['device_kind'] and trained['commit'] and trained['tokens_per_s'] > 0
  assert trained['attention'] == 'xla' and trained['dtype'] == 'float32'  # as resolved on the CPU
  assert len(trained['lrs_trained']) == 4
  partial = json.loads((out / 'decisive.json').read_text())  # a sweep cut off: its finished arm is in
  assert [a['arm'] for a in partial['arms']] == ['preln'] and not partial['claims']
  assert set(partial['unigram_loss']) == {'validation', 'test'}
  assert set(partial['arms'][0]['not_below_unigram_by_lr']) == {'0.001', '0.003', '0.01', '0.03'}

  second = _run(out, *flags)
  assert second.returncode == 0, second.stderr[-2000:]
  assert 'All sweeps finished' in second.stdout
  assert 'arm preln: lr 0.001, 0.003, 0.01, 0.03 finished earlier, skipped' in second.stderr
  decisive = json.loads((out / 'decisive.json').read_text())
  assert [c['label'] for c in decisive['claims']] == ['DNT − Pre-LN, AdamW']
  assert {a['arm'] for a in decisive['arms']} == {'preln', 'dnt'}
  assert all(0 <= f <= 1 for a in decisive['arms'] for f in a['clipped_fraction'])
  assert json.loads((out / 'plan.json').read_text())['sweeps'][0]['sweep'] == 'depth_4x128'

  # A seed added to one arm: only that arm trains, only the new seed, and the claim compares 4 with 3.
  third = _run(out, '--tiny', flags[1], '--only=dnt_adamw/dnt', '--seeds=0,1,2,3')
  assert third.returncode == 0, third.stderr[-2000:]
  assert 'arm dnt: adding seeds 3 at lr 0.001, 0.003, 0.01, 0.03' in third.stderr
  assert 'arm preln: unfinished, and not among the arms to train now' in third.stderr
  assert json.loads((out / 'dnt_adamw' / 'trained_dnt.json').read_text())[-1]['seeds_trained'] == [3]
  assert len(json.loads((out / 'dnt_adamw' / 'trained_preln.json').read_text())) == 1
  decisive = json.loads((out / 'decisive.json').read_text())
  [claim] = decisive['claims']
  assert claim['seeds_per_arm'] == {'dnt_adamw/dnt': 4, 'dnt_adamw/preln': 3}
  assert claim['looks'] == 2 and claim['level'] == pytest.approx(0.9706)  # dnt grew from 3 seeds
  summary = (out / 'summary.md').read_text()
  assert '; 2 looks: a 97.06% interval; seeds: 4 in dnt_adamw/dnt, 3 in dnt_adamw/preln)' in summary
  assert json.loads((out / 'dnt_adamw' / 'sweep.json').read_text())['seeds'] == [0, 1, 2, 3]


def test_an_unmeasured_sweep_is_projected_from_a_sweep_of_its_shape():
  shapes = {'a': (4, 128), 'b': (64, 32), 'c': (4, 128), 'd': (16, 64)}
  clock = gpu_decisive.Clock(budget_s=100, device_kind='x', shapes=shapes)
  assert clock.estimate('c', 1e12) is None  # nothing measured yet
  clock.add('a', 4e12)
  clock.add('b', 1e12)
  margin = gpu_decisive.ESTIMATE_MARGIN
  assert clock.estimate('c', 4e12) == pytest.approx(margin * 1.0)  # a's speed: the same shape
  assert clock.estimate('d', 4e12) == pytest.approx(margin * 4.0)  # no sweep of its shape: the slowest
  assert clock.estimate('b', 4e12) == pytest.approx(margin * 4.0)  # its own
