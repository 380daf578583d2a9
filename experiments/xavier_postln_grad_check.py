r"""The Xavier Post-LN gradient of §8 measured by dsjax and by an independent plain-JAX model, same weights.

  python experiments/xavier_postln_grad_check.py --part=float32 --out=DIR [--batches=16 --seed=0 \
      --activation=relu|gelu --attention=causal|bidirectional]
  python experiments/xavier_postln_grad_check.py --part=float64 --out=DIR [same options]   # batch 1 only
  python experiments/xavier_postln_grad_check.py --part=forms --out=DIR [same options]     # batch 1 only
  python experiments/xavier_postln_grad_check.py --part=summary --out=DIR

The model of experiments/README.md §8 (`xavier_postln_grad.py`): GPT 192 × 256, 4 heads, Xavier init,
λ = β = 1, Post-LN, ReLU, causal, dropout 0.1, seq 128, batch 4, at initialisation, on the training batches
of the embedded Python-documentation corpus; batch k is dropped out with the key of loop step k. For each
batch, the gradient of the loss with respect to every layer's output is measured three ways:

  * instrument: `dsjax.instrument.value_and_grad`, the probe whose custom VJP records `grad_var` (the
    variance over all B·L·D entries of ∂loss/∂(layer output)) — what `dsjax.moments` reports;
  * dsjax: `jax.grad` through dsjax's model with respect to zero tensors added to the layer outputs
    (no probe; dsjax's own derivative rules of its dense layers and attention stay in);
  * reference: `experiments/plain_reference.py`, the same function written in plain `jnp` from the same
    parameters and dropout masks, no custom derivative rule, float32 — and, in a second invocation
    (`--part=float64`, which builds the model, then switches `jax_enable_x64` on), float64 for batch 1.

Per layer n, sequence b and position t it keeps S1 = Σ_i g and S2 = Σ_i g² over the D hidden units, from
which every statistic below is exact: the pooled variance (dsjax's `grad_var`), the variance of one
sequence (over its L·D entries: the statistic of that sequence run alone, whose gradient is B times its
share of the batch's, with the same dropout masks) and the variance at one position. The gradient of
batch 1 (reference and dsjax) is kept in --raw (100 MB each) for the float64 process to compare with.
`--part=forms` runs batch 1 through dsjax with its plain attention (and without the dense layers'
derivative rules) against the reference. The theory's prediction is
`dsjax.instrument.theory_adapter.predict` from the instrument's moments.

Writes OUT/<activation>_<attention>_seed<seed>_<part>.npz and .json; `--part=summary` writes
OUT/tables.md from all of them.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data as data_lib  # noqa: E402
from dsjax import instrument, schemes  # noqa: E402
from dsjax.instrument import collector, theory_adapter  # noqa: E402
from dsjax.instrument import probe as probe_lib  # noqa: E402
from dsjax.models import layers  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import dslm_moments, xavier_postln_grad  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

WIDTH = 256
# Buckets of token positions for the per-position tables.
BUCKETS = ((0, 1), (1, 2), (2, 3), (3, 8), (8, 16), (16, 32), (32, 64), (64, 128))


def build(seed: int, activation: str, causal: bool = True):
  """(config, model, data_info, spec, tree) of the §8 model at `seed` (`causal=False`: the same weights
  without the causal mask, as `xavier_postln_grad.py` runs them)."""

  config = dslm_moments.case_config(
    'xavier_postln', depth=192, width=WIDTH, num_heads=4, seq_len=128, batch_size=4, activation=activation
  )
  config.seed = seed
  data_info = data_lib.dataset_info(config.data)
  model = xavier_postln_grad.set_causal(
    schemes.build_model(config, data_info, nnx.Rngs(params=config.seed), None), causal
  )
  return config, model, data_info, ref.reference_spec(model), ref.reference_tree(model)


def batches(config, num_batches: int) -> list[np.ndarray]:
  """The first `num_batches` training batches' tokens (B, L + 1), as the training loop reads them."""

  pipeline = state_lib.whole_train_batches(config)
  return [np.asarray(b['tokens']) for b in itertools.islice(pipeline, num_batches)]


