"""Shardings: parameters and optimizer state by the logical axes each array declares where it is
created, activations by their batch axis; training on a mesh matches one device."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsjax import data as data_lib
from dsjax import schemes
from dsjax.models import fused_ops, layers, tpu_attention
from dsjax.train import loop
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config


def _state_and_axes(config):
  setup = state_lib.make_setup(config, TEXT_INFO)
  return jax.eval_shape(setup.create_state), sharding_lib.logical_axes(setup.abstract_model)


def test_every_model_array_declares_logical_axes_and_they_reach_the_optimizer_state():
  config = tiny_config('gpt', depth=2, width=32, num_heads=4)
  state, axes = _state_and_axes(config)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  shardings = sharding_lib.state_shardings(state, axes, mesh)
  layer = shardings['params']['trunk']['stack']['layers']
  assert layer['attn']['q']['kernel'].spec == P(None, 'fsdp', 'tensor')  # (layer, embed, heads)
  assert layer['attn']['o']['kernel'].spec == P(None, 'tensor', 'fsdp')  # (layer, heads, embed)
  assert layer['ffn']['ffn1']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert layer['pre_attn_norm']['scale'].spec == P(None, None)  # replicated by decision
  assert shardings['params']['token_embed'].spec == P('tensor', 'fsdp')
  # AdamW moments follow their parameter (the optimizer state is sharded like the model).
  adam = shardings['opt_state'][1][0]
  assert adam.mu['trunk']['stack']['layers']['attn']['q']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert adam.nu['token_embed'].spec == P('tensor', 'fsdp')


def test_a_dimension_that_does_not_divide_its_mesh_axis_is_listed():
  """Width 36 does not divide over fsdp = 8: every 'embed' dimension stays whole, and the loop logs each."""
  state, axes = _state_and_axes(tiny_config('gpt', depth=2, width=36, num_heads=4))
  mesh = sharding_lib.make_mesh((1, 8, 1), jax.devices()[:8])
  undivided = sharding_lib.undivided_dimensions(state, axes, mesh)
  assert 'token_embed: embed size 36 kept whole (fsdp axis of 8)' in undivided
  assert any(line.startswith('trunk/stack/layers/attn/q/kernel: embed size 36') for line in undivided)
  assert sharding_lib.state_shardings(state, axes, mesh)['params']['token_embed'].spec == P('tensor', None)
  state, axes = _state_and_axes(tiny_config('gpt', depth=2, width=32, num_heads=4))
  assert sharding_lib.undivided_dimensions(state, axes, mesh) == []


def test_an_array_without_logical_axes_is_an_error():
  class Bare(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))  # no axes metadata
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
    pytest.skip('needs its data-dependent preparation (covered by tests/schemes/test_registry.py)')
  state, axes = _state_and_axes(config)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  sharding_lib.state_shardings(state, axes, mesh)  # Raises for any array without a rule.


def test_a_logical_axis_without_a_rule_is_an_error():
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  with pytest.raises(ValueError, match="logical axis 'heads_kv' has no rule"):
    sharding_lib.spec_for(('embed', 'heads_kv'), (32, 32), mesh)


@pytest.mark.parametrize(
  'processes_DFT,ok',
  [
    (np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(2, 2, 2), True),  # process p holds data row p
    (np.array([0, 0, 1, 1, 0, 0, 1, 1]).reshape(2, 2, 2), True),  # interleaved fsdp rows: still whole
    (np.array([0, 1, 0, 1, 0, 1, 0, 1]).reshape(2, 2, 2), False),  # tensor spans the processes
    (np.array([0, 0, 0, 0, 0, 0, 1, 1]).reshape(4, 1, 2), False),  # 3 batch shards against 1
    (np.zeros((1, 1, 8), int), True),  # one process: anything goes
  ],
)
def test_every_batch_shard_lives_in_one_process(processes_DFT, ok):
  if ok:
    sharding_lib.check_process_layout(processes_DFT)
  else:
    with pytest.raises(ValueError, match=re.escape(f'mesh.shape {processes_DFT.shape} does not fit 2')):
      sharding_lib.check_process_layout(processes_DFT)


# ------------------------------------------------------------------------------------------------
# Training on a mesh: the loop's own jitted step (`loop.make_train_step`) on 8 simulated CPU devices
# against one device, and the shardings the arrays actually have after the steps.
# ------------------------------------------------------------------------------------------------

STEPS = 5
RTOL = 1e-4
# ((data, fsdp, tensor), dropout). (2, 2, 2) uses every axis at once and runs by default, without
# dropout (its random bits take a third of the compilation; tests/train/test_train.py runs dropout on this
# mesh through the whole loop); the slow set runs every mesh with dropout.
MESHES = [((2, 2, 2), 0.0)] + [
  pytest.param(shape, 0.1, marks=pytest.mark.slow) for shape in ((8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4))
]


def _config(model_name, dropout=0.0, microbatches=1, attention='auto', fused_ops='auto'):
  config = tiny_config(
    model_name, dropout=dropout, depth=2, width=32, num_heads=4, attention=attention, fused_ops=fused_ops
  )
  config.total_steps, config.microbatches = STEPS, microbatches
  return config


def _batches(model_name, config):
  rng = np.random.default_rng(0)
  if model_name == 'gpt':
    return [
      {'tokens': rng.integers(0, 256, (config.batch_size, config.data.seq_len + 1), dtype=np.int32)}
      for _ in range(STEPS)
    ]
  return [
    {
      'image': rng.standard_normal((config.batch_size, 8, 8, 1), dtype=np.float32),
      'label': rng.integers(0, 10, (config.batch_size,), dtype=np.int32),
    }
    for _ in range(STEPS)
  ]


def _setup(model_name, dropout):
  return state_lib.make_setup(_config(model_name, dropout), TEXT_INFO if model_name == 'gpt' else IMAGE_INFO)


@functools.cache
def _initial_state(model_name, dropout):
  """The initial train state on the host (created once, on one device, and put onto each mesh: the
  loop's own `jit(create_state, out_shardings=...)` is run by tests/train/test_train.py and the multi-process
  test)."""
  setup = _setup(model_name, dropout)
  return jax.device_get(jax.jit(setup.create_state)())


def _train(model_name, shape, dropout=0.0, microbatches=1, attention='auto', fused_ops='auto'):
  """(the losses of STEPS steps, the final train state on its mesh)."""
  config = _config(model_name, dropout, microbatches, attention, fused_ops)
  setup = state_lib.make_setup(config, TEXT_INFO if model_name == 'gpt' else IMAGE_INFO)
  mesh = sharding_lib.make_mesh(shape, jax.devices()[: math.prod(shape)])
  shardings = sharding_lib.state_shardings(
    jax.eval_shape(setup.create_state), sharding_lib.logical_axes(setup.abstract_model), mesh
  )
  state = jax.device_put(_initial_state(model_name, dropout), shardings)
  train_step = loop.make_train_step(config, setup, mesh, shardings)
  losses = []
  with sharding_lib.use_mesh(mesh):
    for batch in _batches(model_name, config):
      state, metrics = train_step(state, sharding_lib.global_batch(batch, mesh))
      losses.append(float(metrics['train/loss']))
  return losses, state


@functools.cache
def _one_device(model_name, dropout, attention='auto'):
  losses, state = _train(model_name, (1, 1, 1), dropout, attention=attention)
  return losses, jax.device_get(state)


def _relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_same_training(model_name, dropout, losses, state, attention='auto'):
  losses_1, state_1 = _one_device(model_name, dropout, attention)
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  # Parameters and optimizer state, array by array. The attention key bias is left out: it adds q·b
  # to every score of a query, which the softmax removes, so its gradient is 0 in exact arithmetic and
  # float32 rounding noise in practice, which Adam's g / (|g| + eps) turns into updates of up to the
  # learning rate — other noise for every summation order.
  reference = dict(jax.tree_util.tree_leaves_with_path(state_1))
  for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(state)):
    name = jax.tree_util.keystr(path)
    if "['k']['bias']" not in name:
      assert _relative_error(value, reference[path]) <= RTOL, name


def _leaf(tree, *keys):
  for key in keys:
    tree = getattr(tree, key) if isinstance(key, str) and hasattr(tree, key) else tree[key]
  return tree


def _assert_sharded(array, spec, mesh_shape):
  """`array` (a jax.Array after training) is laid out by `spec`: its sharding says so, and every
  device holds the block that the spec's mesh axes cut out."""
  sizes = dict(zip(sharding_lib.MESH_AXES, mesh_shape))
  assert array.sharding.spec == spec, (array.sharding.spec, spec)
  block = tuple(dim // (sizes[axis] if axis else 1) for dim, axis in zip(array.shape, spec))
  assert {shard.data.shape for shard in array.addressable_shards} == {block}
  assert len({str(shard.index) for shard in array.addressable_shards}) == math.prod(
    sizes[axis] for axis in spec if axis
  )


@pytest.mark.parametrize('shape,dropout', MESHES)
def test_gpt_on_a_mesh_trains_like_one_device_with_sharded_params_and_adam_moments(shape, dropout, capfd):
  losses, state = _train('gpt', shape, dropout)
  _assert_same_training('gpt', dropout, losses, state)
  # XLA's partitioner says so on stderr when it can only reshard by replicating a whole array (the
  # embedding lookup did, before `sharding.gather_tables_over_fsdp`).
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  layer = ('trunk', 'stack', 'layers')
  q, o, ffn1 = (
    layer + ('attn', 'q', 'kernel'),
    layer + ('attn', 'o', 'kernel'),
    layer + ('ffn', 'ffn1', 'kernel'),
  )
  expected = {
    q: P(None, 'fsdp', 'tensor'),  # (layer, embed, heads)
    o: P(None, 'tensor', 'fsdp'),  # (layer, heads, embed)
    ffn1: P(None, 'fsdp', 'tensor'),  # (layer, embed, mlp)
    ('token_embed',): P('tensor', 'fsdp'),  # (vocab, embed)
    layer + ('pre_attn_norm', 'scale'): P(None, None),
  }  # replicated by decision
  adam = state['opt_state'][1][0]
  for path, spec in expected.items():
    param = _leaf(state['params'], *path)
    _assert_sharded(param, spec, shape)
    for moment in (adam.mu, adam.nu):  # AdamW's moments are laid out like their parameter.
      assert _leaf(moment, *path).sharding == param.sharding, path


@pytest.mark.slow
def test_microbatches_on_a_mesh_train_like_one_device_without():
  """Gradient accumulation splits each device's rows evenly (`step.split_microbatches`); the
  constrained batch axis of every microbatch stays on data × fsdp."""
  losses, state = _train('gpt', (2, 2, 2), microbatches=2)
  _assert_same_training('gpt', 0.0, losses, state)


@pytest.mark.slow
def test_vit_on_a_mesh_trains_like_one_device(capfd):
  losses, state = _train('vit', (2, 2, 2), dropout=0.1)
  _assert_same_training('vit', 0.1, losses, state)
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  _assert_sharded(
    state['params']['trunk']['stack']['layers']['attn']['q']['kernel'], P(None, 'fsdp', 'tensor'), (2, 2, 2)
  )


# Slow (31 s): the kernel against the XLA attention runs by default in tests/models, and a Pallas kernel per
# device inside shard_map in test_fused_kernels_on_a_mesh_run_per_device_and_train_like_one_device.
@pytest.mark.slow
def test_splash_attention_on_a_mesh_runs_per_device_and_trains_like_one_device(monkeypatch):
  """The TPU's splash kernel (in Pallas' interpreter here) runs inside `jax.shard_map`, each device on
  its batch rows and heads; 5 steps on a (2, 2, 2) mesh match one device, whose losses match the XLA
  attention's. On a mesh without the logical axis rules (`sharding.use_mesh`) it refuses to run."""
  specs, shard_spec = [], tpu_attention._shard_spec

  def recorded_shard_spec(shape):
    specs.append(shard_spec(shape))
    return specs[-1]

  monkeypatch.setattr(tpu_attention, '_shard_spec', recorded_shard_spec)
  losses, state = _train('gpt', (2, 2, 2), attention='splash')
  assert specs and set(specs) == {P(('data', 'fsdp'), 'tensor', None, None)}
  _assert_same_training('gpt', 0.0, losses, state, attention='splash')
  np.testing.assert_allclose(_one_device('gpt', 0.0, 'splash')[0], _one_device('gpt', 0.0)[0], rtol=RTOL)
  # Two separately traced calls of the same shapes: the kernel built in the first trace (inside
  # shard_map) is reused by the second, and must hold no tracer of the first.
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  q = jax.random.normal(jax.random.key(0), (8, 37, 4, 8))
  reference = jax.nn.dot_product_attention(q, q, q, scale=0.3, is_causal=True)
  with sharding_lib.use_mesh(mesh):
    for _ in range(2):
      out = jax.jit(lambda q: tpu_attention.splash_attention(q, q, q, 0.3, True))(q)
      np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="needs logical axis rules for 'batch'"):
      jax.jit(lambda q: tpu_attention.splash_attention(q, q, q, 1.0, True))(q)


