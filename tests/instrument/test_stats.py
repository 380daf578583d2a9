"""Sampled statistics (instrument.sample_rows): the fixed sample, its shapes, its error against the whole
tensor on synthetic tensors of known moments and on a tiny model's activations, and its cost of nothing
when off (the whole-tensor path is the code path of before, statistic for statistic)."""

import contextlib
import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dsjax import instrument as instrument_lib
from dsjax.instrument import probe as probe_lib
from dsjax.instrument import stats as stats_lib
from dsjax.train import sharding as sharding_lib
from tests.helpers import correlated_activations, tiny_config, tiny_train_step

# ------------------------------------------------------------------------------------------------
# The sample.
# ------------------------------------------------------------------------------------------------


def _position_coded(b, l, d, dtype=jnp.float32):
  """x[b, t, i] = t (exact in bfloat16 up to 256): a row's value names its token position."""
  return jnp.broadcast_to(jnp.arange(l, dtype=jnp.float32)[None, :, None], (b, l, d)).astype(dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_take_rows_shapes_and_dtypes(dtype):
  x = _position_coded(4, 64, 8, dtype)
  sampled = jax.jit(lambda x: stats_lib.take_rows(x, 32))(x)
  chex.assert_shape(sampled, (4, 8, 8))  # 32 rows over 4 examples: 8 positions each
  chex.assert_type(sampled, dtype)
  # At least a pair per example (corr_seq needs one), at most all positions (then x itself).
  chex.assert_shape(stats_lib.take_rows(x, 3), (4, 2, 8))
  assert stats_lib.take_rows(x, 0) is x and stats_lib.take_rows(x, 4 * 64) is x
  assert stats_lib.sample_positions_per_example(4, 64, 0) == 64
  for stats in (stats_lib.forward_stats(x, 32), stats_lib.grad_stats(x, 32)):
    chex.assert_shape(list(stats.values()), ())
    chex.assert_type(list(stats.values()), jnp.float32)


def test_the_sample_is_fixed_distinct_and_whole_rows():
  """Every call (every step, layer and site of that shape, a tensor and its gradient) takes the same
  rows: whole rows of D, distinct sorted positions in each example, a draw of its own per example."""
  x = _position_coded(4, 64, 8)
  first = np.asarray(jax.jit(lambda x: stats_lib.take_rows(x, 32))(x))
  again = np.asarray(stats_lib.take_rows(x + 0.0, 32))
  np.testing.assert_array_equal(first, again)
  positions = first[:, :, 0]
  assert (first == positions[:, :, None]).all()  # whole rows
  assert all(np.all(np.diff(p) > 0) for p in positions)  # distinct, sorted
  assert len({tuple(p) for p in positions}) == 4  # each example its own draw
  # Balanced: 64 examples × 8 of 64 positions take every position exactly 8 times.
  balanced = np.asarray(stats_lib.take_rows(_position_coded(64, 64, 1), 512))[..., 0]
  np.testing.assert_array_equal(np.bincount(balanced.astype(int).ravel(), minlength=64), np.full(64, 8))
  # Weight leaves: the same rows of every layer's (R, C) view, from a draw per layer.
  w = _position_coded(3, 64, 8).transpose(0, 1, 2)
  rows = np.asarray(stats_lib.take_layer_rows(w, 5))
  chex.assert_shape(rows, (3, 5, 8))
  np.testing.assert_array_equal(rows, np.asarray(stats_lib.take_layer_rows(w, 5)))
  assert stats_lib.take_layer_rows(w, 0) is w and stats_lib.take_layer_rows(w, 64) is w
  gains = jnp.ones((3, 32))  # one row per layer: whole
  assert stats_lib.take_layer_rows(gains, 1) is gains


# ------------------------------------------------------------------------------------------------
# Error against the whole tensor: synthetic tensors of known moments.
# ------------------------------------------------------------------------------------------------


# Tolerances of a sample of 2048 of 16384 rows (32 examples × 64 of 512 positions, D 128) against the
# whole tensor: relative for var, grad_var and the quantiles, absolute for mean (in units of σ) and the
# correlations: ~3× the largest deviation over seeds 0–19 (0.022, 0.023, 0.014, 0.015).
SYNTHETIC_SHAPE, SYNTHETIC_ROWS = (32, 512, 128), 2048
SYNTHETIC_TOLERANCE = {'mean': 0.06, 'var': 0.06, 'corr_seq': 0.04, 'corr_hidden': 0.04}


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_sampled_statistics_of_known_moments(seed):
  x = correlated_activations(jax.random.key(seed), SYNTHETIC_SHAPE, 0.5, 1.0, 0.7, 0.4)
  full = jax.jit(stats_lib.forward_stats)(x)
  sampled = jax.jit(lambda x: stats_lib.forward_stats(x, SYNTHETIC_ROWS))(x)
  std = float(np.sqrt(full['var']))
  assert abs(sampled['mean'] - full['mean']) <= SYNTHETIC_TOLERANCE['mean'] * std
  assert abs(sampled['var'] / full['var'] - 1) <= SYNTHETIC_TOLERANCE['var']
  for name in ('corr_seq', 'corr_hidden'):
    assert abs(sampled[name] - full[name]) <= SYNTHETIC_TOLERANCE[name], name
  assert sampled['max_abs'] == full['max_abs']  # always the whole tensor's
  # The population values (1.0², 0.7², 0.4² of σ² = 1.65) are where both land.
  np.testing.assert_allclose(sampled['corr_seq'], 1.0 / 1.65, atol=0.1)
  np.testing.assert_allclose(sampled['corr_hidden'], 0.49 / 1.65, atol=0.1)
  g_full = stats_lib.grad_stats(x)
  g_sampled = stats_lib.grad_stats(x, SYNTHETIC_ROWS)
  assert abs(g_sampled['grad_var'] / g_full['grad_var'] - 1) <= SYNTHETIC_TOLERANCE['var']
  assert abs(g_sampled['grad_corr_seq'] - g_full['grad_corr_seq']) <= SYNTHETIC_TOLERANCE['corr_seq']


@pytest.mark.parametrize('distribution', ['normal', 'laplace'])
def test_sampled_weight_gradient_distribution(distribution):
  """Quantiles and kurtosis of a (layers, R, C) leaf from 1024 of its 12·768 rows, against the whole
  leaf's: within 3% (quantiles, tail ratio) and 10% (kurtosis) relative."""
  key = jax.random.key(3)
  layer_scale = jnp.exp2(jnp.arange(12.0))[:, None, None] / 2**6  # scales across 2^11
  draw = getattr(jax.random, distribution)(key, (12, 768, 256))
  leaf = draw * layer_scale
  rows = stats_lib.take_layer_rows(leaf, 1024 // 12)
  chex.assert_shape(rows, (12, 85, 256))
  full = stats_lib.distribution_stats(leaf)
  sampled = stats_lib.distribution_stats(rows)
  for name, value in sampled.items():
    tolerance = 0.1 if name == 'grad_kurtosis' else 0.03
    np.testing.assert_allclose(value, full[name], rtol=tolerance, err_msg=name)


# ------------------------------------------------------------------------------------------------
# The instrumented step.
# ------------------------------------------------------------------------------------------------

DEPTH, BATCH, SEQ_LEN = 2, 16, 64


def _step(sample_rows, dropout=0.0, remat='none'):
  """The instrumented train step of a tiny GPT (`sample_rows` None: built without the argument)."""
  config = tiny_config('gpt', depth=DEPTH, dropout=dropout, remat=remat)
  config.data.seq_len = SEQ_LEN
  sampling = {} if sample_rows is None else {'moments_sample_rows': sample_rows}
  return tiny_train_step(config, BATCH, use_dropout=dropout > 0, instrument=True, **sampling)


def _moments(sample_rows, num_devices=1, steps=(0,), remat='none'):
  """The moments of the instrumented step from states at each of `steps` (same parameters)."""
  step_fn, state, batch, axes = _step(sample_rows, remat=remat)
  if num_devices == 1:
    jitted, mesh_context = jax.jit(step_fn), contextlib.nullcontext()
  else:  # data × fsdp × tensor = 2 × 2 × 2: batch, model width and heads all sharded.
    mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:num_devices])
    state_sh = sharding_lib.state_shardings(state, axes, mesh)
    jitted = jax.jit(
      step_fn,
      in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
      out_shardings=(state_sh, sharding_lib.replicated(mesh)),
    )
    state, mesh_context = jax.device_put(state, state_sh), jax.set_mesh(mesh)
  out = []
  with mesh_context:
    for step in steps:
      out.append(jax.device_get(jitted({**state, 'step': jnp.asarray(step, jnp.int32)}, batch)[1]['moments']))
  return out


