"""The benchmark's model-FLOPs formula, a tiny run, and its argument checks."""

import math

import pytest

from dsjax import bench, models
from dsjax.train import config as config_lib
from tests.helpers import tiny_config


def test_model_flops_formula():
  """(6·N + 12·depth·d·L) per position, positions = batch × sequence length."""
  config = tiny_config('gpt')
  dims = models.model_dims(config, config_lib.validate_single_device_run(config, training=True))
  flops, positions = bench.model_flops_per_step(config, dims, num_params=1000)
  assert positions == config.batch_size * config.data.seq_len
  assert flops == (6 * 1000 + 12 * config.model.depth * config.model.width * config.data.seq_len) * positions


def test_a_tiny_benchmark_reports_its_modes(tmp_path):
  config = tiny_config('gpt')
  results = bench.run_benchmark(config, num_steps=1, modes=['off', 'callback'], inputs='random',
                                peak_tflops=1.0, workdir=str(tmp_path))
  assert set(results['modes']) == {'off', 'callback'}
  assert results['inputs'] == 'random' and results['config']['attention'] == 'xla'
  # Every parameter but the looked-up token and position tables: q, k, v, o, FFN, two LayerNorms.
  params_per_layer = 4 * (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32) + 2 * 2 * 32
  assert results['matmul_params'] == 2 * params_per_layer + 2 * 32 + 32 * 256  # + final norm, head
  for r in results['modes'].values():
    assert r['step_ms_min'] <= r['step_ms_median'] <= r['step_ms_max']
    assert r['compile_s'] > 0 and r['memory']['total_gib'] > 0
    assert math.isclose(r['mfu'], r['model_tflops_per_s'] / 1.0)
  assert 'instrumentation overhead (callback)' in bench.report(results)


@pytest.mark.parametrize('kwargs,message', [
    (dict(num_steps=0), '--steps'), (dict(modes=['sometimes']), '--instrument'),
    (dict(inputs='zeros'), '--inputs'), (dict(peak_tflops=-1.0), '--peak_tflops')])
def test_bad_arguments_are_one_line_errors(kwargs, message):
  args = dict(num_steps=1, modes=['off'], inputs='random', peak_tflops=None) | kwargs
  with pytest.raises(ValueError, match=message):
    bench.check_args(tiny_config('gpt'), **args)
