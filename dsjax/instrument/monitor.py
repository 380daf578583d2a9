"""Stability monitor: warnings raised from the per-layer moments the instrumentation already fetched.

At every instrumented step the `Collector` hands its new records ({"step", "layer", "site", "stat",
"value"}, host floats) to `Monitor.observe`; nothing here runs on the device or fetches anything. Once a
step's activation table is complete the monitor checks it for

  * rank_collapse: the token correlation r^l (corr_seq) of the residual stream (sites attn_residual,
    ffn_residual) above `corr_seq_max` in some layer. The message names the stable value r_max of Kedia
    et al. 2024 (arXiv:2403.09635) App. F for the model's dropout (`theory.model.stable_correlation`)
    as the reference a healthy deep stack settles at;
  * vanishing_gradient / exploding_gradient: the variance of the gradient w.r.t. the first layer's
    output over that w.r.t. the last layer's output outside [1/grad_ratio_max, grad_ratio_max];
  * theory_drift: at the first instrumented step of a run from initialisation (step 1, where the theory
    applies), a measured variance (layer output, its gradient, both branch outputs) off the theory's
    prediction by more than a factor `theory_factor` in some layer — where the theory covers the model;
  * max_abs_growth / max_abs_bound: max |x| of the residual stream above `max_abs_growth` times its
    value at the first instrumented step, or max |x| of any site above `max_abs_bound`.

A flag is the tuple (kind, site, quantity); per step it names the worst layer. It is logged and written
to `WORKDIR/stability.jsonl` when it is raised and when it clears; the instrumented steps in between are
counted, not repeated. `summary()` is the run's last log line. Thresholds: `MONITOR_FIELDS`, with the
evidence behind each default; docs/instrumentation.md describes the flags and the file.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any, Callable

import ml_collections
import numpy as np
from absl import logging

from dsjax.instrument import stats as stats_lib
from dsjax.models.config import boolean, number
from dsjax.theory import model as theory_model

MONITOR_FILE = 'stability.jsonl'
KINDS = (
  'rank_collapse',
  'vanishing_gradient',
  'exploding_gradient',
  'theory_drift',
  'max_abs_growth',
  'max_abs_bound',
)
# The probe sites (`probe.SITES`; named here, as the config section must not import the probe, which
# imports the model's probe hook).
EMBEDDING = 'embedding'
STREAM_SITES = ('attn_residual', 'ffn_residual')
LAYER_SITES = ('attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual')
NUM_ACTIVATION_STATS = len(stats_lib.FORWARD_STATS) + len(stats_lib.GRAD_STATS)
# Theory quantities (`theory_adapter.predict`) and the measured (site, statistic) each is compared with.
THEORY_QUANTITIES = {
  'forward_var': ('ffn_residual', 'var'),
  'grad_var': ('ffn_residual', 'grad_var'),
  'attn_branch_var': ('attn_branch', 'var'),
  'ffn_branch_var': ('ffn_branch', 'var'),
}

# The `instrument.monitor` section: (default, description). 0 turns a check off.
MONITOR_FIELDS = {
  'enabled': (True, 'check every instrumented step (only when instrument.every > 0)'),
  # Measured (experiments/results/stability_monitor): healthy runs peak at 0.976 (DSLM Pre-LN 64 × 32,
  # dropout 0.1, App. F r_max 0.887) and 0.972 (configs/gpt_preln.py, 4 Xavier layers without dropout,
  # whose App. F fixed point is r = 1); DSLM Post-LN stacks that end on the unigram plateau reach 0.987
  # (64 × 32) and 0.995 (64 × 16). A narrow Pre-LN stack's transient can pass it too (0.994, 64 × 16).
  'corr_seq_max': (0.985, 'rank collapse: token correlation of the residual stream above this'),
  # Theory (`theory.model.propagate`, causal, GeLU, dropout 0.1, seq 32, d 32, 4 heads): the Xavier
  # Pre-LN ratio grows about 0.8 per layer (3.1 at 4 layers, 152 at 192); DSLM keeps it at 0.6–3 at
  # 192 × 256, measured and predicted (experiments/dslm_results.md §1). 10⁴ is ~65× above the Xavier
  # Pre-LN stack at 192 layers; narrow Xavier Post-LN stacks pass it at initialisation (2·10⁵ predicted
  # at 96 × 16), a collapsed DSLM Post-LN stack is at 10⁻⁹ (ibid. §2).
  'grad_ratio_max': (1e4, 'gradient variance of the first over the last layer outside [1/x, x]'),
  # Theory against measurement (experiments/results/rank_collapse, 192 layers): median errors of 0–13%
  # for the covered models (layer outputs, gradients, branches), the largest per-layer error 0.75
  # relative (Xavier Pre-LN gradient) — a factor 2 is past those except on the few layers the theory
  # misses, and past the Xavier Post-LN gradient, which it does not capture (median error 0.999): there
  # the flag should fire.
  'theory_factor': (2.0, 'at step 1, a measured variance off the prediction by more than this factor'),
  # Measured: max |x| of the stream grows by at most 5.9× in the healthy runs of
  # experiments/results/stability_monitor (DSLM Pre-LN 64 × 32; 1.4× for configs/gpt_preln.py), and a
  # Pre-LN stream's variance may grow ~50× (std ~7×, DSLM Pre-LN 96 × 32, experiments/dslm_results.md §2).
  'max_abs_growth': (100.0, 'max |x| of the residual stream over its value at the first check'),
  # Number format: the largest finite float16 (65504); past it a float16 cast overflows.
  'max_abs_bound': (65504.0, 'max |x| of any site above this'),
}


def monitor_config() -> ml_collections.ConfigDict:
  """The `instrument.monitor` section (`MONITOR_FIELDS`)."""
  return ml_collections.ConfigDict({name: default for name, (default, _) in MONITOR_FIELDS.items()})


def validate_monitor_config(c) -> None:
  """One-line errors naming the key: each threshold a number, 0 (off) or in its range."""
  boolean('instrument.monitor.enabled', c.enabled)
  if c.corr_seq_max != 0:
    number('instrument.monitor.corr_seq_max', c.corr_seq_max, low=0, high=1, low_open=True)
  for name in ('grad_ratio_max', 'theory_factor', 'max_abs_growth'):
    if c[name] != 0:
      number(f'instrument.monitor.{name}', c[name], low=1, low_open=True)
  if c.max_abs_bound != 0:
    number('instrument.monitor.max_abs_bound', c.max_abs_bound, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class Flag:
  """One check's finding at one step: the worst layer and how many layers are past the threshold."""

  kind: str
  site: str
  quantity: str
  step: int
  layer: int  # -1: the embedding
  value: float
  threshold: float
  layers_flagged: int
  num_layers: int
  note: str = ''
  op: str = '>'  # how value compares with threshold: '>', '<', or 'off by more than a factor'

  @property
  def key(self) -> tuple[str, str, str]:
    return (self.kind, self.site, self.quantity)


