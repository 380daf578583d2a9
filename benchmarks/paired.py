"""What the CPU benchmark scripts share: paired timing of implementations in one process, their flags
(the checks, and the JSON written), and loading a config file with overrides.

On a shared or virtual machine the speed drifts by tens of percent within minutes, so the scripts time
both implementations in turn, in alternating order, and compare them round by round. Before each timed
call the process idles for `pause` seconds: both runtimes' worker threads spin for a while after their
work and would otherwise take cores from the other's next call.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np


def require_torch(script: str):
  """The `torch` module, or one line naming what to install (PyTorch is not a dependency of dsjax)."""
  try:
    import torch
  except ModuleNotFoundError:
    sys.exit(f'{os.path.basename(script)} needs PyTorch beside dsjax: pip install torch')
  return torch


def load_config(path, overrides: list[str] = ()):
  """The config of the file at `path`, with each 'key.path=value' of `overrides` set (the value read as
  a Python literal where it is one, else as a string)."""
  spec = importlib.util.spec_from_file_location('benchmarked_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for override in overrides:
    key, _, text = override.partition('=')
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    *parents, name = key.split('.')
    section = config
    for depth, part in enumerate(parents + [name]):
      if not hasattr(section, 'keys') or part not in section.keys():
        raise ValueError(f'{override}: the config has no key {key!r}')
      if depth < len(parents):
        section = section[part]
    try:
      section[name] = value
    except (TypeError, ValueError) as e:  # ml_collections keeps each field's type
      raise ValueError(f'{override}: {e}') from None
  return config


def add_config_args(parser: argparse.ArgumentParser) -> None:
  """`--config` (a config file, default the default GPT's) and `--set=KEY=VALUE` (repeatable), read by
  `config_from_args`."""
  parser.add_argument('--config', default='configs/gpt_preln.py', help='A config file (configs/*.py).')
  parser.add_argument(
    '--set',
    action='append',
    default=[],
    metavar='KEY=VALUE',
    help='Override a config key, e.g. --set=model.depth=192 (repeatable).',
  )


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """The config of `--config` with the `--set` overrides; one-line usage errors for a missing file, an
  override without '=', a key the config lacks or a value of the wrong type."""
  if not os.path.isfile(args.config):
    parser.error(f'--config={args.config} is not a file')
  for override in args.set:
    if '=' not in override:
      parser.error(f'--set={override}: expected KEY=VALUE')
  try:
    return load_config(args.config, args.set)
  except ValueError as e:
    parser.error(f'--set={e}')


def parse_config_timing_args(
  doc: str, add_args: Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[argparse.Namespace, object]:
  """The flags of a script that times variants of one config's step in turns (`--rounds`, `--pause`,
  `--json`, `--config`, `--set`, and what `add_args` adds to the parser), checked, and the config they
  name: (args, config). `doc`: the script's docstring, whose first paragraph describes it."""
  parser = timing_parser(doc.split('\n\n')[0], 'rounds', 'rounds')
  if add_args is not None:
    add_args(parser)
  add_config_args(parser)
  args = parse_timing_args(parser, 'rounds')
  return args, config_from_args(parser, args)


def ratio_summary(times_ms: dict[str, list[float]], base: str) -> dict:
  """Per round, each arm's time over `base`'s: median and quartiles, by arm (`base` left out)."""
  ratios = {name: np.array(t) / np.array(times_ms[base]) for name, t in times_ms.items() if name != base}
  return {
    f'ratio_to_{base}_median': {name: float(np.median(r)) for name, r in ratios.items()},
    f'ratio_to_{base}_quartiles': {
      name: [float(np.percentile(r, 25)), float(np.percentile(r, 75))] for name, r in ratios.items()
    },
  }


def without_part(
  times_ms: dict[str, list[float]], part_ms: dict[str, list[float]], base: str, part: str
) -> dict:
  """Each arm's times less a part of them timed on its own (`part_ms`, call by call, for the arms that
  have the part), and per round their ratio to `base`'s (`ratio_summary`): e.g. an instrumented step
  less the host's making of its records, which the train loop overlaps with the next step. Keys name
  the part: '{part}_ms', '{part}_ms_median', 'step_ms_without_{part}',
  'ratio_to_{base}_without_{part}_median' and '..._quartiles'."""
  rest_ms = {
    name: [t - p for t, p in zip(ts, part_ms.get(name, [0.0] * len(ts)), strict=True)]
    for name, ts in times_ms.items()
  }
  summary = ratio_summary(rest_ms, base)
  return {
    f'{part}_ms': part_ms,
    f'{part}_ms_median': {name: statistics.median(t) for name, t in part_ms.items()},
    f'step_ms_without_{part}': rest_ms,
    f'ratio_to_{base}_without_{part}_median': summary[f'ratio_to_{base}_median'],
    f'ratio_to_{base}_without_{part}_quartiles': summary[f'ratio_to_{base}_quartiles'],
  }


