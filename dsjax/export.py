r"""Fold the residual scales λ, β and the output scale into the weights of a plain Pre-LN / Post-LN model.

  python -m dsjax.export --workdir=RUN --out=DIR

DSLM (Kedia et al. 2024, arXiv:2403.09635, §3.5 "Folding scaling into weights for inference") multiplies
the two inputs of every residual add, x ← λ·x + β·f(·), and the final hidden state by s. All of it can be
absorbed into the weights of the same model with λ = β = s = 1, i.e. a checkpoint of the plain method
(`dsjax.schemes.PLAIN`, Xavier with λ = β = 1) that inference code without any DSLM knowledge runs. The
command restores the latest checkpoint of RUN (the model is rebuilt from RUN/config.json), folds,
verifies on a real batch that the folded plain model gives the same logits, and writes

  DIR/checkpoint/   Orbax StandardSave of {'params', 'rest'} of the plain model (`load_exported` reads it)
  DIR/config.json   RUN's config with model.scheme set to the plain method
  DIR/export.json   the verification: max |Δlogits|, the logit scale, the tolerance

The algebra. Number the residual adds a = 0 … 2N−1 (attention add of layer n is 2n, FFN add 2n+1), write
f_a for the branch with its last projection P_a (attention `o`, FFN `ffn2`; kernel and bias) and its
dropout (a random linear map, so it commutes with every scalar below). LayerNorm and RMSNorm are
invariant to a positive scale of their input, Norm(c·z) = Norm(z) for c > 0, up to eps: Norm(c·z) is
Norm(z) with eps/c², a relative change of (eps/2)·|1/c² − 1|/Var(z) — below 1e-6 for the scales here.

Pre-LN, x_{a+1} = λ_a·x_a + β_a·f_a(Norm(x_a)), final Norm, then ×s before the head.
  Let C_a = Π_{j<a} λ_j (C_0 = 1) and y_a = x_a / C_a. Dividing the add by C_{a+1} = C_a·λ_a:
      y_{a+1} = y_a + (β_a / C_{a+1})·f_a(Norm(C_a·y_a)) = y_a + (β_a / C_{a+1})·f_a(Norm(y_a)),
  so P_a ← (β_a / C_{a+1})·P_a and λ_a, β_a ← 1 give a plain Pre-LN stack whose stream is y = x/C. The
  final Norm removes C_{2N}: FinalNorm(x_{2N}) = FinalNorm(y_{2N}). The output scale goes into its affine
  part, s·(γ⊙ẑ + b) = (s·γ)⊙ẑ + s·b. The embedding is untouched (C_0 = 1).

Post-LN, x_{a+1} = Norm_a(λ_a·x_a + β_a·f_a(x_a)), no final norm.
  Norm_a(λ_a·x_a + β_a·f_a(x_a)) = Norm_a(x_a + (β_a/λ_a)·f_a(x_a)), so P_a ← (β_a/λ_a)·P_a. The output
  scale goes into the gain and bias of the last add's norm (the last layer's post-FFN norm), as above.
  The paper states an equivalent fold (the preceding norm's gain and bias ×λ, the block's input
  projections ÷λ, its output projection ×β) that is exact even in eps, but it also has to rescale the
  embedding for the first add — which would change a tied LM head — and touches four matrices per add
  instead of one; the form used here changes only P_a and differs by the eps term above (~1e-8 here).

λ must be positive (DSLM's λ = sqrt(1 − k/N^α) is, and is never learned); β may have any sign (a learned
β is folded at its trained value and becomes a `Constant` 1 in the plain model). A tied LM head reads
the token table, which neither fold changes. Models without the norm to fold s into (Pre-LN with
`model.final_norm=False` and s ≠ 1) and DNT blocks are rejected.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging
from flax import nnx

from dsjax import data as data_lib
from dsjax import schemes
from dsjax.models import model_inputs, nonstandard_residual
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import cli
from dsjax.train import history as history_lib
from dsjax.train.config import base_config

EXPORT_CHECKPOINT = 'checkpoint'
EXPORT_JSON = history_lib.EXPORT_MARKER  # also marks OUT as an export's own output


# ------------------------------------------------------------------------------------------------
# Config round trip.
# ------------------------------------------------------------------------------------------------


def _update(config, raw: dict[str, Any]):
  for key, value in raw.items():
    if key in config and isinstance(config[key], ml_collections.ConfigDict) and isinstance(value, dict):
      _update(config[key], value)
    elif key in config and isinstance(config[key], tuple) and isinstance(value, list):
      config[key] = tuple(value)
    else:
      config[key] = value


def load_config(path: str):
  """A run's config.json back as the ConfigDict of `dsjax.train.config` (field types preserved)."""
  with open(path) as f:
    raw = json.load(f)
  config = base_config(raw['model']['name'], raw['optimizer']['name'])
  with config.unlocked():
    _update(config, raw)
  return config


