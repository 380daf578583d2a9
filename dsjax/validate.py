"""Config checks that run before anything is compiled or written.

Each failure is a one-line `ValueError` naming the key, the allowed values and what was given.
"""

from __future__ import annotations

import math

from dsjax import schemes
from dsjax.instrument.probe import DELIVERIES
from dsjax.models import MODEL_NAMES
from dsjax.models.layers import _ACTIVATIONS
from dsjax.models.transformer import BLOCKS, DNT_SETTINGS, REMAT_POLICIES
from dsjax.models.vit import POOLINGS, POS_EMBEDDINGS
from dsjax.schemes.vanilla import INITS
from dsjax.train import sharding as sharding_lib

NORMS = ('layernorm', 'rmsnorm')
INIT_DISTRIBUTIONS = ('normal', 'truncated_normal', 'uniform')


def one_of(key: str, value, allowed):
  if value not in allowed:
    raise ValueError(f'{key} must be one of {list(allowed)}, got {value!r}')


def _positive_int(key: str, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{key} must be a positive integer, got {value!r}')


def _probability(key: str, value):
  if not 0.0 <= value < 1.0:
    raise ValueError(f'{key} must be in [0, 1), got {value!r}')


def validate_config(config, num_devices: int, process_count: int = 1):
  from dsjax.data.config import parse_config as validate_data_config
  from dsjax.train.optimizers import validate_optimizer_config

  for key in ('total_steps', 'batch_size', 'eval_batch_size', 'eval_every', 'checkpoint_every',
              'log_every', 'keep_checkpoints'):
    _positive_int(key, config[key])
  if not isinstance(config.seed, int) or config.seed < 0:
    raise ValueError(f'seed must be a non-negative integer, got {config.seed!r}')

  m = config.model
  one_of('model.name', m.name, MODEL_NAMES)
  for key in ('depth', 'width', 'num_heads', 'mlp_ratio', 'patch_size'):
    _positive_int(f'model.{key}', m[key])
  if m.width % m.num_heads:
    raise ValueError(f'model.width ({m.width}) must be divisible by model.num_heads ({m.num_heads})')
  one_of('model.block', m.block, BLOCKS)
  one_of('model.dnt_setting', m.dnt_setting, DNT_SETTINGS)
  one_of('model.norm', m.norm, NORMS)
  if not m.norm_eps > 0:
    raise ValueError(f'model.norm_eps must be > 0, got {m.norm_eps!r}')
  one_of('model.activation', m.activation, sorted(_ACTIVATIONS))
  _probability('model.dropout', m.dropout)
  _probability('model.attn_dropout', m.attn_dropout)
  one_of('model.scheme', m.scheme, sorted(schemes.SCHEMES))
  if m.scheme == 'dslm':
    schemes.dslm.validate_config(m)  # model.dslm.* keys and the blocks/embeddings DSLM can scale.
  one_of('model.init', m.init, INITS)
  one_of('model.init_distribution', m.init_distribution, INIT_DISTRIBUTIONS)
  one_of('model.remat', m.remat, REMAT_POLICIES)
  one_of('model.pos_embedding', m.pos_embedding, POS_EMBEDDINGS)
  one_of('model.pooling', m.pooling, POOLINGS)
  if m.name == 'vit' and m.pos_embedding == 'sincos2d' and m.width % 4:
    raise ValueError(f'model.width must be divisible by 4 with model.pos_embedding=sincos2d, got {m.width}')

  validate_optimizer_config(config.optimizer)
  validate_data_config(config.data)

  if not isinstance(config.instrument.every, int) or config.instrument.every < 0:
    raise ValueError(f'instrument.every must be an integer >= 0 (0 = off), got {config.instrument.every!r}')
  one_of('instrument.delivery', config.instrument.delivery, DELIVERIES)

  shape = sharding_lib.resolve_mesh_shape(config.mesh.shape, num_devices)
  batch_shards = math.prod(shape[:2])
  for key in ('batch_size', 'eval_batch_size'):
    if config[key] % batch_shards or config[key] % process_count:
      raise ValueError(f'{key} ({config[key]}) must be divisible by the data×fsdp mesh size '
                       f'({batch_shards}) and the process count ({process_count})')


def validate_against_data(config, data_info):
  """Checks that need the dataset's shapes (known before compilation, after the dataset is found)."""
  m = config.model
  if m.name == 'vit':
    if data_info.kind != 'image':
      raise ValueError(f'model.name=vit needs an image dataset, but data.name={config.data.name!r} is {data_info.kind}')
    h, w, _ = data_info.image_shape
    if h % m.patch_size or w % m.patch_size:
      raise ValueError(f'model.patch_size ({m.patch_size}) must divide the image size {h}x{w}')
  elif data_info.kind != 'text':
    raise ValueError(f'model.name=gpt needs a text dataset, but data.name={config.data.name!r} is {data_info.kind}')
