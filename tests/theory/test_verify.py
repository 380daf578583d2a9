"""The Monte Carlo check of the component formulas (`python -m dsjax.theory.verify --quick`)."""

import json
import os

import pytest

from dsjax.theory import verify

# Quick mode simulates 4–6 configurations per component with small samples; these bounds leave room
# for its Monte Carlo noise while still catching a wrong formula (the paper's own attention gradient
# formula is off by up to ~60% on this grid, its softmax forms by 100% when rg ≠ 0).
P99_BOUND = {
  'relu': 3.0,
  'gelu': 3.0,
  'layernorm': 4.0,
  'dropout': 4.0,
  'softmax': 3.0,
  'linear': 8.0,
  'attention_head': 12.0,
  'attention_head_causal': 15.0,
  'attention_block': 15.0,
  'attention_block_causal': 15.0,
  'ffn_block': 12.0,
}


def test_percent_error_is_the_papers_definition():
  assert verify.percent_error(2.0, 1.0) == pytest.approx(50.0)  # relative to measured
  assert verify.percent_error(2.0, 1.0, scale=10.0) == pytest.approx(10.0)  # min with Δ/σ²_pred
  assert verify.percent_error(0.03, 0.0, scale=0.5) == pytest.approx(3.0)  # p = 0: min(|m|, |m|/σ²)
  assert verify.percent_error(0.03, 0.0, scale=0.01) == pytest.approx(3.0)
  assert verify.percentiles(range(100)) == [50.0, 90.0, 99.0]
  assert verify.percentiles([3.0]) == [3.0, 3.0, 3.0]


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp('verify')
  verify.main(['--quick', '--out', str(out)])
  with open(os.path.join(out, 'verify.json')) as f:
    return json.load(f)


def test_quick_run_writes_every_component_and_statistic(quick_run):
  for name, component in verify.COMPONENTS.items():
    assert set(quick_run[name]) == set(component.statistics)
    for label in component.alternatives:
      assert set(quick_run[f'{name}[{label}]']) == set(component.statistics)
  for table in quick_run.values():
    for values in table.values():
      assert len(values) == 3 and values[0] <= values[1] <= values[2]


def test_quick_run_errors_are_small(quick_run):
  for name, bound in P99_BOUND.items():
    for stat, (p50, p90, p99) in quick_run[name].items():
      assert p99 <= bound, (name, stat, p99)
  # Exact identities: LayerNorm output variance 1 and hidden covariance −1/(d−1), softmax mean 1/L.
  assert quick_run['layernorm']['var'][2] < 0.01
  assert quick_run['layernorm']['cov_hidden'][2] < 0.01
  assert quick_run['softmax']['mean'][2] < 0.01
