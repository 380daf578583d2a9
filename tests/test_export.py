"""Folding λ, β and the output scale into a vanilla checkpoint (`dsjax.export`), Pre-LN and Post-LN."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dsjax import export, schemes
from dsjax.train import loop
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

# float32 forward passes through a few layers: |Δlogits| / max|logits| ~1e-6; 1e-5 leaves room.
RTOL = 1e-5


def _perturbed_dslm_model(name, block, **model):
  """A DSLM model whose norms, biases and β look trained (not 1 / 0 / sqrt(k/N)), so the fold is tested
  on general values; learnable β is on."""
  config = tiny_config(name, scheme='dslm', block=block, depth=5, dropout=0.1, **model)
  config.model.dslm.init = 'full'
  config.model.dslm.learnable_beta = True
  if name == 'vit':
    config.model.dslm.input_corr = 0.46
  info = IMAGE_INFO if name == 'vit' else TEXT_INFO
  model_ = schemes.build_model(config, info, nnx.Rngs(params=0))
  graphdef, state = nnx.split(model_)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  # Multiply every array (weights, gains, biases, β, output scale) by a random factor in [0.5, 1.5] and
  # shift it a little: zero biases become non-zero, λ stays positive.
  leaves = [x * jax.random.uniform(k, x.shape, minval=0.5, maxval=1.5) + 0.01 for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), config, info


def _inputs(name):
  if name == 'vit':
    return jax.random.normal(jax.random.key(3), (4, 8, 8, 1))
  return jax.random.randint(jax.random.key(3), (4, 16), 0, 256)


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('name,tie', [('gpt', False), ('gpt', True), ('vit', False)])
def test_folded_vanilla_model_gives_the_same_logits(block, name, tie):
  kwargs = {'tie_embeddings': tie} if name == 'gpt' else {}
  model, config, _ = _perturbed_dslm_model(name, block, **kwargs)
  folded, plain_config = export.fold_model(model, config)
  assert plain_config.model.scheme == 'vanilla'
  stack = folded.trunk.stack.layers
  for key in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    np.testing.assert_array_equal(getattr(stack, key)[...], 1.0)
  assert float(folded.trunk.output_scale[...]) == 1.0
  check = export.logit_error(model, folded, _inputs(name))
  assert check['relative_error'] < RTOL, check


def test_export_command_round_trip(tmp_path):
  """Train a DSLM run for 2 steps, export it, load it as a vanilla model: same logits on real data."""
  config = tiny_config('gpt', scheme='dslm', block='postln', depth=4, dropout=0.1, tie_embeddings=True)
  config.total_steps = 2
  run, out = str(tmp_path / 'run'), str(tmp_path / 'export')
  loop.train_and_evaluate(config, run)
  check = export.export(run, out)
  assert check['relative_error'] < RTOL
  with open(os.path.join(out, 'export.json')) as f:
    assert json.load(f)['relative_error'] == check['relative_error']
  loaded, loaded_config = export.load_exported(out)
  assert loaded_config.model.scheme == 'vanilla'
  scaled, _ = export.restore_run(run)
  inputs = export.first_eval_inputs(config)
  np.testing.assert_allclose(np.asarray(loaded(inputs)), np.asarray(scaled(inputs)), rtol=1e-4, atol=1e-4)
  # The vanilla model built from the exported config has Constant (not learnable) scales of 1.
  graphdef, params, rest = nnx.split(loaded, nnx.Param, ...)
  assert 'skip_attn' not in nnx.to_pure_dict(params)['trunk']['stack']['layers']


def test_export_rejects_dnt():
  with pytest.raises(ValueError, match='model.block'):
    export.fold_state({'trunk': {}}, 'dnt')


# Slow (28 s): restore_run itself runs by default in test_export_command_round_trip; this adds the
# step choice.
@pytest.mark.slow
def test_restore_run_at_a_chosen_step(tmp_path):
  config = tiny_config('gpt', depth=2)
  config.total_steps, config.checkpoint_every, config.optimizer.lr = 2, 1, 0.1
  run = str(tmp_path / 'run')
  loop.train_and_evaluate(config, run)
  latest, _ = export.restore_run(run)
  first, _ = export.restore_run(run, step=1)
  inputs = export.first_eval_inputs(config)
  assert not np.allclose(np.asarray(first(inputs)), np.asarray(latest(inputs)))
  with pytest.raises(ValueError, match='no checkpoint of step 5'):
    export.restore_run(run, step=5)