def digest(arrays) -> str:
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def sums(g_NBLD) -> dict[str, np.ndarray]:
  """S1, S2 over the hidden units, float64: (N, B, L) each."""
  g = np.asarray(g_NBLD, np.float64)
  return {'s1': g.sum(-1), 's2': (g * g).sum(-1)}


def instrument_tables(config, model, tokens):
  """Per batch, the instrumentation's (depth + 1, sites, stats) table and the loss."""

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def forward_backward(params, batch, key):
    loss_of = lambda p, probe: step_lib.lm_loss(nnx.merge(graphdef, p, rest), batch, key, probe)[0]  # noqa: E731
    loss, _, moments = instrument.value_and_grad(loss_of, params, weights=False)
    return loss, moments

  out = []
  for k, t in enumerate(tokens, start=1):
    loss, moments = forward_backward(params, {'tokens': t}, step_lib.dropout_key_for_step(config.seed, k))
    out.append((float(loss), jax.device_get(moments)))
  return out


def dsjax_grads_fn(config, model):
  """jit(batch, key) -> ∂loss/∂(layer outputs) (N, B, L, D) by `jax.grad` through dsjax's model."""

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  depth, width = config.model.depth, config.model.width

  @jax.jit
  def layer_grads(params, batch, key):
    b, l1 = batch['tokens'].shape

    def loss_of(deltas_NBLD):
      probe = lambda site, x, layer: x + deltas_NBLD[layer] if site == 'ffn_residual' else x  # noqa: E731
      return step_lib.lm_loss(nnx.merge(graphdef, params, rest), batch, key, probe)[0]

    return jax.grad(loss_of)(jnp.zeros((depth, b, l1 - 1, width), jnp.float32))

  return lambda batch, key: layer_grads(params, batch, key)


def run_float32(args):

  t0 = time.time()
  config, model, data_info, spec, tree = build(args.seed, args.activation, args.attention == 'causal')
  tokens = batches(config, args.batches)
  info = {'params_digest': digest(jax.tree.leaves(tree)), 'build_s': time.time() - t0, 'batches': []}
  t0 = time.time()
  tables = instrument_tables(config, model, tokens)
  info['instrument_s'] = time.time() - t0
  dsjax_grads = dsjax_grads_fn(config, model)
  tree32 = ref.cast(tree, jnp.float32)
  ref_grads = jax.jit(ref.layer_output_grads, static_argnums=2)
  out: dict[str, list] = {
    'instrument_grad_var': [],
    'dsjax_s1': [],
    'dsjax_s2': [],
    'ref_s1': [],
    'ref_s2': [],
  }
  records = []
  for k, t in enumerate(tokens, start=1):
    key = step_lib.dropout_key_for_step(config.seed, k)
    masks = ref.dropout_masks(spec, key, *t[:, :-1].shape)
    loss, moments = tables[k - 1]
    records += list(collector.moments_to_records(k, moments))
    row = {'batch': k, 'loss_instrument': loss, 'masks_digest': digest(jax.tree.leaves(masks))}
    t1 = time.time()
    g_ref = ref_grads(tree32, jnp.asarray(t), spec, masks).block_until_ready()
    row['ref_s'] = time.time() - t1
    if k <= args.dsjax_batches:
      t1 = time.time()
      g_dsjax = dsjax_grads({'tokens': jnp.asarray(t)}, key).block_until_ready()
      row['dsjax_s'] = time.time() - t1
      for name, v in sums(g_dsjax).items():
        out[f'dsjax_{name}'].append(v)
      row.update(agreement(np.asarray(g_dsjax), np.asarray(g_ref)))
      if k == 1:
        os.makedirs(args.raw, exist_ok=True)
        np.save(os.path.join(args.raw, f'{case_name(args)}_dsjax_float32.npy'), np.asarray(g_dsjax))
    for name, v in sums(g_ref).items():
      out[f'ref_{name}'].append(v)
    row['exact_zero_fraction_layer1'] = float((np.asarray(g_ref[0]) == 0).mean())
    if k == 1:  # For the float64 process.
      os.makedirs(args.raw, exist_ok=True)
      np.save(os.path.join(args.raw, f'{case_name(args)}_ref_float32.npy'), np.asarray(g_ref))
    out['instrument_grad_var'].append(grad_var_column(moments))
    info['batches'].append(row)
    print(json.dumps(row), flush=True)
  measured = mean_over_steps(records)
  predicted, _ = theory_adapter.predict(config, model, data_info, measured, causal=args.attention == 'causal')
  out['theory_grad_var'] = [np.asarray(predicted['grad_var'])]
  info['first_tokens'] = [t[:, 0].tolist() for t in tokens]
  save(args, 'float32', out, info)


