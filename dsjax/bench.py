r"""Train-step speed and memory: compile time, step time, throughput, model FLOPs, MFU, device memory.

  python -m dsjax.bench --config=configs/gpt2_small.py [--steps=20]
                        [--instrument=off,return,callback,monitor,sampled]
                        [--inputs=random|real] [--peak_tflops=...] [--json=bench.json] [--profile=DIR]
                        [--config.*=...]

What is timed is the loop's own jitted train step (`dsjax.train.step.make_train_step`, donated state,
the optimizer update included) on one device, once per `--instrument` mode: 'off' (no statistics),
'return' (per-layer moments returned from the step) and 'callback' (the same statistics delivered by
`jax.debug.callback`, as the training loop sends them on one device), and, when listed, 'monitor' (the
'return' step with the stability monitor checking each step's statistics, `dsjax.instrument.monitor`,
as the loop does by default; beside 'return' it shows the monitor's cost) and 'sampled' (the 'return' step
with its statistics from `--config.instrument.sample_rows` rows per site, which it needs; the other modes
compute them from whole tensors). Each mode is compiled ahead of
time, run for 2 warm-up steps, then for `--steps` timed steps, each one waited for; the median and the
spread (min–max) are reported. Waiting for each step leaves the device idle while the host dispatches
the next one, so each mode is then also timed as the train loop runs it (`pipelined_*`): 3 runs of
`--steps` steps, each step's metrics read only after the next step is dispatched; per run its mean step,
and the median and min–max of the runs. `--inputs=random` (the default) times random tokens / images of the
configured shape, so no dataset is read; `--inputs=real` times one real batch of the dataset.

Model FLOPs per step follow PaLM's Appendix B (Chowdhery et al. 2022, arXiv:2204.02311): per token
6·N + 12·depth·d·L, N the parameters that take part in matmuls (all but the looked-up embedding tables
and class token), L the sequence length, causal attention counted in full. MFU divides by
`--peak_tflops`, else the device kind's data-sheet peak (`PEAK_TFLOPS`); on a CPU by the benchmark's own
measured matmul peak.

`--profile=DIR` traces 3 more steps with the JAX profiler, prints the device's busy time per step split
into matmul, attention and other kernels (`KERNEL_KINDS`) with the busiest kernels and its idle time
between kernels by the kernels either side and by the gaps' length, beside the kernels per step
(`idle_gaps`), and writes the step's HLO to
DIR/step.hlo.txt. Memory is the compiled step's `memory_analysis()` (and on GPUs the device's peak
bytes in use). `--json` writes everything printed, with the device, the peak's source and
the git commit of the dsjax source that ran (`recorded_commit`: DSJAX_COMMIT where a caller names the
commit of a copy it sent, with the copy's own HEAD beside it).

What each count includes and leaves out, and the measured rows: benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import statistics
import subprocess
import tempfile
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

from dsjax import data as data_lib
from dsjax import instrument as instrument_lib
from dsjax import models
from dsjax.models import fused_ops
from dsjax.train import cli, host_memory
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config', 'configs/gpt_preln.py', 'Config file (configs/*.py).', lock_config=True
)
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps of each mode (after 2 warm-up steps).', lower_bound=1)
INSTRUMENT_MODES = ('off', 'return', 'callback', 'monitor', 'sampled')
_INSTRUMENT = flags.DEFINE_list(
  'instrument', ['off', 'return', 'callback'], f'Modes to time, any of {list(INSTRUMENT_MODES)}.'
)
INPUTS = ('random', 'real')
_INPUTS = flags.DEFINE_string('inputs', 'random', f'Batch contents: one of {list(INPUTS)}.')
_PEAK = flags.DEFINE_float(
  'peak_tflops',
  None,
  'Peak TFLOP/s of one device for MFU (default: looked up from the device kind; on a CPU, measured).',
  lower_bound=1e-9,
)
flags.register_validator(
  'peak_tflops',
  lambda v: v is None or math.isfinite(v),
  message='--peak_tflops must be a finite positive number of TFLOP/s',
)
_GELU_TILES = flags.DEFINE_list(
  'gelu_tiles',
  None,
  "With model.fused_ops=pallas: the fused GELU kernels' tiling, as benchmarks/gpu_gelu_tiles.py names "
  'it (block elements, columns per block, backward programs, warps; default: fused_ops.gelu_tiles()).',
)


def _gelu_tiles_or_error(values) -> fused_ops.GeluTiles | str:
  """The tiling `--gelu_tiles` names, or what is wrong with it."""
  if len(values) != 4 or not all(v.strip().isdigit() for v in values):
    return 'expected 4 positive integers (block elements, columns per block, backward programs, warps)'
  try:
    return fused_ops.GeluTiles(*(int(v) for v in values))
  except ValueError as e:  # a size GeluTiles refuses
    return str(e)


def _check_gelu_tiles(values) -> bool:
  error = None if values is None else _gelu_tiles_or_error(values)
  if isinstance(error, str):
    raise flags.ValidationError(error)
  return True


flags.register_validator('gelu_tiles', _check_gelu_tiles)
_GELU_FMA = flags.DEFINE_bool(
  'gelu_fma',
  False,
  "With model.fused_ops=pallas: the fused GELU kernels' multiply-adds as fused multiply-adds "
  '(fused_ops.GELU_FMA; default: as that constant says).',
)
_JSON = flags.DEFINE_string('json', None, 'Also write the results to this JSON file.')
_PROFILE = flags.DEFINE_string(
  'profile',
  None,
  'Also trace 3 steps of the first mode with the JAX profiler '
  'into this directory (TensorBoard/XProf) and print the device time per '
  "kernel, with the compiled step's HLO text beside it.",
)

WARMUP_STEPS = 2
# Dense peak TFLOP/s of one device by `device_kind` prefix, for bf16 and fp32 (TF32 on NVIDIA) matmuls,
# from the vendors' data sheets (NVIDIA H100/H200 SXM, PCIe and NVL, A100 SXM; Google Cloud TPU system
# architecture pages), halved where a sheet quotes sparse throughput. The longest matching prefix wins
# ('NVIDIA H100 NVL' over 'NVIDIA H100'; a TPU v5p VM reports 'TPU v5', a v5e 'TPU v5 lite').
PEAK_TFLOPS = {
  'NVIDIA H100 PCIe': {'bfloat16': 756.0, 'float32': 378.0},
  'NVIDIA H100 NVL': {'bfloat16': 835.0, 'float32': 418.0},
  'NVIDIA H100': {'bfloat16': 989.0, 'float32': 494.0},
  'NVIDIA H200 NVL': {'bfloat16': 835.0, 'float32': 418.0},
  'NVIDIA H200': {'bfloat16': 989.0, 'float32': 494.0},
  'NVIDIA A100': {'bfloat16': 312.0, 'float32': 156.0},
  'TPU v4': {'bfloat16': 275.0, 'float32': 275.0},
  'TPU v5 lite': {'bfloat16': 197.0, 'float32': 197.0},
  'TPU v5p': {'bfloat16': 459.0, 'float32': 459.0},
  'TPU v5': {'bfloat16': 459.0, 'float32': 459.0},
  'TPU v6 lite': {'bfloat16': 918.0, 'float32': 918.0},
}


def fused_gelu_tiles(model_config) -> list[int] | None:
  """The tiling of the fused GELU kernels the step runs (`fused_ops.gelu_tiles()`), None without them."""
  if models.fused_ops_implementation(model_config) != 'pallas':
    return None
  return list(dataclasses.astuple(fused_ops.gelu_tiles()))


def fused_gelu_fma(model_config) -> bool | None:
  """Whether the fused GELU kernels the step runs use fused multiply-adds (`fused_ops.GELU_FMA`), None
  without them."""
  if models.fused_ops_implementation(model_config) != 'pallas':
    return None
  return fused_ops.GELU_FMA


def check_args(config, modes: list[str], inputs: str):
  """One-line ValueErrors before anything is compiled: the flags, the run's config checks
  (`dsjax.train.config`; one device, no mesh), then the dataset's. Returns the DatasetInfo."""
  # --steps and --peak_tflops are bounded by their flag definitions (absl checks them first).
  if not modes or any(m not in INSTRUMENT_MODES for m in modes):
    raise ValueError(f'--instrument must list some of {list(INSTRUMENT_MODES)}, got {",".join(modes)!r}')
  if inputs not in INPUTS:
    raise ValueError(f'--inputs must be one of {list(INPUTS)}, got {inputs!r}')
  if 'sampled' in modes and not config.instrument.sample_rows:
    raise ValueError('--instrument=sampled needs --config.instrument.sample_rows > 0 (rows per site)')
  return config_lib.validate_single_device_run(config, training=True, require_data=inputs == 'real')


