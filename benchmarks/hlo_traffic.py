"""The memory traffic of each kernel of a compiled XLA GPU program, read from its optimized HLO text.

A kernel here is what the GPU launches: a fusion, a custom call (cuDNN attention, a Pallas/Triton
kernel, a cuBLAS matmul) or an unfused op such as a copy; a kernel inside a `while` loop counts once per
iteration (its known trip count). Its traffic is the bytes it must read and write:

  * every operand read once, except where the fusion only reads part of it: an operand that reaches a
    `slice` or `dynamic-slice` through elementwise ops alone (e.g. one layer's weights cut from the
    stacked (depth, ...) array after a convert) counts the elements it slices, at the operand's own
    element size; the buffer a `dynamic-update-slice` writes into in place is not read;
  * the output written once, except a fusion whose root is a `dynamic-update-slice`: only the update.

Outside the matmuls and attention, a transformer step's kernels are memory-bound, so their traffic over
the device's memory bandwidth is a lower bound on their time, and its change is the change a rewrite
makes in their passes over the activations; compared with a measured profile it says how close a
kernel runs to the bandwidth. It is not a time: caches, launch latency and compute-bound kernels are not
modelled, and the compiler that produced the HLO may choose other kernels on a device that autotunes.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from dsjax.instrument.probe import STATISTICS_SCOPE

ELEMENT_BYTES = {
  'pred': 1,
  's4': 0.5,
  'u4': 0.5,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
}
# Ops that launch nothing: they name, bundle or reinterpret buffers.
FREE_OPS = {'parameter', 'get-tuple-element', 'tuple', 'bitcast', 'constant', 'after-all', 'opt-barrier'}
# Ops through which a fusion parameter is still read element for element (so a slice after them reads
# only the slice).
ELEMENTWISE_OPS = {'convert', 'bitcast', 'copy', 'negate', 'abs', 'multiply', 'add', 'subtract', 'reshape'}
SLICE_OPS = {'slice', 'dynamic-slice'}
# A kernel all of whose operations carry the name dsjax's instrumentation gives its operations
# (STATISTICS_SCOPE) is the statistics', one with some of them 'mixed' (XLA fused statistics into one of
# the step's own kernels), the rest the step's own (PARTS).
PARTS = ('step', 'statistics', 'mixed')
# GPUs (NVIDIA data sheets; SXM parts, boost clock): what XLA's GPU compiler reads of a device
# (benchmarks/gpu_compiled_traffic.py) and the memory bandwidth that converts traffic to time.
_SM90 = dict(
  compute_capability=(9, 0),
  core_count=132,
  clock_rate_ghz=1.98,
  l2_cache_size=50 * 2**20,
  shared_memory_per_core=228 * 2**10,
  shared_memory_per_block_optin=227 * 2**10,
)
# Memory bandwidth by device kind (the longest matching prefix of `jax.Device.device_kind`).
MEMORY_BANDWIDTH = {
  'NVIDIA H100 PCIe': 2.0e12,
  'NVIDIA H100 NVL': 3.9e12,
  'NVIDIA H100': 3.35e12,
  'NVIDIA H200': 4.8e12,
}
DEVICES = {
  'h100': dict(
    name='NVIDIA H100 80GB HBM3',
    memory_bandwidth=MEMORY_BANDWIDTH['NVIDIA H100'],
    device_memory_size=80 << 30,
    **_SM90,
  ),
  'h200': dict(
    name='NVIDIA H200',
    memory_bandwidth=MEMORY_BANDWIDTH['NVIDIA H200'],
    device_memory_size=141 * 10**9,
    **_SM90,
  ),
}


def memory_bandwidth(device_kind: str) -> float | None:
  """The data sheet's memory bandwidth (bytes/s) of a device of this kind, None for a kind not listed."""
  matches = [kind for kind in MEMORY_BANDWIDTH if device_kind.startswith(kind)]
  return MEMORY_BANDWIDTH[max(matches, key=len)] if matches else None


KINDS = ('matmul', 'attention', 'pallas', 'other')
MEMORY_BOUND_KINDS = ('pallas', 'other')  # the matmuls and attention are compute-bound
PHASES = ('forward', 'backward', 'update')

