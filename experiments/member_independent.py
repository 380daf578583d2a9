r"""A `dsjax.sweep` member retrained by an independent loop, beside the sweep's: are its losses the method's?

A check of a sweep's results against the papers' directions before explaining them: experiments/README.md
§7 finds five prior methods ending below DSLM Post-LN at 16 × 32, where the DSLM paper has DSLM ahead of
all of them (Kedia et al. 2024, arXiv:2403.09635, Table 11); §1 finds DNT's mSGDW penalty larger than
the standard transformer's, where the DNT paper has it smaller (Qi et al. 2025, arXiv:2507.17501,
Table 1); §4 finds DSLM better at 4 layers, where the paper has the two comparable. This script
retrains any member (arm, lr, seed) of a sweep's folder with
experiments/independent_loop.py — the plain-`jnp` reference model, `jax.grad` alone and optax, from the
member's initial weights, batches and dropout masks — and sets its training and report losses beside the
member's:

  CONFIG=experiments/configs/dslm_bert.py:16x32 SWEEP=experiments/results/prior_methods
  OUT=experiments/results/prior_methods_independent   # each run ~25 s on 2 CPU cores
  python experiments/member_independent.py --config=$CONFIG --sweep=$SWEEP --arm=tfixup --lr=0.01 \
      --seed=0 --out=$OUT/tfixup_s0.json
  python experiments/member_independent.py --summarize --baseline=dslm_postln $OUT/*.json \
      > $OUT/summary.md                                  # experiments/README.md §7, "Checked independently"
  python -m dsjax.main --config=$CONFIG --config.model.scheme=rezero --config.model.block=nonorm \
      --config.optimizer.lr=0.03 --config.seed=0 --config.log_every=1 --config.data.train_split=train \
      --config.data.eval_split='validation[50%:]' --workdir=$OUT/dsjax_main/rezero_s0   # the member alone
  python experiments/member_independent.py --replicas \
      $OUT/rezero_s0.json=$OUT/dsjax_main/rezero_s0 > $OUT/replicas.md   # sweep, dsjax.main, loop

A member whose loop and sweep losses differ by more than rounding is trained a third way, by `dsjax.main`
alone (the sweep trains it vmapped with the rest of its population, which rounds differently), logging
every step and evaluating on the report split at the end: `--replicas` sets the three side by side.

`experiments/compare.py --loop=NAME=DIR` takes a folder of these JSONs (one lr per arm) as it takes a
sweep, for contrasts over the loop's report losses (§1's mSGDW penalties).

`--config` is the sweep's base config (the one its command named); the member's config is that config with
the arm's overrides (the sweep's `sweep.json`), the sweep's train and selection splits, the lr and the
seed. The script stops before training where the base config differs from the one the sweep recorded (on
the keys both have: fields added to the config since lack a record) or the member's differences from it
are not the ones the sweep recorded (`config_diff`). The report loss is on the sweep's report split.

Of §7's fourteen arms the reference implements eleven; it refuses Catformer (a concatenated stream),
Noci et al. (a warmed-up logit scale) and Value-SkipInit (identity-mixed attention), and the loop refuses
μP (per-parameter learning rates).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import schemes  # noqa: E402
from dsjax import sweep as sweep_lib  # noqa: E402
from dsjax.train import cli, protocol  # noqa: E402
from dsjax.train import config as config_lib  # noqa: E402
from experiments import independent_loop  # noqa: E402


def read_sweep(sweep: str) -> dict:
  """The sweep's `sweep.json`: its arms (overrides of the base config), lrs, seeds and splits."""
  path = os.path.join(sweep, 'sweep.json')
  if not os.path.exists(path):
    raise ValueError(f'--sweep={sweep}: no sweep.json there (a dsjax.sweep output folder is needed)')
  with open(path) as f:
    return json.load(f)


