"""No tool writes into a directory that holds another run, and every output path is checked (by
creating it) before the work that fills it."""

import json
import os
import shutil

import pytest

from dsjax import export
from dsjax.train import checkpoint as checkpoint_lib
from tests.e2e.test_reliability import (
  _snapshot,
)


def test_export_refuses_another_training_workdir_as_out(tmp_path, four_step_run):
  other = tmp_path / 'other_run'
  shutil.copytree(four_step_run, other)
  before = _snapshot(other)
  with pytest.raises(ValueError, match='--out=') as error:
    export.export(str(four_step_run), str(other))
  assert 'training run' in str(error.value) and '\n' not in str(error.value)
  assert _snapshot(other) == before  # config.json included


def test_export_refuses_the_workdir_of_a_live_run_and_rewrites_its_own_output(tmp_path, four_step_run):
  live = tmp_path / 'live'
  lock = checkpoint_lib.WorkdirLock(str(live))
  lock.record_owner()
  try:
    with pytest.raises(ValueError, match='running dsjax run') as error:
      export.export(str(four_step_run), str(live))
    assert f'pid {os.getpid()}' in str(error.value)
  finally:
    lock.release()
  assert os.listdir(live) == [checkpoint_lib.LOCK_FILE]
  out = tmp_path / 'exported'
  export.export(str(four_step_run), str(out))
  export.export(str(four_step_run), str(out))  # its own earlier output: replaced
  assert sorted(os.listdir(out)) == ['checkpoint', 'config.json', 'export.json']


def test_export_of_a_workdir_whose_config_was_replaced_names_the_config(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  config = json.loads((workdir / 'config.json').read_text())
  config['model']['width'] = 64
  (workdir / 'config.json').write_text(json.dumps(config))
  with pytest.raises(ValueError, match='another architecture') as error:
    export.export(str(workdir), str(tmp_path / 'out'))
  assert 'pass the settings' not in str(error.value)
  assert f'{workdir / "config.json"} is not the config its checkpoints were trained with' in str(error.value)