# ---------------------------------------------------------------------------------------------------
# Model FLOPs and peaks
# ---------------------------------------------------------------------------------------------------

LOOKED_UP_PARAMS = ('token_embed', 'pos_embedding', 'cls_token')


def matmul_params(abstract_model: nnx.Module) -> int:
  """Parameters that take part in matmuls: all but the looked-up embedding tables (module docstring)."""
  params = nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param))
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return sum(
    math.prod(leaf.shape)
    for path, leaf in flat
    if not any(getattr(k, 'key', None) in LOOKED_UP_PARAMS for k in path)
  )


def model_flops_per_step(config, model_dims, num_params: int) -> tuple[float, int]:
  """(6·N + 12·depth·d·L) · tokens per step, and the tokens (positions) per step."""
  m, seq_len = config.model, model_dims.seq_len
  tokens = config.batch_size * seq_len
  return (6 * num_params + 12 * m.depth * m.width * seq_len) * tokens, tokens


def peak_tflops_for(device, dtype: str) -> float | None:
  matches = [prefix for prefix in PEAK_TFLOPS if device.device_kind.startswith(prefix)]
  return PEAK_TFLOPS[max(matches, key=len)][dtype] if matches else None


def source_commit() -> str | None:
  """The git commit of the dsjax source being benchmarked ('+dirty' with uncommitted changes), or None
  when it is not a checkout of its own (an installed wheel, even inside some other repository): which
  code a JSON's numbers belong to."""
  package_dir = os.path.dirname(os.path.abspath(__file__))

  def git(*args):
    return subprocess.run(['git', '-C', package_dir, *args], capture_output=True, text=True, timeout=10)

  try:
    top, head = git('rev-parse', '--show-toplevel'), git('rev-parse', 'HEAD')
    status = git('status', '--porcelain', '--untracked-files=no')
  except (OSError, subprocess.SubprocessError):
    return None
  if (
    top.returncode
    or head.returncode
    or (os.path.realpath(top.stdout.strip()) != os.path.realpath(os.path.dirname(package_dir)))
  ):
    return None
  return head.stdout.strip() + ('+dirty' if status.stdout.strip() else '')