def test_fused_kernels_on_a_mesh_run_per_device_and_train_like_one_device(monkeypatch):
  """model.fused_ops='pallas' (the GPU kernels, in Pallas' interpreter here) runs each kernel inside
  `jax.shard_map`, rows over data×fsdp and the FFN's hidden columns over tensor: 5 steps on a (2, 2, 2)
  mesh match the plain model's on one device."""
  specs, row_spec = [], fused_ops._row_spec

  def recorded_row_spec(*args, **kwargs):
    specs.append(row_spec(*args, **kwargs))
    return specs[-1]

  monkeypatch.setattr(fused_ops, '_row_spec', recorded_row_spec)
  losses, state = _train('gpt', (2, 2, 2), fused_ops='pallas')
  assert set(specs) == {P(('data', 'fsdp'), None), P(('data', 'fsdp'), 'tensor')}
  _assert_same_training('gpt', 0.0, losses, state)


def test_evaluation_runs_on_the_mesh_with_its_axis_rules():
  """Evaluation (also that of a run resumed when already done, outside the training steps) runs inside
  the run's one `use_mesh`: the eval step sees the mesh and the activations' logical axis rules (the
  splash kernel's shard_map needs them)."""
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  seen = []

  def eval_step(state, batch):
    del state, batch
    seen.append((jax.sharding.get_abstract_mesh().size, dict(spmd.get_logical_axis_rules())))
    return {'loss_sum': 1.0, 'count': 1.0}

  config = tiny_config('gpt')
  eval_data = data_lib.make_pipeline(
    config.data, global_batch_size=8, train=False, process_index=0, process_count=1
  )
  with sharding_lib.use_mesh(mesh):
    loop.evaluate(eval_step, None, eval_data, mesh, 'gpt')
  assert seen and all(size == 8 and rules['batch'] == sharding_lib.BATCH_AXES for size, rules in seen)


