"""The stability monitor: each flag on synthetic statistics, raised once and counted while it lasts,
silence on a healthy tiny run, stability.jsonl and the final summary line, the TensorBoard histograms
and images, and the validation of its thresholds."""

import json
import os
import struct

import jax
import numpy as np
import pytest
from absl import logging
from tensorboardX.proto.event_pb2 import Event

from dsjax import instrument as instrument_lib
from dsjax.instrument import monitor as monitor_lib
from dsjax.instrument.probe import ACTIVATION_STATS, SITES
from dsjax.train import config as config_lib
from dsjax.train import loop
from tests.helpers import tiny_config

DEPTH = 4
# A healthy layer: values of each statistic (ACTIVATION_STATS order) at every site.
HEALTHY = {'mean': 0.0, 'var': 1.0, 'corr_seq': 0.3, 'corr_hidden': 0.0, 'max_abs': 4.0}
HEALTHY_GRAD = {'grad_var': 1e-6, 'grad_corr_seq': 0.1}


def _moments(**edits):
  """A step's moments as the instrumented step returns them: a healthy table, with `edits`
  {'<site>/<stat>': per-layer values (DEPTH,) or a scalar for the embedding}."""
  values = {**HEALTHY, **HEALTHY_GRAD}
  table = np.array([[[values[s] for s in ACTIVATION_STATS] for _ in SITES] for _ in range(DEPTH + 1)])
  for key, value in edits.items():
    site, stat = key.split('/')
    k = ACTIVATION_STATS.index(stat)
    if site == 'embedding':
      table[0, 0, k] = value
    else:
      table[1:, SITES.index(site), k] = value
  return {'activations': table.astype(np.float32)}


def _monitor(tmp_path=None, predictor=None, dropout=0.1, **thresholds):
  config = monitor_lib.monitor_config()
  config.update(thresholds)
  return monitor_lib.Monitor(
    config, DEPTH, dropout, predictor=predictor, workdir=None if tmp_path is None else str(tmp_path)
  )


def _run(monitor, steps):
  """Feeds {step: moments} through a Collector into `monitor`; returns the flags found per step."""
  collector = instrument_lib.Collector(None, monitor=monitor)
  found = {}
  for step, moments in steps.items():
    collector.add(step, moments)
    before = len(monitor.rows)
    collector.flush()
    found[step] = [(r['kind'], r['event'], r['site'], r['layer']) for r in monitor.rows[before:]]
  return found


def test_healthy_statistics_raise_nothing():
  monitor = _monitor()
  found = _run(monitor, {1: _moments(), 10: _moments(), 20: _moments()})
  assert found == {1: [], 10: [], 20: []}
  assert monitor.summary() == 'stability monitor: no flags in 3 instrumented steps'


def test_rank_collapse_is_raised_once_counted_and_cleared(tmp_path):
  monitor = _monitor(tmp_path)
  collapsed = _moments(**{'ffn_residual/corr_seq': [0.5, 0.9, 0.99, 0.995]})
  found = _run(monitor, {1: _moments(), 10: collapsed, 20: collapsed, 30: collapsed, 40: _moments()})
  assert found[10] == [('rank_collapse', 'raised', 'ffn_residual', 3)]
  assert found[20] == found[30] == []  # repeats are counted, not logged
  assert found[40] == [('rank_collapse', 'cleared', 'ffn_residual', 3)]
  raised, cleared = monitor.rows
  assert raised['value'] == pytest.approx(0.995) and raised['threshold'] == 0.985
  assert raised['layers_flagged'] == 2 and raised['num_layers'] == DEPTH
  # The App. F reference for dropout 0.1 with the paper's Xavier constants: r_max = 0.8865.
  assert 'r_max 0.887 at dropout 0.1' in raised['note']
  assert cleared['repeats'] == 2 and cleared['step'] == 40
  summary = monitor.close()
  assert summary.startswith('stability monitor: rank_collapse raised 1× (first at step 10, 3 flagged steps)')
  rows = [json.loads(line) for line in open(tmp_path / monitor_lib.MONITOR_FILE)]
  assert rows[:2] == [raised, cleared]
  assert rows[2]['event'] == 'summary' and rows[2]['raised'] == {'rank_collapse': 1}
  assert rows[2]['first_step'] == {'rank_collapse': 10}


@pytest.mark.parametrize(
  'first, kind', [(1e-6 * 1e-5, 'vanishing_gradient'), (1e-6 * 1e5, 'exploding_gradient')]
)
def test_gradient_ratio_outside_the_band(first, kind):
  monitor = _monitor()
  grad = [first, 1e-6, 1e-6, 1e-6]
  found = _run(monitor, {1: _moments(**{'ffn_residual/grad_var': grad})})
  assert found[1] == [(kind, 'raised', 'ffn_residual', 0)]
  row = monitor.rows[0]
  assert row['value'] == pytest.approx(first / 1e-6, rel=1e-5)
  assert row['threshold'] == (1e-4 if kind == 'vanishing_gradient' else 1e4)
  assert row['quantity'] == f'grad_var layer 0 / layer {DEPTH - 1}'


