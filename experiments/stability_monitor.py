r"""Does the stability monitor (`dsjax.instrument.monitor`) fire on runs that go wrong, how long before
their loss departs from a healthy run's, and does it stay silent on healthy runs?

  python experiments/stability_monitor.py --out=experiments/results/stability_monitor [--cases=a,b]

Each case is `python -m dsjax.main` under `/usr/bin/time -v` with `instrument.every=10` (the monitor on,
default thresholds), in WORKROOT/<case>. The deep cases share one recipe — GPT, 4 heads, seq 32, batch 16,
dropout 0.1, AdamW lr 5e-3 (30 warmup steps, cosine), clip 1, 150 steps on the embedded
Python-documentation bytes (`configs/gpt_dslm_deep.py` with depth, width, block and method changed);
the DSLM Pre-LN 64 × 32 run is each one's healthy reference (for the width-16 cases one of another
width: see the dslm_preln_64x16 case). The loss departs from the reference at the first logged step
(every 5) from which on its train loss stays more than `DEPART_NATS` above the reference's. The defaults
`configs/gpt_preln.py` and `configs/vit_dnt.py` run 200 of their steps.

Writes OUT/<case>/stability.jsonl and metrics.jsonl (copied from the run), OUT/summary.json (per case:
flags, first flag step, departure step, CPU time) and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
DEPART_NATS = 0.1
DEEP = [
  '--config=configs/gpt_dslm_deep.py',
  '--config.total_steps=150',
  '--config.log_every=5',
  '--config.eval_every=150',
  '--config.checkpoint_every=150',
]


def deep(depth: int, width: int, block: str = 'preln', scheme: str = 'dslm') -> list[str]:
  return DEEP + [
    f'--config.model.{k}={v}' for k, v in dict(depth=depth, width=width, block=block, scheme=scheme).items()
  ]


DEFAULT = [
  '--config.total_steps=200',
  '--config.log_every=10',
  '--config.eval_every=200',
  '--config.checkpoint_every=200',
]
# case: (overrides, the healthy reference's case or None, expected healthy). In the order they run.
CASES = {
  'dslm_preln_64x32': (deep(64, 32), None, True),
  'dslm_postln_64x32': (deep(64, 32, 'postln'), 'dslm_preln_64x32', False),
  'vanilla_postln_64x32': (deep(64, 32, 'postln', 'vanilla'), 'dslm_preln_64x32', False),
  'gpt_preln': (['--config=configs/gpt_preln.py'] + DEFAULT, None, True),
  'vit_dnt': (['--config=configs/vit_dnt.py'] + DEFAULT, None, True),
  'vanilla_postln_96x16': (deep(96, 16, 'postln', 'vanilla'), 'dslm_preln_64x32', False),
  'dslm_postln_64x16': (deep(64, 16, 'postln'), 'dslm_preln_64x32', False),
  'dslm_preln_64x16': (deep(64, 16), 'dslm_preln_64x32', False),
}


def run_case(name: str, workroot: str) -> dict:
  overrides, _, _ = CASES[name]
  workdir = os.path.join(workroot, name)
  shutil.rmtree(workdir, ignore_errors=True)
  cmd = [
    sys.executable,
    '-m',
    'dsjax.main',
    *overrides,
    '--config.instrument.every=10',
    f'--workdir={workdir}',
  ]
  proc = subprocess.run(['/usr/bin/time', '-v', *cmd], cwd=REPO, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f'{name} failed:\n{proc.stderr[-3000:]}')
  time_field = lambda label: float(re.search(rf'{label}: ([\d.]+)', proc.stderr).group(1))  # noqa: E731
  last_line = [line for line in proc.stderr.splitlines() if 'stability monitor:' in line][-1]
  return {
    'command': 'python -m dsjax.main ' + ' '.join(cmd[3:-1]) + f' --workdir=WORKROOT/{name}',
    'cpu_s': time_field('User time \\(seconds\\)') + time_field('System time \\(seconds\\)'),
    'summary_line': last_line.split('] ', 1)[-1],
    'workdir': workdir,
  }


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def losses(workdir: str) -> dict[int, float]:
  return {r['step']: r['train/loss'] for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl'))}


def departure(loss: dict[int, float], reference: dict[int, float]) -> int | None:
  """The first logged step from which on `loss` stays more than DEPART_NATS above `reference`."""
  steps = sorted(set(loss) & set(reference))
  above = [loss[s] - reference[s] > DEPART_NATS for s in steps]
  for i, s in enumerate(steps):
    if all(above[i:]):
      return s
  return None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--workroot', default='/tmp/stability_monitor')
  parser.add_argument('--cases', default=','.join(CASES))
  args = parser.parse_args()
  names = args.cases.split(',')
  for name in names:
    if name not in CASES:
      parser.error(f'--cases: {name!r} is not one of {list(CASES)}')
  summary_path = os.path.join(args.out, 'summary.json')
  summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
  for name in names:
    print(f'running {name}…', flush=True)
    result = run_case(name, args.workroot)
    rows = read_jsonl(os.path.join(result['workdir'], 'stability.jsonl'))
    raised = [r for r in rows if r['event'] == 'raised']
    os.makedirs(os.path.join(args.out, name), exist_ok=True)
    for file in ('stability.jsonl', 'metrics.jsonl'):
      shutil.copy(os.path.join(result['workdir'], file), os.path.join(args.out, name, file))
    loss = losses(result['workdir'])
    summary[name] = {
      **{k: v for k, v in result.items() if k != 'workdir'},
      'healthy_expected': CASES[name][2],
      'reference': CASES[name][1],
      'first_flag_step': min((r['step'] for r in raised), default=None),
      'flags_raised': [
        {k: r[k] for k in ('step', 'kind', 'site', 'layer', 'quantity', 'value', 'threshold')} for r in raised
      ],
      'final_train_loss': loss[max(loss)],
      'loss': loss,
    }
    print(f'  {summary[name]["summary_line"]} ({result["cpu_s"]:.0f} CPU s)', flush=True)
    with open(summary_path, 'w') as f:  # after every case, so that an interrupted sweep keeps its runs
      json.dump(summary, f, indent=1)
  for name, case in summary.items():
    ref = case['reference']
    if ref in summary:
      case['departure_step'] = departure(
        {int(k): v for k, v in case['loss'].items()}, {int(k): v for k, v in summary[ref]['loss'].items()}
      )
  os.makedirs(args.out, exist_ok=True)
  with open(summary_path, 'w') as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(args.out, 'table.md'), 'w') as f:
    f.write(table(summary))
  print(table(summary))


def table(summary: dict) -> str:
  lines = [
    '| case | expected | first flag (step: kind) | kinds raised | loss departs (step) | lead (steps) '
    '| final train loss | CPU s |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for name, c in summary.items():
    first = c['first_flag_step']
    kinds = sorted({r['kind'] for r in c['flags_raised']})
    first_kinds = sorted({r['kind'] for r in c['flags_raised'] if r['step'] == first})
    depart = c.get('departure_step')
    lead = depart - first if depart is not None and first is not None else None
    lines.append(
      f'| {name} | {"healthy" if c["healthy_expected"] else "goes wrong"} '
      f'| {"—" if first is None else f"{first}: " + ", ".join(first_kinds)} | {", ".join(kinds) or "none"} '
      f'| {"—" if depart is None else depart} | {"—" if lead is None else lead} '
      f'| {c["final_train_loss"]:.3f} | {c["cpu_s"]:.0f} |'
    )
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  main()
