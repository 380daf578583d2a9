"""DSLM at initialisation: measured per-layer moments against `dsjax.theory`.

Measured with `dsjax.moments` (the instrumentation tool: forward + backward on real batches with dropout
active, statistics of every layer's output) through `experiments/dslm_moments.py`, which also holds the
six cases (DSLM Pre-LN / Post-LN × full / simple init, Xavier Pre-LN / Post-LN).

* `test_dslm_moments_192_layers` is the full-size run: GPT, 192 layers × d 256, dropout 0.1, seq 128.
* `test_dslm_moments_small` checks the same properties on a 48-layer, d-128 model with sequences of 64
  tokens (both are slow tests):
  per-layer forward variance within 20% of the theory (measured max 15% at this size, 10% at 192 ×
  256: the largest errors sit where the stream's correlation is high, and the statistics of one layer
  pool only B·L·d ≈ 33k correlated values), gradient variance of layer 1 within a factor 2 of the last
  layer's (measured 0.6–1.5; the simple Pre-LN init sits at ≈ 0.6 by design — its stream variance
  falls from 1 to ≈ 0.65, Kedia et al. 2024, arXiv:2403.09635, Appendix E.5 — so this is systematic,
  not noise; the run is seeded and deterministic) — except the full Post-LN init, whose gradient really
  grows toward the input: over ten seeds its ratio is 2.42 ± 1.42 (0.79–5.04) from 2 batches, 2.22 ±
  0.75 (1.19–3.59) from 8 and 2.12 ± 0.65 (1.27–3.27) from 16, about 1.5× the theory's 1.4, and the same
  on jax 0.10.2 and 0.11.2 (experiments/dslm_results.md, section 1). One batch's ratio is heavy-tailed
  (0.6–5.8 within one seed); beyond ~8 batches the spread is that of the models and data themselves.
  So this case averages 8 batches (the others 2; each batch costs ~3 s of CPU here) and is bounded by
  4.5, the ten seeds' mean + 3 standard deviations at 8 batches (seed 0, this test, measures 2.89).
  Xavier Pre-LN: the forward variance of the last layer over the first ≥ 0.7× the theory's ratio
  (measured 102 vs 112 at 48 layers); the absolute "≥ 50× at 192 layers" and the 20% per-layer error of
  the Xavier model (19.5% at layer 3 of the 48-layer model: the Xavier embedding has variance 2/(V+d),
  so the first layers are far from the theory's large-input regime) are checked by the slow test only.
"""

import pytest

from experiments import dslm_moments

DSLM_CASES = ['dslm_preln_full', 'dslm_preln_simple', 'dslm_postln_full', 'dslm_postln_simple']


# Gradient variance at layer 1 over layer N: within a factor 2, but for the full Post-LN init (above).
GRAD_RATIO_BOUNDS = {'dslm_postln_full': (0.5, 4.5)}
# Batches averaged per case: 2, but 8 for the full Post-LN init, whose per-batch ratio is heavy-tailed.
NUM_BATCHES = {'dslm_postln_full': 8}


def _run_cases(out, names, **shape):
  summary = {}
  for name in names:
    summary.update(dslm_moments.run_cases(out, [name], num_batches=NUM_BATCHES.get(name, 2), **shape))
  return summary


def _check_dslm(summary):
  for name in DSLM_CASES:
    s = summary[name]
    assert s['forward_var_max_err'] <= 0.2, (name, s)
    low, high = GRAD_RATIO_BOUNDS.get(name, (0.5, 2.0))
    assert low <= s['grad_ratio_1_N'] <= high, (name, s['grad_ratio_1_N'], s['predicted_grad_ratio_1_N'])


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_dslm_moments_small(tmp_path):
  summary = _run_cases(
    str(tmp_path),
    DSLM_CASES + ['xavier_preln'],
    depth=48,
    width=128,
    num_heads=4,
    seq_len=64,
    batch_size=4,
    activation='relu',
  )
  _check_dslm(summary)
  xavier = summary['xavier_preln']
  assert xavier['forward_growth_N_1'] >= 0.7 * xavier['predicted_growth_N_1'], xavier


@pytest.mark.slow
def test_dslm_moments_192_layers(tmp_path):
  summary = _run_cases(
    str(tmp_path),
    DSLM_CASES + ['xavier_preln'],
    depth=192,
    width=256,
    num_heads=4,
    seq_len=128,
    batch_size=4,
    activation='relu',
  )
  _check_dslm(summary)
  # Median errors: forward ≤ 10%, gradient ≤ 15% (simple init, the default).
  for name in DSLM_CASES:
    assert summary[name]['forward_var_median_err'] <= 0.1, (name, summary[name])
  for name in ('dslm_preln_simple', 'dslm_postln_simple'):
    assert summary[name]['grad_var_median_err'] <= 0.15, (name, summary[name])
  xavier = summary['xavier_preln']
  assert xavier['forward_var_max_err'] <= 0.2, xavier
  assert xavier['forward_var_median_err'] <= 0.1, xavier
  assert xavier['forward_growth_N_1'] >= 50.0, xavier