def test_theory_drift_compares_step_one_only():
  predicted = {name: np.ones(DEPTH) for name in monitor_lib.THEORY_QUANTITIES}
  predicted['grad_var'] = np.full(DEPTH, 1e-6)
  calls = []

  def predictor(measured):
    calls.append(measured)
    return predicted

  monitor = _monitor(predictor=predictor)
  off = _moments(**{'attn_branch/var': [1.0, 1.5, 0.3, 1.0]})  # layer 2: 1/0.3 = 3.3× below
  found = _run(monitor, {1: off, 10: off})
  assert found[1] == [('theory_drift', 'raised', 'attn_branch', 2)] and found[10] == []
  assert len(calls) == 1  # predicted once, from step 1's measurements
  assert calls[0][('embedding', 'var')] == {-1: 1.0} and calls[0][('ffn_residual', 'grad_var')][
    3
  ] == pytest.approx(1e-6)
  row = monitor.rows[0]
  assert row['value'] == pytest.approx(0.3) and row['threshold'] == 2.0
  assert row['quantity'] == 'var measured/predicted'
  assert 'measured 0.3, predicted 1' in row['note']


def test_max_abs_growth_and_bound():
  monitor = _monitor()
  grown = _moments(**{'attn_residual/max_abs': [4.0, 4.0, 4.0, 4.0 * 150]})
  huge = _moments(**{'ffn_branch/max_abs': [4.0, 7e4, 4.0, 4.0]})
  found = _run(monitor, {1: _moments(), 10: grown, 20: huge})
  assert found[10] == [('max_abs_growth', 'raised', 'attn_residual', 3)]
  assert monitor.rows[0]['note'] == '150× its 4 at the first check'
  # Branches only count against the absolute bound (a branch may start near 0, e.g. LayerScale).
  assert found[20] == [
    ('max_abs_growth', 'cleared', 'attn_residual', 3),
    ('max_abs_bound', 'raised', 'ffn_branch', 1),
  ]


def test_a_threshold_of_zero_turns_its_check_off():
  monitor = _monitor(corr_seq_max=0)
  found = _run(monitor, {1: _moments(**{'ffn_residual/corr_seq': 0.999})})
  assert found[1] == []


def test_a_step_delivered_in_pieces_is_checked_once_complete():
  monitor = _monitor()
  collector = instrument_lib.Collector(None)
  collector.add(1, _moments(**{'ffn_residual/corr_seq': 0.999}))
  records = collector.flush()
  assert monitor.observe(records[:-10]) == []  # incomplete: waits
  (flag, *more) = [f for f in monitor.observe(records[-10:]) if f.site == 'ffn_residual']
  assert flag.kind == 'rank_collapse' and not more


def test_a_disabled_monitor_writes_nothing(tmp_path):
  config = monitor_lib.monitor_config()
  monitor = monitor_lib.Monitor(config, DEPTH, 0.1, workdir=str(tmp_path), enabled=False)
  assert monitor.observe([{'step': 1, 'layer': 0, 'site': 'ffn_residual', 'stat': 'var', 'value': 1}]) == []
  monitor.close()
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
  'key, value, message',
  [
    ('corr_seq_max', 1.5, 'instrument.monitor.corr_seq_max must be a number in (0, 1]'),
    ('grad_ratio_max', 0.5, 'instrument.monitor.grad_ratio_max must be a number > 1'),
    ('theory_factor', float('nan'), 'instrument.monitor.theory_factor must be a number > 1'),
    ('max_abs_growth', 1.0, 'instrument.monitor.max_abs_growth must be a number > 1'),
    ('max_abs_bound', -1.0, 'instrument.monitor.max_abs_bound must be a number > 0'),
  ],
)
def test_thresholds_are_validated(key, value, message):
  config = tiny_config()
  with config.unlocked():
    config.instrument.monitor[key] = value
  with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(']', r'\]')):
    config_lib.validate_config(config, num_devices=1)


def _events(directory):
  """Every (step, tag, kind of value) in the event files of `directory`."""
  out = set()
  for name in os.listdir(directory):
    data = open(os.path.join(directory, name), 'rb').read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack('<Q', data[pos : pos + 8])
      event = Event.FromString(data[pos + 12 : pos + 12 + length])
      pos += 12 + length + 4
      out |= {(event.step, v.tag, v.WhichOneof('value')) for v in event.summary.value}
  return out


def test_a_healthy_tiny_run_is_silent_and_writes_histograms_and_images(tmp_path, monkeypatch):
  lines = []
  monkeypatch.setattr(logging, 'info', lambda msg, *args: lines.append(msg % args if args else msg))
  config = tiny_config('gpt')
  config.instrument.every = 2
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(os.path.join(workdir, monitor_lib.MONITOR_FILE))]
  assert rows == [
    {
      'event': 'summary',
      'steps_checked': 3,
      'raised': {},
      'first_step': {},
      'flagged_steps': {},
      'still_raised': [],
    }
  ]
  assert lines[-1] == 'stability monitor: no flags in 3 instrumented steps'
  events = _events(os.path.join(workdir, 'tensorboard'))
  for step in (1, 2, 4):
    assert (step, 'moments_hist/ffn_residual/corr_seq/value', 'histo') in events
    assert (step, 'moments_hist/attn_residual/grad_var/log10', 'histo') in events
    assert (step, 'weight_grad_norm_hist/q/log10', 'histo') in events
    assert (step, 'grad_abs/ffn1', 'histo') in events
    assert (step, 'moments_image/ffn_residual', 'image') in events
