"""Fixtures shared by the end-to-end tests."""

import pytest

from tests.e2e.test_reliability import _config, _train


@pytest.fixture(scope='module')
def four_step_run(tmp_path_factory):
  """A workdir after 4 training steps of a tiny GPT, a checkpoint at every step (built once per module;
  tests copy it before they change it)."""
  workdir = tmp_path_factory.mktemp('four_steps')
  _train(_config(total_steps=4, keep_checkpoints=5), workdir)
  return workdir
