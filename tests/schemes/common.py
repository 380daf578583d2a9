"""Shared pieces of the method tests (`tests/schemes/test_<method>.py`, one file per module of
`dsjax.schemes`): tiny configs of a method, its plan and built model, the Xavier model of the same draws,
the config checks and the short training runs.
"""

from __future__ import annotations

import math
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import data as data_lib
from dsjax import models, schemes
from dsjax.models import layers
from dsjax.models.plan import WEIGHT_KEYS
from dsjax.train import config as config_lib
from dsjax.train import loop
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

DEPTHS = (4, 16)
INFO = {'gpt': TEXT_INFO, 'vit': IMAGE_INFO}

POSTLN_NORMS = dict(
  pre_attn_norm=False,
  mid_attn_norm=False,
  post_attn_norm=True,
  pre_ffn_norm=False,
  mid_ffn_norm=False,
  post_ffn_norm=True,
)
PRELN_NORMS = dict(
  pre_attn_norm=True,
  mid_attn_norm=False,
  post_attn_norm=False,
  pre_ffn_norm=True,
  mid_ffn_norm=False,
  post_ffn_norm=False,
)


# ------------------------------------------------------------------------------------------------
# Configs, plans and built models.
# ------------------------------------------------------------------------------------------------


def method_config(scheme, name='gpt', depth=4, block=None, **model):
  """A tiny GPT or ViT config of `scheme` on its natural block (the first of `Scheme.blocks`)."""
  block = block or schemes.get(scheme).blocks[0]
  return tiny_config(name, scheme=scheme, depth=depth, block=block, **model)


def registry_config(scheme: str, model_name: str, **overrides):
  """The config the registry-walking tests train: depth 3, width 16 (DSLM needs k/N < 1), 3 steps."""
  config = tiny_config(model_name, depth=3, width=16, num_heads=2)
  config.model.scheme = scheme
  config.model.block = schemes.SCHEMES[scheme].blocks[0]
  config.total_steps = 3
  config.eval_every = config.checkpoint_every = 3
  config.log_every = 1
  for key, value in overrides.items():
    config[key] = value
  return config


def init_plan(config, info=None):
  return schemes.make_init_plan(
    config.model,
    models.model_dims(config.model, info or INFO[config.model.name], seq_len=config.data.seq_len),
  )


def build(config, info=None, prepared=None):
  return schemes.build_model(config, info or INFO[config.model.name], nnx.Rngs(params=0), prepared)


def xavier_model(config, **model):
  """The vanilla Xavier model of the same config and seed: the same underlying random draws."""
  reference = method_config(
    'vanilla', config.model.name, config.model.depth, block=config.model.block, **model
  )
  return build(reference)


def registered(name: str) -> dict:
  """The registry's row of method `name`, which names its paper and says what it does."""
  row = {row['name']: row for row in schemes.table()}[name]
  assert row['paper'] and row['summary'], row
  assert schemes.get(name).paper and schemes.get(name).summary
  return row


def assert_rejected(config, key: str, value, message: str):
  """`model.<key>` (a dotted path below `config.model`) set to `value` fails the config checks with one
  line naming `message`."""
  section, _, field = key.rpartition('.')
  (config.model[section] if section else config.model)[field] = value
  with pytest.raises(ValueError, match=re.escape(message)) as err:
    config_lib.validate_config(config, num_devices=1)
  assert '\n' not in str(err.value)


# ------------------------------------------------------------------------------------------------
# The parts of a built model.
# ------------------------------------------------------------------------------------------------


def dense_layers(block) -> dict:
  """The six dense layers of a (stacked) block by their plan keys."""
  return {
    'q': block.attn.q,
    'k': block.attn.k,
    'v': block.attn.v,
    'o': block.attn.o,
    'ffn1': block.ffn.ffn1,
    'ffn2': block.ffn.ffn2,
  }


def kernel_arrays(model) -> dict[str, np.ndarray]:
  """The stacked block kernels of a model, (depth, fan_in, fan_out) float64 arrays."""
  dense = dense_layers(model.trunk.stack.layers)
  return {name: np.asarray(d.kernel[...], np.float64) for name, d in dense.items()}


def input_kernel(model):
  """The token table (GPT) or the patch-embedding kernel (ViT)."""
  kernel = model.token_embed if hasattr(model, 'token_embed') else model.patch_embed.kernel
  return np.asarray(kernel[...])


def norm_paths(model):
  return [path for path, node in nnx.iter_graph(model) if isinstance(node, layers.Norm)]


def norms_present(block) -> dict[str, bool]:
  return {
    name: getattr(block, name) is not None
    for name in (
      'pre_attn_norm',
      'mid_attn_norm',
      'post_attn_norm',
      'pre_ffn_norm',
      'mid_ffn_norm',
      'post_ffn_norm',
    )
  }