_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$')
_COMPUTATION = re.compile(r'^(ENTRY )?%([\w.\-]+) .*\{\s*$')


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result's type text, e.g. 'bf16[16,1024,768]{2,1,0}' or a tuple of such
  op: str
  arguments: str  # the text inside the op's parentheses: operand names, or a parameter's number
  attributes: str  # the rest of the line after the parentheses
  is_root: bool

  @property
  def operands(self) -> tuple[str, ...]:
    return tuple(re.findall(r'%([\w.\-]+)', self.arguments))


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  kind: str  # one of KINDS
  phase: str  # one of PHASES: from the op's jax name (jvp: forward, transpose: backward, else update)
  bytes: float  # read + written, over all its launches
  launches: int
  op_name: str  # the jax operation it was lowered from (metadata op_name)
  group: str  # what a profile reports it as: the deduplicated name, else the name
  part: str = 'step'  # one of PARTS: whose operations it runs, the step's or the statistics'


def _count(dims: str) -> int:
  """Elements of an array whose dimensions are written '16,1024,768' ('' for a scalar)."""
  return math.prod(int(d) for d in dims.split(',') if d)


def array_bytes(shape: str) -> float:
  """Bytes of the arrays in a type text (a tuple's elements summed)."""
  return sum(_count(dims) * ELEMENT_BYTES.get(dtype, 0) for dtype, dims in _ARRAY.findall(shape))


def element_bytes(shape: str) -> float:
  """Bytes of one element of the first array in a type text."""
  found = _ARRAY.search(shape)
  return ELEMENT_BYTES.get(found.group(1), 0) if found else 0


def element_count(shape: str) -> int:
  """Elements of the first array in a type text."""
  found = _ARRAY.search(shape)
  return _count(found.group(2)) if found else 1


def _split_arguments(text: str) -> tuple[str, str]:
  """(inside, after) the op's parentheses; `text` starts just after the opening one."""
  depth = 0
  for i, ch in enumerate(text):
    if ch == '(':
      depth += 1
    elif ch == ')':
      if depth == 0:
        return text[:i], text[i + 1 :]
      depth -= 1
  return text, ''


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """({computation name: its instructions in order}, the entry computation's name)."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if current is None:
      header = _COMPUTATION.match(line)
      if header:
        current = header.group(2)
        computations[current] = []
        entry = current if header.group(1) else entry
      continue
    if line.startswith('}'):
      current = None
      continue
    found = _INSTRUCTION.match(line)
    if found:
      name, shape, op, rest = found.groups()
      arguments, attributes = _split_arguments(rest)
      is_root = line.lstrip().startswith('ROOT ')
      computations[current].append(Instruction(name, shape, op, arguments, attributes, is_root))
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return computations, entry


def _fusion_reads(fused: list[Instruction], operand_bytes: list[float]) -> float:
  """Bytes a fusion reads of its operands (see the module docstring)."""
  users = collections.defaultdict(list)
  for instruction in fused:
    for operand in instruction.operands:
      users[operand].append(instruction)

  def sliced_elements(name: str) -> int | None:
    """Elements read of `name` when each of its uses ends in a slice through elementwise ops, else None."""
    if not users[name]:
      return None
    total = 0
    for user in users[name]:
      if user.op in SLICE_OPS and user.operands[0] == name:
        total += element_count(user.shape)
        continue
      below = sliced_elements(user.name) if user.op in ELEMENTWISE_OPS and len(user.operands) == 1 else None
      if below is None:
        return None
      total += below
    return total

  read = 0.0
  for parameter in (i for i in fused if i.op == 'parameter'):
    whole = operand_bytes[int(parameter.arguments)]
    uses = users[parameter.name]
    if uses and all(u.op == 'dynamic-update-slice' and u.operands[0] == parameter.name for u in uses):
      continue  # the buffer written in place
    sliced = sliced_elements(parameter.name)
    read += whole if sliced is None else min(whole, sliced * element_bytes(parameter.shape))
  return read


def _fusion_writes(fused: list[Instruction], output_bytes: float) -> float:
  root = next((i for i in fused if i.is_root), None)
  if root is not None and root.op == 'dynamic-update-slice':
    update = next(i for i in fused if i.name == root.operands[1])
    return array_bytes(update.shape)
  return output_bytes


def kind_of(instruction: Instruction) -> str:
  """'matmul', 'attention', 'pallas' or 'other' (KINDS)."""
  text = instruction.attributes
  if instruction.op in ('dot', 'convolution'):
    return 'matmul'
  if instruction.op == 'custom-call':
    if 'cudnn$fmha' in text:
      return 'attention'
    if '__cublas' in text:
      return 'matmul'
    return 'pallas' if '__gpu$xla.gpu.triton' in text else 'other'
  if instruction.op == 'fusion' and re.search(r'"kind":"(__triton_(nested_)?gemm|__cublas|__cudnn)', text):
    return 'matmul'
  return 'other'


def phase_of(op_name: str) -> str:
  """The step's part an op belongs to, by the jax name of the op it was lowered from: 'forward' (inside
  the forward pass's jvp), 'backward' (its transpose) or 'update' (the optimizer and the rest)."""
  if 'transpose(' in op_name:
    return 'backward'
  return 'forward' if 'jvp(' in op_name else 'update'