def plain_config(config):
  """The same model with the plain method (its λ = β = s = 1 and fixed, i.e. Constants)."""
  out = copy.deepcopy(config)
  with out.unlocked():
    out.model.scheme = schemes.PLAIN
  return out


# ------------------------------------------------------------------------------------------------
# Folding (module docstring).
# ------------------------------------------------------------------------------------------------


def fold_state(state: dict[str, Any], block: str) -> dict[str, Any]:
  """Folds λ, β and the output scale of a model state (`nnx.to_pure_dict(nnx.state(model))`).

  Returns a new pure dict of the same structure with the residual scales and the output scale set to 1.
  """
  if block not in ('preln', 'postln'):
    raise ValueError(f"model.block must be 'preln' or 'postln' to fold residual scales, got {block!r}")
  state = _to_numpy(state)
  trunk = state['trunk']
  layer = trunk['stack']['layers']
  f64 = lambda key: np.asarray(layer[key], np.float64)
  skip_attn, branch_attn, skip_ffn, branch_ffn = (
    f64(k) for k in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn')
  )
  if np.any(skip_attn <= 0) or np.any(skip_ffn <= 0):
    raise ValueError('folding needs positive skip scales λ (a norm is invariant to positive scales only)')

  if block == 'preln':
    # C after each add, in add order (attn_0, ffn_0, attn_1, ...): running products of the λ's.
    lambdas = np.stack([skip_attn, skip_ffn], axis=1).reshape(-1)
    c_after = np.cumprod(lambdas).reshape(-1, 2)
    attn_factor, ffn_factor = branch_attn / c_after[:, 0], branch_ffn / c_after[:, 1]
  else:
    attn_factor, ffn_factor = branch_attn / skip_attn, branch_ffn / skip_ffn
  _scale_dense(layer['attn']['o'], attn_factor)
  _scale_dense(layer['ffn']['ffn2'], ffn_factor)

  s = float(np.asarray(trunk['output_scale']))
  if trunk.get('final_norm'):
    _scale_norm(trunk['final_norm'], s)
  elif block == 'postln':
    last = {k: v[-1] for k, v in layer['post_ffn_norm'].items()}
    _scale_norm(last, s)
    for k, v in last.items():
      layer['post_ffn_norm'][k] = np.concatenate([layer['post_ffn_norm'][k][:-1], v[None]])
  elif s != 1.0:
    raise ValueError(
      'cannot fold the output scale: the model has no norm before the head '
      '(Pre-LN with model.final_norm=False)'
    )

  for key in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    layer[key] = np.ones_like(layer[key])
  trunk['output_scale'] = np.ones_like(trunk['output_scale'])
  return state


def _to_numpy(tree):
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.array(tree)


def _scale_dense(dense: dict[str, np.ndarray], factor_N: np.ndarray):
  """Multiplies the stacked kernel (N, d_in, d_out) and bias (N, d_out) of layer n by factor_N[n]."""
  for key, value in dense.items():
    f = factor_N.reshape((-1,) + (1,) * (value.ndim - 1))
    dense[key] = (value.astype(np.float64) * f).astype(value.dtype)


def _scale_norm(norm: dict[str, np.ndarray], s: float):
  for key in norm:  # 'scale' (gain) and, for LayerNorm, 'bias'.
    norm[key] = (norm[key].astype(np.float64) * s).astype(norm[key].dtype)