def grad_var_column(moments) -> np.ndarray:

  table = np.asarray(moments['activations'], np.float64)
  return table[1:, probe_lib.SITES.index('ffn_residual'), probe_lib.ACTIVATION_STATS.index('grad_var')]


def mean_over_steps(records) -> dict:
  by_key: dict = {}
  for (_, layer, site, stat), value in records:
    by_key.setdefault((site, stat), {}).setdefault(layer, []).append(value)
  return {key: {layer: float(np.mean(v)) for layer, v in d.items()} for key, d in by_key.items()}


def agreement(g_a, g_b) -> dict:
  """Relative L2 difference ‖a − b‖/‖b‖ per layer, at position 0 and over positions ≥ 1 (worst layer),
  and the pooled variances' largest relative difference."""
  g_a, g_b = np.asarray(g_a, np.float64), np.asarray(g_b, np.float64)
  norm = lambda x, axes: np.sqrt((x * x).sum(axes))  # noqa: E731
  diff = g_a - g_b
  rel0 = norm(diff[:, :, 0], (1, 2)) / norm(g_b[:, :, 0], (1, 2))
  nonzero = norm(g_b[:, :, 1:], (1, 2, 3)) > 0
  rel_rest = norm(diff[:, :, 1:], (1, 2, 3))[nonzero] / norm(g_b[:, :, 1:], (1, 2, 3))[nonzero]
  var_a, var_b = g_a.var(axis=(1, 2, 3)), g_b.var(axis=(1, 2, 3))
  return {
    'max_rel_l2_position0': float(rel0.max()),
    'max_rel_l2_positions_ge1': float(rel_rest.max()) if rel_rest.size else None,
    'layers_with_nonzero_positions_ge1': int(nonzero.sum()),
    'max_rel_pooled_var': float(np.max(np.abs(var_a / var_b - 1))),
    'ratio_1_N': [float(var_a[0] / var_a[-1]), float(var_b[0] / var_b[-1])],
  }


def run_float64(args):

  t0 = time.time()
  # Built before float64 is switched on: with it on, the scheme's draws come out different (checked by
  # the digest below).
  config, model, _, spec, tree = build(args.seed, args.activation, args.attention == 'causal')
  del model
  jax.config.update('jax_enable_x64', True)
  with open(os.path.join(args.out, f'{case_name(args)}_float32.json')) as f:
    info32 = json.load(f)
  info = {'params_digest': digest(jax.tree.leaves(tree)), 'build_s': time.time() - t0}
  if info['params_digest'] != info32['params_digest']:
    raise SystemExit('float64: the model built under jax_enable_x64 has other weights than the float32 run')
  t = batches(config, 1)[0]
  key = step_lib.dropout_key_for_step(config.seed, 1)
  masks = ref.dropout_masks(spec, key, *t[:, :-1].shape)
  info['masks_digest'] = digest(jax.tree.leaves(masks))
  if info['masks_digest'] != info32['batches'][0]['masks_digest']:
    raise SystemExit('float64: the dropout masks differ from the float32 run')
  t1 = time.time()
  g64 = np.asarray(
    jax.jit(ref.layer_output_grads, static_argnums=2)(ref.cast(tree, jnp.float64), t, spec, masks)
  )
  info['ref_s'] = time.time() - t1
  g32 = np.load(os.path.join(args.raw, f'{case_name(args)}_ref_float32.npy'))
  info.update(agreement(g32, g64))
  dsjax_path = os.path.join(args.raw, f'{case_name(args)}_dsjax_float32.npy')
  if os.path.exists(dsjax_path):
    info['dsjax_vs_float64'] = agreement(np.load(dsjax_path), g64)
  info['smallest_nonzero_abs_float64_layer1'] = float(np.abs(g64[0][g64[0] != 0]).min())
  info['exact_zero_fraction_layer1'] = {
    'float32': float((g32[0] == 0).mean()),
    'float64': float((g64[0] == 0).mean()),
  }
  print(json.dumps(info), flush=True)
  save(args, 'float64', {f'ref_{k}': [v] for k, v in sums(g64).items()}, info)