def recorded_commit() -> str | None:
  """The commit a JSON names: DSJAX_COMMIT where the caller sets it, else `source_commit()`. A copy of
  the tree sent to another machine may carry an older .git than its files; its sender names the commit,
  and the JSONs keep the copy's own HEAD beside it (`checkout_head`)."""
  return os.environ.get('DSJAX_COMMIT') or source_commit()


def commit_fields() -> dict[str, str | None]:
  """A results JSON's record of its code: the commit it names (`recorded_commit`) and the checkout's own
  HEAD (`source_commit`), which differ where a caller sent a copy whose .git is older than its files."""
  return {'commit': recorded_commit(), 'checkout_head': source_commit()}


def measured_matmul_tflops(dtype: str, device) -> float:
  """TFLOP/s of a square matmul in `dtype` on `device`, a peak: the fastest of 10 timed runs, after one
  warm-up. (On a shared CPU the median of a few runs of a smaller matmul came out below the rate of the
  train step's own matmuls.)"""
  n = 2048 if device.platform == 'cpu' else 8192
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  times = []
  for _ in range(10):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / min(times) / 1e12


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------


def random_batch(config, data_info, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  if config.model.name == 'vit':
    return {
      'image': rng.standard_normal((config.batch_size, *data_info.image_shape), np.float32),
      'label': rng.integers(0, data_info.num_classes, config.batch_size, np.int32),
    }
  return {
    'tokens': rng.integers(0, data_info.vocab_size, (config.batch_size, config.data.seq_len + 1), np.int32)
  }


def memory_of(compiled) -> dict[str, float]:
  """GiB the compiled step needs on the device, from XLA's memory analysis."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  gib = lambda b: b / 2**30  # noqa: E731
  out = {
    'arguments_gib': gib(analysis.argument_size_in_bytes),
    'outputs_gib': gib(analysis.output_size_in_bytes),
    'temporaries_gib': gib(analysis.temp_size_in_bytes),
    'aliased_gib': gib(analysis.alias_size_in_bytes),
  }
  out['total_gib'] = out['arguments_gib'] + out['outputs_gib'] + out['temporaries_gib'] - out['aliased_gib']
  return out


PROFILED_STEPS = 3
# Runs of `--steps` steps timed as the train loop runs them (`time_mode`), after the steps timed one by one.
PIPELINED_RUNS = 3
REPORTED_KERNELS = 30  # in the printed report; the JSON lists every kernel


class ModeSteps:
  """The compiled step of one mode, run from `state` on `batch` as the train loop runs it: each step's
  moments (modes other than 'off') handed to `collector`, earlier steps' written while this one runs;
  `collector_s` the host's seconds in the collector after each dispatch (where they exceed the device's
  step, the host sets the pace)."""

  def __init__(self, mode: str, compiled, state, batch, collector):
    self.mode, self.compiled, self.state, self.batch, self.collector = mode, compiled, state, batch, collector
    self.collector_s: list[float] = []

  def dispatch(self, step: int) -> dict:
    """Dispatches step `step`; its metrics (device arrays, not waited for)."""
    self.state, metrics = self.compiled(self.state, self.batch)
    moments = metrics.pop('moments', None)
    instrument_lib.start_host_copy(metrics)  # as the train loop does
    if self.mode != 'off':
      start = time.perf_counter()
      self.collector.add(step, moments)
      self.collector.flush(before_step=step)
      self.collector_s.append(time.perf_counter() - start)
    return metrics

  def one_by_one(self, first: int, count: int) -> list[float]:
    """Seconds of each of `count` steps, each waited for before the next is dispatched."""
    times = []
    for step in range(first, first + count):
      start = time.perf_counter()
      jax.block_until_ready(self.dispatch(step))
      times.append(time.perf_counter() - start)
    return times

  def pipelined(self, first: int, count: int) -> float:
    """Seconds per step of `count` steps, each step's metrics read after the next is dispatched, so that
    the device does not wait for the host between steps."""
    jax.block_until_ready(self.state)  # the last update of the steps before, not counted here
    start, previous = time.perf_counter(), None
    for step in range(first, first + count):
      metrics = self.dispatch(step)
      if previous is not None:
        jax.device_get(previous)
      previous = metrics
    jax.block_until_ready((self.state, previous))
    return (time.perf_counter() - start) / count


def _ms_spread(name: str, seconds: list[float]) -> dict[str, float]:
  """{name_median, name_min, name_max} of `seconds`, in milliseconds."""
  return {
    f'{name}_median': 1e3 * statistics.median(seconds),
    f'{name}_min': 1e3 * min(seconds),
    f'{name}_max': 1e3 * max(seconds),
  }


def time_mode(
  mode: str, step_fn, state, batch, num_steps: int, collector, profile_dir: str | None = None
) -> tuple[dict, object]:
  """Compiles `step_fn` ahead of time, runs warm-up steps, `num_steps` steps one by one, then
  PIPELINED_RUNS runs of `num_steps` pipelined steps (then, with `profile_dir`, traced steps); returns
  (results, final state)."""
  start = time.perf_counter()
  compiled = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  steps = ModeSteps(mode, compiled, state, batch, collector)
  steps.one_by_one(0, WARMUP_STEPS)
  times = steps.one_by_one(WARMUP_STEPS, num_steps)
  first = WARMUP_STEPS + num_steps
  pipelined = [steps.pipelined(first + run * num_steps, num_steps) for run in range(PIPELINED_RUNS)]
  results = {
    'compile_s': compile_s,
    **_ms_spread('step_ms', times),
    # Per run of `num_steps` pipelined steps, its mean step; the median and min–max of the runs.
    **_ms_spread('pipelined_step_ms', pipelined),
    'memory': memory_of(compiled),
  }
  if steps.collector_s:  # over the timed steps, one by one and pipelined
    results |= _ms_spread('collector_ms', steps.collector_s[WARMUP_STEPS:])
  if profile_dir:
    with jax.profiler.trace(profile_dir):
      steps.one_by_one(first + PIPELINED_RUNS * num_steps, PROFILED_STEPS)
    hlo_text = compiled.as_text()
    with open(os.path.join(profile_dir, 'step.hlo.txt'), 'w') as f:
      f.write(hlo_text)
    # On a GPU the kernels name themselves; its XLA ops can be command buffers around whole graphs.
    on_cpu = jax.devices()[0].platform == 'cpu'
    results['profile'] = device_time_per_kernel(
      profile_dir, PROFILED_STEPS, matmul_ops(hlo_text) if on_cpu else set()
    )
  return results, steps.state


def device_time_per_kernel(profile_dir: str, num_steps: int, matmul_hlo_ops: set[str]) -> dict:
  """Device time per step of each kernel in the newest trace under `profile_dir`, summed over its
  launches and divided by the traced steps, with the XLA op that launched it (a fusion's kernel is named
  after the fusion; kernels that run in a command buffer (CUDA graph) name it as their op). Kernels are
  the events on the GPU planes' stream lines; the CPU has no device plane, so there the XLA ops are read
  from the host plane. `matmul_hlo_ops`: the step's ops that are or contain a matmul (`matmul_ops`)."""
  paths = sorted(
    glob.glob(os.path.join(profile_dir, '**', '*.xplane.pb'), recursive=True), key=os.path.getmtime
  )
  planes = list(jax.profiler.ProfileData.from_file(paths[-1]).planes)
  device_planes = [p for p in planes if p.name.startswith('/device:')] or [
    p for p in planes if p.name == '/host:CPU'
  ]
  per_kernel_ns: dict[str, float] = {}
  op_of: dict[str, str] = {}
  intervals = []  # (start, end, kernel) of the first device's kernels, for its idle time
  for plane in device_planes:
    lines = list(plane.lines)
    streams = [line for line in lines if line.name.startswith('Stream')] or lines
    for line in streams:
      for event in line.events:
        hlo_op = {name: value for name, value in event.stats}.get('hlo_op')
        if hlo_op is None:
          continue
        per_kernel_ns[event.name] = per_kernel_ns.get(event.name, 0.0) + event.duration_ns
        op_of.setdefault(event.name, hlo_op)
        if plane is device_planes[0]:
          intervals.append((event.start_ns, event.start_ns + event.duration_ns, event.name))
  ranked = sorted(per_kernel_ns.items(), key=lambda kv: -kv[1])
  kernels = [
    {'kernel': name[:90], 'hlo_op': op_of[name], 'ms_per_step': ns / num_steps / 1e6} for name, ns in ranked
  ]
  return {
    'busy_ms_per_step': sum(per_kernel_ns.values()) / num_steps / 1e6,
    'trace': paths[-1],
    'ms_per_step_by_kind': ms_by_kind(kernels, matmul_hlo_ops),
    'idle': idle_gaps(intervals, num_steps),
    'kernels': kernels,
  }