def member_record(sweep: str, arm: str, lr: float, seed: int) -> dict:
  """The sweep's record of the member (`arms/ARM/lr_LR.json`)."""
  path = sweep_lib.lr_path(sweep, arm, lr)
  if not os.path.exists(path):
    raise ValueError(f'--arm={arm} --lr={lr:g}: the sweep has no such arm or lr ({path})')
  with open(path) as f:
    members = json.load(f)['members']
  for member in members:
    if member['seed'] == seed:
      return member
  raise ValueError(f'--seed={seed}: not among the seeds of arm {arm} at lr {lr:g} in {path}')


def member_config(base, described: dict, arm: str, lr: float, seed: int):
  """The base config with the arm's overrides, the sweep's splits, the lr and the seed."""
  config = copy.deepcopy(base)
  for key, value in described['arms'][arm].items():
    config_path.set_value(key, config, value)
  config.data.train_split = described['splits']['train']
  config.data.eval_split = described['splits']['select']
  config.optimizer.lr, config.seed = lr, seed
  config_lib.validate_config(config, num_devices=1)
  return config


def check_same_member(base, config, described: dict, record: dict) -> None:
  """Refuses a base config other than the sweep's, or a member config other than the one it recorded.
  The base configs are compared on the keys both have (a sweep recorded before a config field existed
  lacks it; the model's implementation keys are not recorded) that matter to the member (`_matters`),
  the members' differences from them on all."""
  ours = sweep_lib.identity(base, [], [], [], {})['config']
  differ = [
    k for k in _differing(ours, described['config'], shared_only=True) if _matters(k, config.model.scheme)
  ]
  if not differ:
    diff = json.loads(json.dumps(sweep_lib.config_diff(base, config), default=str))
    differ = _differing(diff, record['config_diff'], shared_only=False)
  if differ:
    raise ValueError(
      f"--config: not the sweep's base config; the member differs from it in {', '.join(differ)}"
    )


def _matters(key: str, scheme: str) -> bool:
  """False for another method's config section (`model.<scheme>.*`, read only by that method), whose
  defaults may have changed since the sweep ran."""
  parts = key.split('.')
  return not (len(parts) > 2 and parts[0] == 'model' and parts[1] in schemes.SCHEMES and parts[1] != scheme)


def _differing(a: dict, b: dict, shared_only: bool) -> list[str]:
  """The flattened keys where two (nested) dicts differ; with `shared_only`, of the keys both have."""
  a, b = sweep_lib.flat_keys(a), sweep_lib.flat_keys(b)
  keys = set(a) & set(b) if shared_only else set(a) | set(b)
  return sorted(k for k in keys if a.get(k) != b.get(k))


def prepare(base, sweep: str, arm: str, lr: float, seed: int) -> tuple:
  """(the member's config, the sweep's description, its record of the member), after every check."""
  described = read_sweep(sweep)
  if arm not in described['arms']:
    raise ValueError(f"--arm={arm}: the sweep's arms are {', '.join(described['arms'])}")
  record = member_record(sweep, arm, lr, seed)
  config = member_config(base, described, arm, lr, seed)
  check_same_member(base, config, described, record)
  independent_loop.check_supported(config)
  independent_loop.initial_model(config)  # the loop's and the reference's refusals
  return config, described, record


def retrain(config, described: dict, record: dict, sweep: str, arm: str) -> dict:
  """The member retrained by the independent loop, with the sweep's record of it beside."""
  return {
    'sweep': os.path.normpath(sweep),
    'arm': arm,
    'lr': config.optimizer.lr,
    'seed': config.seed,
    **independent_loop.train(config, described['splits']['report']),
    'sweep_member': {
      'train_loss': record['train_loss'],
      'report_loss': record['report']['eval/loss'],
      'clipped_steps': record.get('clipped_steps'),
    },
    'device': jax.devices()[0].device_kind,
    'dtype': 'float32',
    'jax': jax.__version__,
  }


def _largest_gap(run: dict) -> tuple[float, int]:
  """The largest |loop − sweep| of the training losses both logged, and how many they share."""
  sweep_losses = dict(map(tuple, run['sweep_member']['train_loss']))
  gaps = [abs(loss - sweep_losses[step]) for step, loss in run['train_loss'] if step in sweep_losses]
  return max(gaps), len(gaps)