def run_forms(args):
  """Batch 1 through dsjax with `model.attention='plain'` (and its dense layers without their derivative
  rules, `layers.FAST_MATMUL = False`), against the reference: which of dsjax's forms sets the float32
  rounding of the 'xla' run."""
  config, _, data_info, _, _ = build(args.seed, args.activation, args.attention == 'causal')
  config.model.attention = 'plain'
  model = xavier_postln_grad.set_causal(
    schemes.build_model(config, data_info, nnx.Rngs(params=config.seed), None), args.attention == 'causal'
  )
  g_ref = np.load(os.path.join(args.raw, f'{case_name(args)}_ref_float32.npy'))
  g_xla = np.load(os.path.join(args.raw, f'{case_name(args)}_dsjax_float32.npy'))
  t = jnp.asarray(batches(config, 1)[0])
  key = step_lib.dropout_key_for_step(config.seed, 1)
  info = {'xla_attention': agreement(g_xla, g_ref)}
  for fast in (True, False):
    layers.FAST_MATMUL = fast
    g = dsjax_grads_fn(config, model)({'tokens': t}, key)
    info[f'plain_attention_fast_matmul_{fast}'] = agreement(np.asarray(g), g_ref)
  layers.FAST_MATMUL = True
  print(json.dumps(info), flush=True)
  with open(os.path.join(args.out, f'{case_name(args)}_forms.json'), 'w') as f:
    json.dump(info, f, indent=1)


def case_name(args) -> str:
  return f'{args.activation}_{args.attention}_seed{args.seed}'


