r"""Contrasts between arms of one or several `python -m dsjax.sweep` results, with 95% intervals (Pocock's
level for a sweep that has grown).

  python experiments/compare.py --sweep=adamw=experiments/results/dnt_gpt_adamw \
      --sweep=msgdw=experiments/results/dnt_gpt_msgdw \
      --contrast='DNT, mSGDW − AdamW: msgdw/dnt - adamw/dnt' \
      --contrast='penalty, DNT − Pre-LN: msgdw/dnt - adamw/dnt - msgdw/preln + adamw/preln' \
      --out=experiments/results/dnt_gpt_contrasts.md

A contrast is 'LABEL: ±SWEEP/ARM ± …' over the report split's metric of each arm at its selected lr (the
seeds of `results.json`), with the Welch–Satterthwaite interval of `dsjax.train.protocol`; arms of
different sweeps are comparable when the sweeps share their data, steps and seeds (the splits are
checked). An arm whose lr is UNSETTLED is marked; a sweep whose seeds were added after an earlier look
makes the contrast's interval Pocock's for that many looks (docs/sweeps.md), named beside it. Where the
interval contains zero, the last column is `protocol.seeds_to_resolve`: the seeds per arm at which the
interval's half-width, at the measured sds, would equal the measured value (a rerun then excludes zero
about half the time if that value is true).

`--seeds=…` restricts each arm to some of its seeds, `--lr=LR` takes every arm at an lr they all trained
instead of its selected one, and `--below=X` adds, per two-arm contrast, the seeds of each arm ending below
X, the difference of those fractions with Newcombe's score interval, and a one-sided Fisher exact p
(docs/sweeps.md).

`--loop=NAME=DIR` takes the members of a sweep retrained by the independent loop instead
(`experiments/member_independent.py`'s JSONs in DIR, one lr per arm): the same contrasts over the loop's
report losses, to set beside the sweep's.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import sys

from absl import flags
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax import sweep as sweep_lib  # noqa: E402
from dsjax.train import cli, protocol  # noqa: E402

_TERM = re.compile(r'([+-])\s*([\w.-]+)/([\w.-]+)')


def load(sweeps: list[str]) -> dict[str, dict]:
  """{NAME: results.json of DIR} of every --sweep=NAME=DIR, all reported on the same splits."""
  if not sweeps:
    raise ValueError('--sweep, --loop: name at least one finished sweep as NAME=DIR')
  results = {}
  for entry in sweeps:
    name, _, directory = entry.partition('=')
    if not name or not directory:
      raise ValueError(f'--sweep={entry}: expected NAME=DIR')
    path = os.path.join(directory, 'results.json')
    try:
      with open(path) as f:
        results[name] = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"--sweep={entry}: {path} is not a finished sweep's results.json ({e})") from None
  splits = {json.dumps(r['splits'], sort_keys=True) for r in results.values()}
  if len(splits) > 1:
    raise ValueError(f'--sweep: the sweeps were reported on different splits: {sorted(splits)}')
  return results


def load_loop(entry: str) -> dict:
  """A results.json-like view of the member JSONs in DIR of --loop=NAME=DIR: per arm, the loop's report
  losses at the arm's one lr, reported on the splits of the sweep the members came from."""
  name, _, directory = entry.partition('=')
  paths = sorted(glob.glob(os.path.join(directory, '*.json'))) if name and directory else []
  if not paths:
    raise ValueError(f'--loop={entry}: expected NAME=DIR, DIR holding member_independent.py JSONs')
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  sweeps = {r['sweep'] for r in runs}
  if len(sweeps) > 1:
    raise ValueError(f'--loop={entry}: the members come from different sweeps {sorted(sweeps)}')
  with open(os.path.join(sweeps.pop(), 'sweep.json')) as f:
    splits = json.load(f)['splits']
  arms = {}
  for r in runs:
    arms.setdefault(r['arm'], []).append(r)
  for arm_name, arm_runs in arms.items():
    if len({r['lr'] for r in arm_runs}) > 1:
      raise ValueError(f'--loop={entry}: arm {arm_name} was retrained at more than one lr')
  return {
    'splits': splits,
    'arms': [
      {'name': n, 'settled': True, 'report': {'eval/loss': {'values': [r['report_loss'] for r in rs]}}}
      for n, rs in arms.items()
    ],
  }


def arms_changed(results: dict[str, dict], flag: str, change) -> dict[str, dict]:
  """The sweeps' results with every arm replaced by `change(sweep name, arm)`; `flag` names the option
  in the error for an independent loop's results, which hold no members to choose from."""
  changed = {}
  for name, result in results.items():
    if any('members' not in a for a in result['arms']):
      raise ValueError(f'{flag}: {name} is an independent loop, not a sweep; {flag} takes sweeps only')
    changed[name] = dict(result, arms=[change(name, a) for a in result['arms']])
  return changed


def report_over(arm: dict, members: list[dict]) -> dict:
  """The arm's report statistics recomputed over `members`."""
  return {key: protocol.spread([m['report'][key] for m in members]) for key in arm['report']}


