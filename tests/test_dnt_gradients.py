"""experiments/dnt_gradients.py: per-seed statistics become intervals over seeds, each read in the
paper's direction, and the script writes its summary."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from experiments import dnt_gradients  # noqa: E402


def _stats(scale: float, kurtosis: float, rng) -> dict:
  """statistics[when][kind][stat] as seeds × batches, as `measure` returns them: 3 seeds, 2 batches."""

  def values(center):
    return (center * (1 + 0.01 * rng.standard_normal((3, 2)))).tolist()

  one = {
    'grad_abs_p50': values(scale),
    'grad_abs_p99.9': values(20 * scale),
    'grad_kurtosis': values(kurtosis),
    'grad_tail_ratio': values(20.0),
  }
  return {when: {'q': one, 'ffn1': one} for when in dnt_gradients.WHEN}


def test_intervals_over_seeds_read_in_the_papers_direction():
  rng = np.random.default_rng(0)
  comparison = dnt_gradients.compare({'S1': _stats(1e-3, 10.0, rng), 'S5': _stats(5e-4, 30.0, rng)})
  median = comparison['init']['q']['grad_abs_p50']
  # Scale statistics: a difference of log10 means, so DNT's half-size gradients are a ratio of ~0.5.
  assert median['log10'] and median['S1']['n'] == 3
  np.testing.assert_allclose(10 ** median['dnt_minus_preln']['difference'], 0.5, rtol=0.02)
  assert median['verdict'] == 'DNT smaller'
  kurtosis = comparison['trained']['ffn1']['grad_kurtosis']
  np.testing.assert_allclose(kurtosis['dnt_minus_preln']['difference'], 20.0, rtol=0.02)
  assert kurtosis['verdict'] == 'DNT larger'
  assert comparison['init']['q']['grad_tail_ratio']['verdict'] == 'not resolved'
  table = dnt_gradients.table(comparison)
  assert '×0.50 [' in table and table.count('\n') == 2 + 2 * 2 - 1
  assert '- init, median |g|: DNT smaller 2 (of 2 weight types)' in dnt_gradients.tally(comparison)


def test_one_seed_gives_no_interval():
  assert dnt_gradients.verdict(None) == 'no interval'


def test_bad_lrs_are_refused_in_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    dnt_gradients.main([f'--out={tmp_path}/out', '--lrs=S1:0.01'])
  assert e.value.code == 2 and not (tmp_path / 'out').exists()
  assert capsys.readouterr().err.strip().count('\n') == 0


# ~35 s: two 4-layer ViTs, two seeds each, compiled and trained 2 steps.
def test_the_script_writes_its_summary(tmp_path):
  dnt_gradients.main([f'--out={tmp_path}', '--steps=2', '--seeds=0,1', '--batches=1'])
  with open(tmp_path / 'summary.json') as f:
    summary = json.load(f)
  assert summary['seeds'] == [0, 1] and len(summary['statistics']['S5']['trained']['q']['grad_kurtosis']) == 2
  assert summary['comparison']['trained']['q']['grad_abs_p50']['dnt_minus_preln'] is not None
  assert (tmp_path / 'summary.md').exists() and (tmp_path / 'histograms.png').exists()
