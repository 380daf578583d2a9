"""μP (Yang et al. 2021, Tensor Programs V) and Catformer (Davis et al. 2021): plans against the papers'
rules, the built models, μP's learning-rate multipliers in the optimizer, Catformer's parameter match,
training, checkpoint resume.

Expected values are written out from the papers' definitions here, not taken from the scheme modules;
Catformer's closed-form parameter count is the scheme's, checked against the built models' counts.
"""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import models, schemes
from dsjax.models import layers
from dsjax.schemes import catformer
from dsjax.train import config as config_lib
from dsjax.train import loop, optimizers
from dsjax.train import state as state_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

WEIGHTS = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')


def _param_count(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _abstract(config, info):
  return nnx.eval_shape(lambda: schemes.build_model(config, info, nnx.Rngs(params=0)))


def _train_steps(workdir) -> list[int]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [r['step'] for r in map(json.loads, f) if 'train/loss' in r]


def _smoke(config, workdir, steps=3):
  config.total_steps = config.eval_every = config.checkpoint_every = steps
  config.log_every = 1
  final = loop.train_and_evaluate(config, str(workdir))
  assert np.isfinite(final['eval/loss'])
  return final


# ------------------------------------------------------------------------------------------------
# μP
# ------------------------------------------------------------------------------------------------

def _mup_config(name='gpt', *, depth=4, width=64, base=16, **model):
  c = tiny_config(name, scheme='mup', depth=depth, width=width, num_heads=4, **model)
  c.model.mup.base_width = base
  return c


def _kernels(block):
  return {'q': block.attn.q, 'k': block.attn.k, 'v': block.attn.v, 'o': block.attn.o,
          'ffn1': block.ffn.ffn1, 'ffn2': block.ffn.ffn2}


@pytest.mark.parametrize('depth', [4, 16])
def test_mup_plan_and_built_model(depth):
  """Width 64 over base 16 (width_mult 4): hidden variances ∝ 1/fan_in (Xavier), embeddings and head
  at their base-width values, readout × 1/4, logits × 1/d_head, hidden Adam lr × 1/4, nothing else."""
  w, base, vocab, mult = 64, 16, 256, 4.0
  config = _mup_config(depth=depth, width=w, base=base)
  plan = schemes.make_init_plan(config.model, models.model_dims(config.model, TEXT_INFO,
                                                                seq_len=config.data.seq_len))
  expected_var = {'q': 1 / w, 'k': 1 / w, 'v': 1 / w, 'o': 1 / w,       # 2/(fan_in + fan_out), square
                  'ffn1': 2 / (5 * w), 'ffn2': 2 / (5 * w)}              # fan_in·fan_out = w·4w
  for name, var in expected_var.items():
    np.testing.assert_allclose(plan.layer[name] ** 2, np.full(depth, var), rtol=1e-6, err_msg=name)
  for name in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[name], np.ones(depth))
  np.testing.assert_allclose(plan.input_std ** 2, 2 / (vocab + base), rtol=1e-6)   # base-width Xavier
  np.testing.assert_allclose(plan.pos_std ** 2, 2 / (vocab + base), rtol=1e-6)
  np.testing.assert_allclose(plan.head_std ** 2, 2 / (base + vocab), rtol=1e-6)
  assert plan.output_scale == 1 / mult and not plan.zero_head
  assert plan.attn_logit_scale == 1 / (w // 4)                                       # 1/d_head
  assert plan.lr_scale == {name: 1 / mult for name in WEIGHTS}

  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  block = model.trunk.stack.layers
  for name, dense in _kernels(block).items():
    kernel = dense.kernel
    # ≥ 4096 draws per layer: the sample variance is within ~7% (3 standard errors).
    np.testing.assert_allclose(np.asarray(kernel[...]).var(axis=(1, 2)), expected_var[name], rtol=0.1,
                               err_msg=name)
    assert kernel.get_metadata()['lr_scale'] == 1 / mult, name
    assert dense.bias.get_metadata()['lr_scale'] == 1.0, name     # biases are vector-like
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
  """One AdamW update from the train setup of a width-2×base model: every hidden kernel moves by exactly
  half of what the same optimizer without multipliers moves it (its decoupled decay included);
  embeddings, biases, norms and the head move by exactly the same."""
  config = _mup_config(width=32, base=16, depth=2)
  config.optimizer.warmup_steps = 0        # the first update uses the full learning rate
  assert config.optimizer.weight_decay > 0
  setup = state_lib.make_setup(config, TEXT_INFO)
  state = jax.jit(setup.create_state)()
  params = state['params']
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  mup_updates, _ = setup.tx.update(grads, state['opt_state'], params)
  plain_tx, _ = optimizers.make_optimizer(config.optimizer, config.total_steps)
  plain_updates, _ = plain_tx.update(grads, plain_tx.init(params), params)

  scales = state_lib.param_lr_scales(setup.abstract_model)
  layers_ = mup_updates['trunk']['stack']['layers']
  plain_layers = plain_updates['trunk']['stack']['layers']
  for name in WEIGHTS:
    group = 'ffn' if name.startswith('ffn') else 'attn'
    assert scales['trunk']['stack']['layers'][group][name]['kernel'] == 0.5
    plain = np.asarray(plain_layers[group][name]['kernel'])
    assert np.abs(plain).min() > 0
    np.testing.assert_array_equal(np.asarray(layers_[group][name]['kernel']), 0.5 * plain, err_msg=name)
    np.testing.assert_array_equal(layers_[group][name]['bias'], plain_layers[group][name]['bias'])
  unscaled = [('token_embed',), ('pos_embedding',), ('head', 'kernel'),
              ('trunk', 'final_norm', 'scale'), ('trunk', 'stack', 'layers', 'pre_attn_norm', 'scale')]
  for path in unscaled:
    mup_leaf, plain_leaf = mup_updates, plain_updates
    for key in path:
      mup_leaf, plain_leaf = mup_leaf[key], plain_leaf[key]
    assert np.abs(np.asarray(plain_leaf)).max() > 0, path
    np.testing.assert_array_equal(mup_leaf, plain_leaf, err_msg='/'.join(path))


@pytest.mark.slow  # The default run trains every method in tests/test_schemes.py.
@pytest.mark.parametrize('model_name', ['gpt', 'vit'])
def test_mup_trains_three_steps(model_name, tmp_path):
  _smoke(_mup_config(model_name, depth=2, width=32, base=16), tmp_path)


# ------------------------------------------------------------------------------------------------
# Catformer
# ------------------------------------------------------------------------------------------------

def _cat_config(name='gpt', *, depth=4, width=128, num_heads=4, **model):
  return tiny_config(name, scheme='catformer', depth=depth, width=width, num_heads=num_heads, **model)


def assert_shape(variable, shape):
  """Shape of a variable of an abstract (`nnx.eval_shape`) model."""
  assert tuple(variable.shape) == shape, (variable.shape, shape)


def _xavier_var(fan_in, fan_out):
  return 2 / (fan_in + fan_out)


@pytest.mark.parametrize('depth', [4, 16])
def test_catformer_widths_follow_the_rule(depth):
  """App. D.1: layer n reads (2n+1)·d at attention and (2n+2)·d at the FFN, q/k/v → a·d, o → d, FFN
  e·d → d, the head reads (2N+1)·d; d the closest parameter match to the Pre-LN model."""
  config = _cat_config(depth=depth)
  dims = models.model_dims(config.model, TEXT_INFO, seq_len=config.data.seq_len)
  c = schemes.make_init_plan(config.model, dims).concat
  d, n = c.growth, depth
  assert c.stream_widths == tuple(k * d for k in range(1, 2 * n + 2))
  assert c.ffn_hidden == 4 * d
  assert c.attn_width % 4 == 0 and abs(c.attn_width - 2 * d) <= 2     # a·d to a multiple of the heads
  target = catformer.preln_param_count(config.model, dims)
  gap = lambda g: abs(catformer.catformer_param_count(config.model, dims, g) - target)
  assert gap(d) <= min(gap(d - 1), gap(d + 1))

  plan = schemes.make_init_plan(config.model, dims)
  model = _abstract(config, TEXT_INFO)
  assert_shape(model.token_embed, (256, d))
  assert_shape(model.pos_embedding, (16, d))
  for i, layer in enumerate(model.trunk.layers):
    w_attn, w_ffn, a = (2 * i + 1) * d, (2 * i + 2) * d, c.attn_width
    for name in ('q', 'k', 'v'):
      assert_shape(getattr(layer.attn, name).kernel, (w_attn, a))
      np.testing.assert_allclose(plan.layer[name][i] ** 2, _xavier_var(w_attn, a), rtol=1e-5)
    assert_shape(layer.attn.o.kernel, (a, d))
    assert_shape(layer.ffn.ffn1.kernel, (w_ffn, 4 * d))
    assert_shape(layer.ffn.ffn2.kernel, (4 * d, d))
    assert_shape(layer.pre_attn_norm.scale, (w_attn,))
    assert_shape(layer.pre_ffn_norm.scale, (w_ffn,))
    assert layer.mid_attn_norm is None and layer.mid_ffn_norm is None
    np.testing.assert_allclose(plan.layer['o'][i] ** 2, _xavier_var(a, d), rtol=1e-5)
    np.testing.assert_allclose(plan.layer['ffn1'][i] ** 2, _xavier_var(w_ffn, 4 * d), rtol=1e-5)
    np.testing.assert_allclose(plan.layer['ffn2'][i] ** 2, _xavier_var(4 * d, d), rtol=1e-5)
  assert_shape(model.trunk.final_norm.scale, ((2 * n + 1) * d,))
  assert_shape(model.head.kernel, ((2 * n + 1) * d, 256))
  np.testing.assert_allclose(plan.head_std ** 2, _xavier_var((2 * n + 1) * d, 256), rtol=1e-6)
  assert model.trunk.input_norm is None


def test_catformer_paper_rule_reproduces_the_papers_widths():
  """App. E.1: width-512 baselines with FFN 2048 → d = 320, 248, 208 at N = 2, 4, 6 (a = 2, e = 4)."""
  for depth, d in ((2, 320), (4, 248), (6, 208)):
    config = _cat_config(depth=depth, width=512, num_heads=8)
    config.model.catformer.match = 'paper'
    plan = schemes.make_init_plan(config.model, models.model_dims(config.model, TEXT_INFO,
                                                                  seq_len=config.data.seq_len))
    assert plan.concat.growth == d and plan.concat.attn_width == 2 * d and plan.concat.ffn_hidden == 4 * d


@pytest.mark.parametrize('depth', [4, 16])
@pytest.mark.parametrize('model_name', ['gpt', 'vit'])
def test_catformer_parameter_count_within_5_percent_of_preln(model_name, depth):
  info = TEXT_INFO if model_name == 'gpt' else IMAGE_INFO
  config = _cat_config(model_name, depth=depth)
  baseline = tiny_config(model_name, depth=depth, width=128, num_heads=4)   # vanilla Pre-LN
  cat_count, base_count = _param_count(_abstract(config, info)), _param_count(_abstract(baseline, info))
  dims = models.model_dims(config.model, info, seq_len=config.data.seq_len)
  growth = schemes.make_init_plan(config.model, dims).concat.growth
  assert cat_count == catformer.catformer_param_count(config.model, dims, growth)
  assert base_count == catformer.preln_param_count(config.model, dims)
  assert abs(cat_count / base_count - 1) < 0.05, (cat_count, base_count)


def test_catformer_built_values_probe_sites_and_remat():
  config = _cat_config(depth=2, width=32, dropout=0.1)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  plan = schemes.make_init_plan(config.model, models.model_dims(config.model, TEXT_INFO,
                                                                seq_len=config.data.seq_len))
  d = plan.concat.growth
  for i, layer in enumerate(model.trunk.layers):
    for name, dense in {'q': layer.attn.q, 'ffn1': layer.ffn.ffn1}.items():
      np.testing.assert_allclose(np.asarray(dense.kernel[...]).std(), plan.layer[name][i], rtol=0.1)
      assert float(jnp.abs(dense.bias[...]).max()) == 0.0

  seen = []

  def probe(site, x, layer):
    seen.append((site, x.shape[-1], int(layer)))
    return x
  tokens = jnp.arange(32).reshape(2, 16) % 256
  logits = model(tokens, probe=probe)
  chex.assert_shape(logits, (2, 16, 256))
  chex.assert_tree_all_finite(logits)
  assert seen == [('embedding', d, -1),
                  ('attn_branch', d, 0), ('attn_residual', 2 * d, 0), ('ffn_branch', d, 0),
                  ('ffn_residual', 3 * d, 0),
                  ('attn_branch', d, 1), ('attn_residual', 4 * d, 1), ('ffn_branch', d, 1),
                  ('ffn_residual', 5 * d, 1)]

  # model.remat: every attention and FFN module is one jax.checkpoint (a remat equation of the trace).
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  remat_config = _cat_config(depth=2, width=32, dropout=0.1, remat='full')
  remat_graphdef = nnx.graphdef(_abstract(remat_config, TEXT_INFO))

  def checkpoints(graphdef):
    loss = lambda p: nnx.merge(graphdef, p, rest)(tokens, dropout_key=jax.random.key(1)).mean()
    jaxpr = jax.make_jaxpr(loss)(params)
    return sum(eqn.primitive.name.startswith(('checkpoint', 'remat')) for eqn in jaxpr.jaxpr.eqns)
  # Without remat the only checkpoints are the exact GELU's, one per FFN (it is recomputed in the
  # backward pass, `dsjax.models.layers.ACTIVATIONS`); with remat they sit inside the modules' own.
  assert checkpoints(graphdef) == 2
  assert checkpoints(remat_graphdef) == 2 * 2


def test_catformer_bad_configs():
  for key, value, match in (('tie_embeddings', True, r'model\.tie_embeddings'),
                            ('block', 'postln', r'model\.block')):
    config = _cat_config()
    config.model[key] = value
    with pytest.raises(ValueError, match=match):
      config_lib.validate_config(config, num_devices=1)
  config = _cat_config()
  config.model.catformer.match = 'params'
  with pytest.raises(ValueError, match=r'model\.catformer\.match'):
    config_lib.validate_config(config, num_devices=1)


@pytest.mark.slow  # Resuming a run is checked in tests/test_reliability.py; this is Catformer's own tree.
def test_catformer_gpt_trains_and_resumes_from_its_checkpoint(tmp_path):
  config = _cat_config(depth=2, width=32, dropout=0.1)
  _smoke(config, tmp_path, steps=2)
  config.total_steps = 3
  final = loop.train_and_evaluate(config, str(tmp_path))       # Restores step 2, trains step 3.
  assert np.isfinite(final['eval/loss'])
  assert _train_steps(tmp_path) == [1, 2, 3]


@pytest.mark.slow  # The default run trains every method in tests/test_schemes.py.
def test_catformer_vit_trains_three_steps(tmp_path):
  _smoke(_cat_config('vit', depth=2, width=32, pos_embedding='sincos2d', pooling='cls'), tmp_path)
