"""DSLM at initialisation: measured per-layer moments against `dsjax.theory` (the issue's acceptance check).

Measured with `dsjax.moments` (the instrumentation tool: forward + backward on real batches with dropout
active, statistics of every layer's output) through `experiments/dslm_moments.py`, which also holds the
six cases (DSLM Pre-LN / Post-LN × full / simple init, Xavier Pre-LN / Post-LN).

* The slow test is the acceptance run itself: GPT, 192 layers × d 256, dropout 0.1, seq 128.
* The fast test checks the same properties on a 48-layer, d-128 model with sequences of 64 tokens.
  Tolerances: per-layer forward variance within 20% of the theory (the issue's number; measured
  ≤ ~10% at both sizes — the statistics pool B·L·d ≈ 30k correlated values per layer, a few % of
  sampling noise); gradient variance of layer 1 within a factor 2 of the last layer's (the issue's
  number); Xavier Pre-LN forward variance growing linearly, the last layer ≥ 0.7× the theory's growth
  (theory's 48-layer growth ≈ 130×; the 192-layer criterion "≥ 50×" is the slow test's).
"""

import pytest

from experiments import dslm_moments

DSLM_CASES = ['dslm_preln_full', 'dslm_preln_simple', 'dslm_postln_full', 'dslm_postln_simple']


def _check(summary, *, growth_min):
  for name in DSLM_CASES:
    s = summary[name]
    assert s['forward_var_max_err'] <= 0.2, (name, s)
    assert 0.5 <= s['grad_ratio_1_N'] <= 2.0, (name, s)
  xavier = summary['xavier_preln']
  assert xavier['forward_var_max_err'] <= 0.2, xavier
  assert xavier['forward_growth_N_1'] >= growth_min(xavier['predicted_growth_N_1']), xavier


def test_dslm_moments_small(tmp_path):
  summary = dslm_moments.run_cases(
      str(tmp_path), DSLM_CASES + ['xavier_preln'], num_batches=2, depth=48, width=128, num_heads=4,
      seq_len=64, batch_size=4, activation='relu')
  _check(summary, growth_min=lambda predicted: 0.7 * predicted)


@pytest.mark.slow
def test_dslm_moments_192_layers(tmp_path):
  summary = dslm_moments.run_cases(
      str(tmp_path), DSLM_CASES + ['xavier_preln'], num_batches=2, depth=192, width=256, num_heads=4,
      seq_len=128, batch_size=4, activation='relu')
  _check(summary, growth_min=lambda predicted: 50.0)
