"""Tests of dsjax.train.optimizers against plain NumPy references of the updates."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsjax.train import optimizers

NUM_STEPS = 6
WARMUP_STEPS = 2
MIN_LR_RATIO = 0.1


def _config(name, **overrides):
  """A small-run config: warmup 2 then cosine to 0.1 * lr at step 6."""
  config = optimizers.default_optimizer_config(name)
  config.warmup_steps = WARMUP_STEPS
  config.min_lr_ratio = MIN_LR_RATIO
  config.clip_norm = None
  config.update(overrides)
  return config


def _reference_lr(
  peak_lr,
  step,
  warmup_steps=WARMUP_STEPS,
  total_steps=NUM_STEPS,
  min_lr_ratio=MIN_LR_RATIO,
  init_lr_ratio=0.0,
):
  """The schedule of make_schedule's docstring, written out in Python."""
  if step < warmup_steps:
    return peak_lr * (init_lr_ratio + (1 - init_lr_ratio) * step / warmup_steps)
  progress = min(step - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
  cosine = 0.5 * (1 + math.cos(math.pi * progress))
  return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


def _initial_params():
  """One decayed leaf (`kernel`) and two non-decayed ones (`bias`, `scale`)."""
  rng = np.random.default_rng(0)
  return {
    'dense': {
      'kernel': rng.normal(size=(3, 4)).astype(np.float32),
      'bias': rng.normal(size=(4,)).astype(np.float32),
    },
    # A stacked (depth, d) norm gain: 2-D, but must not be decayed.
    'norm': {'scale': (1 + 0.1 * rng.normal(size=(2, 4))).astype(np.float32)},
  }


# Which leaves of _initial_params() the mask decays.
_DECAY = {'dense': {'kernel': 1.0, 'bias': 0.0}, 'norm': {'scale': 0.0}}


def _gradients(scale=1.0):
  """A different random gradient for every step."""
  rng = np.random.default_rng(1)
  params = _initial_params()
  return [
    jax.tree.map(lambda p: (scale * rng.normal(size=p.shape)).astype(np.float32), params)
    for _ in range(NUM_STEPS)
  ]


def _clip(grads, clip_norm):
  """Global-norm clipping in NumPy (float64)."""
  if not clip_norm:
    return grads
  norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in jax.tree.leaves(grads)))
  factor = min(1.0, clip_norm / norm)
  return jax.tree.map(lambda g: g * factor, grads)


def _run_optax(tx, params, grads_per_step):
  """Applies tx for every gradient in grads_per_step; returns the params."""
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads in grads_per_step:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _reference_msgdw(config, params, grads_per_step):
  """timm SGDW: decay from the pre-update theta, never in the momentum."""
  theta = jax.tree.map(lambda p: p.astype(np.float64), params)
  momentum_buffer = jax.tree.map(np.zeros_like, theta)
  mu, wd = config.momentum, config.weight_decay
  for step, grads in enumerate(grads_per_step):
    grads = _clip(jax.tree.map(lambda g: g.astype(np.float64), grads), config.clip_norm)
    lr = _reference_lr(config.lr, step)
    momentum_buffer = jax.tree.map(lambda g, m: g + mu * m, grads, momentum_buffer)
    if config.nesterov:
      direction = jax.tree.map(lambda g, m: g + mu * m, grads, momentum_buffer)
    else:
      direction = momentum_buffer
    theta = jax.tree.map(lambda p, d, decay: p * (1 - lr * wd * decay) - lr * d, theta, direction, _DECAY)
  return theta


def _reference_adamw(config, params, grads_per_step):
  """PyTorch AdamW: theta*(1 - lr*wd) - lr*m_hat/(sqrt(v_hat) + eps)."""
  theta = jax.tree.map(lambda p: p.astype(np.float64), params)
  first = jax.tree.map(np.zeros_like, theta)
  second = jax.tree.map(np.zeros_like, theta)
  b1, b2, eps, wd = config.b1, config.b2, config.eps, config.weight_decay
  for step, grads in enumerate(grads_per_step):
    grads = _clip(jax.tree.map(lambda g: g.astype(np.float64), grads), config.clip_norm)
    lr = _reference_lr(config.lr, step)
    first = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, first, grads)
    second = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, second, grads)

    def new_theta(p, m, v, decay):
      m_hat = m / (1 - b1 ** (step + 1))
      v_hat = v / (1 - b2 ** (step + 1))
      return p * (1 - lr * wd * decay) - lr * m_hat / (np.sqrt(v_hat) + eps)

    theta = jax.tree.map(new_theta, theta, first, second, _DECAY)
  return theta


_REFERENCES = {'msgdw': _reference_msgdw, 'adamw': _reference_adamw}

