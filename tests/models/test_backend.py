"""`dsjax.models.backend`: inside `compiling_for(backend)` the model is built and lowered for that backend
('auto' choices, Pallas kernels lowered rather than interpreted) whatever this machine is, and outside
it for this machine again. benchmarks/gpu_compiled_traffic.py compiles a whole GPU step this way
(tests/test_gpu_compiled_traffic.py, where jax's CUDA plugin is installed)."""

import jax
import pytest

from dsjax import models
from dsjax.models import fused_ops, tpu_attention
from tests.helpers import tiny_config


def test_compiling_for_a_gpu_resolves_for_it_and_then_for_this_machine():
  m = tiny_config('gpt').model
  here = (models.compute_dtype(m), models.attention_implementation(m), fused_ops._interpret())
  with models.compiling_for('gpu'):
    assert models.target_backend() == 'gpu'
    assert models.compute_dtype(m) == 'bfloat16'
    assert models.attention_implementation(m) == 'cudnn'  # without asking a device its capability
    assert not fused_ops._interpret() and tpu_attention._interpret()
  assert models.target_backend() == jax.default_backend()
  assert (models.compute_dtype(m), models.attention_implementation(m), fused_ops._interpret()) == here


def test_blocks_nest_and_restore_after_an_error():
  with pytest.raises(RuntimeError):
    with models.compiling_for('tpu'):
      with models.compiling_for('gpu'):
        assert models.target_backend() == 'gpu'
      assert models.target_backend() == 'tpu' and not tpu_attention._interpret()
      raise RuntimeError
  assert models.target_backend() == jax.default_backend()


def test_unknown_backend_is_an_error():
  with pytest.raises(ValueError, match=r"backend must be one of \['cpu', 'gpu', 'tpu'\], got 'cuda'"):
    with models.compiling_for('cuda'):
      pass