def test_a_kernel_sharded_over_its_output_axis_multiplies_without_communication():
  """The stacked q/k/v kernel (d, 3, inner), sharded over `inner` on 'tensor' (`Attention.project_qkv`),
  multiplies the batch-sharded tokens with no collective: a reshape of it to (d, 3·inner) would gather it."""
  mesh = sharding_lib.make_mesh((4, 1, 2), jax.devices()[:8])
  x_ND = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P(('data', 'fsdp'))))
  kernel_D3I = jax.ShapeDtypeStruct(
    (32, 3, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, None, 'tensor'))
  )
  hlo = jax.jit(layers.matmul_last_axis).lower(x_ND, kernel_D3I).compile().as_text()
  assert not re.search(r'all-gather|all-reduce|all-to-all|collective-permute', hlo), hlo


def test_the_train_step_constrains_the_batch_axis_of_inputs_activations_and_logits():
  """Traced on the run's mesh with its logical axis rules (`sharding.use_mesh`), as the loop does: the
  model's constraints (`dsjax.models.partitioning`) read both from there."""
  config = _config('gpt')
  setup = state_lib.make_setup(config, TEXT_INFO)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  abstract = jax.eval_shape(setup.create_state)
  shardings = sharding_lib.state_shardings(abstract, sharding_lib.logical_axes(setup.abstract_model), mesh)
  batch = {'tokens': jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len + 1), jnp.int32)}
  with sharding_lib.use_mesh(mesh):
    hlo = loop.make_train_step(config, setup, mesh, shardings).trace(abstract, batch).lower().as_text()
  constrained = re.findall(
    r'sdy.sharding_constraint \S+ <@mesh, \[\{"data", "fsdp"\}[^>]*> : tensor<([\dx]+)x\w+>', hlo
  )
  b, l, d = config.batch_size, config.data.seq_len, config.model.width
  assert f'{b}x{l + 1}' in constrained  # the tokens
  assert f'{b}x{l}x256' in constrained  # the logits
  # The embedding table is gathered over fsdp before the lookup; its vocabulary stays over tensor.
  assert re.search(r'sdy.sharding_constraint \S+ <@mesh, \[\{"tensor"\}, \{\}\]> : tensor<256x32xf32>', hlo)
  # The residual stream: the embedding and, inside the layer scan, every probe site (forward and
  # backward).
  assert constrained.count(f'{b}x{l}x{d}') >= 5
