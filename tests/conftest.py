"""Test setup (must happen before jax is imported): 8 simulated CPU devices for the sharding tests,
XLA's cheapest CPU compilation, and one compilation cache for the whole run.

The tests run tiny models whose time is almost all compilation. The fast setting halves it (measured on
the registry-walking method tests) and changes no result a test checks — every comparison in the suite
is between runs compiled the same way, or against tolerances.

Many programs are compiled more than once in a run: the same step in the pytest-xdist workers, and in
the command-line tools each test starts as a child process (a resumed run compiles what the first one
did). JAX's persistent compilation cache, in a temporary directory that this run's processes share and
the first process removes at the end, compiles each such program once. A loaded executable is the one
XLA compiled, so no result changes. The cache's size limit turns on its file lock (the `filelock`
package), so that one process never reads an entry another is still writing. A JAX_COMPILATION_CACHE_DIR
set by the user is kept, and then left in place.
"""

import os
import shutil
import tempfile
from importlib import metadata

_FLAGS = (
  '--xla_force_host_platform_device_count=8',
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
)
# jaxlib 0.10 still has XLA's older CPU fusion code generator, which compiles this suite's programs in
# about 60% of the time of the newer one (its default; the only one from 0.11 on, where the flag is gone
# and would stop XLA at start-up).
if tuple(int(part) for part in metadata.version('jaxlib').split('.')[:2]) < (0, 11):
  _FLAGS += ('--xla_cpu_use_fusion_emitters=false',)
os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *_FLAGS]).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

_OWN_CACHE_DIR = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _OWN_CACHE_DIR = tempfile.mkdtemp(prefix='dsjax-tests-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _OWN_CACHE_DIR  # inherited by workers and child processes
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(4 << 30))


def pytest_unconfigure(config):
  if _OWN_CACHE_DIR is not None:
    shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)
