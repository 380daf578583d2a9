"""Test setup (must happen before jax is imported): 8 simulated CPU devices for the sharding tests,
XLA's cheapest CPU compilation, and a compilation cache for the session. The tests run tiny models
whose time is almost all compilation; the fast setting halves it (measured on the registry-walking method tests) and changes no result a test
checks — every comparison in the suite is between runs compiled the same way, or against tolerances.
"""

import atexit
import os
import shutil
import tempfile

_FLAGS = ('--xla_force_host_platform_device_count=8', '--xla_backend_optimization_level=0',
          '--xla_llvm_disable_expensive_passes=true')
os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *_FLAGS]).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# One compilation cache for the whole session, shared with the training subprocesses some tests start
# (they inherit the environment): many tests compile the same tiny models, and compilation is most of
# their time. Fresh per session, so no executable outlives the code that produced it.
_CACHE_DIR = tempfile.mkdtemp(prefix='dsjax-test-xla-cache-')
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', _CACHE_DIR)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