def compact(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """What the summary needs of the (K, N, B, L) sums: S1, S2 at layers 1 and N only, and per layer the
  pooled variance and position 0's share of Σg² (K, N)."""
  out = {}
  for name, a in arrays.items():
    if name.endswith('_s1'):
      src, s2 = name[: -len('_s1')], arrays[name[:-1] + '2']
      out[f'{src}_pooled_var'] = pooled_var(a, s2, WIDTH, (2, 3))
      out[f'{src}_share0'] = s2[..., 0].sum(-1) / s2.sum((-1, -2))
    out[name] = a[:, [0, -1]] if name.endswith(('_s1', '_s2')) else a
  return out


def save(args, part, arrays, info):
  """OUT/<case>_<part>.npz (compact) and .json; the full sums go to --raw."""
  arrays = {k: np.stack(v) for k, v in arrays.items() if v}
  name = f'{case_name(args)}_{part}'
  os.makedirs(args.raw, exist_ok=True)
  np.savez_compressed(os.path.join(args.raw, name + '_sums.npz'), **arrays)
  np.savez_compressed(os.path.join(args.out, name + '.npz'), **compact(arrays))
  with open(os.path.join(args.out, name + '.json'), 'w') as f:
    json.dump(info, f, indent=1)


# ------------------------------------------------------------------------------------------------
# Summary: statistics from the per-(layer, sequence, position) sums S1, S2 over the hidden units.
# ------------------------------------------------------------------------------------------------


def pooled_var(s1, s2, width: int, axes) -> np.ndarray:
  """Variance over the D hidden units and the (sequence, position) axes `axes` of S1, S2."""
  n = width * np.prod([s1.shape[a] for a in axes])
  mean = s1.sum(axes) / n
  return s2.sum(axes) / n - mean**2


def layer_ratio(s1_NBL, s2_NBL, width, sequences=slice(None), positions=slice(None)) -> float:
  """Variance at the output of layer 1 over that at layer N, over the chosen sequences and positions."""
  s1, s2 = s1_NBL[:, sequences, positions], s2_NBL[:, sequences, positions]
  v = pooled_var(s1[[0, -1]], s2[[0, -1]], width, (1, 2))
  return float(v[0] / v[1])


def spread(values) -> str:
  """median [p25, p75] (min–max) of `values`."""
  v = np.asarray(values, np.float64)
  if not v.size:
    return '–'
  q = np.percentile(v, [50, 25, 75])
  return f'{q[0]:.3g} [{q[1]:.3g}, {q[2]:.3g}] ({v.min():.3g}–{v.max():.3g})'


def all_sequences(s_KNBL) -> np.ndarray:
  """(K, N, B, L) -> (N, K·B, L): the batches' sequences side by side."""
  k, n, b, l = s_KNBL.shape
  return s_KNBL.transpose(1, 0, 2, 3).reshape(n, k * b, l)


def per_sequence(s1_KNBL, s2_KNBL, width, positions=slice(None)) -> np.ndarray:
  """The layer-1/layer-N ratio of every sequence alone (K·B values)."""
  k, _, b, _ = s1_KNBL.shape
  return np.array(
    [layer_ratio(s1_KNBL[i], s2_KNBL[i], width, [j], positions) for i in range(k) for j in range(b)]
  )


def case_tables(name: str, z32, info32, z64, info64, width: int) -> list[str]:
  """The markdown tables of one case."""
  s1, s2 = z32['ref_s1'], z32['ref_s2']
  k = s1.shape[0]
  batch_ratio = [layer_ratio(s1[i], s2[i], width) for i in range(k)]
  instrument = z32['instrument_grad_var']
  instrument_ratio = instrument[:, 0] / instrument[:, -1]
  theory = z32['theory_grad_var'][0]
  lines = [
    f'### {name}',
    '',
    '| batch | instrument (probe) | dsjax, jax.grad | reference, float32 | '
    'reference, float64 | max over layers, instrument / reference − 1 | position 0: ‖dsjax − ref‖/‖ref‖ '
    '(worst layer) | positions ≥ 1: same |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for i in range(k):
    row = info32['batches'][i]
    if 'dsjax_s1' not in z32 or i >= z32['dsjax_s1'].shape[0]:
      continue
    dsjax_ratio = layer_ratio(z32['dsjax_s1'][i], z32['dsjax_s2'][i], width)
    ref_var = z32['ref_pooled_var'][i]
    f64 = (
      f'{layer_ratio(z64["ref_s1"][0], z64["ref_s2"][0], width):.4g}' if (z64 is not None and i == 0) else '–'
    )
    lines.append(
      f'| {i + 1} | {instrument_ratio[i]:.4g} | {dsjax_ratio:.4g} | {batch_ratio[i]:.4g} | {f64} | '
      f'{np.max(np.abs(instrument[i] / ref_var - 1)):.1e} | {row["max_rel_l2_position0"]:.1e} | '
      f'{row["max_rel_l2_positions_ge1"]:.1e} |'
    )
  pair = [np.mean(instrument[i : i + 2, 0]) / np.mean(instrument[i : i + 2, -1]) for i in range(0, k - 1, 2)]
  seq_all = per_sequence(s1, s2, width)
  seq_0 = per_sequence(s1, s2, width, slice(0, 1))
  seq_rest = per_sequence(s1, s2, width, slice(1, None))
  share0 = s2[:, 0, :, 0].sum(-1) / s2[:, 0].sum((-1, -2))
  low99 = [
    1 + np.flatnonzero(row < 0.99).min() if (row < 0.99).any() else np.nan for row in z32['ref_share0']
  ]
  lines += [
    '',
    f"Theory (`dsjax.theory`, from the instrument's moments over the {k} batches): layer 1 / layer N = "
    f'{theory[0] / theory[-1]:.3g}.',
    '',
    '| statistic, layer 1 / layer N | median [p25, p75] (min–max) | n |',
    '|---|---|---|',
    f"| pooled over one batch of 4 (the instrument's `grad_var`) | {spread(instrument_ratio)} | {k} |",
    f'| mean of two consecutive batches (as §8 reports) | {spread(pair)} | {len(pair)} |',
    f'| pooled over all {k * s1.shape[2]} sequences | '
    f'{layer_ratio(all_sequences(s1), all_sequences(s2), width):.3g} | 1 |',
    f'| one sequence | {spread(seq_all)} | {seq_all.size} |',
    f'| one sequence, position 0 only | {spread(seq_0)} | {seq_0.size} |',
    f'| one sequence, positions ≥ 1 only | {spread(seq_rest)} | {seq_rest.size} |',
    f'| share of position 0 in Σg² at layer 1 (per batch) | {spread(share0)} | {k} |',
    f"| lowest layer where position 0's share is < 0.99 (per batch) | {spread(low99)} | {k} |",
  ]
  lines += position_table(s1, s2, width, z64)
  if info64 is not None:
    lines += [
      '',
      f'float64 against float32 (batch 1, reference): pooled variance, largest relative difference over '
      f'layers {info64["max_rel_pooled_var"]:.1e}; ‖g32 − g64‖/‖g64‖ at position 0 (worst layer) '
      f'{info64["max_rel_l2_position0"]:.1e}, positions ≥ 1 {info64["max_rel_l2_positions_ge1"]:.1e}; '
      f'entries exactly 0 at layer 1: float32 {info64["exact_zero_fraction_layer1"]["float32"]:.3g}, '
      f'float64 {info64["exact_zero_fraction_layer1"]["float64"]:.3g}; smallest |g| at layer 1 (float64) '
      f'{info64["smallest_nonzero_abs_float64_layer1"]:.2g}.',
    ]
    if 'dsjax_vs_float64' in info64:
      d = info64['dsjax_vs_float64']
      lines += [
        '',
        f'dsjax (float32, its own derivative rules) against the float64 reference, batch 1: pooled variance '
        f'{d["max_rel_pooled_var"]:.1e}; position 0 {d["max_rel_l2_position0"]:.1e}, positions ≥ 1 '
        f'{d["max_rel_l2_positions_ge1"]:.1e}.',
      ]
  return lines + ['']


def position_table(s1, s2, width, z64) -> list[str]:
  """Per bucket of positions: layer-1/layer-N ratio of the mean square, over all sequences and per
  sequence; batch 1 in float32 and float64."""
  s1f, s2f = all_sequences(s1), all_sequences(s2)
  lines = [
    '',
    '| positions | all sequences | one sequence: median [p25, p75] (min–max) | batch 1, float32 | '
    'batch 1, float64 |',
    '|---|---|---|---|---|',
  ]
  for lo, hi in BUCKETS:
    pos = slice(lo, hi)
    seq = per_sequence(s1, s2, width, pos)
    f64 = (
      '–' if z64 is None else f'{layer_ratio(z64["ref_s1"][0], z64["ref_s2"][0], width, positions=pos):.3g}'
    )
    label = str(lo) if hi == lo + 1 else f'{lo}–{hi - 1}'
    lines.append(
      f'| {label} | {layer_ratio(s1f, s2f, width, positions=pos):.3g} | {spread(seq)} | '
      f'{layer_ratio(s1[0], s2[0], width, positions=pos):.3g} | {f64} |'
    )
  return lines


def write_summary(out: str):
  """OUT/tables.md from every case's float32 (and, where present, float64) results."""
  lines = []
  for path in sorted(f for f in os.listdir(out) if f.endswith('_float32.npz')):
    name = path[: -len('_float32.npz')]
    load = lambda suffix: os.path.join(out, f'{name}_{suffix}')  # noqa: E731
    z32 = dict(np.load(load('float32.npz')))
    info32 = json.load(open(load('float32.json')))
    has64 = os.path.exists(load('float64.npz'))
    z64 = dict(np.load(load('float64.npz'))) if has64 else None
    info64 = json.load(open(load('float64.json'))) if has64 else None
    lines += case_tables(name, z32, info32, z64, info64, width=WIDTH)
  with open(os.path.join(out, 'tables.md'), 'w') as f:
    f.write('\n'.join(lines))
  print('\n'.join(lines))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--part', required=True, choices=['float32', 'float64', 'forms', 'summary'])
  parser.add_argument('--batches', type=int, default=16, help='float32: batches of 4 sequences.')
  parser.add_argument('--dsjax_batches', type=int, default=2, help='float32: batches also run through dsjax.')
  parser.add_argument('--seed', type=int, default=0, help='Initialisation and dropout seed.')
  parser.add_argument('--activation', default='relu', choices=['relu', 'gelu'])
  parser.add_argument('--attention', default='causal', choices=['causal', 'bidirectional'])
  parser.add_argument(
    '--raw',
    default='/tmp/xavier_postln_grad_check_raw',
    help="Batch 1's float32 gradient, for --part=float64.",
  )
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.part == 'float32':
    run_float32(args)
  elif args.part == 'float64':
    run_float64(args)
  elif args.part == 'forms':
    run_forms(args)
  else:
    write_summary(args.out)


if __name__ == '__main__':
  main()
