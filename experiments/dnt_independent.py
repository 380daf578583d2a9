r"""DNT against the Pre-LN transformer retrained by an independent loop: is the gap between them the models'?

With AdamW, DNT (setting S5) ends far below Pre-LN (S1) in both of this project's GPT comparisons:
−0.184 nats per byte on the byte-level GPT of experiments/README.md §1, and −0.68 nats per token
(≈ 0.20 per byte) on the GPU's 4×128 GPT (§11). The DNT paper's GPT-2 differences are 0.004–0.039 nats
per token (Qi et al. 2025, arXiv:2507.17501, Table 1). This script retrains the sweeps' members with none
of dsjax's model, gradient or optimizer code on the path and sets them beside the sweeps' own:

  OUT=experiments/results/dnt_independent  # §1 (--study=bytes): each run ~35 s on 2 CPU cores
  python experiments/dnt_independent.py --arm=preln --seed=0 --out=$OUT/preln_s0.json
  python experiments/dnt_independent.py --arm=dnt --seed=0 --out=$OUT/dnt_s0.json
  python experiments/dnt_independent.py --summarize $OUT/*.json > $OUT/summary.md  # experiments/README.md §1

  OUT=experiments/results/dnt_independent_stdlib  # §11 (--study=stdlib): ~45 min on 2 CPU cores
  python experiments/dnt_independent.py --study=stdlib --arm=preln --lr=1e-2 --seed=0 \
      --out=$OUT/preln_lr1e-2_s0.json  # the same for --arm=dnt --lr=9e-2; then --summarize as above
  python experiments/dnt_independent.py --study=stdlib --arm=dnt --lr=1e-2 --seed=0 --steps=300 \
      --out=$OUT/dnt_lr1e-2_s0.json  # the first 300 steps only: ~15 min
  python experiments/dnt_independent.py --summarize_dsjax $OUT/dsjax_float32_cpu/*  # dsjax.main workdirs
  python experiments/dnt_independent.py --study=stdlib --arm=preln --lr=1e-2 --seed=0 --steps=200 \
      --log_every=1 --out=$OUT/step_by_step/preln_lr1e-2_s0.json  # every step's loss: ~6 min
  python experiments/dnt_independent.py --step_by_step $OUT/step_by_step/preln_lr1e-2_s0.json \
      $OUT/dsjax_float32_cpu/preln_lr1e-2_s0  # where the loop parts from dsjax.main, step by step
  python experiments/dnt_independent.py --replicas $OUT/preln_lr1e-2_s0.json \
      $OUT/dsjax_float32_cpu*/preln_lr1e-2_s0  # runs of one member that differ only in rounding

`--study=bytes` is §1's AdamW sweep (`experiments/configs/dnt.py:gpt,adamw`; train on 'train', select on
'validation[:50%]', report on 'validation[50%:]'). `--study=stdlib` is §11's DNT AdamW sweep on one H200
(`experiments/configs/gpu_stdlib.py:dnt,adamw` with the tokenizer it used, committed in
results/gpu_decisive/tokenizer/; 'train', 'validation', 'test'), and `--study=stdlib_msgdw` its mSGDW half
(`gpu_stdlib.py:dnt,msgdw`: momentum 0.9, weight decay 1e-4, the same warm-up), run there with bfloat16
branches and cuDNN's attention (jax 0.11.2), here in float32 (jax 0.10.2): a difference between the two is
what the GPU's precision, kernels and jax version do. `--steps=K` trains the first K steps of the run (the
same schedule, which still ends at the run's last step) and evaluates nothing: the sweep evaluates only at
the end, so the logged training losses are what the two share then.

The loop is experiments/independent_loop.py: the model is `experiments/plain_reference.py` (plain `jnp`,
RMSNorm and DNT's norm placements written out; `jax.grad` alone, no custom derivative rule), started from
dsjax's initial weights for the seed; the optimizer is optax written there from the paper's GPT settings
as the configs set them (Tables 3 and 5: `clip_by_global_norm(1.0)`, then AdamW with betas (0.9, 0.95),
eps 1e-8 and decoupled weight decay 0.1 on the weight matrices and the token table, the lr warmed up from
0 and decayed by a cosine to 0.1 of the peak at the run's last step); the batches are dsjax's
(`dsjax.data.make_pipeline` with the seed), as are the sweep's splits. The run records its training loss
averaged over each `log_every` steps, as the sweep logs it, and its loss on the report split, and sets
them beside those of the sweep's member of the same arm, lr and seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable

import jax
import numpy as np
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs'))
import dnt as dnt_configs  # noqa: E402  (experiments/configs/dnt.py)
import gpu_stdlib  # noqa: E402  (experiments/configs/gpu_stdlib.py)

from dsjax import data as data_lib  # noqa: E402
from dsjax.train import cli, protocol  # noqa: E402
from dsjax.train import config as config_lib  # noqa: E402
from experiments import independent_loop  # noqa: E402

SETTINGS = {'preln': 'S1', 'dnt': 'S5'}  # DNT §4.4: S1 the standard Pre-Norm transformer, S5 DNT
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


@dataclasses.dataclass(frozen=True)
class Study:
  """One of the sweeps retrained: its base config, its splits and where its members' results are."""

  get_config: Callable  # () -> the sweep's base config (arm S1)
  splits: dict  # 'train', 'select', 'report' -> split
  sweep: str  # the sweep's folder (its `arms/ARM/lr_LR.json`)