def _op_name(instruction: Instruction) -> str:
  """The jax operation an instruction was lowered from (its metadata's op_name), or ''."""
  match = re.search(r'op_name="([^"]*)"', instruction.attributes)
  return match.group(1) if match else ''


def _in_scope(op_name: str) -> bool:
  return re.search(rf'(^|/){STATISTICS_SCOPE}/', op_name) is not None


def part_of(op_names: list[str]) -> str:
  """'statistics', 'mixed' or 'step' (PARTS), from the op_names of a kernel's operations."""
  scoped = [_in_scope(name) for name in op_names if name]
  if scoped and all(scoped):
    return 'statistics'
  return 'mixed' if any(scoped) else 'step'


def kernels(hlo_text: str) -> list[Kernel]:
  """Every kernel the program launches, with its traffic (see the module docstring)."""
  computations, entry = parse(hlo_text)
  shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}
  found = []

  def walk(computation: str, launches: int) -> None:
    for instruction in computations[computation]:
      if instruction.op in FREE_OPS:
        continue
      if instruction.op == 'while':
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
        body = re.search(r'body=%([\w.\-]+)', instruction.attributes).group(1)
        walk(body, launches * (int(trips.group(1)) if trips else 1))
        continue
      if instruction.op in ('call', 'conditional'):
        callees = re.findall(r'(?:to_apply=|calls=|computations=\{|, )%([\w.\-]+)', instruction.attributes)
        for callee in callees:
          walk(callee, launches)
        continue
      operand_bytes = [array_bytes(shapes.get(o, '')) for o in instruction.operands]
      output_bytes = array_bytes(instruction.shape)
      op_names = [_op_name(instruction)]  # its own, then those of the operations it fuses
      if instruction.op == 'fusion':
        fused = computations[re.search(r'calls=%([\w.\-]+)', instruction.attributes).group(1)]
        traffic = _fusion_reads(fused, operand_bytes) + _fusion_writes(fused, output_bytes)
        op_names += [_op_name(i) for i in fused]
      else:
        traffic = sum(operand_bytes) + output_bytes
      # A profile names a fusion by its deduplicated name (one per layer otherwise) and a Pallas kernel
      # by the kernel's own name.
      group = re.search(r'deduplicated_name="([^"]*)"|\bname = \\?"(\w+)', instruction.attributes)
      found.append(
        Kernel(
          name=instruction.name,
          kind=kind_of(instruction),
          phase=phase_of(op_names[0]),
          bytes=traffic * launches,
          launches=launches,
          op_name=op_names[0],
          group=next(filter(None, group.groups())) if group else instruction.name,
          part=part_of(op_names),
        )
      )

  walk(entry, 1)
  return found