def test_sampling_off_is_the_whole_tensor_path():
  """sample_rows 0 computes exactly what the statistics computed before the option existed: the same
  functions on the same tensors (`take_rows` hands back x itself)."""
  x = _position_coded(2, 8, 4) ** 0.5
  off = jax.jit(lambda x: stats_lib.forward_stats(x, 0))(x)
  chex.assert_trees_all_equal(jax.jit(stats_lib.forward_stats)(x), off)
  off = jax.jit(lambda g: stats_lib.grad_stats(g, 0))(x)
  chex.assert_trees_all_equal(jax.jit(stats_lib.grad_stats)(x), off)


# Slow (17 s): two steps compiled; the statistics they are built from are compared by default above.
@pytest.mark.slow
def test_the_step_with_sampling_off_is_the_step_without_it():
  """The instrumented step's table with sample_rows 0 is bit-identical to that of the step built without
  the argument."""
  chex.assert_trees_all_equal(_moments(0), _moments(None))


# A tiny model's statistics (2 layers × 32, batch 16 × 64 tokens = 1024 rows per site) from 256 sampled
# rows (4 positions per example) against the whole tensors': relative bounds for the variances, absolute
# ones for the correlations and the mean (in units of the whole tensor's std), 3–5× the largest
# deviations measured (mean 0.006, var 0.036, grad_var 0.060, corr_seq 0.019, corr_hidden 0.002,
# grad_corr_seq 0.005). The weight gradients' distributions from 32 rows per leaf (16 of each layer's 32
# or 128): within 2× the largest deviation measured, 0.25.
TINY_ROWS, TINY_WEIGHT_ROWS = 256, 32
TINY_RELATIVE = {'var': 0.15, 'grad_var': 0.2}
TINY_ABSOLUTE = {'mean': 0.03, 'corr_seq': 0.06, 'corr_hidden': 0.01, 'grad_corr_seq': 0.03}


