"""Small shared test utilities: tiny configs and stand-in dataset descriptions."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsjax import schemes
from dsjax.train import sharding as sharding_lib
from dsjax.train import step as step_lib
from dsjax.train.config import base_config

# The repository's root: the working directory of the tests that run dsjax's commands.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def subprocess_env(**overrides: str) -> dict[str, str]:
  """The environment of a child Python that imports dsjax from this checkout: the repository's root ahead
  of any PYTHONPATH already set (where the dependencies may be installed outside site-packages)."""
  path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get('PYTHONPATH')]))
  return {**os.environ, 'PYTHONPATH': path, **overrides}


def run_python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python ARGS` in the repository's root on the CPU (`subprocess_env`), its output captured."""
  return subprocess.run(
    [sys.executable, *args],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    env=subprocess_env(JAX_PLATFORMS='cpu'),
    timeout=timeout,
  )


IMAGE_INFO = types.SimpleNamespace(kind='image', image_shape=(8, 8, 1), num_classes=10)
TEXT_INFO = types.SimpleNamespace(kind='text', vocab_size=256)


def tiny_config(model_name: str = 'gpt', **model_overrides):
  c = base_config(model_name, optimizer_name='adamw')
  c.total_steps, c.batch_size, c.eval_batch_size = 4, 8, 16
  c.eval_every = c.checkpoint_every = c.log_every = 2
  c.optimizer.warmup_steps = 1
  c.data.seq_len = 16
  c.model.depth, c.model.width, c.model.num_heads = 2, 32, 4
  for k, v in model_overrides.items():
    c.model[k] = v
  return c


_WORDS = (
  'def',
  'return',
  'self',
  'import',
  'class',
  'value',
  'print',
  'for',
  'in',
  'range',
  'if',
  'else',
  'None',
  'True',
  'ünïcode',
  'λ',
  '=',
  '(',
  ')',
  ':',
  '\n',
  '    ',
)


def write_text_corpus(directory, num_files: int = 48, words_per_file: int = 200, seed: int = 0):
  """A tiny `text:GLOB` corpus: `num_files` plain-text files of pseudo-random words (48 files give every
  split some). Returns `directory`."""
  rng = np.random.default_rng(seed)
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(num_files):
    text = ' '.join(rng.choice(_WORDS, words_per_file))
    (directory / f'file_{i:03d}.txt').write_text(text, encoding='utf-8')
  return directory


def tiny_train_step(config, batch_size: int, **step_options):
  """The train step of `config`'s GPT on `TEXT_INFO` by `step.make_train_step` (SGD at 0.1, language
  model loss, seed 0, `step_options` passed on), its initial state, a batch of random tokens of
  `config.data.seq_len` + 1, and the model's logical axes (for sharded runs)."""
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  tx = optax.sgd(0.1)
  state = {
    'params': params,
    'rest': rest,
    'opt_state': tx.init(params),
    'step': jnp.zeros((), jnp.int32),
    'nonfinite_steps': jnp.zeros((), jnp.int32),
  }
  step_fn = step_lib.make_train_step(
    graphdef, tx, step_lib.lm_loss, 0, optax.constant_schedule(0.1), **step_options
  )
  tokens = jax.random.randint(jax.random.key(7), (batch_size, config.data.seq_len + 1), 0, 256)
  return step_fn, state, {'tokens': tokens}, sharding_lib.logical_axes(model)


def correlated_activations(key, shape, mean, seq_std, hidden_std, noise_std):
  """x = mean + a_{b,i} (shared by all tokens) + e_{b,t} (shared by all hidden units) + noise, of known
  moments: corr_seq seq_std²/σ², corr_hidden hidden_std²/σ² (σ² the sum of the three squares)."""
  b, l, d = shape
  k1, k2, k3 = jax.random.split(key, 3)
  return (
    mean
    + seq_std * jax.random.normal(k1, (b, 1, d))
    + hidden_std * jax.random.normal(k2, (b, l, 1))
    + noise_std * jax.random.normal(k3, shape)
  )
