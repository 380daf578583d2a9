"""`model.matmul_cast`: every weight matmul's inputs rounded to FP8 unscaled (direct casting), checked
against numpy's rounding of the same numbers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import models, schemes
from dsjax.models import layers
from dsjax.models.config import RESUMABLE_KEYS, model_config, validate_model
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

FORMATS = ('float8_e4m3fn', 'float8_e5m2')


def _rounded(x, fmt: str) -> np.ndarray:
  """x rounded by numpy (ml_dtypes' conversion), not by XLA."""
  return np.asarray(x, np.float32).astype(getattr(jnp, fmt)).astype(np.float32)


@pytest.mark.parametrize('fmt', FORMATS)
def test_direct_cast_rounds_as_numpy_does_and_passes_the_gradient(fmt):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(1000) * np.logspace(-8, 2, 1000), jnp.float32)
  np.testing.assert_array_equal(layers.direct_cast(x, fmt), _rounded(x, fmt))
  np.testing.assert_array_equal(jax.grad(lambda v: layers.direct_cast(v, fmt).sum())(x), np.ones(1000))
  assert layers.direct_cast(x, 'none') is x
  # Unscaled: below the smallest subnormal is zero; beyond the largest finite is NaN (e4m3fn) or inf.
  tiny_and_huge = layers.direct_cast(jnp.asarray([1e-9, 1e6], jnp.float32), fmt)
  assert tiny_and_huge[0] == 0.0
  assert np.isnan(tiny_and_huge[1]) if fmt == 'float8_e4m3fn' else np.isinf(tiny_and_huge[1])


def test_a_cast_dense_layer_multiplies_the_rounded_inputs():
  dense = layers.Dense(
    16,
    8,
    std=0.3,
    distribution='normal',
    use_bias=True,
    axes=(None, None),
    rngs=nnx.Rngs(params=0),
    input_cast='float8_e4m3fn',
  )
  dense.bias.set_value(jnp.linspace(-1, 1, 8))
  x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
  expected = _rounded(x, 'float8_e4m3fn') @ _rounded(dense.kernel[...], 'float8_e4m3fn') + dense.bias[...]
  np.testing.assert_allclose(dense(jnp.asarray(x)), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name,tie', [('gpt', False), ('gpt', True), ('vit', False)])
def test_every_weight_matmul_of_a_model_is_cast_and_the_parameters_are_the_plain_models(name, tie):
  overrides = {'tie_embeddings': tie} if name == 'gpt' else {}
  plain_config = tiny_config(name, **overrides)
  cast_config = tiny_config(name, matmul_cast='float8_e5m2', **overrides)
  info = TEXT_INFO if name == 'gpt' else IMAGE_INFO
  plain = schemes.build_model(plain_config, info, nnx.Rngs(params=0))
  cast = schemes.build_model(cast_config, info, nnx.Rngs(params=0))
  denses = [node for _, node in nnx.iter_graph(cast) if isinstance(node, layers.Dense)]
  assert denses and all(d.input_cast == 'float8_e5m2' for d in denses)
  chex.assert_trees_all_equal(nnx.state(plain, nnx.Param), nnx.state(cast, nnx.Param))
  inputs = (
    jnp.arange(48).reshape(3, 16) % 256 if name == 'gpt' else jnp.linspace(0, 1, 128).reshape(2, 8, 8, 1)
  )
  plain_logits, cast_logits = plain(inputs), cast(inputs)
  chex.assert_tree_all_finite(cast_logits)
  # e5m2 keeps 2 mantissa bits: each rounding is within 12.5%, and the logits move by about that much.
  error = float(jnp.linalg.norm(cast_logits - plain_logits) / jnp.linalg.norm(plain_logits))
  assert 1e-3 < error < 0.5


def test_the_key_is_checked_and_resumable():
  m = model_config('gpt')
  assert m.matmul_cast == 'none' and 'matmul_cast' in RESUMABLE_KEYS
  assert models.transformer_config(m).matmul_cast == 'none'
  m.matmul_cast = 'float8'
  with pytest.raises(
    ValueError, match=r"model.matmul_cast must be one of \['none', 'float8_e4m3fn', 'float8_e5m2'\]"
  ):
    validate_model(m)
