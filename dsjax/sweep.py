r"""Learning-rate sweeps of several arms with seeds, compared by a protocol: `python -m dsjax.sweep`.

    python -m dsjax.sweep --config=configs/gpt_preln.py --lrs=1e-3,3e-3,1e-2 --seeds=0,1,2 \
        --arm=preln: --arm=postln:model.block=postln --baseline=preln --out=/tmp/sweep

Every arm is the base config (with its `--config.` overrides) plus the arm's own overrides. The members of
an arm — every lr × seed — train together, stacked and vmapped through the project's own train step
(`dsjax.train.population`): member k is the run `python -m dsjax.main --config.optimizer.lr=LR_k
--config.seed=SEED_k` with the sweep's splits. Arms run one after another. The lr is chosen per arm on
the selection split, extended past the grid's edge where the best lr lies on it (and, with
--refine_ratio, narrowed around the best lr by training midpoints), and the chosen lr's
seeds are reported on a split the choice never saw (`dsjax.train.protocol`). Each finished (arm, lr) is
written under OUT at once, so rerunning the command resumes; rerunning it with more --seeds adds them at
every lr the arms have. Outputs: OUT/results.json, OUT/summary.md, OUT/lr_curves.png (docs/sweeps.md).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import os
import re
import shlex
import sys
from typing import Any, Callable, Collection

import matplotlib
import numpy as np
from absl import flags, logging
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from dsjax import data as data_lib
from dsjax.train import cli, history, population, protocol
from dsjax.train import config as config_lib

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402 (after the non-interactive backend is chosen)


def _define_flags():
  # Defined only when run as a program, so that importing dsjax.sweep (tests, other tools with flags of
  # the same names) defines no absl flags.
  config_flags.DEFINE_config_file(
    'config',
    None,
    'Path to a config file (configs/*.py); --config.KEY=VALUE overrides apply to every arm.',
    lock_config=True,
  )
  flags.DEFINE_string('lrs', None, 'Peak learning rates of the grid, comma-separated (e.g. 1e-3,3e-3).')
  flags.DEFINE_string(
    'seeds',
    '0,1,2',
    'Seeds of every lr, comma-separated non-negative integers; a rerun may add seeds (never drop one).',
  )
  flags.DEFINE_multi_string(
    'arm',
    [],
    'NAME:KEY=VALUE,KEY=VALUE: an arm, the base config with these config overrides (NAME: alone is the '
    "base config). Repeatable. None given: one arm 'base'.",
  )
  flags.DEFINE_string('baseline', None, 'The arm the others are compared with (default: the first).')
  flags.DEFINE_string('out', None, 'Directory of the results; rerunning the same command resumes there.')
  flags.DEFINE_integer(
    'max_extend', 2, 'How many lrs an arm may add beyond each edge of the grid when its best lr lies there.'
  )
  flags.DEFINE_float(
    'refine_ratio',
    0.0,
    "After the grid and its extensions, train the geometric midpoint on each side of an arm's best lr "
    'whose nearest trained lr is more than this ratio away, until none is (e.g. 1.9 halves the log-steps '
    'of a 1e-3,3e-3,1e-2 grid around the optimum). 0: off.',
  )
  flags.DEFINE_integer(
    'max_members',
    0,
    'At most this many members (lrs × seeds) trained together in one population, to bound memory; an '
    "lr's seeds always train together. 0: each arm's whole grid at once.",
  )
  flags.DEFINE_string('train_split', None, 'Split to train on (default: per dataset, docs/sweeps.md).')
  flags.DEFINE_string('select_split', None, 'Split the lr is chosen on (default: per dataset).')
  flags.DEFINE_string('report_split', None, 'Split the results are reported on (default: per dataset).')
  flags.mark_flags_as_required(['config', 'lrs', 'out'])


# Keys the sweep sets itself: the grid's axes and the protocol's splits.
SWEEP_KEYS = ('optimizer.lr', 'seed', 'data.train_split', 'data.eval_split')
METRICS = ('eval/loss', 'eval/accuracy')  # reported where the model has them


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  changes: dict[str, Any]  # the arm's overrides, as parsed
  config: Any  # the base config with the overrides and the sweep's splits


# ------------------------------------------------------------------------------------------------
# Checking the command line (everything before anything is written).
# ------------------------------------------------------------------------------------------------


def parse_lrs(text: str) -> list[float]:
  try:
    lrs = [float(x) for x in text.split(',')]
  except ValueError:
    lrs = []
  if not lrs or any(not math.isfinite(lr) or lr <= 0 for lr in lrs) or len(set(lrs)) < len(lrs):
    raise ValueError(f'--lrs must be distinct positive numbers separated by commas, got {text!r}')
  return sorted(lrs)


def parse_seeds(text: str) -> list[int]:
  try:
    seeds = [int(x) for x in text.split(',')]
  except ValueError:
    seeds = []
  if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) < len(seeds):
    raise ValueError(f'--seeds must be distinct non-negative integers separated by commas, got {text!r}')
  return seeds


def _parse_value(config, key: str, text: str) -> Any:
  """`text` as a value of the config field `key`, as a `--config.KEY=text` override would parse it."""
  kind = config_path.get_type(key, config)
  if text == 'None':
    return None
  if kind is bool:
    return flags.BooleanParser().parse(text)
  if kind is int:
    return flags.IntegerParser().parse(text)
  if kind is float:
    return flags.FloatParser().parse(text)
  if kind is str:
    return text
  try:  # Tuples and other literals, as config_flags reads them; else the text itself.
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_arm(spec: str, base) -> Arm:
  """`NAME:KEY=VALUE,KEY=VALUE` → an Arm; ValueErrors name the arm and the key."""
  name, _, body = spec.partition(':')
  if not re.fullmatch(r'[A-Za-z0-9_.-]+', name):
    raise ValueError(f'--arm={spec}: the name must be letters, digits, _ . - followed by ":", got {name!r}')
  config = copy.deepcopy(base)
  changes = {}
  for item in re.split(r',(?=[\w.]+=)', body) if body else []:
    key, eq, text = item.partition('=')
    if not eq or not key:
      raise ValueError(f'--arm={name}: {item!r} is not KEY=VALUE')
    if key in SWEEP_KEYS:
      raise ValueError(f'--arm={name}: {key} is set by the sweep (--lrs, --seeds, the split flags)')
    try:
      value = _parse_value(config, key, text)
      config_path.set_value(key, config, value)
    except (KeyError, AttributeError):
      raise ValueError(f'--arm={name}: the config has no key {key!r}') from None
    except (TypeError, ValueError, flags.Error) as e:
      raise ValueError(f'--arm={name}: {key}={text}: {e}') from None
    changes[key] = value
  return Arm(name, changes, config)


def _with_splits(config, splits: dict[str, str]):
  config = copy.deepcopy(config)
  config.data.train_split, config.data.eval_split = splits['train'], splits['select']
  return config


def check_arm(arm: Arm) -> None:
  """Every check `python -m dsjax.main` makes before training, named by the arm."""
  try:
    validated = config_lib.validate_config(arm.config, num_devices=1)
    config_lib.validate_against_data(arm.config, data_lib.dataset_info(validated.data))
  except ValueError as e:
    raise ValueError(f'--arm={arm.name}: {e}') from None


def sweep_splits(base, given: dict[str, str | None]) -> dict[str, str]:
  """The per-dataset default splits (`protocol.default_splits`) with the split flags' overrides
  (`given`: {'train', 'select', 'report'}, None where not given)."""
  data = config_lib.validate_config(base, num_devices=1).data
  info = data_lib.dataset_info(data)
  splits = protocol.default_splits(info.num_examples)
  splits.update({k: v for k, v in given.items() if v})
  if len(set(splits.values())) < 3:
    raise ValueError(f'--train_split, --select_split and --report_split must differ, got {splits}')
  for role, split in splits.items():  # Builds each pipeline once: a one-line error for a missing split.
    data_lib.make_pipeline(
      data, split=split, global_batch_size=1, process_index=0, process_count=1, train=role == 'train'
    )
  return splits


# How a model is computed, not what it computes (the fast forms are tested against the plain math): a
# sweep may resume with another, e.g. model.attention='xla' where cuDNN's kernel failed on a machine.
IMPLEMENTATION_KEYS = ('attention', 'fused_ops', 'remat', 'scan_layers', 'scan_unroll')


def identity(base, arms: list[Arm], lrs, seeds, splits) -> dict[str, Any]:
  """What a resumed sweep must share with the one in OUT (all but the model's `IMPLEMENTATION_KEYS`)."""
  config = base.to_dict()
  config['model'] = {k: v for k, v in config['model'].items() if k not in IMPLEMENTATION_KEYS}
  return json.loads(
    json.dumps(
      {
        'config': config,
        'arms': {a.name: a.changes for a in arms},
        'lrs': lrs,
        'seeds': seeds,
        'splits': splits,
      },
      default=str,
    )
  )


# ------------------------------------------------------------------------------------------------
# Files under OUT, each written whole (a temporary file renamed over it).
# ------------------------------------------------------------------------------------------------


def write_atomically(path: str, text: str) -> None:
  with open(path + '.tmp', 'w') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


def lr_path(out: str, arm: str, lr: float) -> str:
  return os.path.join(out, 'arms', arm, f'lr_{lr:.6e}.json')


def finished_lrs(out: str, arm: str) -> dict[float, dict]:
  """{lr: its record} of the arm's finished lrs."""
  directory = os.path.join(out, 'arms', arm)
  found = {}
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    if name.startswith('lr_') and name.endswith('.json'):
      with open(os.path.join(directory, name)) as f:
        record = json.load(f)
      found[record['lr']] = record
  return found


def missing_seeds(record: dict, seeds) -> list[int]:
  """The `seeds` an (arm, lr) record does not hold yet (seeds added to a sweep after it was trained)."""
  held = {m['seed'] for m in record['members']}
  return [s for s in seeds if s not in held]


def at_seeds(records: dict[float, dict], seeds) -> dict[float, dict]:
  """The records that hold every one of `seeds`, each with only those seeds' members: the arm as a sweep
  with exactly these seeds has it."""
  wanted = set(seeds)
  return {
    lr: dict(r, members=[m for m in r['members'] if m['seed'] in wanted])
    for lr, r in records.items()
    if not missing_seeds(r, seeds)
  }


def flat_keys(tree: dict, prefix: str = '') -> dict[str, Any]:
  """A nested dict as {'a.b.c': value}, the keys of config overrides."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flat_keys(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def config_diff(base, config) -> dict[str, Any]:
  """{key: value} of `config` where it differs from `base`."""
  a, b = flat_keys(base.to_dict()), flat_keys(config.to_dict())
  return {k: b.get(k) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


# ------------------------------------------------------------------------------------------------
# Training an arm: its grid together, then one lr at a time beyond an edge the best lr lies on, then
# the midpoints beside the best lr where its steps are wider than --refine_ratio.
# ------------------------------------------------------------------------------------------------


class Progress:
  """Progress lines with the estimated time left for the arm and the whole sweep, from the member-steps
  trained so far in this process and their wall time (compilation included)."""

  def __init__(self, planned_member_steps: int):
    self.planned = planned_member_steps  # grows when an arm extends its grid
    self.done = 0
    self.seconds = 0.0

  def eta(self, remaining: int) -> str:
    return f'{remaining * self.seconds / self.done:.0f}s' if self.done else '?'

  def reporter(self, arm: str, num_members: int, total_steps: int, arm_left: int):
    start_done, start_seconds = self.done, self.seconds

    def report(step, losses_K, seconds):
      self.done, self.seconds = start_done + step * num_members, start_seconds + seconds
      left_here = arm_left - step * num_members
      finite = losses_K[np.isfinite(losses_K)]
      loss = f'{finite.min():.3f}–{finite.max():.3f}' if finite.size else 'none finite'
      logging.info(
        'arm %s: step %d/%d of %d members, train loss %s; ETA arm %s, sweep %s',
        arm,
        step,
        total_steps,
        num_members,
        loss,
        self.eta(left_here),
        self.eta(self.planned - self.done),
      )

    return report


def train_lrs(out: str, base, arm: Arm, lrs: list[float], seeds: list[int], splits, progress: Progress):
  """Trains the arm's `lrs` × `seeds` together and writes each lr's record."""
  config = arm.config
  members = population.grid(lrs, seeds)
  steps = config.total_steps
  eval_steps = range(config.eval_every, steps, config.eval_every)
  report = progress.reporter(arm.name, len(members), steps, len(members) * steps)
  result = population.train(
    config,
    members,
    eval_steps=eval_steps,
    report_split=splits['report'],
    log_every=config.log_every,
    progress=report,
    verbose=False,
  )
  os.makedirs(os.path.join(out, 'arms', arm.name), exist_ok=True)
  for lr in lrs:
    path = lr_path(out, arm.name, lr)
    earlier = {}  # the lr's record from before seeds were added, if any
    if os.path.exists(path):
      with open(path) as f:
        earlier = json.load(f)
    records = list(earlier.get('members', []))
    for r in result['members']:
      if r['lr'] != lr:
        continue
      member = copy.deepcopy(config)
      member.optimizer.lr, member.seed = lr, r['seed']
      records.append(
        {
          'seed': r['seed'],
          'lr': lr,
          'config_diff': config_diff(base, member),
          'diverged': r['diverged'],
          'nonfinite_steps': r['nonfinite_steps'],
          'clipped_steps': r['clipped_steps'],
          'train_loss': r['train_loss'],
          'eval_curve': [(step, m['eval/loss']) for step, m in sorted(r['eval'].items())],
          'select': r['final'],
          'report': r['report'],
          'seconds': result['seconds'],
          'members_trained_together': len(members),
        }
      )
    record = {
      'arm': arm.name,
      'lr': lr,
      'members_trained_together': earlier.get('members_trained_together', len(members)),  # the first
      'members': sorted(records, key=lambda m: m['seed']),
    }
    write_atomically(path, json.dumps(record, indent=1, default=float))
  logging.info(
    'arm %s: lr %s finished (%.0fs for %d members)', arm.name, _lrs(lrs), result['seconds'], len(members)
  )


def _lrs(lrs) -> str:
  return ', '.join(f'{lr:.3g}' for lr in sorted(lrs))


def _scores(records: dict[float, dict]) -> dict[float, list[float]]:
  return {
    lr: [protocol.member_score(m['select']['eval/loss'], m['diverged']) for m in r['members']]
    for lr, r in records.items()
  }


def lr_to_extend(lrs, done: dict[float, dict], max_extend: int) -> float | None:
  """The lr the protocol trains next beyond the grid's edge, given the finished lrs `done`; None when
  the best is inside (or the extensions are spent)."""
  best = protocol.select(protocol.lr_means(_scores(done)))
  return protocol.next_lr(lrs, done, best, max_extend)


def lrs_to_refine(done: dict[float, dict], refine_ratio: float) -> list[float]:
  """The midpoints the protocol trains next beside the best of the finished lrs `done` ([]: none)."""
  return protocol.refine_lrs(protocol.lr_means(_scores(done)), refine_ratio)


def arm_finished(out: str, arm: str, lrs, seeds, max_extend: int, refine_ratio: float = 0.0) -> bool:
  """Whether OUT holds every lr of the arm's grid and every extension and refinement the protocol asks
  for, each with every one of `seeds` — and no lr lacking one of them (seeds added, a run cut off before
  they reached every lr the arm has)."""
  records = finished_lrs(out, arm)
  done = at_seeds(records, seeds)
  return (
    len(done) == len(records)
    and all(lr in done for lr in lrs)
    and lr_to_extend(lrs, done, max_extend) is None
    and not lrs_to_refine(done, refine_ratio)
  )


def lr_groups(lrs: list[float], num_seeds: int, max_members: int) -> list[list[float]]:
  """`lrs` in groups that train together: all of them for `max_members` 0, else as many as fit
  `max_members` members (at least one lr, whose seeds never split)."""
  per_group = max(1, len(lrs) if max_members == 0 else max_members // num_seeds)
  return [lrs[i : i + per_group] for i in range(0, len(lrs), per_group)]


def add_seeds(plan: Plan, arm: Arm, short: dict[float, dict], progress: Progress) -> None:
  """Trains the seeds that the records `short` lack (seeds added to the sweep since they were trained),
  so that every seed is at every lr the arm has — extensions and refinements included — before the
  protocol looks at the lrs again. A member's numbers do not depend on which members it trains with
  beyond rounding (docs/sweeps.md, Cost), so the added seeds join the earlier ones as if trained with
  them."""
  lacking = {lr: tuple(missing_seeds(r, plan.seeds)) for lr, r in short.items()}
  for missing in sorted(set(lacking.values())):
    lrs = sorted(lr for lr, m in lacking.items() if m == missing)
    logging.info('arm %s: adding seeds %s at lr %s', arm.name, ', '.join(map(str, missing)), _lrs(lrs))
    # The grid's lrs were planned with every seed; an extension or refinement lr was not planned at all.
    in_grid = sum(lr in plan.lrs for lr in lrs)
    progress.planned += arm.config.total_steps * (len(missing) * len(lrs) - len(plan.seeds) * in_grid)
    for group in lr_groups(lrs, len(missing), plan.max_members):
      train_lrs(plan.out, plan.base, arm, group, list(missing), plan.splits, progress)


def run_arm(plan: Plan, arm: Arm, progress: Progress) -> dict[float, dict]:
  """The arm's records by lr once its grid is trained, extended and refined as far as the protocol
  asks."""
  out, base, lrs, seeds, splits = plan.out, plan.base, plan.lrs, plan.seeds, plan.splits
  max_extend, max_members, refine_ratio = plan.max_extend, plan.max_members, plan.refine_ratio
  steps = arm.config.total_steps
  records = finished_lrs(out, arm.name)
  done = at_seeds(records, seeds)
  if done:
    where = os.path.join(out, 'arms', arm.name)
    logging.info('arm %s: lr %s finished earlier, skipped (%s)', arm.name, _lrs(done), where)
    progress.planned -= steps * len(seeds) * sum(lr in done for lr in lrs)
  add_seeds(plan, arm, {lr: r for lr, r in records.items() if lr not in done}, progress)
  done = at_seeds(finished_lrs(out, arm.name), seeds)
  todo = [lr for lr in lrs if lr not in done]
  for group in lr_groups(todo, len(seeds), max_members):
    train_lrs(out, base, arm, group, seeds, splits, progress)
  while True:
    done = at_seeds(finished_lrs(out, arm.name), seeds)
    best = protocol.select(protocol.lr_means(_scores(done)))
    beyond = lr_to_extend(lrs, done, max_extend)
    if beyond is not None:
      logging.info(
        'arm %s: best lr %.3g is at the edge of %s; training lr %.3g', arm.name, best, _lrs(done), beyond
      )
      todo = [beyond]
    else:
      todo = lrs_to_refine(done, refine_ratio)  # Never moves the best lr to an edge: extensions are over.
      if not todo:
        return done
      logging.info(
        'arm %s: best lr %.3g has a step wider than ×%g beside it in %s; training lr %s',
        arm.name,
        best,
        refine_ratio,
        _lrs(done),
        _lrs(todo),
      )
    progress.planned += arm.config.total_steps * len(seeds) * len(todo)
    for group in lr_groups(todo, len(seeds), max_members):
      train_lrs(out, base, arm, group, seeds, splits, progress)


# ------------------------------------------------------------------------------------------------
# Results: the protocol's numbers, results.json, summary.md and lr_curves.png.
# ------------------------------------------------------------------------------------------------


def arm_result(arm: Arm, records: dict[float, dict]) -> dict[str, Any]:
  means = protocol.lr_means(_scores(records))
  best = protocol.select(means)
  chosen = records[best]['members']
  report = {
    key: protocol.spread([m['report'][key] for m in chosen]) for key in METRICS if key in chosen[0]['report']
  }
  return {
    'name': arm.name,
    'changes': arm.changes,
    'lrs': sorted(records),
    'lr_means': {f'{lr:.6e}': mean for lr, mean in means.items()},
    'selected_lr': best,
    'settled': protocol.settled(records, best),
    'lr_status': 'settled' if protocol.settled(records, best) else 'UNSETTLED',
    'report': report,
    'members': [m for lr in sorted(records) for m in records[lr]['members']],
  }


def compare(results: list[dict], baseline: str, level: float = 0.95) -> None:
  """Adds each arm's difference to the baseline arm (report split) with its Welch interval at `level`."""
  base = next(r for r in results if r['name'] == baseline)
  for r in results:
    r['vs_baseline'] = {}
    for key in r['report']:
      if key not in base['report']:
        continue
      groups = [r['report'][key]['values'], base['report'][key]['values']]
      interval = protocol.welch_interval(*groups, level=level)
      if interval is not None:
        interval['seeds_to_resolve'] = protocol.seeds_to_resolve(groups, [1, -1], level)
      r['vs_baseline'][key] = interval


def _number(x: float) -> str:
  return f'{x:.4f}' if math.isfinite(x) else str(x)


def summary(
  command: str,
  results: list[dict],
  baseline: str,
  splits,
  seeds,
  lrs,
  steps,
  refine_ratio: float = 0.0,
  earlier_seeds: list[list[int]] = (),
) -> str:
  looks = len(earlier_seeds) + 1
  level = protocol.interval_level(looks)
  percent = f'{100 * level:.4g}%'
  sequential = (
    f' Seeds were added after {looks - 1} earlier {"look" if looks == 2 else "looks"} at these comparisons '
    '(seeds '
    + '; '.join(', '.join(map(str, s)) for s in earlier_seeds)
    + f"), so the intervals are at Pocock's level for {looks} looks, {percent} (docs/sweeps.md)."
    if earlier_seeds
    else ''
  )
  refined = (
    " Each arm's grid is refined around its selected lr until the lrs beside it are within "
    f'×{refine_ratio:g} of it.'
    if refine_ratio
    else ''
  )
  lines = [
    '# Sweep',
    '',
    f'Command: `{command}`',
    '',
    f'Splits: trained on `{splits["train"]}`; the lr is selected on `{splits["select"]}` (mean eval loss '
    f'over seeds, a diverged seed counts as +inf); results are reported on `{splits["report"]}`, which the '
    'selection never saw.',
    f'Steps: {steps}. Grid: lr {_lrs(lrs)}, seeds {", ".join(map(str, seeds))} (each seed draws the '
    'initialisation, the data order and the dropout masks).' + refined,
    '',
    '## Arms',
    '',
    '| arm | changes to the base config |',
    '|---|---|',
  ]
  for r in results:
    changes = ', '.join(f'`{k}={v}`' for k, v in r['changes'].items()) or '(none)'
    lines.append(f'| {r["name"]}{" (baseline)" if r["name"] == baseline else ""} | {changes} |')
  all_lrs = sorted({lr for r in results for lr in r['lrs']})
  lines += [
    '',
    f'## Learning-rate curves: mean eval loss on `{splits["select"]}` over seeds',
    '',
    '| arm | ' + ' | '.join(f'{lr:.3g}' for lr in all_lrs) + ' |',
    '|---|' + '---|' * len(all_lrs),
  ]
  for r in results:
    cells = []
    for lr in all_lrs:
      mean = r['lr_means'].get(f'{lr:.6e}')
      cell = '' if mean is None else _number(mean)
      cells.append(f'**{cell}**' if lr == r['selected_lr'] else cell)
    lines.append(f'| {r["name"]} | ' + ' | '.join(cells) + ' |')
  lines += [
    '',
    f'## Results on `{splits["report"]}` at the selected lr',
    '',
    f"mean ± sample sd (min–max) over n seeds; Δ: mean minus the baseline's, with a {percent} Welch interval "
    '(unequal variances, Welch–Satterthwaite degrees of freedom; within an arm the seeds are independent '
    'draws, across arms seed s shares its data order, which makes the interval err on the wide side). An '
    'UNSETTLED lr is at the edge of the grid after its extensions: the optimum may lie beyond it.'
    + sequential,
    '',
  ]
  keys = [k for k in METRICS if any(k in r['report'] for r in results)]
  lines.append('| arm | selected lr | ' + ' | '.join(f'{k} | Δ {k} [{percent} CI]' for k in keys) + ' | n |')
  lines.append('|---|---|' + '---|---|' * len(keys) + '---|')
  for r in results:
    lr = f'{r["selected_lr"]:.3g}' + ('' if r['settled'] else ' UNSETTLED')
    cells = []
    for k in keys:
      s, d = r['report'][k], r['vs_baseline'].get(k)
      cells.append(f'{_number(s["mean"])} ± {_number(s["sd"])} ({_number(s["min"])}–{_number(s["max"])})')
      if r['name'] == baseline:
        cells.append('—')
      elif d is None:
        cells.append('(needs ≥ 2 seeds)')
      else:
        cells.append(f'{d["difference"]:+.4f} [{d["low"]:+.4f}, {d["high"]:+.4f}]')
    n = r['report']['eval/loss']['n']
    lines.append(f'| {r["name"]} | {lr} | ' + ' | '.join(cells) + f' | {n} |')
  budgets = [
    f'{r["name"]} {k}: {d["seeds_to_resolve"]}'
    for r in results
    for k, d in r['vs_baseline'].items()
    if d is not None and d.get('seeds_to_resolve')
  ]
  if budgets:
    lines += [
      '',
      "Intervals that contain zero, and the seeds per arm at which the interval's half-width, at these "
      'sds, would equal the measured difference (a rerun would then exclude zero about half the time if '
      'that difference is the true one): ' + '; '.join(budgets) + '.',
    ]
  return '\n'.join(lines) + '\n'


def plot(path: str, results: list[dict], splits) -> None:
  """Selection-split eval loss against lr per arm: the mean over seeds (line) and each seed (points)."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in results:
    lrs = sorted({m['lr'] for m in r['members']})
    means = [r['lr_means'][f'{lr:.6e}'] for lr in lrs]
    line = ax.plot(lrs, [m if math.isfinite(m) else np.nan for m in means], marker='o', label=r['name'])[0]
    finite = [(m['lr'], m['select']['eval/loss']) for m in r['members'] if not m['diverged']]
    if finite:
      ax.scatter(*zip(*finite), s=10, alpha=0.5, color=line.get_color())
  ax.set_title('lines: mean over seeds (diverged: left out); points: each seed', fontsize=9)
  ax.set_xscale('log')
  ax.set_xlabel('peak learning rate')
  ax.set_ylabel(f'eval loss on {splits["select"]}')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(plan: Plan, results: list[dict], earlier_seeds: list[list[int]]) -> None:
  level = protocol.interval_level(len(earlier_seeds) + 1)
  compare(results, plan.baseline, level)
  steps = sorted(
    {m['config_diff'].get('total_steps', plan.base.total_steps) for r in results for m in r['members']}
  )
  document = {
    'command': plan.command,
    'splits': plan.splits,
    'lrs': plan.lrs,
    'seeds': plan.seeds,
    'earlier_seeds': earlier_seeds,
    'interval_level': level,
    'refine_ratio': plan.refine_ratio,
    'baseline': plan.baseline,
    'arms': results,
  }
  write_atomically(os.path.join(plan.out, 'results.json'), json.dumps(document, indent=1, default=float))
  steps_text = ', '.join(map(str, steps))
  text = summary(
    plan.command,
    results,
    plan.baseline,
    plan.splits,
    plan.seeds,
    plan.lrs,
    steps_text,
    plan.refine_ratio,
    earlier_seeds,
  )
  write_atomically(os.path.join(plan.out, 'summary.md'), text)


# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """A checked command line."""

  base: Any
  arms: list[Arm]
  lrs: list[float]
  seeds: list[int]
  splits: dict[str, str]
  baseline: str
  max_extend: int
  refine_ratio: float
  max_members: int
  out: str
  command: str


def check(args) -> Plan:
  """Every check of the command line, before anything is written; one-line ValueErrors."""
  base, out = args.config, args.out
  lrs, seeds = parse_lrs(args.lrs), parse_seeds(args.seeds)
  if args.max_extend < 0:
    raise ValueError(f'--max_extend must be a non-negative integer, got {args.max_extend}')
  if not protocol.refine_ratio_allowed(args.refine_ratio):
    raise ValueError(
      f'--refine_ratio must be 0 (off) or at least {protocol.MIN_REFINE_RATIO}, got {args.refine_ratio}'
    )
  if args.max_members != 0 and args.max_members < len(seeds):
    raise ValueError(
      f"--max_members must be 0 or at least the number of seeds ({len(seeds)}: an lr's seeds train "
      f'together), got {args.max_members}'
    )
  cli.check_output_dir('--out', out)
  history.check_not_a_run('--out', out)
  config_lib.validate_config(base, num_devices=1)
  given = {'train': args.train_split, 'select': args.select_split, 'report': args.report_split}
  splits = sweep_splits(base, given)
  arms = [parse_arm(spec, base) for spec in args.arm or ['base:']]
  names = [a.name for a in arms]
  if len(set(names)) < len(names):
    raise ValueError(f'--arm names must differ, got {names}')
  baseline = args.baseline or names[0]
  if baseline not in names:
    raise ValueError(f'--baseline={baseline} is not an arm; the arms are {names}')
  arms = [dataclasses.replace(a, config=_with_splits(a.config, splits)) for a in arms]
  for arm in arms:
    check_arm(arm)
  command = shlex.join(['python', '-m', 'dsjax.sweep', *sys.argv[1:]])
  return Plan(
    base=base,
    arms=arms,
    lrs=lrs,
    seeds=seeds,
    splits=splits,
    baseline=baseline,
    max_extend=args.max_extend,
    refine_ratio=args.refine_ratio,
    max_members=args.max_members,
    out=out,
    command=command,
  )


# sweep.json's keys beside the identity: the seeds, which may grow, and the seeds of each earlier look.
SEED_KEYS = ('seeds', 'earlier_seeds')


def recorded_sweep(out: str) -> dict | None:
  """OUT/sweep.json (None before the sweep started)."""
  path = os.path.join(out, 'sweep.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def with_keys_added_since(recorded: dict, current: dict, defaults: dict) -> dict:
  """The recorded config with each key that dsjax gained after the sweep started filled in, where the
  current config holds that key's default: the default is how the sweep's runs were trained (a new key
  keeps the earlier behaviour at its default), so such a sweep is the same sweep. A new key set to
  anything else stays missing, and the sweep differs."""
  filled = dict(recorded)
  for key, value in current.items():
    default = defaults.get(key) if isinstance(defaults, dict) else None
    if key not in recorded:
      if key in defaults and value == default:
        filled[key] = value
    elif isinstance(value, dict) and isinstance(recorded[key], dict):
      filled[key] = with_keys_added_since(recorded[key], value, default if isinstance(default, dict) else {})
  return filled


def check_resumable(plan: Plan) -> None:
  """That OUT holds nothing or this sweep, with the same seeds or fewer (seeds may be added, never
  dropped); one-line ValueErrors."""
  recorded = recorded_sweep(plan.out)
  if recorded is None:
    return
  this_sweep = identity(plan.base, plan.arms, plan.lrs, plan.seeds, plan.splits)
  defaults = identity(config_lib.base_config(plan.base.model.name, plan.base.optimizer.name), [], [], [], {})[
    'config'
  ]
  recorded = dict(recorded, config=with_keys_added_since(recorded['config'], this_sweep['config'], defaults))
  if {k: v for k, v in recorded.items() if k not in SEED_KEYS} != {
    k: v for k, v in this_sweep.items() if k not in SEED_KEYS
  }:
    raise ValueError(
      f'--out={plan.out} holds another sweep (its base config, arms, grid or splits differ); '
      'rerun that command to resume it, or name another --out'
    )
  dropped = [s for s in recorded['seeds'] if s not in plan.seeds]
  if dropped:
    raise ValueError(
      f'--seeds={",".join(map(str, plan.seeds))} leaves out seeds {dropped} that --out={plan.out} holds; '
      'seeds may be added to a sweep, never dropped'
    )


def earlier_seeds(plan: Plan) -> list[list[int]]:
  """The earlier seed sets of this sweep: the recorded seeds each time a rerun added seeds ([] for a
  sweep that never grew). Each counts as a look at its comparisons, even where the sweep was cut off
  before it compared anything (on the safe side)."""
  recorded = recorded_sweep(plan.out)
  if recorded is None:
    return []
  earlier = recorded.get('earlier_seeds', [])
  return earlier + [recorded['seeds']] if set(recorded['seeds']) != set(plan.seeds) else earlier


def run(
  plan: Plan, stop_before: Callable[[Arm], bool] | None = None, train_arms: Collection[str] | None = None
) -> list[dict] | None:
  """Trains what OUT does not hold yet, arm by arm, and writes the outputs; the arms' results.
  `stop_before(arm)` True (e.g. a time budget that the arm would overrun) stops the sweep there, with
  what was finished kept under OUT and no outputs written; it returns None then. With `train_arms`, an
  unfinished arm not named there is left as it is (and the outputs are not written: None)."""
  out = plan.out
  check_resumable(plan)
  looked = earlier_seeds(plan)
  this_sweep = dict(identity(plan.base, plan.arms, plan.lrs, plan.seeds, plan.splits), earlier_seeds=looked)
  sweep_path = os.path.join(out, 'sweep.json')
  cli.create_output_dir('--out', out)
  write_atomically(sweep_path, json.dumps(this_sweep, indent=1))

  logging.info(
    'Sweep of %d arms × lr %s × seeds %s; splits %s', len(plan.arms), _lrs(plan.lrs), plan.seeds, plan.splits
  )
  progress = Progress(sum(a.config.total_steps for a in plan.arms) * len(plan.lrs) * len(plan.seeds))
  results, left = [], []
  for arm in plan.arms:
    finished = arm_finished(out, arm.name, plan.lrs, plan.seeds, plan.max_extend, plan.refine_ratio)
    if train_arms is not None and arm.name not in train_arms and not finished:
      logging.info('arm %s: unfinished, and not among the arms to train now', arm.name)
      left.append(arm.name)
      progress.planned -= arm.config.total_steps * len(plan.lrs) * len(plan.seeds)
      continue
    if stop_before is not None and stop_before(arm):
      logging.info('Stopped before arm %s; rerun the command to resume', arm.name)
      return None
    records = run_arm(plan, arm, progress)
    r = arm_result(arm, records)
    results.append(r)
    logging.info(
      'arm %s: selected lr %.3g%s; eval loss on %s %.4f ± %.4f over %d seeds',
      arm.name,
      r['selected_lr'],
      '' if r['settled'] else ' UNSETTLED (at the edge of the grid)',
      plan.splits['report'],
      r['report']['eval/loss']['mean'],
      r['report']['eval/loss']['sd'],
      len(plan.seeds),
    )
  if left:
    logging.info('Unfinished arms, left as they are: %s; no outputs written', ', '.join(left))
    return None
  write_outputs(plan, results, looked)
  plot(os.path.join(out, 'lr_curves.png'), results, plan.splits)
  written = ', '.join(os.path.join(out, f) for f in ('results.json', 'summary.md', 'lr_curves.png'))
  logging.info('Wrote %s', written)
  return results


def main(argv):
  del argv
  run(check(flags.FLAGS))


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