# A step's activation statistics: {(site, stat): (depth,) array}, the embedding as site 'embedding'
# with a (1,) array.
Table = dict[tuple[str, str], np.ndarray]
# Theory predictions of step 1's moments: measured {(site, stat): {layer: value}} → {quantity: (depth,)}.
Predictor = Callable[[dict[tuple[str, str], dict[int, float]]], dict[str, np.ndarray]]


def _worst(kind, site, quantity, step, values, past, threshold, badness, note='') -> Flag | None:
  """The Flag of the layers where `past` holds (None if none), naming the one of largest `badness`."""
  if not past.any():
    return None
  index = int(np.argmax(np.where(past, badness, -np.inf)))
  layer = -1 if site == EMBEDDING else index
  return Flag(
    kind, site, quantity, step, layer, float(values[index]), threshold, int(past.sum()), len(values), note
  )


class Monitor:
  """Raises, clears and counts stability flags from the records of instrumented steps.

  `depth`: layers of the stack; `dropout`: the model's dropout (App. F reference); `predictor`: the
  theory's prediction for step 1 (None where the theory does not cover the model); `workdir`: where
  stability.jsonl goes (None: nothing written); `enabled=False` (processes other than 0, or
  instrument.monitor.enabled False): a no-op.
  """

  def __init__(
    self,
    config,
    depth: int,
    dropout: float,
    *,
    predictor: Predictor | None = None,
    workdir: str | None = None,
    enabled: bool = True,
  ):
    self.config, self.depth, self.predictor = config, depth, predictor
    self.enabled = enabled and bool(config.enabled)
    self.r_max = theory_model.stable_correlation(dropout=dropout)[0] if dropout < 1 else 1.0
    self.dropout = dropout
    self._steps: dict[int, dict[tuple[int, str, str], float]] = collections.defaultdict(dict)
    self._first_max_abs: Table | None = None
    self._active: dict[tuple[str, str, str], Flag] = {}
    self._repeats: collections.Counter = collections.Counter()
    self.raised: collections.Counter = collections.Counter()  # kind → times raised
    self.first_step: dict[str, int] = {}
    self.flagged_steps: collections.Counter = collections.Counter()  # kind → instrumented steps flagged
    self.steps_checked = 0
    self.rows: list[dict[str, Any]] = []
    self._file = None
    if self.enabled and workdir is not None:
      os.makedirs(workdir, exist_ok=True)
      self._file = open(os.path.join(workdir, MONITOR_FILE), 'a')

  @property
  def _expected(self) -> int:
    return (1 + self.depth * len(LAYER_SITES)) * NUM_ACTIVATION_STATS

  def observe(self, records) -> list[Flag]:
    """Takes a Collector's new records; checks each step whose activation table is now complete (in
    step order) and returns the flags found."""
    if not self.enabled:
      return []
    for r in records:
      if not r['site'].startswith('weight/'):
        self._steps[r['step']][(r['layer'], r['site'], r['stat'])] = r['value']
    done = sorted(s for s, values in self._steps.items() if len(values) >= self._expected)
    return [flag for step in done for flag in self._check_step(step, self._steps.pop(step))]

  def _table(self, values) -> Table:
    out: Table = {}
    for (layer, site, stat), value in values.items():
      column = out.get((site, stat))
      if column is None:  # (not `setdefault`, which would build an array for every value)
        column = out[(site, stat)] = np.full(1 if site == EMBEDDING else self.depth, np.nan)
      column[max(layer, 0)] = value
    return out

  def _check_step(self, step: int, values) -> list[Flag]:
    table = self._table(values)
    self.steps_checked += 1
    results: dict[tuple[str, str, str], Flag | None] = {}
    for check in (self._rank_collapse, self._gradients, self._theory_drift, self._max_abs):
      results.update(check(step, table, values))
    found = [f for f in results.values() if f is not None]
    for kind in {f.kind for f in found}:
      self.flagged_steps[kind] += 1
    for key, flag in results.items():
      self._update(key, flag, step)
    return found

  # ----------------------------------------------------------------------------------------------
  # The checks: each returns {flag key: Flag or None} for the keys it evaluated at this step.

  def _rank_collapse(self, step, table, values):
    threshold = self.config.corr_seq_max
    if not threshold:
      return {}
    note = f'App. F r_max {self.r_max:.3f} at dropout {self.dropout:g}'
    out = {}
    for site in STREAM_SITES:
      corr = table.get((site, 'corr_seq'))
      if corr is not None:
        past = np.nan_to_num(corr, nan=-np.inf) > threshold
        out[('rank_collapse', site, 'corr_seq')] = _worst(
          'rank_collapse', site, 'corr_seq', step, corr, past, threshold, corr, note
        )
    return out

  def _gradients(self, step, table, values):
    limit = self.config.grad_ratio_max
    grad = table.get(('ffn_residual', 'grad_var'))
    if not limit or grad is None or self.depth < 2:
      return {}
    quantity = f'grad_var layer 0 / layer {self.depth - 1}'
    ratio = grad[0] / grad[-1] if grad[-1] > 0 else np.inf if grad[0] > 0 else np.nan
    out = {}
    for kind, past, threshold in (
      ('vanishing_gradient', ratio < 1 / limit, 1 / limit),
      ('exploding_gradient', ratio > limit, limit),
    ):
      flag = None
      if np.isfinite(ratio) and past:
        op = '<' if kind == 'vanishing_gradient' else '>'
        flag = Flag(kind, 'ffn_residual', quantity, step, 0, float(ratio), threshold, 1, 1, op=op)
      out[(kind, 'ffn_residual', quantity)] = flag
    return out

  def _theory_drift(self, step, table, values):
    factor = self.config.theory_factor
    if not factor or self.predictor is None or step != 1:
      return {}
    measured: dict[tuple[str, str], dict[int, float]] = collections.defaultdict(dict)
    for (layer, site, stat), value in values.items():
      measured[(site, stat)][layer] = value
    try:
      predicted = self.predictor(dict(measured))
    except (ValueError, ArithmeticError) as e:  # e.g. a measured input outside the theory's domain
      logging.warning('stability monitor: no comparison with the theory at step %d (%s)', step, e)
      return {}
    out = {}
    for name, (site, stat) in THEORY_QUANTITIES.items():
      m, p = table[(site, stat)], np.asarray(predicted[name], np.float64)
      with np.errstate(divide='ignore', invalid='ignore'):
        ratio = m / p
        off = np.nan_to_num(np.abs(np.log(np.abs(ratio))), nan=0.0)
      quantity = f'{stat} measured/predicted'
      flag = _worst('theory_drift', site, quantity, step, ratio, off > math.log(factor), factor, off)
      if flag is not None:
        n = flag.layer
        note = f'{name}: measured {m[n]:.4g}, predicted {p[n]:.4g}'
        flag = dataclasses.replace(flag, note=note, op='off by more than a factor')
      out[('theory_drift', site, quantity)] = flag
    return out

  def _max_abs(self, step, table, values):
    sites = (EMBEDDING,) + LAYER_SITES
    current = {site: table[(site, 'max_abs')] for site in sites if (site, 'max_abs') in table}
    if self._first_max_abs is None:
      self._first_max_abs = current
    out = {}
    growth = self.config.max_abs_growth
    if growth:
      for site in (EMBEDDING,) + STREAM_SITES:
        if site not in current or site not in self._first_max_abs:
          continue
        first = self._first_max_abs[site]
        with np.errstate(divide='ignore', invalid='ignore'):
          ratio = np.where(first > 0, current[site] / first, np.nan)
        past = np.nan_to_num(ratio, nan=0.0) > growth
        flag = _worst('max_abs_growth', site, 'max_abs', step, current[site], past, growth, ratio)
        if flag is not None:
          flag = dataclasses.replace(
            flag, note=f'{ratio[flag.layer]:.3g}× its {first[flag.layer]:.4g} at the first check'
          )
        out[('max_abs_growth', site, 'max_abs')] = flag
    bound = self.config.max_abs_bound
    if bound:
      for site, value in current.items():
        past = np.nan_to_num(value, nan=0.0) > bound
        out[('max_abs_bound', site, 'max_abs')] = _worst(
          'max_abs_bound', site, 'max_abs', step, value, past, bound, value
        )
    return out

  # ----------------------------------------------------------------------------------------------
  # Raising, clearing, counting and writing.

  def _update(self, key, flag: Flag | None, step: int):
    active = self._active.get(key)
    if flag is not None and active is None:
      self._active[key] = flag
      self._repeats[key] = 0
      self.raised[flag.kind] += 1
      self.first_step.setdefault(flag.kind, step)
      self._emit('raised', flag, repeats=0)
    elif flag is not None:
      self._repeats[key] += 1
    elif active is not None:
      del self._active[key]
      self._emit('cleared', dataclasses.replace(active, step=step), repeats=self._repeats.pop(key))

  def _emit(self, event: str, flag: Flag, repeats: int):
    where = 'embedding' if flag.layer < 0 else f'layer {flag.layer}'
    layers = f'{flag.layers_flagged} of {flag.num_layers} layers' if flag.num_layers > 1 else ''
    detail = '; '.join(x for x in (layers, flag.note) if x)
    if event == 'raised':
      logging.warning(
        'stability: step %d, %s, site %s, %s %.4g %s %.4g (%s%s)',
        flag.step, where, flag.site, flag.quantity, flag.value, flag.op, flag.threshold, flag.kind,
        f'; {detail}' if detail else '',
      )  # fmt: skip
    else:
      logging.info(
        'stability: step %d, site %s, %s: %s cleared after %d more flagged instrumented steps',
        flag.step, flag.site, flag.quantity, flag.kind, repeats,
      )  # fmt: skip
    row = {
      'step': flag.step,
      'event': event,
      'kind': flag.kind,
      'layer': flag.layer,
      'site': flag.site,
      'quantity': flag.quantity,
      'value': _json_float(flag.value) if event == 'raised' else None,
      'threshold': flag.threshold,
      'layers_flagged': flag.layers_flagged if event == 'raised' else None,
      'num_layers': flag.num_layers,
      'repeats': repeats,
      'note': flag.note if event == 'raised' else '',
    }
    self._write(row)

  def _write(self, row: dict[str, Any]):
    self.rows.append(row)
    if self._file is not None:
      self._file.write(json.dumps(row, allow_nan=False) + '\n')
      self._file.flush()

  def summary(self) -> str:
    """One line: per kind, times raised, first step and instrumented steps flagged; or that none were."""
    if not self.enabled:
      return 'stability monitor: off'
    if not self.raised:
      return f'stability monitor: no flags in {self.steps_checked} instrumented steps'
    parts = [
      f'{kind} raised {self.raised[kind]}× (first at step {self.first_step[kind]}, '
      f'{self.flagged_steps[kind]} flagged steps)'
      for kind in KINDS
      if kind in self.raised
    ]
    still = len(self._active)
    return (
      f'stability monitor: {"; ".join(parts)} in {self.steps_checked} instrumented steps; '
      f'{still} still raised at the end; rows in {MONITOR_FILE}'
    )

  def close(self) -> str:
    """Checks any step left incomplete, writes a summary row, closes the file; returns `summary()`."""
    if self.enabled:
      for step in sorted(self._steps):
        self._check_step(step, self._steps.pop(step))
      self._write(
        {
          'event': 'summary',
          'steps_checked': self.steps_checked,
          'raised': dict(self.raised),
          'first_step': self.first_step,
          'flagged_steps': dict(self.flagged_steps),
          'still_raised': [list(key) for key in self._active],
        }
      )
    if self._file is not None:
      self._file.close()
      self._file = None
    return self.summary()


def _json_float(value: float) -> float | None:
  return float(value) if np.isfinite(value) else None