def idle_gaps(intervals: list[tuple[float, float, str]], num_steps: int, top: int = 10) -> dict:
  """The device's idle time among its kernels' (start_ns, end_ns, name) intervals, all its streams
  together: each gap in their union named by the kernel that ended last before it and the one that
  starts it, summed per such pair over the traced steps (per step), the `top` pairs by time. The traced
  steps run one by one, so the gaps between them (the host's wait for each step) are among the pairs.
  `kernels_per_step`: how many kernels ran, so that idle time spread over many small gaps can be read as
  a cost per kernel boundary (a launch inside a CUDA graph) rather than a wait; `idle_ms_per_step_by_gap`
  splits the idle time by the length of its gaps (`GAP_LABELS`) to tell the two apart."""
  gaps_ns: dict[tuple[str, str], float] = {}
  counts: dict[tuple[str, str], int] = {}
  by_gap_ns = dict.fromkeys(GAP_LABELS, 0.0)
  ordered = sorted(intervals)
  busy_until, last = (ordered[0][1], ordered[0][2]) if ordered else (0.0, '')
  for start, end, name in ordered[1:]:
    if start > busy_until:
      pair, gap_ns = (last[:60], name[:60]), start - busy_until
      gaps_ns[pair] = gaps_ns.get(pair, 0.0) + gap_ns
      counts[pair] = counts.get(pair, 0) + 1
      by_gap_ns[_gap_label(gap_ns)] += gap_ns
    if end >= busy_until:
      busy_until, last = end, name
  ranked = sorted(gaps_ns.items(), key=lambda kv: -kv[1])[:top]
  return {
    'idle_ms_per_step': sum(gaps_ns.values()) / num_steps / 1e6,
    'gaps_per_step': sum(counts.values()) / num_steps,
    'kernels_per_step': len(intervals) / num_steps,
    'idle_ms_per_step_by_gap': {label: ns / num_steps / 1e6 for label, ns in by_gap_ns.items()},
    'largest': [
      {
        'after': a,
        'before': b,
        'ms_per_step': ns / num_steps / 1e6,
        'gaps_per_step': counts[a, b] / num_steps,
      }
      for (a, b), ns in ranked
    ],
  }


