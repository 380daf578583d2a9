"""`dsjax.coordcheck`: the coordinate check across widths and depths (docs/coordcheck.md).

A tiny sweep writes every quantity per run, step and layer, the plotted points, the growth exponents
and the plots; bad input fails in one line before anything is written; the measured update of a matrix
is its change's RMS and its RMS-to-RMS operator norm; and (slow) μP's output-logit change stays flat
across widths where the standard parametrisation's grows.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import coordcheck
from dsjax.train import config as config_lib
from tests.helpers import REPO_ROOT, tiny_config


def _config(**model):
  c = tiny_config('gpt', attention='plain', **model)
  c.data.seq_len, c.batch_size = 8, 4
  return c


def test_one_model_is_measured_after_every_step():
  config = coordcheck.point_config(_config(), 16, 2, 0, 2, 1e-2)
  info = config_lib.validate_single_device_run(config, training=True)
  record = coordcheck.train_and_measure(config, info, coordcheck.first_batches(config, 2))
  assert len(record['train_loss']) == 2 and len(record['loss']) == 3 and record['nonfinite_steps'] == 0
  assert record['train_loss'][0] == pytest.approx(record['loss'][0])  # step 1 trains on the fixed batch
  assert [len(v) for v in record['activation_rms']['ffn_residual']] == [2, 2, 2]
  assert record['activation_rms']['embedding'][0][0] > 0 and record['activation_rms']['logits'][0][0] > 0
  assert (
    record['activation_change_rms']['logits'][0] == [0.0]
    and record['activation_change_rms']['logits'][2][0] > 0
  )
  for per_step in record['weight_change_op'].values():
    assert per_step[0] == [0.0, 0.0] and all(x > 0 for x in per_step[2])


@pytest.mark.slow
def test_tiny_sweep_writes_every_quantity_and_plot(tmp_path):
  steps = 2
  result = coordcheck.run(_config(), str(tmp_path), widths=[16, 32], depths=[1, 2], steps=steps, lr=1e-2)
  saved = json.loads((tmp_path / coordcheck.RESULT_FILE).read_text())
  assert saved['settings']['widths'] == [16, 32] and saved['settings']['depths'] == [1, 2]
  assert saved['settings']['lr'] == 1e-2 and saved['settings']['steps'] == steps
  assert [(r['width'], r['depth']) for r in saved['runs']] == [(16, 1), (16, 2), (32, 1), (32, 2)]
  for run in saved['runs']:
    assert len(run['train_loss']) == steps and len(run['loss']) == steps + 1 and run['nonfinite_steps'] == 0
    assert set(run) >= set(coordcheck.QUANTITIES)
    sites = run['activation_rms']
    assert set(sites) == {'embedding', 'attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual', 'logits'}
    for name in ('attn_branch', 'ffn_residual'):
      assert len(sites[name]) == steps + 1 and all(len(v) == run['depth'] for v in sites[name])
      assert all(x > 0 for v in sites[name] for x in v)
    assert (
      run['activation_change_rms']['logits'][0] == [0.0] and run['activation_change_rms']['logits'][1][0] > 0
    )
    assert set(run['weight_change_op']) == set(coordcheck.BLOCK_MATRICES)
    assert set(run['weight_change_rms']) >= set(coordcheck.BLOCK_MATRICES) | {'token_embed', 'head/kernel'}
    for per_step in run['weight_change_rms'].values():
      assert all(x == 0 for x in per_step[0]) and all(x > 0 for x in per_step[steps])
  # The plotted points: one per quantity, series, step, width and depth, the layer RMS of the run.
  first = saved['runs'][1]
  point = next(
    p
    for p in saved['points']
    if (p['quantity'], p['series'], p['step'], p['width'], p['depth'])
    == ('activation_rms', 'ffn_residual', 1, 16, 2)
  )
  assert point['value'] == pytest.approx(
    np.sqrt(np.mean(np.square(first['activation_rms']['ffn_residual'][1])))
  )
  against = {(e['against'], e['quantity']) for e in saved['exponents']}
  assert against == {(a, q) for a in ('width', 'depth') for q in coordcheck.QUANTITIES}
  assert not [e for e in saved['exponents'] if e['step'] == 0 and coordcheck.QUANTITIES[e['quantity']]]
  for quantity in coordcheck.QUANTITIES:
    for axis in ('width', 'depth'):
      assert (tmp_path / f'{quantity}_vs_{axis}.png').stat().st_size > 0
  assert result['points'] == saved['points']
  assert 'value ∝ width^p at depth 1' in coordcheck.format_exponents(result)


def test_weight_changes_are_rms_and_rms_to_rms_operator_norm():
  depth, fan_in, fan_out = 2, 8, 32
  u, v = np.ones((fan_in, 1)), np.ones((1, fan_out))
  kernel0 = jnp.zeros((depth, fan_in, fan_out))
  kernel = jnp.stack([0.1 * u @ v, 0.2 * u @ v])  # rank one: σ_max = c·sqrt(fan_in·fan_out)
  params = lambda q, e: {'trunk': {'stack': {'layers': {'attn': {'q': {'kernel': q}}}}}, 'token_embed': e}
  out = coordcheck.weight_changes(params(kernel, jnp.ones((4, 3))), params(kernel0, jnp.zeros((4, 3))))
  np.testing.assert_allclose(out['weight_change_rms']['q'], [0.1, 0.2], rtol=1e-6)
  np.testing.assert_allclose(out['weight_change_op']['q'], [0.1 * fan_in, 0.2 * fan_in], rtol=1e-5)
  np.testing.assert_allclose(out['weight_change_rms']['token_embed'], [1.0])
  assert set(out['weight_change_op']) == {'q'}


def test_growth_exponent_fits_a_power_law():
  points = [
    {'quantity': 'weight_change_op', 'series': 'q', 'step': 1, 'width': w, 'depth': 2, 'value': 3.0 * w}
    for w in (16, 32, 64)
  ] + [
    {'quantity': 'weight_change_op', 'series': 'k', 'step': 1, 'width': w, 'depth': 2, 'value': 0.0}
    for w in (16, 32)
  ]
  exponents = {e['series']: e['exponent'] for e in coordcheck.growth_exponents(points, 'width')}
  assert exponents['q'] == pytest.approx(1.0) and exponents['k'] is None


@pytest.mark.parametrize(
  'kwargs, words',
  [
    ({'widths': [16, 30]}, ('--widths', '30', 'model.num_heads (4)')),
    ({'widths': [16, 32], 'depths': [0, 2]}, ('--depths', 'integers >= 1')),
    ({'widths': ['16', 'x']}, ('--widths', "'16,x'")),
    ({'widths': [16, 16]}, ('--widths', 'distinct')),
    ({'widths': [32]}, ('one model', 'width 32, depth 2')),
    ({'widths': [16, 32], 'steps': 0}, ('--steps',)),
    ({'widths': [16, 32], 'lr': -1.0}, ('--lr',)),
    ({'widths': [16, 32], 'seeds': [-1]}, ('--seeds',)),
    ({'widths': [16, 32], 'depths': [2], 'scheme': 'bogus'}, ('at width 16, depth 2', 'model.scheme')),
  ],
)
def test_bad_input_fails_before_anything_is_written(tmp_path, kwargs, words):
  config = _config(**({'scheme': kwargs.pop('scheme')} if 'scheme' in kwargs else {}))
  out = tmp_path / 'out'
  with pytest.raises(ValueError) as error:
    coordcheck.run(config, str(out), **kwargs)
  message = str(error.value)
  assert '\n' not in message and all(w in message for w in words), message
  assert not out.exists()


def test_cli_help_and_one_line_error(tmp_path):
  program = [sys.executable, '-m', 'dsjax.coordcheck']
  help_run = subprocess.run(program + ['--help'], cwd=REPO_ROOT, capture_output=True, text=True)
  assert help_run.returncode == 0 and '--widths' in help_run.stdout
  proc = subprocess.run(
    program + ['--config=configs/gpt_preln.py', '--widths=64,90', f'--out={tmp_path}/o'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 2, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith('dsjax.coordcheck: error:')]
  assert len(errors) == 1 and '--widths: 90' in errors[0] and 'Traceback' not in proc.stderr, proc.stderr
  assert not (tmp_path / 'o').exists()


@pytest.mark.slow
def test_mup_updates_stay_flat_across_widths_where_vanilla_grows(tmp_path):
  """Adam at lr 1e-3, one layer, widths 32–128, one step on 8 tokens. Under the standard
  parametrisation the change of the output logits and the RMS-to-RMS size of the hidden updates grow
  about ∝ width; under μP the hidden updates stay flat and the logit change does not grow (it falls
  toward its limit as the finite-width part of the readout's update fades: docs/coordcheck.md). The
  same sweep over widths 32–256 (one and two layers) gave exponents 1.17–1.25 (logits) and 0.91–1.01 (q,
  ffn1) for the standard parametrisation, −0.36 and −0.07 … 0.03 for μP."""
  exponents = {}
  for scheme in ('vanilla', 'mup'):
    config = _config(scheme=scheme)
    config.data.seq_len, config.batch_size, config.model.depth = 5, 2, 1
    out = tmp_path / scheme
    result = coordcheck.run(config, str(out), widths=[32, 64, 128], steps=1, lr=1e-3)
    exponents[scheme] = {
      (e['quantity'], e['series']): e['exponent'] for e in result['exponents'] if e['step'] == 1
    }
    # Only a width sweep: no plots against depth.
    assert sorted(os.listdir(out)) == sorted(
      [coordcheck.RESULT_FILE] + [f'{q}_vs_width.png' for q in coordcheck.QUANTITIES]
    )
  vanilla, mup = exponents['vanilla'], exponents['mup']
  assert vanilla[('activation_change_rms', 'logits')] > 0.8, vanilla
  assert mup[('activation_change_rms', 'logits')] < 0.1, mup
  for matrix in coordcheck.BLOCK_MATRICES:
    assert vanilla[('weight_change_op', matrix)] > 0.8, vanilla
    assert abs(mup[('weight_change_op', matrix)]) < 0.15, mup