def fold_model(model, config):
  """The folded plain model (an nnx.Module) and its config, from a scaled model and its config."""
  reason = nonstandard_residual(model)
  if reason is not None:
    raise ValueError(f'model.scheme={config.model.scheme!r} cannot be folded into a plain model: {reason}')
  plain = plain_config(config)
  data_info = data_lib.dataset_info(config.data)
  folded = jax.tree.map(jnp.asarray, fold_state(nnx.to_pure_dict(nnx.state(model)), config.model.block))
  abstract = nnx.eval_shape(lambda: schemes.build_model(plain, data_info, nnx.Rngs(params=0)))
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, folded)
  return nnx.merge(graphdef, state), plain


# ------------------------------------------------------------------------------------------------
# Restore, save, load, verify.
# ------------------------------------------------------------------------------------------------


def restore_run(workdir: str, step: int | None = None):
  """The model of a training workdir at its latest checkpoint (or at `step`), and the run's config."""
  config = load_config(os.path.join(workdir, 'config.json'))
  remedy = (
    f'{os.path.join(workdir, "config.json")} is not the config its checkpoints were trained with '
    '(was it replaced?); put back the config.json that run wrote'
  )
  return checkpoint_lib.restore_model(
    config, data_lib.dataset_info(config.data), workdir, '--workdir', remedy, step
  ), config