@pytest.mark.parametrize('sample_rows', [0, 16])
def test_statistics_of_stacked_partial_sums_are_each_tensors(sample_rows):
  """The small reductions of `forward_stats_of_sums` / `grad_stats_of_sums` batch over leading axes
  (layers × sites after the layer loop): stacked sums give each tensor's statistics."""
  x_NBLD = jax.random.normal(jax.random.key(0), (3, 4, 12, 8)) * jnp.arange(1.0, 4.0)[:, None, None, None]
  stacked = jax.vmap(functools.partial(stats_lib.forward_sums, sample_rows=sample_rows))(x_NBLD)
  tokens = stats_lib.sample_positions_per_example(4, 12, sample_rows)
  both = {
    **stats_lib.forward_stats_of_sums(stacked),
    **stats_lib.grad_stats_of_sums({k: stacked[k] for k in ('sum_BD', 'sum_sq_BD')}, tokens),
  }
  for n in range(3):
    expected = {
      **stats_lib.forward_stats(x_NBLD[n], sample_rows),
      **stats_lib.grad_stats(x_NBLD[n], sample_rows),
    }
    for name, value in expected.items():
      chex.assert_shape(both[name], (3,))
      np.testing.assert_allclose(both[name][n], value, rtol=1e-5, atol=1e-7, err_msg=f'{name} {n}')