# Upper bounds (µs) of the gap lengths `idle_gaps` totals the idle time by: a few µs is the gap a CUDA
# graph leaves between two dependent kernels; tens of µs and more, a wait (for the host, a copy, a sync).
GAP_BOUNDS_US = (2, 5, 10, 50, 1000)
GAP_LABELS = tuple(f'<{b}us' for b in GAP_BOUNDS_US) + (f'>={GAP_BOUNDS_US[-1]}us',)


def _gap_label(gap_ns: float) -> str:
  shorter = (label for bound, label in zip(GAP_BOUNDS_US, GAP_LABELS) if gap_ns < bound * 1e3)
  return next(shorter, GAP_LABELS[-1])


# Kernel kinds by name: cuBLAS (nvjet, cutlass, xmma) and XLA's Triton GEMM fusions are matmuls; cuDNN's
# fused attention kernels (and its helper kernels) and the Pallas splash kernels (named `splash_mha_*`;
# no TPU trace has been read here) are attention. On a CPU, whose XLA ops stand in for kernels, an op
# that is or contains a dot is a matmul (`matmul_ops`; XLA's attention included).
# Everything else (XLA's elementwise and reduction fusions: norms, activations, residual adds, casts,
# bias gradients, the optimizer) is 'other'.
KERNEL_KINDS = {
  'matmul': ('gemm', 'nvjet', 'cutlass', 'xmma'),
  'attention': ('sdpa', 'cudnn', 'fmha', 'flash', 'splash'),
}


def matmul_ops(hlo_text: str) -> set[str]:
  """Names of the instructions of an HLO module's text that are a dot or a convolution, or call one
  through `calls=`, `to_apply=` or `called_computations=` at any depth (a fusion around a matmul, such
  as the CPU's YNNPACK fusions). Loops and conditionals (`body=`, `branch_computations=`) are not
  followed: a loop is not a matmul."""
  is_product = re.compile(r'[\]}] (?:dot|convolution)\(')  # the result's shape or layout, then the opcode
  called = re.compile(r'(?:calls|to_apply|called_computations)=\{?((?:%?[\w.\-]+(?:, )?)+)')
  computations = dict(re.findall(r'^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}', hlo_text, re.M | re.S))

  def callees(text: str) -> set[str]:
    return {name.lstrip('%') for group in called.findall(text) for name in group.split(', ')}

  callees_of = {name: callees(body) for name, body in computations.items()}
  with_product = {name for name, body in computations.items() if is_product.search(body)}
  grown = True
  while grown:  # computations that call one with a product, to a fixed point
    more = {name for name, called_names in callees_of.items() if called_names & with_product}
    grown = not more <= with_product
    with_product |= more
  return {
    name
    for name, rest in re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$', hlo_text, re.M)
    if is_product.search(rest) or callees(rest) & with_product
  }


def ms_by_kind(kernels: list[dict], matmul_hlo_ops: set[str]) -> dict[str, float]:
  totals = {kind: 0.0 for kind in (*KERNEL_KINDS, 'other')}
  for k in kernels:
    name = k['kernel'].lower()
    kind = next((kind for kind, marks in KERNEL_KINDS.items() if any(m in name for m in marks)), 'other')
    if kind == 'other' and k['hlo_op'] in matmul_hlo_ops:
      kind = 'matmul'
    totals[kind] += k['ms_per_step']
  return totals


class Prepared(NamedTuple):
  """What the benchmark times, built as the training loop builds it."""

  data_info: object
  setup: state_lib.TrainSetup
  state: dict  # the first train state
  batch: dict  # one batch, on the device
  make_step: (
    Callable  # (instrument=False, receiver=None, per_site=False, sample_rows=0) -> the step, not jitted
  )