def save_exported(model, config, out: str):
  """Orbax StandardSave of {'params', 'rest'} in out/checkpoint, and out/config.json."""
  _, params, rest = nnx.split(model, nnx.Param, ...)
  os.makedirs(out, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(
    os.path.join(os.path.abspath(out), EXPORT_CHECKPOINT),
    {'params': nnx.to_pure_dict(params), 'rest': nnx.to_pure_dict(rest)},
    force=True,
  )
  checkpointer.wait_until_finished()
  with open(os.path.join(out, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))


def load_exported(directory: str):
  """(model, config) of an exported plain checkpoint: any code that builds plain-method models from a
  config can run it."""
  config = load_config(os.path.join(directory, 'config.json'))
  data_info = data_lib.dataset_info(config.data)
  abstract = nnx.eval_shape(lambda: schemes.build_model(config, data_info, nnx.Rngs(params=0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
    {'params': nnx.to_pure_dict(params), 'rest': nnx.to_pure_dict(rest)},
  )
  restored = ocp.StandardCheckpointer().restore(
    os.path.join(os.path.abspath(directory), EXPORT_CHECKPOINT), target
  )
  return nnx.merge(graphdef, restored['params'], restored['rest']), config


def logit_error(model_a, model_b, inputs) -> dict[str, float]:
  """max |logits_a − logits_b| and max |logits_a| on `inputs` (deterministic forward passes)."""
  a = np.asarray(jax.jit(lambda x: model_a(x))(inputs), np.float64)
  b = np.asarray(jax.jit(lambda x: model_b(x))(inputs), np.float64)
  scale = float(np.abs(a).max())
  err = float(np.abs(a - b).max())
  return {'max_abs_error': err, 'logit_scale': scale, 'relative_error': err / max(scale, 1e-30)}


def first_eval_inputs(config):
  """Model inputs of the first evaluation batch (real data)."""
  pipeline = data_lib.make_pipeline(
    config.data,
    global_batch_size=config.eval_batch_size,
    seed=config.seed,
    process_index=0,
    process_count=1,
    train=False,
  )
  return model_inputs(config.model.name, next(iter(pipeline)))


# ------------------------------------------------------------------------------------------------
# Checks: every argument is checked before anything is restored or written.
# ------------------------------------------------------------------------------------------------


def _inside(path: str, directory: str) -> bool:
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_args(workdir: str | None, out: str | None, rtol: float):
  """One-line ValueErrors naming the flag; returns the run's config (read from WORKDIR/config.json)."""
  if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not (rtol > 0 and math.isfinite(rtol)):
    raise ValueError(f'--rtol must be a positive number, got {rtol!r}')
  if not workdir:
    raise ValueError(f'--workdir must name a training workdir, got {workdir!r}')
  if not os.path.exists(workdir):
    raise ValueError(
      f'--workdir={workdir} does not exist (expected a training workdir: config.json, checkpoints/)'
    )
  if not os.path.isdir(workdir):
    raise ValueError(f'--workdir={workdir} is not a directory (expected a training workdir)')
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(config_path):
    raise ValueError(f'--workdir={workdir} has no config.json: not a training workdir')
  try:
    config = load_config(config_path)
  except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON or structure of another file.
    raise ValueError(
      f'--workdir: {config_path} is not a run config ({type(e).__name__}: {" ".join(str(e).split())})'
    ) from e
  checkpoints = os.path.join(workdir, 'checkpoints')
  # Orbax names a finished step's directory by the step; unfinished saves carry a suffix.
  if not os.path.isdir(checkpoints) or not any(name.isdigit() for name in os.listdir(checkpoints)):
    raise ValueError(f'--workdir={workdir} holds no checkpoint (looked in {checkpoints})')
  if config.model.block not in ('preln', 'postln'):
    raise ValueError(
      f"model.block must be 'preln' or 'postln' to fold residual scales, got "
      f'{config.model.block!r} (from {config_path})'
    )
  cli.check_output_dir('--out', out)
  # The export writes OUT/config.json and replaces OUT/checkpoint: neither may be the run's own.
  if os.path.realpath(out) == os.path.realpath(workdir) or _inside(out, checkpoints):
    raise ValueError(f'--out={out} would overwrite the run in --workdir={workdir}; name another directory')
  if _inside(workdir, os.path.join(out, EXPORT_CHECKPOINT)):
    raise ValueError(
      f'--out={out} would replace {os.path.join(out, EXPORT_CHECKPOINT)}, which holds '
      f'--workdir={workdir}; name another directory'
    )
  # Another run's workdir (its config.json, checkpoints/ or a live lock) is never written into; an
  # earlier export (its export.json) is replaced.
  history_lib.check_not_a_run('--out', out, own_marker=EXPORT_JSON)
  cli.create_output_dir('--out', out)  # Last: removed again if the program fails.
  return config


def export(workdir: str, out: str, rtol: float = 1e-4) -> dict[str, Any]:
  """Restore → fold → verify on a real batch → save. Raises ValueError if the logits disagree."""
  check_args(workdir, out, rtol)
  model, config = restore_run(workdir)
  folded, plain = fold_model(model, config)
  check = logit_error(model, folded, first_eval_inputs(config))
  check['rtol'] = rtol
  logging.info(
    'Folded vs scaled logits: max |Δ| %.3g (max |logit| %.3g, relative %.3g)',
    check['max_abs_error'],
    check['logit_scale'],
    check['relative_error'],
  )
  if not check['relative_error'] <= rtol:
    raise ValueError(
      f'folded model disagrees with the scaled model: max |Δlogits| / max |logits| = '
      f'{check["relative_error"]:.3g} > {rtol}'
    )
  save_exported(folded, plain, out)
  with open(os.path.join(out, EXPORT_JSON), 'w') as f:
    json.dump({'workdir': os.path.abspath(workdir), **check}, f, indent=1)
  return check


def _define_flags():
  # Defined only when run as a program, so that importing dsjax.export (tests, other tools with flags
  # of the same names) defines no absl flags.
  flags.DEFINE_string('workdir', None, 'Training workdir of the scaled (e.g. DSLM) model.')
  flags.DEFINE_string('out', None, 'Output directory for the folded plain checkpoint.')
  flags.DEFINE_float('rtol', 1e-4, 'Allowed max |Δlogits| relative to max |logits|.')
  flags.mark_flags_as_required(['workdir', 'out'])


def main(argv):
  del argv
  args = flags.FLAGS
  check = export(args.workdir, args.out, args.rtol)
  print(
    f'wrote {args.out}: plain {load_config(os.path.join(args.out, "config.json")).model.block} '
    f'checkpoint; max |Δlogits| {check["max_abs_error"]:.3g} '
    f'(relative {check["relative_error"]:.3g} <= {check["rtol"]})'
  )


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
