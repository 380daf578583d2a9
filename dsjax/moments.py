r"""Per-layer moments of a model, measured on real batches and predicted by `dsjax.theory`.

  python -m dsjax.moments --config=configs/gpt_preln.py --out=DIR [--batches=4] [--checkpoint=WORKDIR]
      [--theory_form=exact|paper|simple] [--input_moments=measured|theory]
      [--config.model.depth=192 --config.model.width=256 --config.model.dropout=0.1 ...]

Commands and results of the DSLM-figure reproduction (192 layers): dsjax/instrument/README.md.

The analogue of the DSLM paper's Figures 1–4 (Kedia et al. 2024): the model at initialisation (or restored
from the latest checkpoint of a training workdir) runs forward and backward on `--batches` real training
batches with dropout active, as at train time (the theory includes dropout), under the `dsjax.instrument`
probe. Per layer, the statistics of the layer output (the residual stream after the layer, site
'ffn_residual') are averaged over the batches and compared with `dsjax.theory.model.propagate` for the
same configuration (see `dsjax.instrument.theory_adapter`).

Writes
  DIR/moments.json  {"config", "settings", "summary", "input", "layers": [{"layer", "forward_var":
                    {"measured", "predicted"}, "grad_var", "corr_seq", "grad_corr_seq",
                    "attn_branch_var", "ffn_branch_var"}, ...], "sites": every per-layer record
                    (all probe sites, forward and backward, weight-gradient norms), measured}
  DIR/moments.png   forward variance, gradient variance, token correlations and branch variances against
                    layer, measured vs predicted (variances on a log scale, as in the paper)
and prints, per quantity, the mean / median / max error of prediction vs measurement — relative,
|predicted − measured| / |measured|, for variances; absolute for correlations — and R² over layers.

The theory's backward recursion is relative: the prediction starts from the gradient measured at the
output of the last layer (variance and token correlation), so the predicted gradient variance matches
the measured one at the last layer by construction and the errors measure the propagation through depth.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import jax
import matplotlib
import numpy as np
from absl import flags, logging
from flax import nnx
from ml_collections import config_flags

from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.instrument import theory_adapter
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import cli
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import matplotlib.ticker  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Path to a config file (configs/*.py).', lock_config=True
)
_OUT = flags.DEFINE_string('out', None, 'Output directory for moments.json and moments.png.')
_BATCHES = flags.DEFINE_integer(
  'batches', 4, 'Number of training batches to average the statistics over.', lower_bound=1
)
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', None, 'A training workdir: measure its latest checkpoint instead of the init.'
)
INPUT_MOMENTS = ('measured', 'theory')
THEORY_FORMS = ('exact', 'paper', 'simple')
_INPUT_MOMENTS = flags.DEFINE_enum(
  'input_moments',
  'measured',
  INPUT_MOMENTS,
  'Moments entering the first layer for the prediction: measured at the embedding output, or the '
  "theory's embedding formula (Zipf-distributed tokens, DSLM paper Appendix A.1).",
)
_THEORY_FORM = flags.DEFINE_enum(
  'theory_form',
  'exact',
  THEORY_FORMS,
  "Formulas of `dsjax.theory.model.propagate`: 'exact' (finite-d LayerNorm, exact softmax and "
  "attention), 'paper' (the DSLM paper's Appendix A formulas) or 'simple' (its Tables 1-2).",
)
flags.mark_flags_as_required(['config', 'out'])

# Quantities compared per layer: JSON name -> measured (site, statistic). The first four are of the
# layer output (the residual stream after the layer); the branch variances (the branch output after
# its dropout, before the β scale) are what a Post-LN stack's forward pass is really about, since its
# stream has variance 1 by construction.
QUANTITIES = {
  'forward_var': ('ffn_residual', 'var'),
  'grad_var': ('ffn_residual', 'grad_var'),
  'corr_seq': ('ffn_residual', 'corr_seq'),
  'grad_corr_seq': ('ffn_residual', 'grad_corr_seq'),
  'attn_branch_var': ('attn_branch', 'var'),
  'ffn_branch_var': ('ffn_branch', 'var'),
}


# ------------------------------------------------------------------------------------------------
# Checks: every argument is checked before anything is compiled or written.
# ------------------------------------------------------------------------------------------------


def check_config(config):
  """The run's config checks (`dsjax.train.config`), then the dataset's; returns its DatasetInfo.

  The measurement runs on one device and never builds the mesh, so `mesh.shape` is not checked."""
  data_info = config_lib.validate_single_device_run(config, training=False)
  return data_info


def check_args(
  config, out: str, num_batches: int, checkpoint: str | None, input_moments: str, theory_form: str
):
  """One-line ValueErrors naming the flag, for everything `run` is given; returns the DatasetInfo."""
  if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
    raise ValueError(f'--batches must be a positive integer, got {num_batches!r}')
  for flag, value, allowed in (
    ('--input_moments', input_moments, INPUT_MOMENTS),
    ('--theory_form', theory_form, THEORY_FORMS),
  ):
    if value not in allowed:
      raise ValueError(f'{flag} must be one of {", ".join(allowed)}; got {value!r}')
  cli.check_output_dir('--out', out)
  history_lib.check_not_a_run('--out', out)
  if checkpoint is not None:
    if not os.path.isdir(checkpoint):
      raise ValueError(f'--checkpoint={checkpoint} is not a directory (expected a training workdir)')
    if not os.path.isdir(os.path.join(checkpoint, 'checkpoints')):
      raise ValueError(f'--checkpoint={checkpoint} holds no checkpoint (looked in {checkpoint}/checkpoints)')
  data_info = check_config(config)
  cli.create_output_dir('--out', out)  # Last: created only once every other check has passed.
  return data_info


# ------------------------------------------------------------------------------------------------
# Model and measurement.
# ------------------------------------------------------------------------------------------------


def load_model(config, data_info, checkpoint: str | None):
  """The model at initialisation, or with the train state of the latest checkpoint in `checkpoint`."""
  if checkpoint is not None:
    return checkpoint_lib.restore_model(config, data_info, checkpoint, '--checkpoint')
  # A method with a preparation step (e.g. DSLM's measured input correlation) runs it afresh on the
  # first training batches.
  prepared = state_lib.method_preparation(config, data_info)
  return schemes.build_model(config, data_info, nnx.Rngs(params=config.seed), prepared)


def measure(model, config, batches) -> tuple[dict[tuple[str, str], dict[int, float]], dict[str, Any]]:
  """Forward + backward of `model` on each batch under the instrumentation probe.

  Returns ({(site, stat): {layer: mean over batches}}, {'loss': mean loss, 'num_batches': n}).
  """
  collector = instrument_lib.Collector(None)
  loss_fn = step_lib.LOSSES[config.model.name]
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def forward_backward(params, batch, step):
    key = step_lib.dropout_key_for_step(config.seed, step) if use_dropout else None

    def loss_of_params(params, probe):
      return loss_fn(nnx.merge(graphdef, params, rest), batch, key, probe)[0]

    # Per-layer activation statistics only: moments.json has no use for the weight statistics.
    loss, _, moments = instrument_lib.value_and_grad(loss_of_params, params, weights=False)
    return loss, moments

  losses = []
  for step, batch in enumerate(batches, start=1):  # The step tags the records of each batch.
    loss, moments = forward_backward(params, batch, step)
    collector.add(step, moments)
    losses.append(float(loss))
    logging.info('batch %d: loss %.4f', step, losses[-1])
  collector.flush()
  per_batch = instrument_lib.collector.table(collector.records)
  means = {
    key: {layer: float(np.mean(values)) for layer, values in by_layer.items()}
    for key, by_layer in per_batch.items()
  }
  return means, {'loss': float(np.mean(losses)), 'num_batches': len(losses)}


# ------------------------------------------------------------------------------------------------
# Comparison, figure, summary.
# ------------------------------------------------------------------------------------------------


def layer_rows(measured, predicted, depth: int) -> list[dict[str, Any]]:
  """Per layer, measured and predicted quantities (predicted None where the theory does not apply)."""
  rows = []
  for n in range(depth):
    row: dict[str, Any] = {'layer': n}
    for name, key in QUANTITIES.items():
      row[name] = {
        'measured': measured[key][n],
        'predicted': None if predicted is None else predicted[name][n],
      }
    rows.append(row)
  return rows


# Correlations are compared by their absolute error: a relative error is meaningless near r = 0.
CORRELATIONS = ('corr_seq', 'grad_corr_seq')


def summarize(rows) -> dict[str, dict[str, float]]:
  """Mean / median / max error and R² of prediction vs measurement, per quantity: relative error
  |p − m| / |m| for variances, absolute error |p − m| for correlations. Empty without a prediction."""
  out = {}
  if rows and rows[0]['forward_var']['predicted'] is None:
    return out
  for name in QUANTITIES:
    m = np.array([r[name]['measured'] for r in rows])
    p = np.array([r[name]['predicted'] for r in rows])
    if name in CORRELATIONS:
      kind, err = 'abs', np.abs(p - m)
    else:
      kind, err = 'rel', np.abs(p - m) / np.maximum(np.abs(m), 1e-30)
    total = ((m - m.mean()) ** 2).sum()
    out[name] = {
      f'mean_{kind}_error': float(err.mean()),
      f'median_{kind}_error': float(np.median(err)),
      f'max_{kind}_error': float(err.max()),
      'r2': float(1 - ((m - p) ** 2).sum() / total) if total > 0 else float('nan'),
    }
  return out


def plot(rows, path: str, title: str):
  layers = np.array([r['layer'] for r in rows]) + 1
  panels = [
    ('forward_var', 'forward variance (layer output)', True),
    ('grad_var', 'gradient variance (layer output)', True),
    ('attn_branch_var', 'attention branch output variance', True),
    ('corr_seq', 'token correlation rˡ (forward)', False),
    ('grad_corr_seq', 'token correlation rˡ of the gradient', False),
    ('ffn_branch_var', 'FFN branch output variance', True),
  ]
  fig, axes = plt.subplots(2, 3, figsize=(15, 7), constrained_layout=True)
  for ax, (name, label, log) in zip(axes.flat, panels):
    measured = np.array([r[name]['measured'] for r in rows])
    ax.plot(layers, measured, 'o', ms=3, label='measured')
    predicted = measured[:0]
    if rows[0][name]['predicted'] is not None:
      predicted = np.array([r[name]['predicted'] for r in rows])
      ax.plot(layers, predicted, '-', lw=1.5, label='predicted (theory)')
    ax.set_xlabel('layer')
    ax.set_title(label)
    both = np.concatenate([measured, predicted])
    both = both[np.isfinite(both)]
    if not both.size:
      continue
    if log and both.min() > 0 and both.max() / both.min() > 3:  # Log scale for wide ranges.
      ax.set_yscale('log')
      # Plain '1e-06' tick labels: the default mathtext ones have hit pyparsing's recursion limit.
      ax.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter())
      ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
      # Short tick labels (no offset, 4 significant digits): long ones can break the layout engine.
      ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter('%.4g'))
      centre, spread = np.median(both), both.max() - both.min()
      if centre > 0 and spread < 0.1 * centre:  # A flat quantity: show ±10%, not float noise.
        ax.set_ylim(0.9 * centre, 1.1 * centre)
    ax.grid(alpha=0.3, which='both')
  axes.flat[0].legend()
  fig.suptitle(title)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def describe(config) -> str:
  m = config.model
  inputs = f'seq {config.data.seq_len}' if m.name == 'gpt' else f'patch {m.patch_size}'
  return (
    f'{m.name} {m.block} scheme={m.scheme}, depth {m.depth}, d {m.width}, dropout {m.dropout}, '
    f'{m.activation}, {inputs}'
  )


def run(
  config,
  out: str,
  num_batches: int,
  checkpoint: str | None = None,
  input_moments: str = 'measured',
  theory_form: str = 'exact',
) -> dict[str, Any]:
  """Measures, predicts, writes DIR/moments.json and DIR/moments.png; returns the JSON content.

  Where the theory does not cover the model (`theory_adapter.coverage_gap`: no-norm or DNT blocks,
  vector or learnable-per-site residual scales of some methods, edited attention, concatenation), only
  the measurement is written, and `settings.theory` says why."""
  data_info = check_args(config, out, num_batches, checkpoint, input_moments, theory_form)
  model = load_model(config, data_info, checkpoint)
  pipeline = state_lib.whole_train_batches(config)
  batches = (jax.device_put(b) for b in itertools.islice(pipeline, num_batches))
  measured, info = measure(model, config, batches)
  gap = theory_adapter.coverage_gap(config, model)
  if gap is None:
    predicted, settings = theory_adapter.predict(
      config, model, data_info, measured, input_moments=input_moments, form=theory_form
    )
  else:
    predicted, settings = None, {'theory': f'not covered: {gap}'}
  rows = layer_rows(measured, predicted, config.model.depth)
  summary = summarize(rows)
  result = {
    'config': json.loads(config.to_json_best_effort()),
    'settings': {
      **settings,
      **info,
      'checkpoint': checkpoint,
      'grad_normalisation': 'prediction starts from the gradient measured at the last layer output',
    },
    'summary': summary,
    'input': theory_adapter.embedding_moments(measured),
    'layers': rows,
    # Every per-layer record (all four sites, forward and backward, weight-gradient norms).
    'sites': {
      f'{site}/{stat}': [values[n] for n in range(config.model.depth)]
      for (site, stat), values in sorted(measured.items())
      if 0 in values
    },
  }
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'moments.json'), 'w') as f:
    json.dump(result, f, indent=1)
  plot(rows, os.path.join(out, 'moments.png'), describe(config))
  return result


def format_summary(result) -> str:
  if not result['summary']:
    return f'measured only; the theory does not predict this model ({result["settings"]["theory"]})'
  lines = [f'{"quantity":16s} {"error":>9s} {"mean":>8s} {"median":>8s} {"max":>8s} {"R²":>9s}']
  for name, s in result['summary'].items():
    kind = 'rel' if 'mean_rel_error' in s else 'abs'
    fmt = (lambda v: f'{100 * v:7.1f}%') if kind == 'rel' else (lambda v: f'{v:8.3f}')
    errors = ''.join(fmt(s[f'{k}_{kind}_error']) for k in ('mean', 'median', 'max'))
    label = 'relative' if kind == 'rel' else 'absolute'
    lines.append(f'{name:16s} {label:>9s} {errors} {s["r2"]:9.4f}')
  lines.append(
    '(gradient prediction starts from the gradient measured at the last layer output; '
    'R² over layers is uninformative where a quantity is flat)'
  )
  return '\n'.join(lines)


def main(argv):
  del argv
  result = run(
    _CONFIG.value, _OUT.value, _BATCHES.value, _CHECKPOINT.value, _INPUT_MOMENTS.value, _THEORY_FORM.value
  )
  print(describe(_CONFIG.value))
  print(format_summary(result))
  print(f'wrote {os.path.join(_OUT.value, "moments.json")} and moments.png')


if __name__ == '__main__':
  cli.run(main)