# (name, config overrides, gradient scale): the clipped cases use gradients
# far above clip_norm so that clipping changes every step.
_CASES = [
  ('msgdw', dict(lr=0.5, weight_decay=0.1, nesterov=False), 1.0),
  ('msgdw', dict(lr=0.5, weight_decay=0.1, nesterov=True), 1.0),
  ('adamw', dict(lr=0.05, weight_decay=0.1), 1.0),
  ('msgdw', dict(lr=0.5, weight_decay=0.1, clip_norm=1.0), 100.0),
  ('msgdw', dict(lr=0.5, weight_decay=0.1, clip_norm=1.0, nesterov=True), 100.0),
  ('adamw', dict(lr=0.05, weight_decay=0.1, clip_norm=1.0), 100.0),
]


@pytest.mark.parametrize('name,overrides,grad_scale', _CASES)
def test_optimizer_matches_numpy_reference(name, overrides, grad_scale):
  config = _config(name, **overrides)
  tx, _ = optimizers.make_optimizer(config, total_steps=NUM_STEPS)
  params = _initial_params()
  grads_per_step = _gradients(grad_scale)

  got = _run_optax(tx, params, grads_per_step)
  want = _REFERENCES[name](config, params, grads_per_step)

  chex.assert_trees_all_close(got, jax.tree.map(lambda x: x.astype(np.float32), want), rtol=2e-6, atol=1e-6)
  # The parameters moved well beyond the tolerance.
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), got, params)
  assert min(jax.tree.leaves(moved)) > 1e-3


def test_clipping_matters_in_clipped_cases():
  """Without clipping, the large-gradient run lands somewhere else."""
  params = _initial_params()
  grads_per_step = _gradients(100.0)
  clipped_tx, _ = optimizers.make_optimizer(
    _config('msgdw', lr=0.5, weight_decay=0.1, clip_norm=1.0), NUM_STEPS
  )
  unclipped_tx, _ = optimizers.make_optimizer(
    _config('msgdw', lr=0.5, weight_decay=0.1, clip_norm=0.0), NUM_STEPS
  )
  clipped = _run_optax(clipped_tx, params, grads_per_step)
  unclipped = _run_optax(unclipped_tx, params, grads_per_step)
  assert np.max(np.abs(clipped['dense']['kernel'] - unclipped['dense']['kernel'])) > 1.0


def test_msgdw_decay_is_decoupled_from_momentum():
  """With zero gradients theta shrinks by prod(1 - lr_t*wd), nothing else.

  The coupled variant (decay added before the momentum, torch SGD's
  weight_decay) accumulates wd*theta in the buffer and decays faster.
  """
  config = _config('msgdw', lr=0.5, weight_decay=0.1, warmup_steps=0)
  tx, schedule = optimizers.make_optimizer(config, NUM_STEPS)
  params = _initial_params()
  zero_grads = [jax.tree.map(np.zeros_like, params)] * NUM_STEPS

  got = _run_optax(tx, params, zero_grads)
  factor = np.prod([1 - float(schedule(t)) * config.weight_decay for t in range(NUM_STEPS)])
  chex.assert_trees_all_close(got['dense']['kernel'], params['dense']['kernel'] * factor, rtol=1e-6)
  chex.assert_trees_all_close(got['dense']['bias'], params['dense']['bias'])
  chex.assert_trees_all_close(got['norm']['scale'], params['norm']['scale'])

  coupled_tx = optax.chain(
    optax.add_decayed_weights(config.weight_decay, optimizers.weight_decay_mask),
    optax.trace(decay=config.momentum),
    optax.scale_by_learning_rate(schedule),
  )
  coupled = _run_optax(coupled_tx, params, zero_grads)
  assert np.all(np.abs(coupled['dense']['kernel']) < np.abs(got['dense']['kernel']) - 1e-4)


# ---------------------------------------------------------------------------
# Weight-decay mask on a real nnx module.
# ---------------------------------------------------------------------------


class _Block(nnx.Module):
  """A tiny transformer-like block: norm, two matrices, a residual scale."""

  def __init__(self, width, rngs):
    self.norm = nnx.RMSNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 2 * width, rngs=rngs)
    self.down = nnx.Linear(2 * width, width, use_bias=False, rngs=rngs)
    self.branch_scale = nnx.Param(jnp.ones(()))


class _TinyModel(nnx.Module):
  """Token + position embeddings, layers stacked for scan, final norm, head."""

  def __init__(self, depth, width, vocab, seq_len, rngs):
    self.token_embed = nnx.Embed(vocab, width, rngs=rngs)
    self.pos_embedding = nnx.Param(jnp.zeros((seq_len, width)))
    self.cls_token = nnx.Param(jnp.zeros((1, width)))
    # An nnx.Embed used as a position table stores ('pos_embed', 'embedding').
    self.pos_embed = nnx.Embed(seq_len, width, rngs=rngs)

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return _Block(width, rngs)

    self.blocks = make_blocks(rngs)  # Every Param has a leading depth axis.
    self.skip_scale = nnx.Param(jnp.ones((depth,)))
    self.final_norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)