def prepare(config, modes: list[str], inputs: str, shapes_only: bool = False) -> Prepared:
  """Checks the arguments (`check_args`), then builds the model, its first state, one batch and the
  train-step maker (also used by the scripts in benchmarks/). `shapes_only`: the state and a random
  batch as shapes (`jax.ShapeDtypeStruct`), nothing computed or allocated: for compiling the step only."""
  data_info = check_args(config, modes, inputs)
  if inputs == 'real' and not shapes_only:
    batch = next(
      data_lib.make_pipeline(
        config.data, global_batch_size=config.batch_size, seed=config.seed, process_index=0, process_count=1
      )
    )
  else:
    batch = random_batch(config, data_info)
  if shapes_only:
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  else:
    batch = jax.device_put(batch, jax.devices()[0])
  prepared = state_lib.method_preparation(config, data_info)
  setup = state_lib.make_setup(config, data_info, prepared)
  state = jax.eval_shape(setup.create_state) if shapes_only else jax.jit(setup.create_state)()
  loss_fn = step_lib.LOSSES[config.model.name]
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0

  def make_step(
    instrument: bool = False,
    receiver: instrument_lib.Collector | None = None,
    per_site: bool = False,
    sample_rows: int = 0,
  ) -> Callable:
    # One device: a callback delivery sends each step's table in one callback, as the loop does there
    # (`per_site=True`: a callback per probe site, as on several devices).
    return step_lib.make_train_step(
      setup.graphdef,
      setup.tx,
      loss_fn,
      config.seed,
      setup.schedule,
      use_dropout,
      instrument,
      moments_receiver=receiver,
      moments_per_site=per_site,
      microbatches=config.microbatches,
      moments_sample_rows=sample_rows,
    )

  return Prepared(data_info, setup, state, batch, make_step)


def step_runner(
  prepared: Prepared,
  step_fn: Callable | None = None,
  state: dict | None = None,
  after: Callable[[int, dict], None] | None = None,
) -> Callable[[], None]:
  """`step_fn` (default: the plain train step of `prepared`), compiled, as a function that runs one step
  from `state` (default `prepared.state`; the step donates it, so each runner needs its own), carries
  the state from call to call, waits for the step's metrics and then calls `after(step number,
  metrics)`: what the paired benchmarks in benchmarks/ time."""
  step_fn = prepared.make_step() if step_fn is None else step_fn
  state = prepared.state if state is None else state
  compiled = jax.jit(step_fn, donate_argnums=0).lower(state, prepared.batch).compile()
  steps = 0

  def step():
    nonlocal state, steps
    state, metrics = compiled(state, prepared.batch)
    jax.block_until_ready(metrics)
    steps += 1
    if after is not None:
      after(steps, metrics)

  return step


def run_benchmark(
  config,
  num_steps: int,
  modes: list[str],
  inputs: str,
  peak_tflops: float | None,
  workdir: str,
  profile_dir: str | None = None,
) -> dict:
  data_info, setup, state, batch, make_step = prepare(config, modes, inputs)
  device = jax.devices()[0]
  dims = models.model_dims(config.model, data_info, seq_len=config.data.seq_len)
  num_params = matmul_params(setup.abstract_model)
  flops, tokens = model_flops_per_step(config, dims, num_params)
  dtype = models.compute_dtype(config.model)
  spec_peak = peak_tflops or peak_tflops_for(device, dtype)
  tf32 = ' (TF32)' if dtype == 'float32' and device.platform == 'gpu' else ''
  peak_source = (
    '--peak_tflops' if peak_tflops else None if spec_peak is None else f'data sheet, {dtype}{tf32}'
  )
  measured_peak = measured_matmul_tflops(dtype, device)

  results = {
    'config': {
      'model': config.model.name,
      'block': config.model.block,
      'scheme': config.model.scheme,
      'depth': config.model.depth,
      'width': config.model.width,
      'num_heads': config.model.num_heads,
      'seq_len': dims.seq_len,
      'batch_size': config.batch_size,
      'microbatches': config.microbatches,
      'dtype': dtype,
      'param_dtype': config.model.param_dtype,
      'attention': '+'.join(models.attention_implementations(setup.abstract_model)),
      'fused_ops': models.fused_ops_implementation(config.model),
      'gelu_tiles': fused_gelu_tiles(config.model),
      'gelu_fma': fused_gelu_fma(config.model),
      'remat': config.model.remat,
      'scan_layers': config.model.scan_layers,
      'scan_unroll': config.model.scan_unroll,
      'optimizer': config.optimizer.name,
    },
    'device': {
      'kind': device.device_kind,
      'platform': device.platform,
      'count': 1,
      'jax': jax.__version__,
      'date': time.strftime('%Y-%m-%d'),
    },
    # Set (JAX_COMPILATION_CACHE_DIR), a compile may load an earlier process's program or autotuning:
    # then compile_s is not the cold compile time.
    'compilation_cache': jax.config.jax_compilation_cache_dir,
    **commit_fields(),
    'inputs': inputs,
    'steps': num_steps,
    'sample_rows': config.instrument.sample_rows if 'sampled' in modes else 0,
    'matmul_params': num_params,
    'model_flops_per_step': flops,
    'positions_per_step': tokens,
    'peak_tflops': spec_peak,
    'peak_source': peak_source,
    'measured_matmul_tflops': measured_peak,
    'modes': {},
  }
  with host_memory.built_objects_frozen():  # as the train loop runs its steps
    timed = time_modes(config, modes, make_step, state, batch, num_steps, workdir, profile_dir)
  for mode, r in timed.items():
    results['modes'][mode] = r | throughput(r, config.batch_size, tokens, flops, spec_peak, measured_peak)
  if device.platform == 'gpu':
    stats = device.memory_stats() or {}
    results['device_peak_memory_gib'] = stats.get('peak_bytes_in_use', 0) / 2**30
  return results