def summary(runs: list[dict], baseline: str | None) -> str:
  """Markdown: each run beside its sweep member; then, per arm at its lr, arm − baseline in report loss
  with its 95% interval (Welch's, the protocol's), by the loop and by the sweep on the same seeds."""
  if len({r['sweep'] for r in runs}) > 1:
    raise ValueError('--summarize: the JSONs are of different sweeps')
  lines = [
    '| arm | lr | seed | report loss, independent loop | report loss, dsjax sweep | loop − sweep '
    '| largest train-loss difference (losses compared) |',
    '|---|---|---|---|---|---|---|',
  ]
  runs = sorted(runs, key=lambda r: (r['arm'], r['lr'], r['seed']))
  for r in runs:
    gap, shared = _largest_gap(r)
    loop, member = r['report_loss'], r['sweep_member']['report_loss']
    lines.append(
      f'| {r["arm"]} | {r["lr"]:g} | {r["seed"]} | {loop:.4f} | {member:.4f} | {loop - member:+.1e} '
      f'| {gap:.1e} ({shared}) |'
    )
  members = [(r['arm'], r['lr'], r['seed']) for r in runs]
  if len(set(members)) < len(members):
    raise ValueError('--summarize: a member (arm, lr, seed) appears in more than one JSON')
  groups = {}
  for r in runs:
    groups.setdefault((r['arm'], r['lr']), []).append(r)
  base_groups = [key for key in groups if key[0] == baseline]
  if baseline is None:
    return '\n'.join(lines)
  if len(base_groups) != 1:
    raise ValueError(f'--baseline={baseline}: needs runs of that arm at one lr, found {len(base_groups)} lrs')
  base = sorted(groups[base_groups[0]], key=lambda r: r['seed'])
  lines.append(f'\nReport loss, arm − {baseline} at lr {base_groups[0][1]:g}, 95% interval (Welch):\n')
  lines += ['| arm | lr | seeds | independent loop | dsjax sweep |', '|---|---|---|---|---|']
  for (arm, lr), arm_runs in sorted(groups.items()):
    if arm == baseline:
      continue
    cells = []
    for value in (lambda r: r['report_loss'], lambda r: r['sweep_member']['report_loss']):
      interval = protocol.welch_interval([value(r) for r in arm_runs], [value(r) for r in base])
      cells.append('–' if interval is None else _interval(interval))
    seeds = ', '.join(str(r['seed']) for r in sorted(arm_runs, key=lambda r: r['seed']))
    lines.append(f'| {arm} | {lr:g} | {seeds} | {cells[0]} | {cells[1]} |')
  return '\n'.join(lines)


def main_run(run: dict, workdir: str) -> dict:
  """A `dsjax.main` run of the loop run's member (its workdir: config.json, metrics.jsonl logged every
  step, evaluated at the end on the sweep's report split): its training loss averaged over the sweep's
  logging windows and its report loss. Refused where it is another member."""
  with open(os.path.join(workdir, 'config.json')) as f:
    config = sweep_lib.flat_keys(json.load(f))
  described = read_sweep(run['sweep'])
  record = member_record(run['sweep'], run['arm'], run['lr'], run['seed'])
  # The sweep's base config with the member's differences from it, evaluated on the report split and
  # logged every step; compared on the keys both have (see `check_same_member`).
  expected = {**sweep_lib.flat_keys(described['config']), **record['config_diff'], 'seed': run['seed']}
  expected.update({'data.eval_split': described['splits']['report'], 'log_every': 1})
  other = sorted(
    k
    for k, v in expected.items()
    if k in config and config[k] != v and _matters(k, config.get('model.scheme'))
  )
  if other:
    raise ValueError(
      f'{workdir}: not the member {run["arm"]} at lr {run["lr"]:g}, seed {run["seed"]} ({other})'
    )
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  losses = {r['step']: r['train/loss'] for r in records if 'train/loss' in r}
  window = record['train_loss'][0][0]
  logged = [
    [step, float(np.mean([losses[s] for s in range(step - window + 1, step + 1)]))]
    for step, _ in record['train_loss']
  ]
  final = [r['eval/loss'] for r in records if r['step'] == config['total_steps'] and 'eval/loss' in r]
  return {'train_loss': logged, 'report_loss': final[-1]}