_EXPECTED_DECAY = {
  ('token_embed', 'embedding'): True,
  ('pos_embedding',): False,
  ('cls_token',): False,
  ('pos_embed', 'embedding'): False,
  ('blocks', 'norm', 'scale'): False,
  ('blocks', 'up', 'kernel'): True,
  ('blocks', 'up', 'bias'): False,
  ('blocks', 'down', 'kernel'): True,
  ('blocks', 'branch_scale'): False,
  ('skip_scale',): False,
  ('final_norm', 'scale'): False,
  ('final_norm', 'bias'): False,
  ('head', 'kernel'): True,
  ('head', 'bias'): False,
}


def _names(path):
  """('blocks', 'norm', 'scale') from a path of DictKey entries."""
  return tuple(key.key for key in path)


def _tiny_model(depth=3, width=8):
  return _TinyModel(depth=depth, width=width, vocab=11, seq_len=5, rngs=nnx.Rngs(0))


def test_weight_decay_mask_on_nnx_state():
  model = _tiny_model(depth=3, width=8)
  _, params, _ = nnx.split(model, nnx.Param, ...)
  mask = optimizers.weight_decay_mask(params)

  assert isinstance(mask, nnx.State)
  got = {_names(path): value for path, value in jax.tree_util.tree_leaves_with_path(mask)}
  assert got == _EXPECTED_DECAY
  assert all(isinstance(value, bool) for value in got.values())
  # The stacked norm gain is 2-D, which an ndim-based rule would decay.
  assert params['blocks']['norm']['scale'].shape == (3, 8)

  # One mask fits both trees optax sees under nnx.Optimizer: the pure-array
  # State (same structure) and the Param-valued State (mask is a prefix).
  pure = nnx.as_pure(params)
  assert jax.tree.structure(mask) == jax.tree.structure(pure)
  assert optimizers.weight_decay_mask(pure) == mask
  jax.tree.map(lambda m, p: None, mask, params)  # Raises if not a prefix.


def test_weight_decay_mask_on_plain_dicts():
  params = {
    'blocks': {'norm': {'scale': np.ones((3, 4))}, 'attn': {'qkv': {'kernel': np.ones((3, 4, 12))}}},
    'layers': [{'kernel': np.ones((4, 4)), 'bias': np.ones(4)}],
    'alphas': [np.float32(1.0), np.float32(1.0)],
    'pos_embedding': {'embedding': np.ones((5, 4))},
    'embedding': np.ones((7, 4)),
    'token_embed': np.ones((7, 4)),  # dsjax.models.gpt's bare Param table.
    'skip_attn': np.ones(3),  # A learnable per-layer residual scale.
  }
  chex.assert_trees_all_equal(
    optimizers.weight_decay_mask(params),
    {
      'blocks': {'norm': {'scale': False}, 'attn': {'qkv': {'kernel': True}}},
      'layers': [{'kernel': True, 'bias': False}],
      'alphas': [False, False],
      'pos_embedding': {'embedding': False},
      'embedding': True,
      'token_embed': True,
      'skip_attn': False,
    },
  )


