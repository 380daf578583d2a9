"""μP (Yang et al. 2021, Tensor Programs V, `dsjax.schemes.mup`): the plan against the paper's rules, the
built model, the learning-rate multipliers in the optimizer, the base-width model, the zero readout, the
config checks and a 3-step training run of GPT and ViT.

Expected values are written out from the paper's definitions here, not taken from the scheme module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import models, schemes
from dsjax.models import layers
from dsjax.train import config as config_lib
from dsjax.train import optimizers
from dsjax.train import state as state_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config
from tests.schemes.common import dense_layers, registered, smoke

WEIGHTS = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')


def test_registered_with_its_blocks():
  assert registered('mup')['blocks'] == ('preln', 'postln')


def _mup_config(name='gpt', *, depth=4, width=64, base=16, **model):
  c = tiny_config(name, scheme='mup', depth=depth, width=width, num_heads=4, **model)
  c.model.mup.base_width = base
  return c


@pytest.mark.parametrize('depth', [4, 16])
def test_mup_plan_and_built_model(depth):
  """Width 64 over base 16 (width_mult 4): hidden variances ∝ 1/fan_in (Xavier), embeddings and head
  at their base-width values, readout × 1/4, logits × 1/d_head, hidden Adam lr × 1/4, nothing else."""
  w, base, vocab, mult = 64, 16, 256, 4.0
  config = _mup_config(depth=depth, width=w, base=base)
  plan = schemes.make_init_plan(
    config.model, models.model_dims(config.model, TEXT_INFO, seq_len=config.data.seq_len)
  )
  expected_var = {
    'q': 1 / w,
    'k': 1 / w,
    'v': 1 / w,
    'o': 1 / w,  # 2/(fan_in + fan_out), square
    'ffn1': 2 / (5 * w),
    'ffn2': 2 / (5 * w),
  }  # fan_in·fan_out = w·4w
  for name, var in expected_var.items():
    np.testing.assert_allclose(plan.layer[name] ** 2, np.full(depth, var), rtol=1e-6, err_msg=name)
  for name in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[name], np.ones(depth))
  np.testing.assert_allclose(plan.input_std**2, 2 / (vocab + base), rtol=1e-6)  # base-width Xavier
  np.testing.assert_allclose(plan.pos_std**2, 2 / (vocab + base), rtol=1e-6)
  np.testing.assert_allclose(plan.head_std**2, 2 / (base + vocab), rtol=1e-6)
  assert plan.output_scale == 1 / mult and not plan.zero_head
  assert plan.attn_logit_scale == 1 / (w // 4)  # 1/d_head
  assert plan.lr_scale == {name: 1 / mult for name in WEIGHTS}

  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  block = model.trunk.stack.layers
  for name, dense in dense_layers(block).items():
    kernel = dense.kernel
    # ≥ 4096 draws per layer: the sample variance is within ~7% (3 standard errors).
    np.testing.assert_allclose(
      np.asarray(kernel[...]).var(axis=(1, 2)), expected_var[name], rtol=0.1, err_msg=name
    )
    assert kernel.get_metadata()['lr_scale'] == 1 / mult, name
    assert dense.bias.get_metadata()['lr_scale'] == 1.0, name  # biases are vector-like
    assert float(jnp.abs(dense.bias[...]).max()) == 0.0
  for norm in (block.pre_attn_norm, block.pre_ffn_norm, model.trunk.final_norm):
    assert norm.scale.get_metadata()['lr_scale'] == 1.0 and np.all(np.asarray(norm.scale[...]) == 1)
  for table in (model.token_embed, model.head.kernel):
    assert table.get_metadata()['lr_scale'] == 1.0
  np.testing.assert_allclose(np.var(model.token_embed[...]), 2 / (vocab + base), rtol=0.05)
  np.testing.assert_allclose(np.var(model.head.kernel[...]), 2 / (base + vocab), rtol=0.05)
  assert float(model.trunk.output_scale[...]) == 1 / mult
  assert block.attn.logit_scale == 1 / 16
  assert isinstance(block.skip_attn, layers.Constant)


def test_mup_at_base_width_is_the_xavier_model_with_1_over_d_attention():
  for name, info in (('gpt', TEXT_INFO), ('vit', IMAGE_INFO)):
    config = _mup_config(name, width=32, base=32)
    vanilla = tiny_config(name, depth=4, width=32, num_heads=4)
    dims = models.model_dims(config.model, info, seq_len=config.data.seq_len)
    mup_plan = schemes.make_init_plan(config.model, dims)
    xavier = schemes.make_init_plan(vanilla.model, dims)
    for key in xavier.layer:
      np.testing.assert_allclose(mup_plan.layer[key], xavier.layer[key], rtol=1e-6, err_msg=key)
    for field in ('input_std', 'pos_std', 'head_std', 'output_scale'):
      np.testing.assert_allclose(getattr(mup_plan, field), getattr(xavier, field), rtol=1e-6, err_msg=field)
    assert mup_plan.lr_scale == {k: 1.0 for k in WEIGHTS}
    assert xavier.attn_logit_scale is None and mup_plan.attn_logit_scale == 1 / 8


def test_mup_zero_readout_and_bad_configs():
  config = _mup_config(width=32, depth=2)
  config.model.mup.zero_readout = True
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  assert float(jnp.abs(model.head.kernel[...]).max()) == 0.0
  config.model.tie_embeddings = True
  with pytest.raises(ValueError, match=r'model\.mup\.zero_readout'):
    schemes.validate(config.model)
  bad = _mup_config()
  bad.model.mup.base_width = 0
  with pytest.raises(ValueError, match=r'model\.mup\.base_width'):
    config_lib.validate_config(bad, num_devices=1)


def test_mup_lr_scaling_reaches_the_optimizer():
  """One AdamW update from the train setup of a width-2×base model: every hidden kernel moves by half of
  what the same optimizer without multipliers moves it (its decoupled decay included; to float32
  rounding); embeddings, biases, norms and the head move by exactly the same."""
  config = _mup_config(width=32, base=16, depth=2)
  config.optimizer.warmup_steps = 0  # the first update uses the full learning rate
  assert config.optimizer.weight_decay > 0
  setup = state_lib.make_setup(config, TEXT_INFO)
  state = jax.jit(setup.create_state)()
  params = state['params']
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  # Jitted: one compilation each, not one per operation.
  mup_updates, _ = jax.jit(setup.tx.update)(grads, state['opt_state'], params)
  plain_tx, _ = optimizers.make_optimizer(config.optimizer, config.total_steps)
  plain_updates, _ = jax.jit(plain_tx.update)(grads, jax.jit(plain_tx.init)(params), params)

  scales = state_lib.param_lr_scales(setup.abstract_model)
  layers_ = mup_updates['trunk']['stack']['layers']
  plain_layers = plain_updates['trunk']['stack']['layers']
  for name in WEIGHTS:
    group = 'ffn' if name.startswith('ffn') else 'attn'
    assert scales['trunk']['stack']['layers'][group][name]['kernel'] == 0.5
    plain = np.asarray(plain_layers[group][name]['kernel'])
    assert np.abs(plain).min() > 0
    # Half, up to float32 rounding: the two updates are differently compiled programs.
    np.testing.assert_allclose(
      np.asarray(layers_[group][name]['kernel']), 0.5 * plain, rtol=1e-6, err_msg=name
    )
    np.testing.assert_array_equal(layers_[group][name]['bias'], plain_layers[group][name]['bias'])
  unscaled = [
    ('token_embed',),
    ('pos_embedding',),
    ('head', 'kernel'),
    ('trunk', 'final_norm', 'scale'),
    ('trunk', 'stack', 'layers', 'pre_attn_norm', 'scale'),
  ]
  for path in unscaled:
    mup_leaf, plain_leaf = mup_updates, plain_updates
    for key in path:
      mup_leaf, plain_leaf = mup_leaf[key], plain_leaf[key]
    assert np.abs(np.asarray(plain_leaf)).max() > 0, path
    np.testing.assert_array_equal(mup_leaf, plain_leaf, err_msg='/'.join(path))


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('model_name', ['gpt', 'vit'])
def test_mup_trains_three_steps(model_name, tmp_path):
  smoke(_mup_config(model_name, depth=2, width=32, base=16), tmp_path)
