"""Test setup: 8 simulated CPU devices for the sharding tests (must happen before jax is imported)."""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