def test_nnx_optimizer_decays_only_masked_params():
  """End to end through nnx.Optimizer (init on Params, update on pure arrays)."""
  model = _tiny_model()
  config = _config('msgdw', lr=0.5, weight_decay=0.1, warmup_steps=0)
  tx, schedule = optimizers.make_optimizer(config, NUM_STEPS)
  before = nnx.clone(nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  zero_grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  optimizer.update(model, zero_grads)
  after = nnx.state(model, nnx.Param)

  shrink = 1 - float(schedule(0)) * config.weight_decay
  mask = optimizers.weight_decay_mask(before)

  def check(decayed, old, new):
    chex.assert_trees_all_close(new, old * shrink if decayed else old, rtol=1e-6)

  jax.tree.map(check, mask, nnx.as_pure(before), nnx.as_pure(after))


# ---------------------------------------------------------------------------
# Schedule.
# ---------------------------------------------------------------------------


def test_schedule_values():
  config = _config('adamw', lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
  schedule = optimizers.make_schedule(config, total_steps=110)
  np.testing.assert_allclose(schedule(0), 0.0, atol=1e-12)
  np.testing.assert_allclose(schedule(5), 0.5e-3, rtol=1e-6)
  np.testing.assert_allclose(schedule(10), 1e-3, rtol=1e-6)  # end of warmup
  np.testing.assert_allclose(schedule(60), 0.55e-3, rtol=1e-6)  # half of cosine
  np.testing.assert_allclose(schedule(110), 1e-4, rtol=1e-6)  # end
  np.testing.assert_allclose(schedule(500), 1e-4, rtol=1e-6)  # held after
  for step in range(0, 111, 7):
    np.testing.assert_allclose(
      schedule(step), _reference_lr(1e-3, step, warmup_steps=10, total_steps=110, min_lr_ratio=0.1), rtol=1e-5
    )


def test_schedule_variants():
  no_warmup = optimizers.make_schedule(_config('msgdw', lr=1.0, warmup_steps=0, min_lr_ratio=0.0), 100)
  np.testing.assert_allclose(no_warmup(0), 1.0, rtol=1e-6)
  np.testing.assert_allclose(no_warmup(100), 0.0, atol=1e-7)

  warm_start = optimizers.make_schedule(_config('adamw', lr=1e-3, warmup_steps=10, init_lr_ratio=0.1), 100)
  np.testing.assert_allclose(warm_start(0), 1e-4, rtol=1e-6)

  constant = optimizers.make_schedule(_config('adamw', lr=1e-3, warmup_steps=4, schedule='constant'), 100)
  np.testing.assert_allclose(constant(2), 0.5e-3, rtol=1e-6)
  np.testing.assert_allclose(constant(4), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(constant(100), 1e-3, rtol=1e-6)

  linear = optimizers.make_schedule(
    _config('adamw', lr=1e-3, warmup_steps=10, schedule='linear', min_lr_ratio=0.1), 110
  )
  np.testing.assert_allclose(linear(10), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(linear(60), 0.55e-3, rtol=1e-6)  # halfway down to min_lr_ratio · lr
  np.testing.assert_allclose(linear(110), 1e-4, rtol=1e-6)
  np.testing.assert_allclose(linear(500), 1e-4, rtol=1e-6)

  with pytest.raises(ValueError, match='optimizer.warmup_steps must be <'):
    optimizers.make_schedule(_config('adamw', warmup_steps=100), 100)


# ---------------------------------------------------------------------------
# Configs and validation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('name', optimizers.OPTIMIZER_NAMES)
@pytest.mark.parametrize('family', ['gpt', 'vit'])
def test_default_configs_are_valid(name, family):
  config = optimizers.default_optimizer_config(name, family)
  optimizers.validate_optimizer_config(config)
  tx, schedule = optimizers.make_optimizer(config, total_steps=10_000)
  assert isinstance(tx, optax.GradientTransformation)
  # The cosine ends at the paper's minimum learning rate (Qi et al. 2025, Tables 4–5).
  min_lr = {'gpt': 6e-5, 'vit': 1e-8}[family]
  np.testing.assert_allclose(schedule(10_000), min_lr, rtol=1e-5)


@pytest.mark.parametrize(
  'name,overrides,message',
  [
    ('adamw', dict(name='sgd'), "optimizer.name must be one of ['adamw', 'msgdw'], got 'sgd'"),
    ('adamw', dict(lr=-1.0), 'optimizer.lr must be > 0, got -1.0'),
    ('msgdw', dict(lr=0.0), 'optimizer.lr must be > 0, got 0.0'),
    ('adamw', dict(weight_decay=-0.1), 'optimizer.weight_decay must be >= 0, got -0.1'),
    ('msgdw', dict(momentum=1.0), 'optimizer.momentum must be in [0, 1), got 1.0'),
    ('msgdw', dict(momentum=-0.5), 'optimizer.momentum must be in [0, 1), got -0.5'),
    ('adamw', dict(b2=1.5), 'optimizer.b2 must be in [0, 1), got 1.5'),
    (
      'adamw',
      dict(schedule='exponential'),
      "optimizer.schedule must be one of ['cosine', 'linear', 'constant'], got 'exponential'",
    ),
    ('adamw', dict(warmup_steps=-1), 'optimizer.warmup_steps must be an integer >= 0, got -1'),
    ('msgdw', dict(clip_norm=-1.0), 'optimizer.clip_norm must be >= 0'),
  ],
)
def test_validation_errors(name, overrides, message):
  config = optimizers.default_optimizer_config(name)
  with config.ignore_type():  # Allow e.g. a str where a float was.
    config.update(overrides)
  with pytest.raises(ValueError) as error:
    optimizers.validate_optimizer_config(config)
  assert message in str(error.value)
  assert '\n' not in str(error.value)


def test_weight_decay_must_be_explicit():
  config = optimizers.default_optimizer_config('adamw')
  del config['weight_decay']
  with pytest.raises(ValueError, match='optimizer.weight_decay must be set'):
    optimizers.validate_optimizer_config(config)
