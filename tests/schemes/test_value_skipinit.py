"""Value-SkipInit (He et al. 2023, `dsjax.schemes.value_skipinit`): no attention skip, the attention
matrix α·I + β·A with learnable α = 1, β = 0.

The plan and the built model at two depths on every block, the identity attention at initialisation, the
config checks and a 3-step training run of GPT and ViT.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.models import layers
from tests.schemes.common import (
  DEPTHS,
  POSTLN_NORMS,
  PRELN_NORMS,
  assert_rejected,
  build,
  check_three_loop_steps,
  check_xavier_qk,
  init_plan,
  layer_of,
  method_config,
  norms_present,
  registered,
)


def test_registered_with_its_blocks():
  assert registered('value_skipinit')['blocks'][0] == 'preln'


@pytest.mark.parametrize('block', ['preln', 'postln', 'nonorm'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_value_skipinit_plan_and_model(depth, block):
  d = 32
  config = method_config('value_skipinit', 'gpt', depth=depth, width=d, block=block)
  plan = init_plan(config)
  np.testing.assert_array_equal(plan.layer['skip_attn'], np.zeros(depth))
  for key in ('skip_ffn', 'branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.ones(depth))
  assert plan.attn_identity and not plan.skip.learnable
  check_xavier_qk(plan, d)
  model = build(config)
  block_ = model.trunk.stack.layers
  assert isinstance(block_.skip_attn, layers.Constant)
  np.testing.assert_array_equal(block_.skip_attn[...], np.zeros(depth))
  np.testing.assert_array_equal(block_.skip_ffn[...], np.ones(depth))
  attn = block_.attn
  assert isinstance(attn.mix_identity, nnx.Param) and isinstance(attn.mix_attention, nnx.Param)
  chex.assert_shape([attn.mix_identity[...], attn.mix_attention[...]], (depth,))
  np.testing.assert_array_equal(attn.mix_identity[...], np.ones(depth))
  np.testing.assert_array_equal(attn.mix_attention[...], np.zeros(depth))
  expected_norms = {'preln': PRELN_NORMS, 'postln': POSTLN_NORMS}.get(block, {k: False for k in PRELN_NORMS})
  assert norms_present(block_) == expected_norms


@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_value_skipinit_attention_is_the_identity_at_init(name):
  """The attention module's output is o(v(x)) on random x: the identity attention matrix."""
  d = 32
  model = build(method_config('value_skipinit', name, depth=4, width=d))
  for n in (0, 3):
    attn = layer_of(model.trunk.stack.layers.attn, n)
    x = jax.random.normal(jax.random.key(n), (3, 16, d))
    out = attn(x, None)
    chex.assert_shape(out, (3, 16, d))
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn.o(attn.v(x))), rtol=1e-5, atol=1e-6)
    # Once β moves away from 0 the attention mixes tokens again.
    attn.mix_attention[...] = jnp.ones(())
    assert not np.allclose(np.asarray(attn(x, None)), np.asarray(attn.o(attn.v(x))), atol=1e-3)


@pytest.mark.parametrize(
  'name,key,value,message',
  [
    ('gpt', 'block', 'dnt', 'model.block'),
  ],
)
def test_bad_configs_fail_in_validate(name, key, value, message):
  assert_rejected(method_config('value_skipinit', name), key, value, message)


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(tmp_path, name):
  check_three_loop_steps('value_skipinit', name, tmp_path)