def _stdlib_config(optimizer: str = 'adamw'):
  """§11's config with the tokenizer the GPU sweep used, refused where this Python's standard library is
  not the text it was trained on (the GPU machine read this machine's library, packed)."""
  c = gpu_stdlib.get_config(f'dnt,{optimizer}')
  tokenizer_dir = os.path.join(RESULTS, 'gpu_decisive', 'tokenizer')
  c.data.tokenizer = os.path.join(tokenizer_dir, 'tokenizer.json')
  with open(os.path.join(tokenizer_dir, 'tokenizer_info.json')) as f:
    trained_on = json.load(f)['corpus_sha256']
  here = data_lib.dataset_info(c.data).corpus_sha256
  if here != trained_on:
    raise ValueError(
      f"--study=stdlib: this Python's standard library (corpus {here[:16]}) is not the one the GPU sweep "
      f'read ({trained_on[:16]}, Python 3.11.7)'
    )
  return c


STUDIES = {
  # §1: byte-level GPT on the embedded Python documentation, 4 × 64, 300 steps.
  'bytes': Study(
    lambda: dnt_configs.get_config('gpt,adamw'),
    {'train': 'train', 'select': 'validation[:50%]', 'report': 'validation[50%:]'},
    os.path.join(RESULTS, 'dnt_gpt_adamw'),
  ),
  # §11: 4 × 128 GPT on the standard library with a 4,096-token BPE, 1,000 steps, on one H200.
  'stdlib': Study(
    _stdlib_config,
    {'train': 'train', 'select': 'validation', 'report': 'test'},
    os.path.join(RESULTS, 'gpu_decisive', 'dnt_adamw'),
  ),
  # §11's mSGDW half: the same model and data, mSGDW with the same warm-up.
  'stdlib_msgdw': Study(
    lambda: _stdlib_config('msgdw'),
    {'train': 'train', 'select': 'validation', 'report': 'test'},
    os.path.join(RESULTS, 'gpu_decisive', 'dnt_msgdw'),
  ),
}


def arm_config(arm: str, lr: float, seed: int, study: str = 'bytes'):
  """The study's member with the arm's setting, lr and seed, trained on its train split and
  evaluated (by dsjax) on its selection split."""
  c = STUDIES[study].get_config()
  c.model.dnt_setting, c.optimizer.lr, c.seed = SETTINGS[arm], lr, seed
  c.data.train_split, c.data.eval_split = STUDIES[study].splits['train'], STUDIES[study].splits['select']
  config_lib.validate_config(c, num_devices=1)
  return c


