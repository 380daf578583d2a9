"""The host memory of a run: freed memory kept in the process, so that XLA's CPU backend does not pay page
faults every step (`keep_freed_memory`), and what the run has built kept out of the garbage collector's
full collections (`built_objects_frozen`).

XLA's CPU runtime allocates one temporary buffer per execution of a compiled step, as large as all of
the step's live intermediates together (0.3 GiB for configs/gpt_preln.py), and frees it when the step
ends. glibc's malloc serves a block that large with a fresh `mmap` and unmaps it again on free, and it
does so from the per-thread arena of whichever runtime thread runs the step. Every step therefore
touches a new, unmapped 0.3 GiB: on the 2-core CPU about 80,000 page faults per step, each one a kernel
entry that zeroes a 4 KiB page, which made the train step of configs/gpt_preln.py 1.3–1.5x slower than it
is with the memory kept (README, Performance). PyTorch's CPU tensors are allocated one by one, small
enough for glibc to reuse freed blocks, so a PyTorch loop does not pay this.

`keep_freed_memory()` tells glibc (`mallopt`) to use one arena for all threads, never to `mmap` a block
and never to return freed memory at the top of the heap to the OS. The heap then grows to the step's
peak once and is reused by every later step. It is called by `cli.run` before JAX starts its threads.

It applies only where JAX will compute on the CPU: `JAX_PLATFORMS` names the CPU first, or it is unset
and no accelerator plugin of JAX (CUDA, ROCm, TPU) is installed. On a GPU or TPU host the step's
temporaries live in device memory, and one arena for all threads could slow the host's many compiler
threads, which allocate a lot. It changes nothing either off Linux/glibc, under an allocator preloaded
in glibc's place (tcmalloc, jemalloc: their `mallopt` ignores these settings), or when any of glibc's
own variables for these settings (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_MAX_`, `MALLOC_TRIM_THRESHOLD_`) or
`DSJAX_KEEP_FREED_MEMORY=0` is set in the environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib.metadata
import os
import sys

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# Trim threshold "never": mallopt takes an int and glibc stores it as a size_t, so -1 is the largest
# size and freed memory is never trimmed on its own (`malloc_trim(0)` still returns it on request).
NEVER_TRIM = -1
GLIBC_VARIABLES = ('MALLOC_ARENA_MAX', 'MALLOC_MMAP_MAX_', 'MALLOC_TRIM_THRESHOLD_')
OPT_OUT_VARIABLE = 'DSJAX_KEEP_FREED_MEMORY'
# Distributions that give JAX a non-CPU backend (jax-cuda12-plugin, jax-cuda13-plugin, jax-rocm*-plugin,
# libtpu, libtpu-nightly).
ACCELERATOR_PLUGIN_PREFIXES = ('jax-cuda', 'jax-rocm', 'libtpu')


def cpu_backend_expected() -> bool:
  """Whether JAX's default backend will be the CPU, judged before JAX starts (nothing is initialised)."""
  platforms = os.environ.get('JAX_PLATFORMS', '').strip()
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  names = {
    (dist.metadata['Name'] or '').lower().replace('_', '-') for dist in importlib.metadata.distributions()
  }
  return not any(name.startswith(ACCELERATOR_PLUGIN_PREFIXES) for name in names)


def keep_freed_memory() -> bool:
  """Applies the settings above; True if glibc accepted all of them, False where they do not apply."""
  if not sys.platform.startswith('linux') or os.environ.get(OPT_OUT_VARIABLE, '1') == '0':
    return False
  if any(name in os.environ for name in GLIBC_VARIABLES) or not cpu_backend_expected():
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    mallopt = libc.mallopt
    libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such symbol)
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  # mallopt returns 1 on success.
  return all(
    mallopt(param, value) == 1
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM))
  )


@contextlib.contextmanager
def built_objects_frozen():
  """While a run's steps run: every object there is, once the garbage is collected, moved to the garbage
  collector's permanent generation (`gc.freeze`), so that a full collection does not walk the model,
  compiled steps and data pipeline the run has built; moved back when the steps end (`gc.unfreeze`), so
  that a process that runs several runs frees what one of them left. With the per-layer statistics at
  192 layers every step, a full collection (one in about 130 steps) took up to ~200 ms and stalled that
  step; frozen, 2.4 ms at most (benchmarks/README.md, "Instrumentation overhead"). Objects made meanwhile
  are collected as before. Not to be nested: leaving it thaws everything frozen, a caller's too."""
  gc.collect()
  gc.freeze()
  try:
    yield
  finally:
    gc.unfreeze()
