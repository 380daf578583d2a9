"""experiments/dslm_stall.py: the per-step table it reads out of a run's moments and metrics."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax.instrument import stats  # noqa: E402
from experiments import dslm_stall  # noqa: E402


def _write_run(workdir, depth):
  with open(workdir / 'moments.jsonl', 'w') as f:
    for step in (1, 50):
      for layer in range(depth):
        for site, stat, value in [
          ('ffn_residual', 'grad_var', 10.0 ** (layer - depth + 1) * step),
          ('ffn_residual', 'corr_seq', layer / depth),
          ('attn_branch', 'var', 0.5),
          ('ffn_branch', 'var', 1.0),
        ]:
          f.write(
            json.dumps({'step': step, 'layer': layer, 'site': site, 'stat': stat, 'value': value}) + '\n'
          )
      f.write(json.dumps({'step': step, 'event': 'raised'}) + '\n')  # a record of another kind
  with open(workdir / 'metrics.jsonl', 'w') as f:
    for step, loss in [(1, 8.0), (48, 7.0)]:
      f.write(json.dumps({'step': step, 'train/loss': loss}) + '\n')


def test_trajectory_reads_ratios_correlations_and_the_nearest_loss(tmp_path):
  _write_run(tmp_path, depth=8)
  rows = dslm_stall.trajectory(dslm_stall.read_moments(tmp_path), dslm_stall.read_losses(tmp_path), 8)
  assert [r['step'] for r in rows] == [1, 50]
  assert rows[1]['layers'] == [0, 1, 4, 7] and rows[1]['loss_step'] == 48 and rows[1]['train_loss'] == 7.0
  np.testing.assert_allclose(rows[1]['grad_var_over_last'], [1e-7, 1e-6, 1e-3, 1.0])
  np.testing.assert_allclose(rows[0]['corr_seq'], [0.0, 0.125, 0.5, 0.875])


@pytest.mark.parametrize('shared', [0.0, 0.6])
def test_explicit_token_correlation_equals_the_instrumentation(shared):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 12, 5)) + shared * 3 * rng.normal(size=(3, 1, 5))  # tokens share a component
  assert dslm_stall.corr_seq_explicit(x) == pytest.approx(float(stats.forward_stats(x)['corr_seq']), abs=1e-5)