def test_sampled_statistics_of_a_tiny_model():
  (full,), (sampled,), (few_rows,) = _moments(0), _moments(TINY_ROWS), _moments(TINY_WEIGHT_ROWS)
  chex.assert_equal_shape([full['activations'], sampled['activations']])
  chex.assert_type(sampled['activations'], jnp.float32)
  table_full, table = full['activations'], sampled['activations']
  k = {name: i for i, name in enumerate(probe_lib.ACTIVATION_STATS)}
  std = np.sqrt(table_full[..., k['var']])  # 0 where the table has no site (row 0: the embedding only)
  np.testing.assert_array_equal(table[..., k['max_abs']], table_full[..., k['max_abs']])
  for name, tolerance in TINY_RELATIVE.items():
    np.testing.assert_allclose(table[..., k[name]], table_full[..., k[name]], rtol=tolerance, err_msg=name)
  for name, tolerance in TINY_ABSOLUTE.items():
    scale = std if name == 'mean' else 1.0
    assert np.all(np.abs(table[..., k[name]] - table_full[..., k[name]]) <= tolerance * scale), name
  for kind, kind_stats in few_rows['weights'].items():
    # The whole gradient's norm, not a sample's: equal up to the rounding of two compiled programs.
    chex.assert_trees_all_close(
      kind_stats['grad_norm'], full['weights'][kind]['grad_norm'], rtol=1e-6, atol=0
    )
    for name in stats_lib.DISTRIBUTION_STATS:
      np.testing.assert_allclose(kind_stats[name], full['weights'][kind][name], rtol=0.5, err_msg=kind)


# Slow (26 s): by default the whole-tensor statistics' independence of mesh and remat runs in
# tests/instrument/test_instrument.py (test_statistics_do_not_depend_on_mesh_or_remat), and the sampled
# table against the whole tensors' in test_sampled_statistics_of_a_tiny_model.
@pytest.mark.slow
def test_the_sample_is_the_same_every_step_on_a_mesh_and_with_remat():
  """The same parameters and batch at two different steps give the same sampled table (the rows do not
  move with the step), and a mesh of 8 devices (batch, width and heads sharded) and remat the same
  values as one device without it, with the activations' and the weight gradients' rows sampled."""
  first, later = _moments(TINY_WEIGHT_ROWS, steps=(0, 5))
  chex.assert_trees_all_equal(first, later)
  assert len(jax.devices()) >= 8
  (on_mesh,) = _moments(TINY_WEIGHT_ROWS, num_devices=8)
  chex.assert_trees_all_close(on_mesh, first, rtol=2e-3, atol=1e-6)
  (rematerialised,) = _moments(TINY_WEIGHT_ROWS, remat='full')  # the forward rule runs twice
  chex.assert_trees_all_close(rematerialised, first, rtol=2e-3, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The config key.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('value', [-1, 1.5, True, '64'])
def test_bad_sample_rows_is_one_line_naming_the_key(value):
  config = ml_collections.ConfigDict({**instrument_lib.instrument_config().to_dict(), 'sample_rows': value})
  with pytest.raises(ValueError, match=r'^instrument.sample_rows must be an integer >= 0') as error:
    instrument_lib.validate_instrument_config(config)
  assert '\n' not in str(error.value)


def test_default_is_whole_tensors():
  assert instrument_lib.instrument_config().sample_rows == 0


# Slow (26 s): the step built with sample_rows as the loop builds it runs by default in tests/test_bench.py
# (mode 'sampled'), and the config key's checks in test_bad_sample_rows_is_one_line_naming_the_key.
@pytest.mark.slow
def test_the_training_loop_samples_when_configured(tmp_path):
  """instrument.sample_rows reaches the loop's instrumented step: the same records as on whole tensors,
  max |x| equal and the weight-gradient norms equal up to rounding, the sampled statistics not."""
  from dsjax.train import loop

  records = {}
  for rows in (0, 32):
    config = tiny_config('gpt', depth=2)
    config.total_steps, config.instrument.every, config.instrument.sample_rows = 2, 2, rows
    workdir = tmp_path / str(rows)
    loop.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])
    moments = instrument_lib.read_jsonl(str(workdir / instrument_lib.MOMENTS_FILE))
    records[rows] = {(r['step'], r['layer'], r['site'], r['stat']): r['value'] for r in moments}
  whole, sampled = records[0], records[32]
  assert whole.keys() == sampled.keys()
  # Both from whole tensors: a maximum is exact; a norm is a sum, whose order XLA may choose differently in
  # the two compiled steps (a last-bit difference under the test suite's XLA flags).
  max_abs = [k for k in whole if k[3] == 'max_abs']
  assert max_abs and all(sampled[k] == whole[k] for k in max_abs)
  norms = [k for k in whole if k[3] == 'grad_norm']
  assert norms and all(np.isclose(sampled[k], whole[k], rtol=1e-6, atol=0) for k in norms)
  assert any(sampled[k] != whole[k] for k in whole if k[3] == 'var')
