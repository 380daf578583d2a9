r"""Contrasts between arms of one or several `python -m dsjax.sweep` results, with 95% intervals.

  python experiments/compare.py --sweep=adamw=experiments/results/dnt_gpt_adamw \
      --sweep=msgdw=experiments/results/dnt_gpt_msgdw \
      --contrast='DNT, mSGDW − AdamW: msgdw/dnt - adamw/dnt' \
      --contrast='penalty, DNT − Pre-LN: msgdw/dnt - adamw/dnt - msgdw/preln + adamw/preln' \
      --out=experiments/results/dnt_gpt_contrasts.md

A contrast is 'LABEL: ±SWEEP/ARM ± …' over the report split's metric of each arm at its selected lr (the
seeds of `results.json`), with the Welch–Satterthwaite interval of `dsjax.train.protocol`; arms of
different sweeps are comparable when the sweeps share their data, steps and seeds (the splits are
checked). An arm whose lr is UNSETTLED is marked.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax.train import cli, protocol  # noqa: E402

_SWEEPS = flags.DEFINE_multi_string('sweep', [], 'NAME=DIR of a finished sweep (its results.json).')
_CONTRASTS = flags.DEFINE_multi_string('contrast', [], "'LABEL: ±SWEEP/ARM ± SWEEP/ARM …'")
_METRIC = flags.DEFINE_string('metric', 'eval/loss', 'The reported metric.')
_OUT = flags.DEFINE_string('out', None, 'Markdown file to write (default: print only).')

_TERM = re.compile(r'([+-])\s*([\w.-]+)/([\w.-]+)')


def load(sweeps: list[str]) -> dict[str, dict]:
  """{NAME: results.json of DIR} of every --sweep=NAME=DIR, all reported on the same splits."""
  if not sweeps:
    raise ValueError('--sweep: name at least one finished sweep as NAME=DIR')
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


def contrast_row(results: dict[str, dict], text: str, metric: str) -> str:
  label, _, expression = text.rpartition(':')
  terms = terms_of(text)
  arms = [arm(results, sweep, name) for _, sweep, name in terms]
  if any(metric not in a['report'] for a in arms):
    raise ValueError(f'--metric={metric}: not reported by every arm of {text!r}')
  groups = [a['report'][metric]['values'] for a in arms]
  weights = [1.0 if sign == '+' else -1.0 for sign, _, _ in terms]
  out = protocol.contrast_interval(groups, weights)
  unsettled = [f'{s}/{n}' for (_, s, n), a in zip(terms, arms) if not a['settled']]
  note = f' (UNSETTLED: {", ".join(unsettled)})' if unsettled else ''
  if out is None:
    return f'| {label.strip()} | `{expression.strip()}` | – | fewer than two seeds{note} |'
  return (
    f'| {label.strip()} | `{expression.strip()}` | {out["difference"]:+.4f} | '
    f'[{out["low"]:+.4f}, {out["high"]:+.4f}] (df {out["df"]:.1f}){note} |'
  )


def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {argv[1:]}; pass --sweep and --contrast')
  if not _CONTRASTS.value:
    raise ValueError("--contrast: name at least one, as 'LABEL: ±SWEEP/ARM ± SWEEP/ARM …'")
  results = load(_SWEEPS.value)
  if _OUT.value:
    cli.create_output_file('--out', _OUT.value)
  lines = [
    f"Contrasts of `{_METRIC.value}` on the report split at each arm's selected lr (95% Welch intervals)",
    '',
    '| contrast | arms | value | 95% interval |',
    '|---|---|---|---|',
  ] + [contrast_row(results, c, _METRIC.value) for c in _CONTRASTS.value]
  text = '\n'.join(lines) + '\n'
  print(text)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(text)


if __name__ == '__main__':
  cli.run(main)  # user errors as one line, without a traceback
