"""Test setup (must happen before jax is imported): 8 simulated CPU devices for the sharding tests, and
XLA's cheapest CPU compilation. The tests run tiny models whose time is almost all compilation; the
fast setting halves it (measured on the registry-walking method tests) and changes no result a test
checks — every comparison in the suite is between runs compiled the same way, or against tolerances.
"""

import os

_FLAGS = (
  '--xla_force_host_platform_device_count=8',
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
)
os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *_FLAGS]).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
