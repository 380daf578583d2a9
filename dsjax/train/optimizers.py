"""Optimizers of dsjax: AdamW and mSGDW, learning-rate schedule, weight-decay mask.

Qi et al. 2025 (DNT) §4 and Tables 3–5 for the settings; Loshchilov & Hutter 2019 for AdamW. Entry points:

  validate_optimizer_config(opt_config)          -> None, raises ValueError
  parse_optimizer_config(opt_config)             -> OptimizerConfig (validated once)
  make_schedule(opt_config, total_steps)         -> optax.Schedule
  weight_decay_mask(params)                      -> pytree of bool
  make_optimizer(opt_config, total_steps)        -> (optax.GradientTransformation,
                                                     optax.Schedule)
  default_optimizer_config(name, family='gpt')   -> ml_collections.ConfigDict

Both optimizers use *decoupled* weight decay multiplied by the scheduled learning
rate (PyTorch AdamW / timm SGDW semantics), optional global-norm gradient
clipping applied to the raw gradient before anything else, and the same
weight-decay mask.

The optimizer config (`opt_config`, an ml_collections.ConfigDict) has the fields

  name           'adamw' | 'msgdw'                                  (required)
  lr             peak learning rate, > 0                            (required)
  weight_decay   decoupled decay coefficient, >= 0                  (required;
                 optax's AdamW default 1e-4 differs from PyTorch's 1e-2, so
                 we never fall back on a library default)
  b1, b2, eps    Adam moments / epsilon (adamw)        default 0.9, 0.999, 1e-8
  momentum       heavy-ball momentum mu in [0, 1) (msgdw)         default 0.9
  nesterov       Nesterov momentum (msgdw)                        default False
  warmup_steps   linear warmup length in steps                    default 0
  init_lr_ratio  warmup starts at init_lr_ratio * lr              default 0.0
  schedule       'cosine' | 'linear' | 'constant' (after warmup)  default 'cosine'
  min_lr_ratio   cosine/linear end at min_lr_ratio * lr at         default: the paper's minimum lr / lr
                 total_steps
  clip_norm      global-norm clipping threshold; 0 or None = off  default None

Fields with a default may be missing from the config.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

OPTIMIZER_NAMES = ('adamw', 'msgdw')
SCHEDULE_NAMES = ('cosine', 'linear', 'constant')

# Leaf names (last key of the parameter path) that receive weight decay: the
# weight matrices of Linear / Conv / Dense layers (`kernel`) and token
# embedding tables: `embedding` is what nnx.Embed calls its table, and
# dsjax.models.gpt.GPT stores its table as a bare nnx.Param `token_embed`.
DECAYED_PARAM_NAMES = ('kernel', 'embedding', 'token_embed', 'token_embedding')

# Path components that switch decay off for everything below them, even a
# `kernel` or an `embedding`: a learned position table built from nnx.Embed is
# stored as ('pos_embedding', 'embedding') and must not be decayed.
NEVER_DECAYED_PATH_NAMES = (
  'pos_embedding',
  'pos_embed',
  'position_embedding',
  'position_embeddings',
  'cls_token',
)

# Defaults of the optional fields (see the module docstring).
_OPTIONAL_DEFAULTS = dict(
  b1=0.9,
  b2=0.999,
  eps=1e-8,
  momentum=0.9,
  nesterov=False,
  warmup_steps=0,
  init_lr_ratio=0.0,
  schedule='cosine',
  min_lr_ratio=0.0,
  clip_norm=None,
)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """A validated optimizer section, its absent optional fields at their defaults
  (`parse_optimizer_config`). `make_schedule` and `make_optimizer` take it as
  it is; given a ConfigDict they validate it first."""

  name: str
  lr: float
  weight_decay: float
  b1: float
  b2: float
  eps: float
  momentum: float
  nesterov: bool
  warmup_steps: int
  init_lr_ratio: float
  schedule: str
  min_lr_ratio: float
  clip_norm: float | None


def _get(opt_config: ml_collections.ConfigDict | OptimizerConfig, key: str) -> Any:
  """Returns opt_config[key], or its documented default when it is absent."""
  if isinstance(opt_config, OptimizerConfig):
    return getattr(opt_config, key)
  if key in opt_config:
    return opt_config[key]
  return _OPTIONAL_DEFAULTS[key]


# --------------------------------------------------------------------------
# Default configurations (DNT paper, Qi et al. 2025, Tables 3-5).
# --------------------------------------------------------------------------


def default_optimizer_config(name: str, family: str = 'gpt') -> ml_collections.ConfigDict:
  """Returns the DNT paper's optimizer settings for `name` and a model family.

  Args:
    name: 'adamw' or 'msgdw'.
    family: 'gpt' (L-DNT / GPT-2 on OpenWebText) or 'vit' (V-DNT / ViT on
      ImageNet). The paper tunes different values for the two.

  Returns:
    A ConfigDict with every field of the optimizer config set, including the
    fields the chosen optimizer ignores (b1/b2/eps for mSGDW, momentum/nesterov
    for AdamW), so a config can be switched with a single `name` override.
  """
  if name not in OPTIMIZER_NAMES:
    raise ValueError(f'optimizer.name must be one of {list(OPTIMIZER_NAMES)}, got {name!r}')
  if family not in ('gpt', 'vit'):
    raise ValueError(f"family must be one of ['gpt', 'vit'], got {family!r}")

  config = ml_collections.ConfigDict()
  config.name = name
  config.schedule = 'cosine'  # DNT: cosine schedule for every run.
  # The cosine ends at the paper's minimum learning rate, set below as a
  # ratio to the peak: 6e-5 for GPT (Table 5), 1e-8 for ViT (Table 4).
  config.init_lr_ratio = 0.0  # Warmup starts from 0.
  config.eps = 1e-8  # Not stated; the PyTorch AdamW default.
  config.momentum = 0.9  # DNT Tables 3-5: mSGDW momentum 0.9.
  config.nesterov = False  # DNT's equation is plain heavy ball (the
  # timm 'sgdw' factory would turn it on).
  config.b1 = 0.9  # DNT Tables 3-5: AdamW beta1 = 0.9.
  if family == 'gpt':
    config.b2 = 0.95  # DNT Table 5 (GPT-2): AdamW beta2 = 0.95.
    config.clip_norm = 1.0  # DNT Table 5 (GPT-2): gradient clipping 1.0.
    if name == 'adamw':
      config.lr = 6e-4  # DNT Table 5: AdamW lr 6e-4.
      config.weight_decay = 0.1  # DNT Table 5: AdamW weight decay 0.1.
      config.warmup_steps = 2000  # DNT Table 5: AdamW warmup 2000 iterations.
      config.min_lr_ratio = 0.1  # DNT Table 5: minimum lr 6e-5 = 0.1 x 6e-4.
    else:
      config.lr = 1.0  # DNT Table 5: mSGDW lr 1.0.
      config.weight_decay = 1e-4  # DNT Table 5: mSGDW weight decay 1e-4.
      config.warmup_steps = 0  # DNT Table 5 says 0 for mSGDW (App. B's
      # text says 2000 for all; we keep the table).
      config.min_lr_ratio = 6e-5  # DNT Table 5: minimum lr 6e-5 = 6e-5 x 1.0.
  else:
    config.b2 = 0.99  # DNT Table 4 (ViT): AdamW beta2 = 0.99.
    config.clip_norm = None  # DNT ViT runs: no gradient clipping.
    # DNT Table 4 warms up for 60 of 150 epochs; how many steps that is depends
    # on the dataset and batch size, so the caller sets warmup_steps from it.
    config.warmup_steps = 0
    if name == 'adamw':
      config.lr = 1e-3  # DNT Tables 3-4: AdamW lr 1e-3.
      config.weight_decay = 0.1  # DNT Tables 3-4: AdamW weight decay 0.1.
      config.min_lr_ratio = 1e-5  # DNT Table 4: minimum lr 1e-8 = 1e-5 x 1e-3.
    else:
      config.lr = 0.5  # DNT Table 4 (ViT-L, batch 1024): mSGDW lr 0.5
      config.weight_decay = 2e-4  # and weight decay 2e-4 (ViT-H: 0.1 / 1e-3).
      config.min_lr_ratio = 2e-8  # DNT Table 4: minimum lr 1e-8 = 2e-8 x 0.5.
  return config


# --------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------


def _is_real(value: Any) -> bool:
  # bool is an int subclass; `lr=True` is a config mistake, not a number.
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_real(key: str, value: Any) -> None:
  if not _is_real(value) or not math.isfinite(value):
    raise ValueError(f'optimizer.{key} must be a finite number, got {value!r}')


def _check_in_unit_interval(key: str, value: Any, upper_inclusive: bool):
  _check_real(key, value)
  ok = 0.0 <= value <= 1.0 if upper_inclusive else 0.0 <= value < 1.0
  if not ok:
    bracket = ']' if upper_inclusive else ')'
    raise ValueError(f'optimizer.{key} must be in [0, 1{bracket}, got {value!r}')


def validate_optimizer_config(opt_config: ml_collections.ConfigDict) -> None:
  """Raises a one-line ValueError naming the offending key, or returns None.

  Only the fields the chosen optimizer uses are checked (b1/b2/eps for AdamW,
  momentum/nesterov for mSGDW), so a config may carry the other optimizer's
  fields unchanged.
  """
  for key in ('name', 'lr', 'weight_decay'):
    if key not in opt_config or opt_config[key] is None:
      raise ValueError(f'optimizer.{key} must be set explicitly')

  name = opt_config.name
  if name not in OPTIMIZER_NAMES:
    raise ValueError(f'optimizer.name must be one of {list(OPTIMIZER_NAMES)}, got {name!r}')

  lr = opt_config.lr
  _check_real('lr', lr)
  if lr <= 0:
    raise ValueError(f'optimizer.lr must be > 0, got {lr!r}')

  weight_decay = opt_config.weight_decay
  _check_real('weight_decay', weight_decay)
  if weight_decay < 0:
    raise ValueError(f'optimizer.weight_decay must be >= 0, got {weight_decay!r}')

  schedule = _get(opt_config, 'schedule')
  if schedule not in SCHEDULE_NAMES:
    raise ValueError(f'optimizer.schedule must be one of {list(SCHEDULE_NAMES)}, got {schedule!r}')

  warmup_steps = _get(opt_config, 'warmup_steps')
  if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or (warmup_steps < 0):
    raise ValueError(f'optimizer.warmup_steps must be an integer >= 0, got {warmup_steps!r}')

  _check_in_unit_interval('init_lr_ratio', _get(opt_config, 'init_lr_ratio'), upper_inclusive=True)
  _check_in_unit_interval('min_lr_ratio', _get(opt_config, 'min_lr_ratio'), upper_inclusive=True)

  clip_norm = _get(opt_config, 'clip_norm')
  if clip_norm is not None:
    _check_real('clip_norm', clip_norm)
    if clip_norm < 0:
      raise ValueError(f'optimizer.clip_norm must be >= 0 (0 or None = off), got {clip_norm!r}')

  if name == 'adamw':
    _check_in_unit_interval('b1', _get(opt_config, 'b1'), upper_inclusive=False)
    _check_in_unit_interval('b2', _get(opt_config, 'b2'), upper_inclusive=False)
    eps = _get(opt_config, 'eps')
    _check_real('eps', eps)
    if eps <= 0:
      raise ValueError(f'optimizer.eps must be > 0, got {eps!r}')
  else:  # msgdw
    _check_in_unit_interval('momentum', _get(opt_config, 'momentum'), upper_inclusive=False)
    nesterov = _get(opt_config, 'nesterov')
    if not isinstance(nesterov, bool):
      raise ValueError(f'optimizer.nesterov must be a bool, got {nesterov!r}')


def parse_optimizer_config(opt_config: ml_collections.ConfigDict | OptimizerConfig) -> OptimizerConfig:
  """The optimizer section as an OptimizerConfig: validated
  (`validate_optimizer_config`) unless it already is one."""
  if isinstance(opt_config, OptimizerConfig):
    return opt_config
  validate_optimizer_config(opt_config)
  return OptimizerConfig(
    **{field.name: _get(opt_config, field.name) for field in dataclasses.fields(OptimizerConfig)}
  )


# --------------------------------------------------------------------------
# Learning-rate schedule.
# --------------------------------------------------------------------------


def make_schedule(
  opt_config: ml_collections.ConfigDict | OptimizerConfig, total_steps: int
) -> optax.Schedule:
  """Linear warmup, then cosine or linear decay (or a constant) over `total_steps`.

  With lr = opt_config.lr, W = warmup_steps and T = total_steps, the learning
  rate used by update number t (0-based: the first update uses t = 0) is

    t <  W:  lr * (r0 + (1 - r0) * t / W)               r0 = init_lr_ratio
    t >= W:  cosine: lr * (m + (1 - m) * (1 + cos(pi * (t - W) / (T - W))) / 2)
             linear: lr * (1 - (1 - m) * (t - W) / (T - W))
             constant: lr                               m = min_lr_ratio

  so it reaches lr at t = W and min_lr_ratio * lr at t = T (and stays there
  beyond). With the default init_lr_ratio = 0 the first update has lr 0 and
  changes nothing except the optimizer's moments (the big_vision / optax
  convention); set init_lr_ratio > 0 to start from a non-zero value.
  """
  opt_config = parse_optimizer_config(opt_config)
  if not isinstance(total_steps, int) or total_steps <= 0:
    raise ValueError(f'total_steps must be an integer > 0, got {total_steps!r}')
  peak_lr = float(opt_config.lr)
  warmup_steps = _get(opt_config, 'warmup_steps')
  schedule_name = _get(opt_config, 'schedule')
  if schedule_name in ('cosine', 'linear') and warmup_steps >= total_steps:
    raise ValueError(
      f'optimizer.warmup_steps must be < total_steps ({total_steps}) for a '
      f'{schedule_name} schedule, got {warmup_steps}'
    )
  if warmup_steps > total_steps:
    raise ValueError(f'optimizer.warmup_steps must be <= total_steps ({total_steps}), got {warmup_steps}')

  if schedule_name == 'cosine':
    after_warmup = optax.cosine_decay_schedule(
      init_value=peak_lr,
      decay_steps=total_steps - warmup_steps,
      alpha=float(_get(opt_config, 'min_lr_ratio')),
    )
  elif schedule_name == 'linear':  # BERT's (Devlin et al. 2019) and the DSLM paper's (Table 25) decay
    after_warmup = optax.linear_schedule(
      init_value=peak_lr,
      end_value=float(_get(opt_config, 'min_lr_ratio')) * peak_lr,
      transition_steps=total_steps - warmup_steps,
    )
  else:
    after_warmup = optax.constant_schedule(peak_lr)

  if warmup_steps == 0:
    return after_warmup
  warmup = optax.linear_schedule(
    init_value=float(_get(opt_config, 'init_lr_ratio')) * peak_lr,
    end_value=peak_lr,
    transition_steps=warmup_steps,
  )
  # join_schedules calls the second schedule with (t - warmup_steps).
  return optax.join_schedules([warmup, after_warmup], [warmup_steps])


# --------------------------------------------------------------------------
# Weight-decay mask.
# --------------------------------------------------------------------------


def _key_name(key: Any) -> str | int:
  """The name (or index) carried by one jax.tree_util path entry."""
  if isinstance(key, jax.tree_util.DictKey):
    return key.key
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return key.idx
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return key.key
  return str(key)


def _path_names(path: Sequence[Any]) -> list[str]:
  """The string names along a path; integer entries (list indices) dropped."""
  names = [_key_name(key) for key in path]
  return [name for name in names if isinstance(name, str)]


def is_decayed_path(
  path: Sequence[Any],
  decayed_names: Sequence[str] = DECAYED_PARAM_NAMES,
  never_decayed_path_names: Sequence[str] = NEVER_DECAYED_PATH_NAMES,
) -> bool:
  """Whether the parameter at `path` (a jax.tree_util key path) is decayed.

  The decision uses names only. The parameter's name is the last *string* key
  of its path (list indices such as the 0 in ('layers', 0, 'kernel') or
  ('alphas', 0) are skipped, so an entry of a list of scalars takes the list's
  name). It is decayed iff that name is in `decayed_names` and no component of
  the path is in `never_decayed_path_names`.
  """
  names = _path_names(path)
  if not names:
    return False
  if any(name in never_decayed_path_names for name in names):
    return False
  return names[-1] in decayed_names


def weight_decay_mask(
  params: Any,
  decayed_names: Sequence[str] = DECAYED_PARAM_NAMES,
  never_decayed_path_names: Sequence[str] = NEVER_DECAYED_PATH_NAMES,
) -> Any:
  """True for parameters that receive weight decay, False for all others.

  Decayed: weight matrices, i.e. leaves named `kernel` (Linear, Conv, patch
  embedding, untied LM head) and token embedding tables (`embedding`,
  `token_embed`, `token_embedding`; see DECAYED_PARAM_NAMES).
  Not decayed: norm gains (`scale`), biases (`bias`), residual scales
  (`skip_scale`, `branch_scale`, scalar alpha/beta/gamma/tau), position
  embeddings (`pos_embedding`, also when it is an nnx.Embed whose table is
  called `embedding`) and `cls_token`. See `is_decayed_path` for the rule.

  Why names rather than the usual `ndim >= 2` rule: the models stack the
  per-layer parameters along a leading layer axis for `jax.lax.scan`, so a norm
  gain has shape (depth, d) and a per-layer scalar shape (depth,); the number
  of dimensions no longer tells a matrix from a gain.

  Accepted inputs, and the structure of the result:
  * a `flax.nnx.State` from `nnx.split(model, nnx.Param, ...)` or
    `nnx.state(model, nnx.Param)`. In flax 0.12 its leaves are nnx.Param
    Variables, which are pytree nodes with one child (path entry
    GetAttrKey('value')). We stop at the Variable (is_leaf), so the path ends
    with the parameter's name and the result is a State with one bool where
    each Param was. That is a tree *prefix* of the Variable-valued State and
    has exactly the structure of its pure-array form (`nnx.as_pure(state)`,
    what `nnx.Optimizer.update` hands to optax, while `nnx.Optimizer.__init__`
    hands the Variable-valued State to `tx.init`); optax.masked accepts a
    prefix, so one mask fits both.
  * plain nested dicts / lists of arrays: a tree of bools of the same
    structure.

  make_optimizer passes this function itself (a callable) as the optax mask, so
  the mask is recomputed from whatever tree optax is given.
  """

  def leaf_mask(path, _):
    return is_decayed_path(path, decayed_names, never_decayed_path_names)

  return jax.tree_util.tree_map_with_path(leaf_mask, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


# --------------------------------------------------------------------------
# Optimizers.
# --------------------------------------------------------------------------


def _clip_or_identity(clip_norm: float | None) -> optax.GradientTransformation:
  if clip_norm:  # 0 and None both switch clipping off.
    return optax.clip_by_global_norm(float(clip_norm))
  return optax.identity()


def msgdw(
  learning_rate: optax.ScalarOrSchedule,
  weight_decay: float,
  momentum: float = 0.9,
  nesterov: bool = False,
  mask: Any | Callable[[Any], Any] | None = weight_decay_mask,
) -> optax.GradientTransformation:
  """SGD with momentum and decoupled, lr-coupled weight decay (timm SGDW).

  With g the gradient, mu the momentum, wd the weight decay and lr_t the
  scheduled learning rate of this step, each step is

    theta <- theta * (1 - lr_t * wd)          (masked parameters only)
    m     <- g + mu * m
    theta <- theta - lr_t * m                 (Nesterov: lr_t * (g + mu * m))

  where the decay uses the parameters from *before* this step, like timm's
  SGDW (`param.mul_(1 - lr * wd)` then `param.add_(buf, alpha=-lr)`).

  Built as chain(trace, add_decayed_weights, scale_by_learning_rate). The
  order is the whole point:
  * trace first: the momentum buffer accumulates gradients only, so the decay
    term never enters it (it is *decoupled*).
  * add_decayed_weights second: it adds wd * theta to the momentum output,
    with theta the `params` passed to `update`, i.e. the pre-update values.
  * scale_by_learning_rate last: multiplies (m + wd * theta) by -lr_t, so the
    decay is lr_t * wd * theta, coupled to the schedule as in PyTorch AdamW.
  Moving add_decayed_weights *before* trace adds wd * theta to the gradient
  and lets it accumulate in the momentum: that is torch.optim.SGD's
  `weight_decay` (L2 regularisation), the coupled variant DNT warns against.

  Args:
    learning_rate: a float or an optax schedule (called with the step count).
    weight_decay: decoupled decay coefficient wd (0 switches it off).
    momentum: heavy-ball coefficient mu in [0, 1).
    nesterov: use g + mu * m as the update (off by default: DNT's equation is
      plain heavy ball, although timm's 'sgdw' factory turns Nesterov on).
    mask: which parameters are decayed: a pytree of bools or a callable
      returning one; `weight_decay_mask` by default.
  """
  return optax.chain(
    optax.trace(decay=momentum, nesterov=nesterov),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )


def scale_by_tree(factors: Any) -> optax.GradientTransformation:
  """Multiplies each update leaf by its factor (a tree shaped like the params)."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, f: u * f, updates, factors), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
  opt_config: ml_collections.ConfigDict | OptimizerConfig,
  total_steps: int,
  lr_scale: Any | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Builds the optimizer named by opt_config and its learning-rate schedule.

  The transformation is chain(clip_by_global_norm?, <optimizer>): clipping
  acts on the raw gradient, before the momentum or Adam moments see it
  (clip_norm 0 or None: no clipping). The weight-decay mask is
  `weight_decay_mask`, passed as a callable.

  `lr_scale`: per-parameter learning-rate multipliers (a tree shaped like
  the params, e.g. μP's 1/width_mult for matrix-like parameters; None = 1).
  They multiply the whole update of a parameter, its decoupled decay
  included, exactly as a per-parameter learning rate does.

  Returns:
    (tx, schedule): the optax transformation and the schedule it uses, which
    callers can evaluate at the step count for logging.
  """
  opt_config = parse_optimizer_config(opt_config)
  schedule = make_schedule(opt_config, total_steps)
  weight_decay = float(opt_config.weight_decay)
  if opt_config.name == 'adamw':
    # optax.adamw = chain(scale_by_adam, add_decayed_weights(wd, mask),
    # scale_by_learning_rate): the same order as mSGDW, hence the PyTorch
    # AdamW update theta <- theta*(1 - lr_t*wd) - lr_t*m_hat/(sqrt(v_hat)+eps).
    optimizer = optax.adamw(
      learning_rate=schedule,
      b1=float(_get(opt_config, 'b1')),
      b2=float(_get(opt_config, 'b2')),
      eps=float(_get(opt_config, 'eps')),
      weight_decay=weight_decay,
      mask=weight_decay_mask,
    )
  else:
    optimizer = msgdw(
      learning_rate=schedule,
      weight_decay=weight_decay,
      momentum=float(_get(opt_config, 'momentum')),
      nesterov=bool(_get(opt_config, 'nesterov')),
      mask=weight_decay_mask,
    )
  tx = optax.chain(_clip_or_identity(_get(opt_config, 'clip_norm')), optimizer)
  if lr_scale is not None:
    tx = optax.chain(tx, scale_by_tree(lr_scale))
  return with_float32_state(tx), schedule


def with_float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` seeing float32 gradients and parameters, so its state (moments, momentum) is float32 even when
  the parameters are stored in bfloat16 (`model.param_dtype`); the updates come out in float32 and
  `optax.apply_updates` rounds the new parameters to their own dtype. With float32 parameters this is
  `tx` itself, up to no-op casts."""

  def update(grads, state, params=None):
    return tx.update(as_float32(grads), state, None if params is None else as_float32(params))

  return optax.GradientTransformation(lambda params: tx.init(as_float32(params)), update)


def as_float32(tree):
  """Every leaf of `tree` in float32 (bfloat16 parameters and gradients for the optimizer's state and
  for the norms the train step reports)."""
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)