def summarize(found: list[Kernel], bandwidth_bytes_per_s: float, top: int = 15) -> dict:
  """Traffic by kind and by part (PARTS: the step's own kernels, the instrumentation's statistics')
  and, outside the matmuls and attention, by phase and part, each with its bandwidth-bound time; and
  the `top` groups of other and Pallas kernels by traffic."""

  def totals(selected) -> dict:
    selected = list(selected)
    traffic = sum(k.bytes for k in selected)
    return {
      'kernels': sum(k.launches for k in selected),
      'gb': traffic / 1e9,
      'ms_at_bandwidth': traffic / bandwidth_bytes_per_s * 1e3,
    }

  memory_bound = [k for k in found if k.kind in MEMORY_BOUND_KINDS]
  groups = collections.defaultdict(list)
  for k in memory_bound:
    groups[(k.group, k.kind, k.phase, k.op_name, k.part)].append(k)
  ranked = sorted(groups.items(), key=lambda item: -sum(k.bytes for k in item[1]))[:top]
  return {
    'by_kind': {kind: totals(k for k in found if k.kind == kind) for kind in KINDS},
    'by_part': {part: totals(k for k in found if k.part == part) for part in PARTS},
    'memory_bound': totals(memory_bound),
    'memory_bound_by_phase': {p: totals(k for k in memory_bound if k.phase == p) for p in PHASES},
    'memory_bound_by_part': {part: totals(k for k in memory_bound if k.part == part) for part in PARTS},
    'top_memory_bound': [
      {'group': g, 'kind': kind, 'phase': phase, 'op_name': op, 'part': part, **totals(ks)}
      for (g, kind, phase, op, part), ks in ranked
    ],
  }


def _profile_name(name: str) -> str:
  """A kernel's name as a GPU profile writes it: a CUDA kernel's name has '_' where HLO has '.'."""
  return name.replace('.', '_')


def beside_profile(found: list[Kernel], measured: list[dict], bandwidth_bytes_per_s: float) -> dict:
  """The measured kernels (`dsjax.bench --profile`'s JSON: {'kernel', 'ms_per_step'} each) that are
  memory-bound kernels of this program (MEMORY_BOUND_KINDS), matched by name, each with its traffic, the
  bandwidth it ran at and its part (PARTS); and their totals, also by part.
  The HLO must be the profiled program's own (the profile's DIR/step.hlo.txt): fusion names are not
  stable from one compilation to the next."""
  traffic = collections.defaultdict(float)
  parts = collections.defaultdict(set)
  for k in found:
    if k.kind in MEMORY_BOUND_KINDS:
      traffic[_profile_name(k.group)] += k.bytes
      parts[_profile_name(k.group)].add(k.part)
  rows = []
  for kernel in measured:
    name = _profile_name(kernel['kernel'])
    gb = traffic.get(name)
    if gb is None or kernel['ms_per_step'] <= 0:
      continue
    rows.append(
      {
        'kernel': kernel['kernel'],
        'ms_per_step': kernel['ms_per_step'],
        'gb': gb / 1e9,
        'tb_per_s': gb / 1e9 / kernel['ms_per_step'],
        'fraction_of_bandwidth': gb / (kernel['ms_per_step'] / 1e3) / bandwidth_bytes_per_s,
        # A name that kernels of different parts share (deduplicated over the layers) is 'mixed'.
        'part': next(iter(parts[name])) if len(parts[name]) == 1 else 'mixed',
      }
    )
  total_ms = sum(r['ms_per_step'] for r in rows)
  total_gb = sum(r['gb'] for r in rows)
  return {
    'matched_kernels': len(rows),
    'ms_per_step': total_ms,
    'gb': total_gb,
    'fraction_of_bandwidth': total_gb * 1e9 / (total_ms / 1e3) / bandwidth_bytes_per_s if total_ms else 0.0,
    'by_part': {
      part: {
        'matched_kernels': sum(r['part'] == part for r in rows),
        'ms_per_step': sum(r['ms_per_step'] for r in rows if r['part'] == part),
        'gb': sum(r['gb'] for r in rows if r['part'] == part),
      }
      for part in PARTS
    },
    'kernels': rows,
  }