def time_modes(config, modes, make_step, state, batch, num_steps: int, workdir: str, profile_dir) -> dict:
  """`time_mode`'s results for each of `modes` in turn, the state carried from one to the next (the
  first mode profiled when `profile_dir` is given)."""
  timed = {}
  for mode in modes:
    # One collector per mode, so that no mode de-duplicates another's records.
    mode_dir = os.path.join(workdir, mode)
    monitor = None
    if mode == 'monitor':  # Without the theory's comparison: that happens once, at step 1, untimed.
      monitor = instrument_lib.Monitor(
        config.instrument.monitor, config.model.depth, config.model.dropout, workdir=mode_dir
      )
    collector = instrument_lib.Collector(mode_dir, keep_records=False, monitor=monitor)
    step_fn = make_step(
      mode != 'off',
      collector if mode == 'callback' else None,
      sample_rows=config.instrument.sample_rows if mode == 'sampled' else 0,
    )
    timed[mode], state = time_mode(
      mode, step_fn, state, batch, num_steps, collector, profile_dir if mode == modes[0] else None
    )
    collector.close()
  return timed


def throughput(
  r: dict, examples: int, tokens: int, flops: float, spec_peak: float | None, measured_peak: float
) -> dict:
  """What a mode's median step times (`time_mode`'s results `r`) make of a step of `examples` examples,
  `tokens` positions and `flops` model FLOPs: examples and tokens per second, TFLOP/s and MFU (against
  the data sheet's peak, and the measured matmul's), and the same throughput from the pipelined steps."""
  seconds, pipelined_seconds = r['step_ms_median'] / 1e3, r['pipelined_step_ms_median'] / 1e3
  tflops = flops / seconds / 1e12
  return {
    'examples_per_s': examples / seconds,
    'tokens_per_s': tokens / seconds,
    'model_tflops_per_s': tflops,
    'mfu': None if spec_peak is None else tflops / spec_peak,
    'fraction_of_measured_matmul_peak': tflops / measured_peak,
    'pipelined_examples_per_s': examples / pipelined_seconds,
    'pipelined_tokens_per_s': tokens / pipelined_seconds,
  }


