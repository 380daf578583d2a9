"""The command-line tools keep freed host memory for reuse, and a run's steps keep what it built out of
the full garbage collections (`dsjax.train.host_memory`).

Each case runs a fresh interpreter (the settings are process-wide): it frees a 64 MiB block, then
allocates and writes one as large again on another thread (plain `malloc`, as XLA's CPU runtime
allocates a step's temporaries), and counts the page faults of that second allocation.
"""

import gc
import os
import subprocess
import sys

import pytest

from dsjax.train import host_memory
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
BLOCK_PAGES = (64 << 20) // 4096

REUSE = """
import ctypes, resource, threading
from dsjax.train import host_memory
applied = host_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def touch():
  block = libc.malloc(64 << 20)
  ctypes.memset(block, 1, 64 << 20)  # every page written
  libc.free(block)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
worker = threading.Thread(target=touch)
worker.start()
worker.join()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(extra_env: dict[str, str]) -> tuple[bool, int]:
  ours = (*host_memory.GLIBC_VARIABLES, host_memory.OPT_OUT_VARIABLE)
  env = {k: v for k, v in os.environ.items() if k not in ours}
  env['JAX_PLATFORMS'] = 'cpu'
  out = subprocess.run(
    [sys.executable, '-c', REUSE],
    cwd=ROOT,
    env={**env, **extra_env},
    text=True,
    capture_output=True,
    check=True,
  ).stdout.split()
  return out[0] == 'True', int(out[1])


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc settings: Linux only')
def test_freed_block_is_reused_without_page_faults():
  applied, faults = _run({})
  assert applied
  assert faults < BLOCK_PAGES // 10, faults


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc settings: Linux only')
@pytest.mark.parametrize(
  'opt_out', [{'DSJAX_KEEP_FREED_MEMORY': '0'}, {'MALLOC_ARENA_MAX': '4'}, {'JAX_PLATFORMS': 'cuda,cpu'}]
)
def test_opted_out_or_off_the_cpu_glibc_is_left_as_it_was(opt_out):
  # glibc's default: the block is mapped afresh and every page faults again.
  applied, faults = _run(opt_out)
  assert not applied
  assert faults >= BLOCK_PAGES * 9 // 10, faults


def test_every_tool_applies_it_before_running():
  cli_source = (ROOT / 'dsjax' / 'train' / 'cli.py').read_text()
  run_body = cli_source.split('def run(', 1)[1]
  assert 'host_memory.keep_freed_memory()' in run_body.split('def guarded_main', 1)[0]


def test_what_is_built_is_frozen_while_the_steps_run_and_thawed_after():
  """`built_objects_frozen`: the objects there are when the steps start stay out of full collections
  (`gc.get_objects()` no longer lists them) until the steps end, an exception included; a cycle made
  meanwhile is collected as before."""

  class Node:
    pass

  built = Node()
  collected = []
  with host_memory.built_objects_frozen():
    assert gc.get_freeze_count() > 0 and not any(o is built for o in gc.get_objects())
    cycle = Node()
    cycle.self = cycle
    gc.callbacks.append(lambda phase, info: collected.append(info.get('collected', 0)))
    del cycle
    gc.collect()
    gc.callbacks.pop()
    assert sum(collected) >= 1  # the cycle made while frozen
  assert gc.get_freeze_count() == 0 and any(o is built for o in gc.get_objects())
  with pytest.raises(RuntimeError), host_memory.built_objects_frozen():
    raise RuntimeError('a step failed')
  assert gc.get_freeze_count() == 0


def test_the_train_loop_and_the_benchmark_run_their_steps_frozen():
  loop_source = (ROOT / 'dsjax' / 'train' / 'loop.py').read_text()
  assert 'with host_memory.built_objects_frozen():\n      state = training.run_steps(' in loop_source
  bench_source = (ROOT / 'dsjax' / 'bench.py').read_text()
  assert 'with host_memory.built_objects_frozen():' in bench_source.split('def run_benchmark(', 1)[1]