def only_seeds(results: dict[str, dict], seeds: list[int]) -> dict[str, dict]:
  """The sweeps' results with each arm's report statistics over `seeds` alone, at the lr the arm's
  protocol selected with all its seeds: e.g. seeds added to a sweep, as a replication no earlier look saw.
  Such a contrast is a first look at those seeds (its level is 95%, whatever the sweeps' earlier_seeds)."""
  wanted = set(seeds)

  def restrict(name, arm):
    chosen = [m for m in arm['members'] if m['lr'] == arm['selected_lr'] and m['seed'] in wanted]
    if {m['seed'] for m in chosen} != wanted:
      raise ValueError(f'--seeds: arm {name}/{arm["name"]} lacks some of seeds {sorted(wanted)}')
    return dict(arm, report=report_over(arm, chosen))

  restricted = arms_changed(results, '--seeds', restrict)
  return {name: dict(result, earlier_seeds=[]) for name, result in restricted.items()}


def at_lr(results: dict[str, dict], lr: float) -> dict[str, dict]:
  """The sweeps' results with each arm's report statistics over its seeds at `lr` instead of the lr its
  protocol selected: a contrast at an lr the arms share, to set beside the protocol's (descriptive: no
  selection chose that lr). Each arm must have trained it; with --seeds, those seeds of it."""

  def move(name, arm):
    at = [m for m in arm['members'] if math.isclose(m['lr'], lr, rel_tol=1e-6)]
    if not at:
      trained = sorted({m['lr'] for m in arm['members']})
      raise ValueError(f'--lr={lr:g}: arm {name}/{arm["name"]} has not trained it; its lrs are {trained}')
    return dict(arm, selected_lr=at[0]['lr'], settled=True, report=report_over(arm, at))

  return arms_changed(results, '--lr', move)


def below_row(
  results: dict[str, dict], text: str, metric: str, threshold: float, looks_at_least: int = 1
) -> str:
  """For a contrast of two arms (+A − B): how many seeds of each end below `threshold` (e.g. runs that
  leave a loss plateau), the difference of the two fractions with Newcombe's score interval (at the
  contrast's level, as `contrast_row`'s), and the one-sided Fisher exact p that A's seeds end below it
  more often than B's."""
  label = text.rpartition(':')[0].strip()
  terms = terms_of(text)
  if sorted(sign for sign, _, _ in terms) != ['+', '-']:
    return f'| {label} | – | – | – | – (two arms, +A − B, only) |'
  counts = []
  for sign in '+-':
    _, sweep, name = next(t for t in terms if t[0] == sign)
    values = arm(results, sweep, name)['report'][metric]['values']
    counts.append((sum(v < threshold for v in values), len(values)))
  (a, n_a), (b, n_b) = counts
  looks = looks_of(results, terms, looks_at_least)
  level = protocol.interval_level(looks)
  out = protocol.fraction_difference_interval(a, n_a, b, n_b, level)
  note = f' ({looks} looks: a {100 * level:.4g}% interval)' if looks > 1 else ''
  p = stats.fisher_exact([[a, n_a - a], [b, n_b - b]], alternative='greater').pvalue
  return (
    f'| {label} | {a} of {n_a} | {b} of {n_b} | '
    f'{out["difference"]:+.3f} [{out["low"]:+.3f}, {out["high"]:+.3f}]{note} | {p:.3g} |'
  )


def gather(sweeps: list[str], loops: list[str]) -> dict[str, dict]:
  """{NAME: results} of every --sweep and --loop, all reported on the same splits."""
  results = load(sweeps) if sweeps or not loops else {}
  for entry in loops:
    name = entry.partition('=')[0]
    if name in results:
      raise ValueError(f'--loop={entry}: the name {name!r} is taken')
    results[name] = load_loop(entry)
  splits = {json.dumps(r['splits'], sort_keys=True) for r in results.values()}
  if len(splits) > 1:
    raise ValueError(f'--sweep, --loop: reported on different splits: {sorted(splits)}')
  return results


def arm(results: dict[str, dict], sweep: str, name: str) -> dict:
  if sweep not in results:
    raise ValueError(f'--contrast: no sweep {sweep!r}; the sweeps are {sorted(results)}')
  for a in results[sweep]['arms']:
    if a['name'] == name:
      return a
  names = [a['name'] for a in results[sweep]['arms']]
  raise ValueError(f'--contrast: no arm {name!r} in sweep {sweep!r}; its arms are {names}')


def terms_of(text: str) -> list[tuple[str, str, str]]:
  """[(sign, SWEEP, ARM), …] of a contrast 'LABEL: ±SWEEP/ARM ± …'; a ValueError unless it parses whole."""
  _, _, expression = text.rpartition(':')
  signed = expression.strip() if expression.lstrip()[:1] in '+-' else '+' + expression.strip()
  terms = _TERM.findall(signed)
  if not terms or _TERM.sub('', signed).strip():
    raise ValueError(f"--contrast={text!r}: expected 'LABEL: ±SWEEP/ARM ± SWEEP/ARM …'")
  return terms


