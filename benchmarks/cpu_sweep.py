r"""Member-steps per second of a vmapped sweep against the same runs made one after another.

  python benchmarks/cpu_sweep.py [--steps=60] [--lrs=3e-4,1e-3,3e-3,1e-2] [--seeds=0,1,2]
      [--override=KEY=VALUE ...] [--json=benchmarks/results/cpu_sweep.json]

Runs `python -m dsjax.sweep` once over the lr × seed grid of configs/gpt_preln.py shrunk to `--steps`
steps (one arm, no edge extension), then `python -m dsjax.main` once per member, each a fresh process:
both sides pay start-up, data loading and compilation as a user of either would. The sweep also
evaluates its members on a second split (the report split), which the single runs do not. Prints the
wall times, member-steps per second of each side, their ratio, and the largest difference between a
member's final eval loss and its single run's (the two compute the same runs). `--override` (a config
key, repeatable) applies to both sides, e.g. for a quick check with a smaller model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax
from absl import flags

from dsjax import sweep
from dsjax.train import cli

_STEPS = flags.DEFINE_integer('steps', 60, 'Training steps of every member.')
_LRS = flags.DEFINE_string('lrs', '3e-4,1e-3,3e-3,1e-2', 'Peak learning rates, comma-separated.')
_SEEDS = flags.DEFINE_string('seeds', '0,1,2', 'Seeds, comma-separated.')
_OVERRIDES = flags.DEFINE_multi_string('override', [], 'KEY=VALUE config overrides of both sides.')
_JSON = flags.DEFINE_string('json', None, 'Also write the results to this JSON file.')

CONFIG = 'configs/gpt_preln.py'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config_flags(steps: int) -> list[str]:
  shrunk = [f'total_steps={steps}', f'eval_every={steps}', f'checkpoint_every={steps}', f'log_every={steps}']
  shrunk.append(f'optimizer.warmup_steps={max(1, steps // 10)}')
  return [f'--config={CONFIG}'] + [f'--config.{o}' for o in shrunk + _OVERRIDES.value]


def _timed(command: list[str]) -> float:
  """Seconds `command` took; a ValueError with its last error line if it failed (a bad --override is
  reported by the command it reaches)."""
  t0 = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if done.returncode != 0:
    last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ['no error output']
    raise ValueError(f'{command[2]} exited with {done.returncode}: {last[0]}')
  return time.perf_counter() - t0


def _final_eval_loss(workdir: str) -> float:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if 'eval/loss' in line]
  return rows[-1]['eval/loss']


def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {argv[1:]}')
  if _STEPS.value < 1:
    raise ValueError(f'--steps={_STEPS.value}: must be a positive integer')
  sweep.parse_lrs(_LRS.value), sweep.parse_seeds(_SEEDS.value)  # the checks of dsjax.sweep, which runs them
  lrs, seeds = _LRS.value.split(','), _SEEDS.value.split(',')
  if _JSON.value:
    cli.create_output_file('--json', _JSON.value)
  common = _config_flags(_STEPS.value)
  member_steps = len(lrs) * len(seeds) * _STEPS.value
  with tempfile.TemporaryDirectory() as scratch:
    out = os.path.join(scratch, 'sweep')
    sweep_s = _timed(
      [sys.executable, '-m', 'dsjax.sweep', *common, f'--lrs={_LRS.value}', f'--seeds={_SEEDS.value}']
      + ['--max_extend=0', f'--out={out}']
    )
    with open(os.path.join(out, 'results.json')) as f:
      document = json.load(f)
    splits = document['splits']
    swept = {(m['lr'], m['seed']): m['select']['eval/loss'] for m in document['arms'][0]['members']}

    run_s, differences, members = [], [], []
    for lr in lrs:
      for seed in seeds:
        workdir = os.path.join(scratch, f'run_{lr}_{seed}')
        member = [f'--config.optimizer.lr={lr}', f'--config.seed={seed}']
        member += [
          f'--config.data.train_split={splits["train"]}',
          f'--config.data.eval_split={splits["select"]}',
        ]
        run_s.append(_timed([sys.executable, '-m', 'dsjax.main', *common, *member, f'--workdir={workdir}']))
        differences.append(abs(_final_eval_loss(workdir) - swept[float(lr), int(seed)]))
        members.append((lr, seed))

  sequential_s = sum(run_s)
  results = {
    'python': sys.version.split()[0],
    'jax': jax.__version__,
    'cpus': os.cpu_count(),
    'config': CONFIG,
    'config_overrides': common[1:],
    'lrs': lrs,
    'seeds': seeds,
    'steps': _STEPS.value,
    'members': len(lrs) * len(seeds),
    'sweep_s': round(sweep_s, 2),
    'sequential_s': round(sequential_s, 2),
    'single_run_s': [round(s, 2) for s in run_s],
    'sweep_member_steps_per_s': round(member_steps / sweep_s, 2),
    'sequential_member_steps_per_s': round(member_steps / sequential_s, 2),
    'speedup': round(sequential_s / sweep_s, 2),
    'max_abs_eval_loss_difference': max(differences),
    'abs_eval_loss_differences': {f'{lr},{seed}': d for (lr, seed), d in zip(members, differences)},
  }
  for key, value in results.items():
    print(f'{key}: {value}')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  cli.run(main)  # user errors as one line, without a traceback
