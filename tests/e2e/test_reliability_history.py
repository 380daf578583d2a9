"""A run never starts again from step 0 by surprise, and never loses the history of an earlier run:
every checkpoint unreadable, logs without a checkpoint, damaged log files, a damaged workdir layout."""

import json
import os
import re
import shutil

import pytest

from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import loop
from tests.e2e.test_reliability import (
  ONE_DEVICE,
  ROOT,
  _config,
  _largest_file,
  _snapshot,
  _truncate,
)


def _train(config, workdir, **kwargs):
  return loop.train_and_evaluate(config, str(workdir), devices=ONE_DEVICE, **kwargs)


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _without_lock(snapshot):
  snapshot.pop('.dsjax.lock', None)
  return snapshot


def _damage_every_checkpoint(workdir):
  for step in os.listdir(workdir / 'checkpoints'):
    if step.isdigit():
      _truncate(_largest_file(workdir / 'checkpoints' / step / 'state'))


def test_every_checkpoint_unreadable_is_an_error_that_changes_nothing(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  _damage_every_checkpoint(workdir)
  before = _without_lock(_snapshot(workdir))
  with pytest.raises(ValueError, match='unreadable') as error:
    _train(_config(total_steps=4, keep_checkpoints=5), workdir)
  message = str(error.value)
  assert '\n' not in message and 'step 4' in message and 'step 2' in message and '--fresh' in message
  assert _without_lock(_snapshot(workdir)) == before  # metrics.jsonl and the checkpoints included.
  assert [r['step'] for r in _rows(workdir / 'metrics.jsonl')] == [1, 2, 3, 4]


def test_fresh_starts_again_and_keeps_the_earlier_history(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  _damage_every_checkpoint(workdir)
  # An earlier run's method preparation (DSLM's measured input, ADMIN's profile) is not reused.
  (workdir / 'scheme_preparation.json').write_text('{"scheme": "dslm", "result": {}}')
  _train(_config(total_steps=4, keep_checkpoints=5), workdir, fresh=True)
  assert [r['step'] for r in _rows(workdir / 'metrics.jsonl')] == [1, 2, 3, 4]
  earlier = workdir / 'earlier_runs'
  (kept,) = os.listdir(earlier)
  assert not (workdir / 'scheme_preparation.json').exists()
  assert (earlier / kept / 'scheme_preparation.json').exists()
  assert [r['step'] for r in _rows(earlier / kept / 'metrics.jsonl')] == [1, 2, 3, 4]
  assert sorted(os.listdir(earlier / kept / 'checkpoints')) == ['2', '4']
  assert sorted(d for d in os.listdir(workdir / 'checkpoints') if d.isdigit()) == ['2', '4']


def test_fresh_with_an_intact_checkpoint_is_an_error(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  before = _without_lock(_snapshot(workdir))
  with pytest.raises(ValueError, match='--fresh') as error:
    _train(_config(total_steps=6, keep_checkpoints=5), workdir, fresh=True)
  assert 'intact checkpoint (step 4)' in str(error.value)
  assert _without_lock(_snapshot(workdir)) == before


def test_logs_without_a_checkpoint_are_an_error_that_changes_nothing(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  shutil.rmtree(workdir / 'checkpoints')  # e.g. killed before its first checkpoint
  before = _without_lock(_snapshot(workdir))
  with pytest.raises(ValueError, match='no checkpoint') as error:
    _train(_config(total_steps=4, keep_checkpoints=5), workdir)
  assert 'metrics.jsonl' in str(error.value) and '--fresh' in str(error.value)
  assert _without_lock(_snapshot(workdir)) == before


@pytest.mark.parametrize(
  'tail', [b'{"step": 5, "train/loss": 2.', b'\0' * 300, b'null\n', b'{"step": 5}\n{"ste']
)
@pytest.mark.parametrize('log', ['metrics.jsonl', 'moments.jsonl'])
def test_a_damaged_log_tail_is_cut_back_to_the_restored_step(tmp_path, four_step_run, caplog, tail, log):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  with open(workdir / log, 'ab') as f:
    f.write(tail)
  _train(_config(total_steps=4, keep_checkpoints=5), workdir)  # Resumed at its end: nothing to train.
  assert [r['step'] for r in _rows(workdir / 'metrics.jsonl')] == [1, 2, 3, 4]
  cut = [r.getMessage() for r in caplog.records if 'cut back' in r.getMessage()]
  assert len(cut) == 1 and str(workdir / log) in cut[0], cut


@pytest.mark.parametrize('damage', [b'{"step": 2, "train/lo\n', b'null\n', b'\0' * 50 + b'\n'])
def test_a_damaged_row_in_the_middle_is_an_error_naming_file_and_line(tmp_path, four_step_run, damage):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  path = workdir / 'metrics.jsonl'
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(lines[0] + damage + b''.join(lines[2:]))
  before = _snapshot(workdir)  # config.json and the lock's owner line included
  with pytest.raises(ValueError, match=f'{path}, line 2: ') as error:
    _train(_config(total_steps=6, keep_checkpoints=5), workdir)
  assert '\n' not in str(error.value)
  assert _snapshot(workdir) == before


@pytest.mark.parametrize(
  'name,kind',
  [
    ('checkpoints', 'file'),
    ('metrics.jsonl', 'directory'),
    ('moments.jsonl', 'directory'),
    ('tensorboard', 'file'),
    ('config.json', 'directory'),
  ],
)
def test_a_workdir_of_the_wrong_layout_is_refused_before_anything_is_written(tmp_path, name, kind):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  if kind == 'file':
    (workdir / name).write_text('not a directory\n')
  else:
    (workdir / name).mkdir()
  before = _snapshot(workdir)
  expected = 'directory' if kind == 'file' else 'file'
  with pytest.raises(ValueError, match=f'{workdir / name} is not a {expected}'):
    _train(_config(total_steps=2, **{'instrument.every': 1}), workdir)
  assert sorted(os.listdir(workdir)) == [name] and _snapshot(workdir) == before


def test_an_unreadable_checkpoint_is_reported_without_object_reprs(tmp_path, four_step_run, caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  _truncate(_largest_file(workdir / 'checkpoints' / '4' / 'state'))
  _train(_config(total_steps=4, keep_checkpoints=5), workdir)
  (warning,) = [r.getMessage() for r in caplog.records if 'is unreadable' in r.getMessage()]
  assert 'Checkpoint step 4 of' in warning and '<bound method' not in warning and ' at 0x' not in warning


def test_the_docs_state_the_one_list_of_what_may_change_on_resume():
  text = open(os.path.join(ROOT, 'docs', 'running.md')).read()
  (resume,) = [p for p in text.split('\n- ') if p.startswith('**Resume.**')]
  stated = set(re.findall(r'`(model\.\w+)`', resume))
  assert stated == set(checkpoint_lib.resumable_model_keys()), stated
  assert all(f'`{key}`' in resume for key in checkpoint_lib.IDENTITY_KEYS)