def replicas(pairs: list[tuple[dict, str]]) -> str:
  """Markdown: members trained three ways that differ only in how they round — the sweep (the member
  vmapped with the others of its population), `dsjax.main` (alone) and the independent loop — with each
  one's report loss and its largest training-loss difference from the sweep's."""
  lines = [
    '| arm | lr | seed | report loss: sweep | dsjax.main | independent loop '
    '| largest train-loss difference from the sweep: dsjax.main | loop |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for run, workdir in sorted(pairs, key=lambda p: (p[0]['arm'], p[0]['seed'])):
    main = main_run(run, workdir)
    main_gap, _ = _largest_gap({**main, 'sweep_member': run['sweep_member']})
    loop_gap, _ = _largest_gap(run)
    lines.append(
      f'| {run["arm"]} | {run["lr"]:g} | {run["seed"]} | {run["sweep_member"]["report_loss"]:.4f} '
      f'| {main["report_loss"]:.4f} | {run["report_loss"]:.4f} | {main_gap:.1e} | {loop_gap:.1e} |'
    )
  return '\n'.join(lines)


def _interval(i: dict) -> str:
  return f'{i["difference"]:+.3f} [{i["low"]:+.3f}, {i["high"]:+.3f}]'


def main(argv):
  args = flags.FLAGS
  if args.replicas:
    pairs = []
    for pair in argv[1:]:
      path, _, workdir = pair.partition('=')
      with open(path) as f:
        pairs.append((json.load(f), workdir))
    print(replicas(pairs))
    return
  if args.summarize:
    runs = []
    for path in argv[1:]:
      with open(path) as f:
        runs.append(json.load(f))
    if not runs:
      raise ValueError('--summarize reads the JSONs named as arguments; none given')
    print(summary(runs, args.baseline))
    return
  if len(argv) > 1:
    raise ValueError(f'{argv[1]!r}: paths are read with --summarize and --replicas only')
  if args.config is None or args.sweep is None or args.arm is None:
    raise ValueError("--config (the sweep's base config), --sweep (its folder) and --arm are required")
  if not np.isfinite(args.lr) or args.lr <= 0:
    raise ValueError(f'--lr must be > 0, got {args.lr}')
  config, described, record = prepare(args.config, args.sweep, args.arm, args.lr, args.seed)
  cli.create_output_file('--out', args.out)  # A bad path now, not after the training.
  result = retrain(config, described, record, args.sweep, args.arm)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  member = result['sweep_member']['report_loss']
  print(f'wrote {args.out}: report loss {result["report_loss"]:.4f} (sweep {member:.4f})')


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, "The sweep's base config (as its command named it).")
  flags.DEFINE_string('sweep', None, 'The dsjax.sweep output folder whose member is retrained.')
  flags.DEFINE_string('arm', None, 'The arm (a name in the sweep).')
  flags.DEFINE_float('lr', 0.0, "The peak learning rate (one of the arm's).")
  flags.DEFINE_integer('seed', 0, "The seed (one of the sweep's).")
  flags.DEFINE_string('out', None, 'The JSON to write.')
  flags.DEFINE_bool('summarize', False, 'Print the table of the JSONs named as arguments; train nothing.')
  flags.DEFINE_string('baseline', None, 'With --summarize: the arm the others are compared with.')
  flags.DEFINE_bool(
    'replicas',
    False,
    'Print the report losses of members trained by the sweep, by dsjax.main and by this loop, from '
    'arguments RUN_JSON=DSJAX_MAIN_WORKDIR; train nothing.',
  )
  cli.run(main)  # user errors as one line, without a traceback