def looks_of(results: dict[str, dict], terms: list[tuple[str, str, str]], looks_at_least: int) -> int:
  """The looks a contrast has had: a sweep whose seeds were added after an earlier look is judged at
  Pocock's level for that many (docs/sweeps.md)."""
  return max([looks_at_least] + [1 + len(results[s].get('earlier_seeds', [])) for _, s, _ in terms])


def contrast_row(results: dict[str, dict], text: str, metric: str, looks_at_least: int = 1) -> str:
  label, _, expression = text.rpartition(':')
  terms = terms_of(text)
  arms = [arm(results, sweep, name) for _, sweep, name in terms]
  if any(metric not in a['report'] for a in arms):
    raise ValueError(f'--metric={metric}: not reported by every arm of {text!r}')
  groups = [a['report'][metric]['values'] for a in arms]
  weights = [1.0 if sign == '+' else -1.0 for sign, _, _ in terms]
  looks = looks_of(results, terms, looks_at_least)
  level = protocol.interval_level(looks)
  out = protocol.contrast_interval(groups, weights, level)
  unsettled = [f'{s}/{n}' for (_, s, n), a in zip(terms, arms) if not a['settled']]
  notes = [f'UNSETTLED: {", ".join(unsettled)}'] if unsettled else []
  notes += [f'{looks} looks: a {100 * level:.4g}% interval'] if looks > 1 else []
  note = f' ({"; ".join(notes)})' if notes else ''
  if out is None:
    return f'| {label.strip()} | `{expression.strip()}` | – | fewer than two seeds{note} | – |'
  seeds = protocol.seeds_to_resolve(groups, weights, level)
  return (
    f'| {label.strip()} | `{expression.strip()}` | {out["difference"]:+.4f} | '
    f'[{out["low"]:+.4f}, {out["high"]:+.4f}] (df {out["df"]:.1f}){note} | {seeds or "–"} |'
  )


def _define_flags():
  # Defined only when run as a program, so that importing this module (tests) defines no absl flags.
  flags.DEFINE_multi_string('sweep', [], 'NAME=DIR of a finished sweep (its results.json).')
  flags.DEFINE_multi_string('contrast', [], "'LABEL: ±SWEEP/ARM ± SWEEP/ARM …'")
  flags.DEFINE_string('metric', 'eval/loss', 'The reported metric.')
  flags.DEFINE_string('out', None, 'Markdown file to write (default: print only).')
  flags.DEFINE_string(
    'seeds',
    None,
    "Only these seeds of each arm (comma-separated), at the lr selected with all the arm's seeds; a "
    'first look at them (95%).',
  )
  flags.DEFINE_float(
    'lr',
    None,
    'Each arm at this lr, which every arm has trained, instead of its selected one (descriptive: no '
    'selection chose it).',
  )
  flags.DEFINE_float(
    'below',
    None,
    'Also count the seeds of each arm of a two-arm contrast (+A − B) whose value ends below this, with the '
    "difference of the fractions (Newcombe's interval) and the one-sided Fisher exact p that A's do more "
    'often.',
  )
  flags.DEFINE_integer(
    'looks',
    1,
    'The total number of looks at every contrast, counting those in other sweep folders, which the '
    "sweeps' own earlier_seeds do not know of (at least the sweeps' own count is used; docs/sweeps.md).",
  )
  flags.DEFINE_multi_string(
    'loop', [], "NAME=DIR of a sweep's members retrained by experiments/member_independent.py (its JSONs)."
  )


def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {argv[1:]}; pass --sweep and --contrast')
  args = flags.FLAGS
  if not args.contrast:
    raise ValueError("--contrast: name at least one, as 'LABEL: ±SWEEP/ARM ± SWEEP/ARM …'")
  if args.looks < 1:
    raise ValueError(f'--looks must be at least 1, got {args.looks}')
  results = gather(args.sweep, args.loop)
  if args.lr is not None:
    results = at_lr(results, args.lr)
  if args.seeds is not None:
    results = only_seeds(results, sweep_lib.parse_seeds(args.seeds))
  rows = [contrast_row(results, c, args.metric, args.looks) for c in args.contrast]
  below = []
  if args.below is not None:
    below = [below_row(results, c, args.metric, args.below, args.looks) for c in args.contrast]
  if args.out:
    cli.create_output_file('--out', args.out)
  where = "each arm's selected lr" if args.lr is None else f'lr {args.lr:g} in every arm (no selection)'
  lines = [
    f'Contrasts of `{args.metric}` on the report split at {where} (Welch intervals, 95% unless a row '
    'names another level)',
    '',
    f'Command: `python {shlex.join(sys.argv)}`',
    '',
    '| contrast | arms | value | interval | seeds per arm to resolve |',
    '|---|---|---|---|---|',
    *rows,
  ]
  if below:
    lines += [
      '',
      f'| contrast | seeds of +A below {args.below:g} | seeds of −B below {args.below:g} | '
      "fraction below: +A − B [Newcombe's interval] | one-sided Fisher exact p (+A more often) |",
      '|---|---|---|---|---|',
      *below,
    ]
  text = '\n'.join(lines) + '\n'
  print(text)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text)


if __name__ == '__main__':
  _define_flags()
  cli.run(main)  # user errors as one line, without a traceback