def layer_of(stacked: nnx.Module, n: int) -> nnx.Module:
  """Layer n of a module whose parameters are stacked on axis 0 by the scanned stack."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[n], state))


def kernel_std(dense) -> float:
  """Sample std of a stacked kernel, pooled over layers (≥ 4·1024 draws: relative error ≈ 1%)."""
  return float(np.asarray(dense.kernel[...]).std())


def random_tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


# ------------------------------------------------------------------------------------------------
# Expected scales.
# ------------------------------------------------------------------------------------------------


def xavier_std(fan_in, fan_out):
  return math.sqrt(2.0 / (fan_in + fan_out))


def check_xavier_qk(plan, d):
  for key in ('q', 'k'):
    np.testing.assert_allclose(plan.layer[key], xavier_std(d, d), rtol=1e-6, err_msg=key)


def assert_layer_stds(model, plan, rtol=0.1):
  """Per-layer sample std of every block matrix against the plan (≥ 1024 draws per layer)."""
  for name, w in kernel_arrays(model).items():
    np.testing.assert_allclose(w.std(axis=(1, 2)), plan.layer[name], rtol=rtol, err_msg=name)


def check_zero_branch_identity(scheme, depth):
  """SkipInit and ReZero: no norm, x + α·f(x) with learnable scalars α = 0 and fixed λ = 1, Xavier
  weights: the trunk is the identity at initialisation. Returns the plan and the stacked block for the
  method's own checks (whether the two adds share α)."""
  config = method_config(scheme, 'gpt', depth=depth)
  plan = init_plan(config)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.zeros(depth))
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.ones(depth))
  assert plan.branch.learnable and not plan.branch.vector
  assert not plan.skip.learnable
  vanilla = init_plan(method_config('vanilla', depth=depth, block='nonorm'))
  for key in WEIGHT_KEYS:  # Xavier weights, as the vanilla plan
    np.testing.assert_allclose(plan.layer[key], vanilla.layer[key])

  model = build(config)
  assert norm_paths(model) == []
  block = model.trunk.stack.layers
  assert isinstance(block.branch_attn, nnx.Param) and isinstance(block.skip_attn, layers.Constant)
  chex.assert_shape(block.branch_attn[...], (depth,))  # one scalar per layer (stacked)
  for key, value in block.scales().items():
    np.testing.assert_array_equal(value, plan.layer[key], err_msg=key)
  ref_kernels = kernel_arrays(xavier_model(config))
  for key, w in kernel_arrays(model).items():  # Xavier weights
    np.testing.assert_array_equal(w, ref_kernels[key])
  x = model.embed(random_tokens())
  y = model.trunk(x, None)  # dropout off
  chex.assert_equal_shape((x, y))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  return plan, block


def check_initial_alpha_is_configurable(scheme):
  """`model.<scheme>.init` sets α at both adds; α ≠ 0 makes the trunk no longer the identity."""
  config = method_config(scheme, 'gpt', depth=4)
  config.model[scheme].init = 0.25
  model = build(config)
  block = model.trunk.stack.layers
  np.testing.assert_array_equal(block.scales()['branch_attn'], np.full(4, 0.25, np.float32))
  np.testing.assert_array_equal(block.scales()['branch_ffn'], np.full(4, 0.25, np.float32))
  x = model.embed(random_tokens())
  assert not np.allclose(model.trunk(x, None), x)


# ------------------------------------------------------------------------------------------------
# Training smoke runs.
# ------------------------------------------------------------------------------------------------

# XLA's cheapest CPU compilation (compile time dominates a 3-step run; the numbers are the same up to
# floating-point reassociation): these runs check that each method trains, not the kernels' speed.
FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}


def train_three_steps(config, name):
  """3 steps of the trainer's own jitted train step and optimizer on real batches: the initial
  parameters, the final state and the losses."""
  config.batch_size = 8
  config_lib.validate_config(config, num_devices=1)
  info = data_lib.dataset_info(config.data)
  setup = state_lib.make_setup(config, info)
  state = setup.create_state()
  initial = jax.tree.map(np.asarray, state['params'])
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=0, process_index=0, process_count=1, train=True
  )
  batches = [jax.tree.map(jnp.asarray, next(pipeline)) for _ in range(3)]
  train_step = jax.jit(
    step_lib.make_train_step(
      setup.graphdef, setup.tx, step_lib.LOSSES[name], config.seed, setup.schedule, use_dropout=False
    )
  )
  train_step = train_step.lower(state, batches[0]).compile(compiler_options=FAST_COMPILE)
  losses = []
  for batch in batches:
    state, metrics = train_step(state, batch)
    losses.append(float(metrics['train/loss']))
  return initial, state, losses


def check_three_training_steps(scheme, name, learnable_branch):
  """3 finite training steps of `scheme` at depth 4; a learnable residual scale β moves, and a method
  without one has no β among its parameters."""
  config = method_config(scheme, name, depth=4)
  config.total_steps = 3
  initial, state, losses = train_three_steps(config, name)
  assert int(state['step']) == 3 and np.all(np.isfinite(losses)), losses
  block = state['params']['trunk']['stack']['layers']
  if learnable_branch:  # the learnable residual scales train
    before = initial['trunk']['stack']['layers']['branch_attn']
    assert not np.allclose(np.asarray(block['branch_attn']), before)
  else:
    assert 'branch_attn' not in block


def loop_config(scheme, name, total_steps=3):
  """A config for the full training loop on one device, evaluating and checkpointing at its end."""
  config = method_config(scheme, name)
  config.total_steps = total_steps
  config.eval_every = config.checkpoint_every = config.log_every = 3
  config.mesh.shape = (1, 1, 1)  # one device: compiling for the 8 simulated ones costs a third more
  return config


def train_on_one_device(config, workdir):
  return loop.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


def check_three_loop_steps(scheme, name, workdir):
  """3 steps of the full training loop of a method without a preparation step: a finite evaluation
  loss, and no preparation result saved."""
  final = train_on_one_device(loop_config(scheme, name), workdir)
  assert np.isfinite(final['eval/loss'])
  assert not os.path.exists(os.path.join(workdir, schemes.PREPARATION_FILE))


def smoke(config, workdir, steps=3):
  """The full training loop (all devices) for `steps` steps, evaluating and checkpointing at the end."""
  config.total_steps = config.eval_every = config.checkpoint_every = steps
  config.log_every = 1
  final = loop.train_and_evaluate(config, str(workdir))
  assert np.isfinite(final['eval/loss'])
  return final
