"""Parameter shardings come from the logical axes each array declares where it is created."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsjax import schemes
from dsjax.models import layers
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from tests.helpers import TEXT_INFO, tiny_config


def _state_and_axes(config):
  setup = state_lib.make_setup(config, TEXT_INFO)
  return jax.eval_shape(setup.create_state), sharding_lib.logical_axes(setup.abstract_model)


def test_every_model_array_declares_logical_axes_and_they_reach_the_optimizer_state():
  config = tiny_config('gpt', depth=2, width=32, num_heads=4)
  state, axes = _state_and_axes(config)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  shardings = sharding_lib.state_shardings(state, axes, mesh)
  layer = shardings['params']['trunk']['stack']['layers']
  assert layer['attn']['q']['kernel'].spec == P(None, 'fsdp', 'tensor')   # (layer, embed, heads)
  assert layer['attn']['o']['kernel'].spec == P(None, 'tensor', 'fsdp')   # (layer, heads, embed)
  assert layer['ffn']['ffn1']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert layer['pre_attn_norm']['scale'].spec == P(None, None)            # replicated by decision
  assert shardings['params']['token_embed'].spec == P('tensor', 'fsdp')
  # AdamW moments follow their parameter (the optimizer state is sharded like the model).
  adam = shardings['opt_state'][1][0]
  assert adam.mu['trunk']['stack']['layers']['attn']['q']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert adam.nu['token_embed'].spec == P('tensor', 'fsdp')


def test_an_array_without_logical_axes_is_an_error():
  class Bare(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))             # no axes metadata
      self.v = layers.param(jnp.ones((4, 4)), ('embed', 'mlp'))

  with pytest.raises(ValueError, match='w declares no logical axes'):
    sharding_lib.logical_axes(nnx.eval_shape(Bare))


def test_a_state_array_matching_no_model_array_is_an_error():
  config = tiny_config('gpt', depth=2, width=32, num_heads=4)
  state, axes = _state_and_axes(config)
  state['extra'] = jax.ShapeDtypeStruct((3, 3), jnp.float32)
  mesh = sharding_lib.make_mesh((8, 1, 1), jax.devices()[:8])
  with pytest.raises(ValueError, match='extra of shape'):
    sharding_lib.state_shardings(state, axes, mesh)


@pytest.mark.parametrize('name', sorted(schemes.SCHEMES))
def test_every_method_shards_every_array(name):
  config = tiny_config('gpt', depth=3, width=32, num_heads=4)
  config.model.scheme = name
  config.model.block = schemes.SCHEMES[name].blocks[0]
  if schemes.get(name).needs_preparation(config.model):
    pytest.skip('needs its data-dependent preparation (covered by tests/test_schemes.py)')
  state, axes = _state_and_axes(config)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  sharding_lib.state_shardings(state, axes, mesh)  # Raises for any array without a rule.