def _arm_file(arm: str, lr: float, study: str) -> str:
  """The sweep's results of an arm at one lr (dsjax.sweep's `arms/ARM/lr_LR.json`)."""
  return os.path.join(STUDIES[study].sweep, 'arms', arm, f'lr_{lr:e}.json')


def sweep_member(arm: str, lr: float, seed: int, study: str = 'bytes') -> dict | None:
  """The sweep's member of the same arm, lr and seed: its logged training losses and report loss."""
  path = _arm_file(arm, lr, study)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    members = json.load(f)['members']
  for m in members:
    if m['seed'] == seed:
      path = os.path.relpath(path, os.path.dirname(RESULTS))
      return {'train_loss': m['train_loss'], 'report_loss': m['report']['eval/loss'], 'path': path}
  return None


def _steps(run: dict) -> tuple[int, int]:
  """Steps trained and the run's length (runs recorded before `--steps` trained the whole run)."""
  if 'steps' in run:
    return run['steps'], run['total_steps']
  return run['train_loss'][-1][0], run['train_loss'][-1][0]


def _report(value: float | None) -> str:
  return '–' if value is None else f'{value:.4f}'


def summary(paths: list[str]) -> str:
  """Markdown: per run, the largest difference of the logged training losses from the sweep's member
  and both report losses; per seed, each Pre-LN run's logged training losses beside each DNT run's;
  then DNT − Pre-LN on the report split with its 95% interval, from each loop."""
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  studies = {r.get('study', 'bytes') for r in runs}  # runs recorded before --study retrained §1
  if len(studies) > 1:
    raise ValueError(f'--summarize: the JSONs are of different studies ({", ".join(sorted(studies))})')
  lines = [
    '| arm | lr | seed | steps trained | report loss, independent loop | report loss, dsjax sweep '
    '| largest train-loss difference (logged losses compared) |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in sorted(runs, key=lambda r: (r['arm'], r['lr'], r['seed'])):
    m = r['sweep_member']
    gaps = [abs(a - m_loss) for a, m_loss in _by_step(r, m).values()] if m else []
    gap = f'{max(gaps):.2e} ({len(gaps)})' if gaps else '–'
    trained, total = _steps(r)
    sweep = _report(m['report_loss']) if m else '–'
    lines.append(
      f'| {r["arm"]} | {r["lr"]:g} | {r["seed"]} | {trained} of {total} | {_report(r["report_loss"])} '
      f'| {sweep} | {gap} |'
    )
  lines += _side_by_side(runs)
  for lr in sorted({r['lr'] for r in runs}):
    by_arm = {arm: [r for r in runs if r['lr'] == lr and r['arm'] == arm] for arm in SETTINGS}
    for source, value in (
      ('independent loop', lambda r: r['report_loss']),
      ('dsjax sweep', lambda r: r['sweep_member'] and r['sweep_member']['report_loss']),
    ):
      groups = [[value(r) for r in by_arm['dnt']], [value(r) for r in by_arm['preln']]]
      if any(v is None for g in groups for v in g):
        continue
      interval = protocol.contrast_interval(groups, [1, -1])
      if interval:
        lines.append(
          f'\nDNT − Pre-LN at lr {lr:g}, {source}: {interval["difference"]:+.4f} '
          f'[{interval["low"]:+.4f}, {interval["high"]:+.4f}] ({len(groups[0])} and {len(groups[1])} seeds)'
        )
  return '\n'.join(lines)


def _side_by_side(runs: list[dict]) -> list[str]:
  """Per seed, each Pre-LN run against each DNT run (at its own lr or another): every logged training
  loss of both loops, and DNT − Pre-LN."""
  lines = []
  with_member = [r for r in runs if r['sweep_member']]
  for seed in sorted({r['seed'] for r in with_member}):
    arms = {
      arm: sorted((r for r in with_member if (r['arm'], r['seed']) == (arm, seed)), key=lambda r: r['lr'])
      for arm in SETTINGS
    }
    for preln in arms['preln']:
      for dnt in arms['dnt']:
        lines += _pair_table(preln, dnt)
  return lines


def _by_step(run: dict, member: dict) -> dict[int, tuple[float, float]]:
  """The logged training losses of a run and of its sweep member, at the steps both logged."""
  member_losses = dict(map(tuple, member['train_loss']))
  return {step: (loss, member_losses[step]) for step, loss in run['train_loss'] if step in member_losses}


def _pair_table(preln: dict, dnt: dict) -> list[str]:
  """Both runs' and both sweep members' logged training losses, at the steps all four logged, and the
  difference of the report losses when both runs trained to the end."""
  p_losses, d_losses = _by_step(preln, preln['sweep_member']), _by_step(dnt, dnt['sweep_member'])
  steps = sorted(set(p_losses) & set(d_losses))
  if not steps:
    return []
  lines = [
    f'\nTraining loss (mean of each {steps[0]} steps), seed {dnt["seed"]}, '
    f'Pre-LN at lr {preln["lr"]:g}, DNT at lr {dnt["lr"]:g}:\n',
    '| step | Pre-LN, independent | Pre-LN, sweep | DNT, independent | DNT, sweep '
    '| DNT − Pre-LN, independent | DNT − Pre-LN, sweep |',
    '|---|---|---|---|---|---|---|',
  ]
  for step in steps:
    (p, sp), (d, sd) = p_losses[step], d_losses[step]
    lines.append(f'| {step} | {p:.4f} | {sp:.4f} | {d:.4f} | {sd:.4f} | {d - p:+.4f} | {sd - sp:+.4f} |')
  if preln['report_loss'] is not None and dnt['report_loss'] is not None:
    loop_gap = dnt['report_loss'] - preln['report_loss']
    sweep_gap = dnt['sweep_member']['report_loss'] - preln['sweep_member']['report_loss']
    lines.append(
      f'\nReport loss, DNT − Pre-LN: {loop_gap:+.4f} independent loop, {sweep_gap:+.4f} dsjax sweep'
    )
  return lines


def _read_workdir(workdir: str) -> tuple[tuple, dict, list[dict]]:
  """(arm, lr, seed), the config and the logged records of a `dsjax.main` workdir."""
  with open(os.path.join(workdir, 'config.json')) as f:
    config = json.load(f)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  arm = 'dnt' if config['model'].get('dnt_setting') == SETTINGS['dnt'] else 'preln'
  return (arm, config['optimizer']['lr'], config['seed']), config, records


def dsjax_run(workdir: str, study: str = 'stdlib') -> dict:
  """A `dsjax.main` run of a sweep's member (its workdir's config.json and metrics.jsonl, logged every
  step) as this script's runs are recorded: arm, lr, seed, the training loss averaged over each of the
  sweep member's logging windows, the report loss and the sweep member."""
  (arm, lr, seed), config, records = _read_workdir(workdir)
  report_split = STUDIES[study].splits['report']
  if config['data']['eval_split'] != report_split:
    raise ValueError(f'{workdir}: evaluated on {config["data"]["eval_split"]!r}, not {report_split!r}')
  member = sweep_member(arm, lr, seed, study)
  losses = {r['step']: r['train/loss'] for r in records}
  window = member['train_loss'][0][0]
  logged = [
    [step, float(np.mean([losses[s] for s in range(step - window + 1, step + 1)]))]
    for step, _ in member['train_loss']
    if all(s in losses for s in range(step - window + 1, step + 1))
  ]
  finals = [r['eval/loss'] for r in records if r['step'] == config['total_steps'] and 'eval/loss' in r]
  return {
    'arm': arm,
    'lr': lr,
    'seed': seed,
    'train_loss': logged,
    'report_loss': finals[-1] if finals else None,
    'sweep_member': member,
  }


def dsjax_summary(workdirs: list[str]) -> str:
  """Markdown: each `dsjax.main` run beside the sweep's member of the same arm, lr and seed (on one
  machine and precision against the sweep's): the largest difference of the logged training losses, the
  difference at a few steps and of the report losses; then, per arm and lr, the report losses' mean
  difference over seeds with its 95% interval (paired by seed, t with seeds − 1 degrees of freedom)."""
  runs = sorted((dsjax_run(w) for w in workdirs), key=lambda r: (r['arm'], r['lr'], r['seed']))
  lines = [
    '| arm | lr | seed | largest train-loss difference (steps) | run − sweep at step 300 / 550 / 1,000 '
    '| report loss, run | report loss, sweep | run − sweep |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in runs:
    by_step = _by_step(r, r['sweep_member'])
    largest = max(by_step.values(), key=lambda pair: abs(pair[0] - pair[1]))
    at = ' / '.join(
      f'{a - b:+.4f}' for a, b in (by_step[step] for step in (300, 550, 1000) if step in by_step)
    )
    sweep_report = r['sweep_member']['report_loss']
    lines.append(
      f'| {r["arm"]} | {r["lr"]:g} | {r["seed"]} | {largest[0] - largest[1]:+.4f} ({len(by_step)}) | {at} '
      f'| {_report(r["report_loss"])} | {sweep_report:.4f} | {r["report_loss"] - sweep_report:+.4f} |'
    )
  for arm, lr in sorted({(r['arm'], r['lr']) for r in runs}):
    diffs = [
      r['report_loss'] - r['sweep_member']['report_loss'] for r in runs if (r['arm'], r['lr']) == (arm, lr)
    ]
    # One group of paired differences: its contrast interval is the one-sample t interval (seeds − 1 df).
    interval = protocol.contrast_interval([diffs], [1])
    if interval:
      d = protocol.spread(diffs)
      lines.append(
        f'\n{arm} at lr {lr:g}, report loss, run − sweep over {d["n"]} seeds: '
        f'{d["mean"]:+.4f} ± {d["sd"]:.4f} (sd), '
        f'95% interval [{interval["low"]:+.4f}, {interval["high"]:+.4f}], '
        f'range [{d["min"]:+.4f}, {d["max"]:+.4f}]'
      )
  lines.extend(_gap_lines(runs))
  return '\n'.join(lines)


def _gap_lines(runs: list[dict]) -> list[str]:
  """DNT − Pre-LN in report loss over the seeds run, by these runs and by the sweep's members of the same
  seeds, each with the 95% interval the sweep's claim uses (Welch's, the arms as independent groups).
  Only when each arm ran at one lr and at least two seeds."""
  by_arm = {arm: [r for r in runs if r['arm'] == arm] for arm in ('dnt', 'preln')}
  if any(len(arm_runs) < 2 or len({r['lr'] for r in arm_runs}) > 1 for arm_runs in by_arm.values()):
    return []
  dnt, preln = by_arm['dnt'], by_arm['preln']
  seeds = ', '.join(str(r['seed']) for r in dnt), ', '.join(str(r['seed']) for r in preln)
  lines = [
    f'\nDNT at lr {dnt[0]["lr"]:g} (seeds {seeds[0]}) − Pre-LN at lr {preln[0]["lr"]:g} (seeds {seeds[1]}), '
    'report loss, 95% interval (Welch):'
  ]
  for label, value in (
    ('run', lambda r: r['report_loss']),
    ('sweep', lambda r: r['sweep_member']['report_loss']),
  ):
    interval = protocol.welch_interval([value(r) for r in dnt], [value(r) for r in preln])
    lines.append(
      f'- {label}: {interval["difference"]:+.4f} [{interval["low"]:+.4f}, {interval["high"]:+.4f}]'
    )
  return lines


def _every_step(path: str) -> tuple[tuple, dict[int, float], str]:
  """(arm, lr, seed), the training loss at every step logged and a label: of this loop's JSON logged
  every step (`--log_every=1`) or of a `dsjax.main` workdir (a folder; its metrics.jsonl)."""
  if os.path.isdir(path):
    member, _, records = _read_workdir(path)
    return member, {r['step']: r['train/loss'] for r in records if 'train/loss' in r}, 'dsjax.main'
  with open(path) as f:
    run = json.load(f)
  if run['train_loss'][0][0] != 1:
    every = run['train_loss'][0][0]
    raise ValueError(f'{path}: logged every {every} steps, not every step (--log_every=1)')
  return (run['arm'], run['lr'], run['seed']), dict(map(tuple, run['train_loss'])), 'the loop'


def step_by_step(first: str, second: str, windows: int = 10) -> str:
  """Markdown: where two runs of one member, each logged every step, part: the first step at which their
  training losses differ, and the largest difference in each of `windows` equal spans of the steps both
  logged. Each is this loop's JSON (`--log_every=1`) or a `dsjax.main` workdir. Two implementations of
  one computation agree to the bit until their roundings first differ; how fast that difference then
  grows is the training's own sensitivity to rounding."""
  (member, losses, label), (other, other_losses, other_label) = _every_step(first), _every_step(second)
  if member != other:
    raise ValueError(f'{first} and {second}: not the same arm, lr and seed')
  diffs = [(step, loss - other_losses[step]) for step, loss in sorted(losses.items()) if step in other_losses]
  differs = next((step for step, d in diffs if d != 0), None)
  arm, lr, seed = member
  lines = [
    f'{arm} at lr {lr:g}, seed {seed}: {label} − {other_label}, training loss at each of {len(diffs)} '
    f'steps; first step that differs: {differs or "none"}\n',
    '| steps | largest difference | at step |',
    '|---|---|---|',
  ]
  span = max(1, math.ceil(len(diffs) / windows))
  for i in range(0, len(diffs), span):
    step, d = max(diffs[i : i + span], key=lambda sd: abs(sd[1]))
    lines.append(f'| {diffs[i][0]}–{diffs[i : i + span][-1][0]} | {d:+.2e} | {step} |')
  return '\n'.join(lines)


def _report_of(path: str) -> tuple[tuple, float | None]:
  """(arm, lr, seed) and the report loss of this loop's JSON or of a `dsjax.main` workdir (its evaluation
  at the last step); None for a run that did not train to the end."""
  if os.path.isdir(path):
    run = dsjax_run(path)
  else:
    with open(path) as f:
      run = json.load(f)
  return (run['arm'], run['lr'], run['seed']), run['report_loss']


def replicas(paths: list[str], study: str = 'stdlib') -> str:
  """Markdown: runs of one member (arm, lr and seed) that differ only in how they round — this loop,
  `dsjax.main` with other XLA flags or microbatches — each with its report loss, and their spread beside
  the sweep's member of that seed and the sweep's spread over its seeds at that lr."""
  by_member: dict[tuple, list[tuple[str, float]]] = {}
  for path in paths:
    member, loss = _report_of(path)
    if loss is not None:
      by_member.setdefault(member, []).append((os.path.normpath(path), loss))
  lines = []
  for (arm, lr, seed), runs in sorted(by_member.items()):
    d = protocol.spread([loss for _, loss in runs])
    lines += [
      f'\n{arm} at lr {lr:g}, seed {seed}: report loss of {d["n"]} runs\n',
      '| run | report loss |',
      '|---|---|',
    ]
    lines += [f'| {path} | {loss:.4f} |' for path, loss in runs]
    lines.append(f'\nthese runs: {_spread_text(d)}')
    arm_file = _arm_file(arm, lr, study)
    if os.path.exists(arm_file):
      with open(arm_file) as f:
        members = json.load(f)['members']
      over_seeds = protocol.spread([m['report']['eval/loss'] for m in members])
      this_seed = ''.join(
        f'seed {seed} {m["report"]["eval/loss"]:.4f}; ' for m in members if m['seed'] == seed
      )
      lines.append(f'the sweep: {this_seed}its {over_seeds["n"]} seeds {_spread_text(over_seeds)}')
  return '\n'.join(lines)


def _spread_text(d: dict) -> str:
  return f'{d["mean"]:.4f} ± {d["sd"]:.4f} (sd), range {d["min"]:.4f}–{d["max"]:.4f}'


def main(argv):
  args = flags.FLAGS
  if args.summarize:
    print(summary(argv[1:]))
    return
  if args.summarize_dsjax:
    print(dsjax_summary(argv[1:]))
    return
  if args.replicas:
    print(replicas(argv[1:]))
    return
  if args.step_by_step:
    if len(argv) != 3:
      raise ValueError('--step_by_step reads two runs: JSONs of this loop or dsjax.main workdirs')
    print(step_by_step(*argv[1:]))
    return
  if len(argv) > 1:
    raise ValueError(
      f'{argv[1]!r}: paths are read with --summarize, --summarize_dsjax, --replicas, --step_by_step'
    )
  if not args.lr > 0:
    raise ValueError(f'--lr must be > 0, got {args.lr}')
  config = arm_config(args.arm, args.lr, args.seed, args.study)
  if args.log_every < 0:
    raise ValueError(f"--log_every must be >= 0 (0: the sweep's {config.log_every}), got {args.log_every}")
  config.log_every = args.log_every or config.log_every
  steps = args.steps or config.total_steps
  if not 0 < steps <= config.total_steps or steps % config.log_every:
    raise ValueError(
      f"--steps must be a multiple of the run's {config.log_every} steps between logged losses, at most "
      f'its {config.total_steps} steps; got {args.steps}'
    )
  cli.create_output_file('--out', args.out)  # A bad path now, not after the training.
  result = {
    'study': args.study,
    'arm': args.arm,
    'setting': SETTINGS[args.arm],
    'lr': args.lr,
    'seed': args.seed,
    **independent_loop.train(config, STUDIES[args.study].splits['report'], steps),
    'sweep_member': sweep_member(args.arm, args.lr, args.seed, args.study),
    'device': jax.devices()[0].device_kind,
    'dtype': 'float32',
    'jax': jax.__version__,
  }
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(f'wrote {args.out}: report loss {_report(result["report_loss"])}')


if __name__ == '__main__':
  flags.DEFINE_enum(
    'study',
    'bytes',
    list(STUDIES),
    "The sweep retrained: 'bytes' (§1), 'stdlib' or 'stdlib_msgdw' (§11's AdamW or mSGDW half).",
  )
  flags.DEFINE_enum('arm', 'dnt', list(SETTINGS), "'preln' (S1) or 'dnt' (S5).")
  flags.DEFINE_float('lr', 1e-2, "Peak learning rate (§1's selected lr for both arms, §11's for Pre-LN).")
  flags.DEFINE_integer('seed', 0, 'Parameter and data seed.')
  flags.DEFINE_integer('steps', 0, "Train the run's first this many steps only (0: all); no report loss.")
  flags.DEFINE_integer('log_every', 0, "Steps per logged mean training loss (0: the sweep's).")
  flags.DEFINE_string('out', None, 'The JSON to write.')
  flags.DEFINE_bool('summarize', False, 'Print the table of the JSONs named as arguments; train nothing.')
  flags.DEFINE_bool(
    'summarize_dsjax', False, 'Print the table of the dsjax.main workdirs named as arguments; train nothing.'
  )
  flags.DEFINE_bool(
    'replicas',
    False,
    'Print the report losses of runs of one member that differ only in rounding (loop JSONs, dsjax.main '
    'workdirs) beside the sweep; train nothing.',
  )
  flags.DEFINE_bool(
    'step_by_step',
    False,
    'Print where two runs logged every step (loop JSONs, dsjax.main workdirs) part; train nothing.',
  )
  cli.run(main)  # user errors as one line, without a traceback
