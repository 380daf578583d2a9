"""Bamboo (Xue et al. 2023, `dsjax.schemes.bamboo`): the vanilla Xavier Pre-LN plan; the method is the
deeper-narrower config (`configs/gpt_bamboo.py`).

The plan and the built model at two depths against the vanilla Pre-LN ones, the config against the Pre-LN
one of equal block parameters, the config checks and a 3-step training run of GPT and ViT.
"""

import importlib.util
import pathlib

import numpy as np
import pytest
from flax import nnx

from dsjax.train import config as config_lib
from tests.schemes.common import (
  DEPTHS,
  assert_rejected,
  build,
  check_three_training_steps,
  init_plan,
  method_config,
  norm_paths,
  registered,
  xavier_model,
  xavier_std,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_registered_with_its_blocks():
  assert registered('bamboo')['blocks'] == ('preln',)


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'postln', 'model.block'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('bamboo'), key, value, message)


@pytest.mark.parametrize('depth', DEPTHS)
def test_bamboo_is_the_xavier_pre_ln_plan(depth):
  config = method_config('bamboo', depth=depth)
  plan = init_plan(config)
  vanilla = init_plan(method_config('vanilla', depth=depth, block='preln'))
  for key, value in vanilla.layer.items():
    np.testing.assert_array_equal(plan.layer[key], value, err_msg=key)
  for field in (
    'distribution',
    'input_std',
    'pos_std',
    'head_std',
    'output_scale',
    'skip',
    'branch',
    'layout',
  ):
    assert getattr(plan, field) == getattr(vanilla, field), field
  np.testing.assert_allclose(plan.layer['ffn1'], xavier_std(32, 128), rtol=1e-6)
  model, reference = build(config), xavier_model(config)  # the built model is the vanilla one
  assert len(norm_paths(model)) == 3  # pre-attention, pre-FFN and final LayerNorm
  for (path, a), (_, b) in zip(nnx.iter_graph(model), nnx.iter_graph(reference)):
    if isinstance(a, nnx.Variable):
      np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))


def _load_config(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / 'configs' / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_bamboo_config_is_deeper_and_narrower_at_equal_block_parameters():
  bamboo, preln = _load_config('gpt_bamboo'), _load_config('gpt_preln')
  config_lib.validate_config(bamboo, num_devices=1)
  assert bamboo.model.scheme == 'bamboo' and bamboo.model.block == 'preln'
  assert bamboo.model.depth > preln.model.depth and bamboo.model.width < preln.model.width
  block_params = lambda m: 12 * m.width**2 * m.depth
  assert block_params(bamboo.model) == block_params(preln.model)
  assert bamboo.model.width // bamboo.model.num_heads == preln.model.width // preln.model.num_heads
  for key in ('total_steps', 'batch_size'):
    assert bamboo[key] == preln[key]
  assert bamboo.data.seq_len == preln.data.seq_len
  assert bamboo.optimizer.to_dict() == preln.optimizer.to_dict()


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('bamboo', name, learnable_branch=False)