def report(results: dict) -> str:
  c, d = results['config'], results['device']
  unit = 'images' if c['model'] == 'vit' else 'tokens'
  causal_note = '; causal attention counted in full' if c['model'] == 'gpt' else ''
  lines = [
    f'{c["model"]} {c["block"]} {c["scheme"]}, depth {c["depth"]} x width {c["width"]}, '
    f'{c["num_heads"]} heads, seq {c["seq_len"]}, batch {c["batch_size"]} '
    f'({c["microbatches"]} microbatch(es)), {c["dtype"]} compute, {c["param_dtype"]} params, '
    f'attention {c["attention"]}, fused ops {c.get("fused_ops", "none")}, remat {c["remat"]}, '
    f'{"scan unroll " + str(c["scan_unroll"]) if c["scan_layers"] else "python loop"}, {c["optimizer"]}',
    f'device: {d["kind"]} ({d["platform"]}), jax {d["jax"]}, {d["date"]}; inputs: {results["inputs"]} '
    f'{"(random values of the configured shape)" if results["inputs"] == "random" else "(one real batch)"}'
    + (f'; compilation cache {results["compilation_cache"]}' if results.get('compilation_cache') else ''),
    f'model FLOPs/step {results["model_flops_per_step"]:.4g} (6N + 12·depth·d·L per position, N = '
    f'{results["matmul_params"]:,} matmul parameters{causal_note})',
    f'peak: {results["peak_tflops"] or "unknown"} TFLOP/s '
    f'({results["peak_source"] or "no data-sheet entry for this device; give --peak_tflops"}); '
    f'measured matmul {results["measured_matmul_tflops"]:.2f} TFLOP/s',
    f'median of {results["steps"]} steps after {WARMUP_STEPS} warm-up:',
  ]
  for mode, r in results['modes'].items():
    per_s = r['examples_per_s'] if unit == 'images' else r['tokens_per_s']
    mfu = 'n/a' if r['mfu'] is None else f'{100 * r["mfu"]:.1f}%'
    mem = r['memory'].get('total_gib')
    lines.append(
      f'  instrument {mode:8s} {r["step_ms_median"]:9.2f} ms/step (min {r["step_ms_min"]:.2f}, max '
      f'{r["step_ms_max"]:.2f})  {per_s:12,.0f} {unit}/s  {r["model_tflops_per_s"]:8.2f} TFLOP/s  '
      f'MFU {mfu}  ({100 * r["fraction_of_measured_matmul_peak"]:.1f}% of measured matmul)  '
      f'compile {r["compile_s"]:.1f} s  step memory '
      f'{"n/a" if mem is None else f"{mem:.2f} GiB"}'
    )
  lines.append(
    f"as the train loop runs them ({PIPELINED_RUNS} runs of {results['steps']} steps, each step's "
    "metrics read after the next is dispatched; median and min-max of the runs' mean step):"
  )
  for mode, r in results['modes'].items():
    per_s = r['pipelined_examples_per_s'] if unit == 'images' else r['pipelined_tokens_per_s']
    lines.append(
      f'  instrument {mode:8s} {r["pipelined_step_ms_median"]:9.2f} ms/step (min '
      f'{r["pipelined_step_ms_min"]:.2f}, max {r["pipelined_step_ms_max"]:.2f})  {per_s:12,.0f} {unit}/s'
    )
  for mode, r in results['modes'].items():
    if 'collector_ms_median' in r:
      lines.append(
        f'  instrument {mode:8s} host in the collector after each dispatch (records, files): '
        f'{r["collector_ms_median"]:.2f} ms median (min {r["collector_ms_min"]:.2f}, '
        f'max {r["collector_ms_max"]:.2f})'
      )
  off = results['modes'].get('off')
  for mode in ('return', 'callback', 'monitor', 'sampled'):
    if off and mode in results['modes']:
      ratio = results['modes'][mode]['step_ms_median'] / off['step_ms_median']
      lines.append(f'  instrumentation overhead ({mode}): {ratio:.2f}x the plain step')
  if 'return' in results['modes'] and 'monitor' in results['modes']:
    ratio = results['modes']['monitor']['step_ms_median'] / results['modes']['return']['step_ms_median']
    lines.append(f'  stability monitor: {ratio:.3f}x the instrumented step without it')
  if 'return' in results['modes'] and 'sampled' in results['modes']:
    ratio = results['modes']['sampled']['step_ms_median'] / results['modes']['return']['step_ms_median']
    lines.append(
      f'  sampled statistics ({results["sample_rows"]} rows per site): {ratio:.3f}x the instrumented step'
      ' on whole tensors'
    )
  if 'device_peak_memory_gib' in results:
    lines.append(f'  device peak memory in use: {results["device_peak_memory_gib"]:.2f} GiB')
  for mode, r in results['modes'].items():
    if 'profile' in r:
      p = r['profile']
      lines.append(
        f"profile of '{mode}' ({p['trace']}): device busy {p['busy_ms_per_step']:.2f} ms per "
        f'step: '
        + ', '.join(f'{kind} {ms:.2f} ms' for kind, ms in p['ms_per_step_by_kind'].items())
        + '; busiest kernels (ms per step, share of busy time, kernel, XLA op):'
      )
      lines += [
        f'  {k["ms_per_step"]:8.3f}  {100 * k["ms_per_step"] / p["busy_ms_per_step"]:5.1f}%  '
        f'{k["kernel"]:60s} {k["hlo_op"]}'
        for k in p['kernels'][:REPORTED_KERNELS]
      ]
      idle = p['idle']
      lines.append(
        f'  idle {idle["idle_ms_per_step"]:.2f} ms per step in {idle["gaps_per_step"]:.0f} gaps among '
        f'{idle["kernels_per_step"]:.0f} kernels (the waits between the traced steps among them); by gap '
        'length: '
        + ', '.join(f'{label} {ms:.2f} ms' for label, ms in idle['idle_ms_per_step_by_gap'].items())
        + '; the longest, by the kernels either side (ms per step, gaps):'
      )
      lines += [
        f'  {g["ms_per_step"]:8.3f}  {g["gaps_per_step"]:5.1f}  {g["after"]} -> {g["before"]}'
        for g in idle['largest']
      ]
  return '\n'.join(lines)


def main(argv):
  del argv
  config = _CONFIG.value
  json_path, profile_dir = _JSON.value, _PROFILE.value
  for flag in (_GELU_TILES, _GELU_FMA):
    if flag.value and models.fused_ops_implementation(config.model) != 'pallas':
      needs = '--config.model.fused_ops=pallas (or auto, where it takes them)'
      raise ValueError(f'--{flag.name} needs the fused kernels: {needs}')
  # The outputs are created before the measurement (and removed again if the program fails).
  if json_path:
    if os.path.basename(json_path) in history_lib.FILES:  # e.g. a run's config.json
      history_lib.check_not_a_run('--json', os.path.dirname(os.path.abspath(json_path)))
    cli.create_output_file('--json', json_path)
  if profile_dir:
    cli.create_output_dir('--profile', os.path.abspath(profile_dir))
  if _GELU_TILES.value:
    fused_ops.GELU_TILES = _gelu_tiles_or_error(_GELU_TILES.value)
  if _GELU_FMA.value:
    fused_ops.GELU_FMA = True
  if tuple(config.mesh.shape) != tuple(sharding_lib.mesh_config().shape):
    print(f'note: mesh.shape {tuple(config.mesh.shape)} is not used: the benchmark times one device')
  with tempfile.TemporaryDirectory() as workdir:
    results = run_benchmark(
      config, _STEPS.value, _INSTRUMENT.value, _INPUTS.value, _PEAK.value, workdir, profile_dir
    )
  print(report(results))
  if json_path:
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  cli.run(main)