def report(
  args: argparse.Namespace,
  seconds: dict[str, list[float]],
  base: str,
  device: str,
  commit: str,
  jax_version: str,
  checkout_head: str | None = None,
) -> dict:
  """Prints and returns (for `--json`) the results of a script that times config variants of one step
  in turns (`--config`, `--set`, `--rounds`): each arm's step times, and per round its ratio to
  `base`'s. `commit`: the one the JSON names (`bench.recorded_commit`); `checkout_head`: the source
  tree's own (`bench.source_commit`), where the two may differ."""
  times = {name: [1e3 * t for t in ts] for name, ts in seconds.items()}
  summary = ratio_summary(times, base)
  results = {
    'date': time.strftime('%Y-%m-%d'),
    'jax': jax_version,
    'config': args.config,
    'overrides': args.set,
    'device': device,
    'commit': commit,
    'checkout_head': checkout_head,
    'rounds': args.rounds,
    'pause_s': args.pause,
    'step_ms': times,
    'step_ms_median': {name: statistics.median(t) for name, t in times.items()},
    **summary,
  }
  print(f'{args.config}, {args.rounds} rounds on {device}; jax {jax_version}, {results["date"]}')
  print_times(times, summary, base)
  return results


def print_times(times_ms: dict[str, list[float]], summary: dict, base: str) -> None:
  """Each arm's median and min–max step time, with its per-round ratio to `base` (`ratio_summary`)."""
  for name, t in times_ms.items():
    line = f'  {name:18s} {statistics.median(t):8.1f} ms/step median (min {min(t):.1f}, max {max(t):.1f})'
    if name != base:
      q = summary[f'ratio_to_{base}_quartiles'][name]
      line += (
        f'   / {base} per round: {summary[f"ratio_to_{base}_median"][name]:.3f} '
        f'(quartiles {q[0]:.3f}–{q[1]:.3f})'
      )
    print(line)


def timing_parser(description: str, count: str, what: str) -> argparse.ArgumentParser:
  """A parser with the flags every script here shares: `--<count>` (timed rounds, default 40, after the
  warm-up ones), `--pause` and `--json`; `parse_timing_args` reads and checks them."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument(f'--{count}', type=int, default=40, help=f'Timed {what} (after the warm-up ones).')
  parser.add_argument('--pause', type=float, default=0.05, help='Idle seconds before each timed call.')
  parser.add_argument('--json', default=None, help='Also write the results (every time) to this file.')
  return parser


def parse_timing_args(parser: argparse.ArgumentParser, count: str) -> argparse.Namespace:
  """The parsed flags of `timing_parser` (and any the script added): one-line usage errors for a count
  below 1 and for the output flags (`check_output_args`)."""
  args = parser.parse_args()
  if getattr(args, count) < 1:
    parser.error(f'--{count} must be >= 1, got {getattr(args, count)}')
  check_output_args(parser, args)
  return args


def check_output_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """`--pause` (seconds, >= 0) and `--json` (a file to write, not a directory, in a directory that
  exists): one-line usage errors before anything runs, not after minutes of timing."""
  if getattr(args, 'pause', 0) < 0:
    parser.error(f'--pause must be >= 0, got {args.pause}')
  if args.json and os.path.isdir(args.json):
    parser.error(f'--json={args.json} is a directory; name a file')
  parent = os.path.dirname(os.path.abspath(args.json)) if args.json else None
  if parent and not os.path.isdir(parent):
    parser.error(f'--json={args.json}: the directory {parent} does not exist')


def step_ms(seconds: list[float]) -> dict[str, float]:
  """The median, min and max of timed steps (given in seconds), in milliseconds, as the JSONs name them."""
  return {
    'step_ms_median': 1e3 * statistics.median(seconds),
    'step_ms_min': 1e3 * min(seconds),
    'step_ms_max': 1e3 * max(seconds),
  }


def step_ms_line(results: dict, steps: int) -> str:
  """'M ms/step median of N (min A, max B)' of the `step_ms` entries in `results`."""
  return (
    f'{results["step_ms_median"]:.1f} ms/step median of {steps} '
    f'(min {results["step_ms_min"]:.1f}, max {results["step_ms_max"]:.1f})'
  )


def write_json(path: str | None, results: dict) -> None:
  """The results to `path` (the `--json` flag), if one was given."""
  if path:
    with open(path, 'w') as f:
      json.dump(results, f, indent=1)


def alternate(
  calls: dict[str, Callable[[], object]], rounds: int, warmup: int, pause: float
) -> dict[str, list[float]]:
  """Runs `warmup + rounds` rounds of every call in `calls`, in their order on even rounds and reversed
  on odd ones, after `pause` seconds of idle each; returns the seconds of each timed (post-warm-up) call
  by name. Each call must wait for its own work to finish."""
  names = list(calls)
  seconds = {name: [] for name in names}
  for i in range(warmup + rounds):
    for name in names if i % 2 == 0 else names[::-1]:
      time.sleep(pause)
      start = time.perf_counter()
      calls[name]()
      if i >= warmup:
        seconds[name].append(time.perf_counter() - start)
  return seconds
