"""The backend the model is built and lowered for: this machine's, or another named by `compiling_for`.

What depends on the backend is decided in Python while the model is built and traced: 'auto' choices
(`model.dtype`, `model.attention`; `dsjax.models.config`) and whether a Pallas kernel is lowered for its
device or run in Pallas' interpreter (`dsjax.models.fused_ops`, `dsjax.models.tpu_attention`). They all
ask `target_backend()`. Inside `compiling_for('gpu')` a machine without a GPU builds the model and lowers
its step as a GPU would, so that the step can be compiled ahead of time for a GPU it does not have
(`jax.experimental.topologies`; benchmarks/gpu_compiled_traffic.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

BACKENDS = ('cpu', 'gpu', 'tpu')

_target: str | None = None  # set by `compiling_for`; None: this machine's backend


def target_backend() -> str:
  """'cpu', 'gpu' or 'tpu': the backend named by the enclosing `compiling_for`, else this machine's."""
  return _target or jax.default_backend()


def compiling_for_another() -> bool:
  """Whether a `compiling_for` block names the backend (its devices cannot then be asked anything)."""
  return _target is not None


@contextlib.contextmanager
def compiling_for(backend: str) -> Iterator[None]:
  """Within the block, models are built, traced and lowered for `backend` whatever this machine has; a
  GPU is taken to be a capable one (an NVIDIA GPU of compute capability ≥ 8.0)."""
  global _target
  if backend not in BACKENDS:
    raise ValueError(f'backend must be one of {list(BACKENDS)}, got {backend!r}')
  previous, _target = _target, backend
  try:
    yield
  finally:
    _target = previous
