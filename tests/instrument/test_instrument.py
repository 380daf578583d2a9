"""Instrumentation tests: statistics against numpy, exactly-once delivery, off-means-off, the collector."""

import collections
import contextlib
import functools
import json
import os
import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.instrument import collector as collector_lib
from dsjax.instrument import probe as probe_lib
from dsjax.instrument import stats as stats_lib
from dsjax.instrument.probe import LAYER_SITES, SITES
from dsjax.train import sharding as sharding_lib
from tests.helpers import TEXT_INFO, correlated_activations, tiny_config, tiny_train_step

# ------------------------------------------------------------------------------------------------
# Statistics.
# ------------------------------------------------------------------------------------------------


def _numpy_pair_corr(x_BLD, axis):
  """Brute force: mean over all pairs i ≠ j along `axis` of centred products, over the variance."""
  c = x_BLD - x_BLD.mean()
  c = np.moveaxis(c, axis, -1)  # (..., n)
  n = c.shape[-1]
  outer = c[..., :, None] * c[..., None, :]  # (..., n, n)
  off_diagonal = outer[..., ~np.eye(n, dtype=bool)]  # (..., n·(n−1))
  return off_diagonal.mean() / (c**2).mean()


def test_forward_stats_match_numpy_brute_force():
  x = correlated_activations(jax.random.key(0), (3, 7, 5), 0.5, 1.0, 0.7, 0.4)
  got = jax.jit(stats_lib.forward_stats)(x)
  xn = np.asarray(x, np.float64)
  np.testing.assert_allclose(got['mean'], xn.mean(), rtol=1e-5)
  np.testing.assert_allclose(got['var'], xn.var(), rtol=1e-5)
  np.testing.assert_allclose(got['corr_seq'], _numpy_pair_corr(xn, axis=1), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got['corr_hidden'], _numpy_pair_corr(xn, axis=2), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got['max_abs'], np.abs(xn).max(), rtol=1e-6)


def test_forward_stats_recover_known_correlations():
  """Variance components 1 (token-shared), 0.5 (hidden-shared), 0.5 (noise): r^l = 0.5, r^d = 0.25."""
  x = correlated_activations(jax.random.key(1), (64, 64, 64), 3.0, 1.0, np.sqrt(0.5), np.sqrt(0.5))
  got = stats_lib.forward_stats(x)
  np.testing.assert_allclose(got['mean'], 3.0, atol=0.05)
  np.testing.assert_allclose(got['var'], 2.0, rtol=0.05)
  np.testing.assert_allclose(got['corr_seq'], 0.5, atol=0.03)
  np.testing.assert_allclose(got['corr_hidden'], 0.25, atol=0.03)


def test_grad_stats_match_numpy():
  g = correlated_activations(jax.random.key(2), (2, 6, 4), 0.0, 1e-3, 0.0, 2e-3)
  got = stats_lib.grad_stats(g)
  gn = np.asarray(g, np.float64)
  np.testing.assert_allclose(got['grad_var'], gn.var(), rtol=1e-5)
  np.testing.assert_allclose(got['grad_corr_seq'], _numpy_pair_corr(gn, axis=1), rtol=1e-4)


def test_layernorm_output_has_hidden_correlation_minus_one_over_d_minus_one():
  """Kedia et al. 2024, Table 19: after LayerNorm r^d = −1/(d−1) exactly (per-token mean is removed)."""
  x = jax.random.normal(jax.random.key(3), (4, 8, 16))
  y = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
  np.testing.assert_allclose(stats_lib.forward_stats(y)['corr_hidden'], -1 / 15, rtol=1e-4)


def test_weight_grad_stats():
  depth = 3
  keys = jax.random.split(jax.random.key(4), 4)
  grads = {
    'attn': {'q': {'kernel': jax.random.normal(keys[0], (depth, 8, 8)), 'bias': jnp.ones((depth, 8))}},
    'ffn': {'ffn1': {'kernel': jax.random.laplace(keys[1], (depth, 8, 32))}},
    'pre_attn_norm': {
      'scale': jax.random.normal(keys[2], (depth, 8)),
      'bias': jax.random.normal(keys[3], (depth, 8)),
    },
  }
  got = jax.jit(stats_lib.weight_grad_stats)(grads)
  assert set(got) == {'q', 'ffn1', 'norms'}  # Dense biases are not a weight type.
  q = np.asarray(grads['attn']['q']['kernel'])
  np.testing.assert_allclose(got['q']['grad_norm'], np.sqrt((q**2).sum((1, 2))), rtol=1e-5)
  norm = np.concatenate([np.asarray(grads['pre_attn_norm'][k]) for k in ('scale', 'bias')], 1)
  np.testing.assert_allclose(got['norms']['grad_norm'], np.sqrt((norm**2).sum(1)), rtol=1e-5)
  np.testing.assert_allclose(got['q']['grad_abs_p90'], np.quantile(np.abs(q), 0.9), rtol=0.02)
  # Gaussian: kurtosis 3; Laplace: 6 (heavier tail), and a larger p99.9/median ratio.
  assert got['ffn1']['grad_kurtosis'] > got['q']['grad_kurtosis']
  assert got['ffn1']['grad_tail_ratio'] > got['q']['grad_tail_ratio']


@pytest.mark.parametrize('sample_rows', [0, 16])
def test_weight_types_finished_together_equal_each_on_its_own(sample_rows):
  """`weight_grad_stats` finishes all weight types' summaries stacked; each equals `distribution_stats` of
  that type alone (to float32 rounding), whatever the types' sizes and scales, an all-zero type too."""
  depth, keys = 3, jax.random.split(jax.random.key(9), 3)
  grads = {
    'attn': {'q': {'kernel': jax.random.normal(keys[0], (depth, 16, 16)) * 1e-3}},
    'ffn': {'ffn1': {'kernel': jax.random.cauchy(keys[1], (depth, 16, 64))}},
    'pre_attn_norm': {'scale': jax.random.laplace(keys[2], (depth, 16)), 'bias': jnp.ones((depth, 16))},
    'pre_ffn_norm': {'scale': jnp.zeros((depth, 16))},
  }
  grads['attn']['k'] = {'kernel': jnp.zeros((depth, 16, 16))}
  got = jax.jit(lambda g: stats_lib.weight_grad_stats(g, sample_rows=sample_rows))(grads)
  rows = max(1, sample_rows // depth) if sample_rows else 0
  for kind, leaves in stats_lib.group_layer_grads(grads).items():
    alone = stats_lib.distribution_stats([stats_lib.take_layer_rows(leaf, rows) for leaf in leaves])
    assert set(got[kind]) == {'grad_norm', *alone}
    for name, value in alone.items():
      np.testing.assert_allclose(got[kind][name], value, rtol=1e-5, err_msg=f'{kind} {name}')
  assert float(got['k']['grad_abs_p50']) == float(got['k']['grad_kurtosis']) == 0.0


@pytest.mark.parametrize('distribution', ['normal', 'laplace', 'cauchy'])
def test_abs_quantiles_match_numpy(distribution):
  """The log-histogram quantiles are within 1% of the exact ones, also for very heavy tails."""
  g = getattr(jax.random, distribution)(jax.random.key(5), (200_000,)) * 1e-4
  probs = tuple(stats_lib.GRAD_QUANTILES.values())
  np.testing.assert_allclose(stats_lib.abs_quantiles(g, probs), np.quantile(np.abs(g), probs), rtol=0.01)


def test_distribution_stats_of_a_gaussian():
  got = stats_lib.distribution_stats(jax.random.normal(jax.random.key(6), (400_000,)))
  np.testing.assert_allclose(got['grad_abs_p50'], 0.6745, rtol=0.01)  # median of |N(0,1)|
  np.testing.assert_allclose(got['grad_kurtosis'], 3.0, rtol=0.03)
  np.testing.assert_allclose(got['grad_tail_ratio'], 3.2905 / 0.6745, rtol=0.03)
  assert float(stats_lib.abs_quantiles(jnp.zeros(10), (0.5,))[0]) == 0.0


@pytest.mark.parametrize('offset', [0.0, 0.5, 2.0])
def test_kurtosis_from_raw_moments_matches_the_centred_one(offset):
  """The kurtosis comes from one pass of raw power sums; for means up to 2σ it is the centred
  E[(g−μ)⁴]/σ⁴ that numpy computes in float64, over leaves of per-layer sums pooled."""
  leaves = [
    jax.random.laplace(jax.random.key(7), (3, 64, 96)) + offset,
    jax.random.normal(jax.random.key(8), (3, 96)) * 2 + offset,
  ]
  g = np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in leaves])
  c = g - g.mean()
  expected = (c**4).mean() / (c**2).mean() ** 2
  got = jax.jit(stats_lib.distribution_stats)(leaves)['grad_kurtosis']
  np.testing.assert_allclose(got, expected, rtol=1e-4)


# Shapes whose element counts pass int32: GPT-small at batch 16 × 1024 (B·L·D·(L−1) ≈ 1.3e10 ordered
# token pairs), a tensor of 2^32 elements, and one weight type of 3·2^30 gradient entries. Lowering
# traces with these shapes without allocating anything.
_GPT_SMALL_BLD = (16, 1024, 768)
_HUGE_BLD = (32, 8192, 16384)
_HUGE_N = 3 * 2**30


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_statistics_trace_past_int32_element_counts(dtype):
  """Counts are float arithmetic: a Python int past 2^31 − 1 as a jnp operand raises OverflowError."""
  spec = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  for shape in (_GPT_SMALL_BLD, _HUGE_BLD):
    for fn in (stats_lib.forward_stats, stats_lib.grad_stats):
      out = jax.eval_shape(fn, spec(shape))
      assert {v.dtype for v in out.values()} == {jnp.dtype(jnp.float32)}
      jax.jit(fn).lower(spec(shape))
  # One stacked weight type of 4 · 2^30 entries, and a single flat one past 2^31.
  grads = {'ffn': {'ffn1': {'kernel': spec((16, 8192, 32768))}}}
  out = jax.eval_shape(stats_lib.weight_grad_stats, grads)['ffn1']
  assert out['grad_norm'].shape == (16,)
  assert {v.dtype for v in out.values()} == {jnp.dtype(jnp.float32)}
  jax.jit(stats_lib.distribution_stats).lower(spec((_HUGE_N,)))


def test_histogram_counts_cannot_wrap():
  """|g| histogram of 3·2^30 entries: every int32 count (bincount) is over at most 2^30 entries, and
  the counts are added and cumulated in float32, so no count wraps at 2^31."""

  def eqns(jaxpr):  # all equations, those of nested jaxprs (jit, custom rules) included
    for e in jaxpr.eqns:
      yield e
      for param in e.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          if hasattr(sub, 'eqns') or hasattr(sub, 'jaxpr'):
            yield from eqns(getattr(sub, 'jaxpr', sub))

  all_eqns = list(
    eqns(
      jax.make_jaxpr(lambda g: stats_lib.abs_quantiles(g, (0.5,)))(
        jax.ShapeDtypeStruct((_HUGE_N,), jnp.float32)
      ).jaxpr
    )
  )
  scatters = [e for e in all_eqns if e.primitive.name == 'scatter-add']
  sizes = [int(np.prod(e.invars[2].aval.shape)) for e in scatters]
  # Three chunks of 2^30, each counted by a CPU and an accelerator variant (`lax.platform_dependent`).
  assert len(scatters) == 6 and set(sizes) == {stats_lib._MAX_CHUNK} == {_HUGE_N // 3}
  assert all(e.outvars[0].aval.dtype == jnp.int32 for e in scatters)
  cumsums = [e for e in all_eqns if e.primitive.name.startswith('cum')]
  assert cumsums and all(e.outvars[0].aval.dtype == jnp.float32 for e in cumsums)


def test_histogram_chunks_and_leaves_add_up(monkeypatch):
  """The quantiles do not depend on how the entries are cut into chunks or leaves."""
  g = jax.random.laplace(jax.random.key(9), (200_001,))
  whole = jax.jit(stats_lib.distribution_stats)(g)
  monkeypatch.setattr(stats_lib, '_MAX_CHUNK', 40_000)  # 2 + 4 chunks, the last of each leaf partial
  pieces = jax.jit(stats_lib.distribution_stats)([g[:50_000].reshape(5, 10_000), g[50_000:]])
  for name in whole:
    np.testing.assert_allclose(pieces[name], whole[name], rtol=1e-5, err_msg=name)
  # The interleaved copies of the accelerator variant count the same.
  index = jax.random.randint(jax.random.key(10), (100_003,), 0, 1281)
  interleaved, single = jax.jit(
    lambda i: (stats_lib._bin_counts(i, copies=24), stats_lib._bin_counts(i, copies=1))
  )(index)
  np.testing.assert_array_equal(interleaved, single)


def _bf16_pair(key, shape, scale):
  """An activation-like float32 tensor (correlated, nonzero mean) and its bfloat16 rounding."""
  x = scale * correlated_activations(key, shape, 0.3, 1.0, 0.5, 1.0)
  return x, x.astype(jnp.bfloat16)


def test_bf16_inputs_give_float32_statistics():
  """bf16 activations and gradients: every statistic is float32 and computed in float32 — equal to
  the statistics of the same values cast to float32 (bf16 arithmetic would be ~1e-3 off at this size)
  and within bf16 rounding of those of the unrounded float32 tensor."""
  import chex

  x32, x16 = _bf16_pair(jax.random.key(10), (8, 64, 96), 1.0)
  g32, g16 = _bf16_pair(jax.random.key(11), (8, 64, 96), 1e-4)

  @jax.jit
  def all_stats(x, g):  # one compilation per input dtype
    return {
      **stats_lib.forward_stats(x),
      **stats_lib.grad_stats(g),
      **{f'dist/{k}': v for k, v in stats_lib.distribution_stats(g.reshape(-1)).items()},
      **{f'weight/{k}': v for k, v in stats_lib.weight_grad_stats({'q': {'kernel': g}})['q'].items()},
    }

  got = all_stats(x16, g16)
  chex.assert_trees_all_equal_dtypes(got, jax.tree.map(lambda _: jnp.zeros((), jnp.float32), got))
  same_values = all_stats(x16.astype(jnp.float32), g16.astype(jnp.float32))
  unrounded = all_stats(x32, g32)
  for name in got:
    np.testing.assert_allclose(got[name], same_values[name], rtol=1e-5, atol=1e-12, err_msg=name)
    # bf16 keeps 8 significant bits (relative rounding ≤ 2^−9): means and variances move by about
    # that, correlations by less, quantiles by up to a bin width (2.2%).
    rtol = 0.03 if 'grad_abs' in name or name.endswith('ratio') else 1e-2
    atol = 2e-3 if 'corr' in name else 1e-3 * float(np.abs(unrounded[name]).max())
    np.testing.assert_allclose(got[name], unrounded[name], rtol=rtol, atol=atol, err_msg=name)


def test_probe_keeps_the_cotangent_dtype_and_reports_float32():
  """The probe is an identity in the probed dtype: bf16 in, bf16 out, bf16 cotangent back, while the
  statistics it reports (sink table, callbacks) are float32 — for both deliveries."""
  import chex

  x32, x16 = _bf16_pair(jax.random.key(12), (2, 16, 32), 1.0)
  g32, g16 = _bf16_pair(jax.random.key(13), (2, 16, 32), 1e-3)
  sink = jnp.zeros((3, len(SITES), len(probe_lib.ACTIVATION_STATS)), jnp.float32)
  site = SITES.index('ffn_residual')

  @jax.jit
  def sink_tap(x, sink, g):
    y, vjp = jax.vjp(lambda x, sink: probe_lib._stats_tap(site, sink.shape, x, sink, jnp.int32(1)), x, sink)
    return (y, *vjp(g))

  y, dx, dsink = sink_tap(x16, sink, g16)
  chex.assert_type([y, dx, dsink], [jnp.bfloat16, jnp.bfloat16, jnp.float32])
  chex.assert_trees_all_equal((y, dx), (x16, g16))
  expected = {
    **stats_lib.forward_stats(x16.astype(jnp.float32)),
    **stats_lib.grad_stats(g16.astype(jnp.float32)),
  }
  np.testing.assert_allclose(dsink[2, site], [expected[k] for k in probe_lib.ACTIVATION_STATS], rtol=1e-5)
  received = []
  receiver = types.SimpleNamespace(receive=lambda *args: received.append(args))

  @jax.jit
  def callback_tap(x, g):
    y, vjp = jax.vjp(lambda x: probe_lib._callback_tap(site, receiver, x, jnp.int32(5), jnp.int32(1)), x)
    return (y, *vjp(g))

  y, dx = callback_tap(x16, g16)
  jax.effects_barrier()
  chex.assert_type([y, dx], [jnp.bfloat16, jnp.bfloat16])
  assert [np.asarray(r[-1]).dtype for r in received] == [np.float32]  # one callback, from the backward
  np.testing.assert_allclose(received[0][-1], [expected[k] for k in probe_lib.ACTIVATION_STATS], rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Collector.
# ------------------------------------------------------------------------------------------------


def _fake_moments(depth, offset=0.0):
  table = offset + np.arange((depth + 1) * len(SITES) * 7, dtype=np.float32).reshape(depth + 1, len(SITES), 7)
  weights = {'q': {'grad_norm': np.arange(depth, dtype=np.float32), 'grad_kurtosis': np.float32(3.0)}}
  return {'activations': table, 'weights': weights}


def test_collector_records_deduplicates_and_writes_jsonl(tmp_path):
  collector = instrument_lib.Collector(str(tmp_path), tensorboard=False)
  collector.add(3, _fake_moments(depth=2))
  collector.add(3, _fake_moments(depth=2, offset=100.0))  # same step again: every record a duplicate
  collector.add(4, _fake_moments(depth=2))
  assert collector.flush(before_step=4) and len(collector.records) == 7 * (1 + 4 * 2) + 2 + 1
  collector.close()  # writes step 4
  assert collector.num_duplicates == len(collector.records) // 2
  rows = instrument_lib.read_jsonl(os.path.join(tmp_path, 'moments.jsonl'))
  assert rows == collector.records and {r['step'] for r in rows} == {3, 4}
  table = _fake_moments(depth=2)['activations']
  k = list(stats_lib.FORWARD_STATS).index('corr_seq')
  assert {
    'step': 3,
    'layer': 1,
    'site': 'attn_residual',
    'stat': 'corr_seq',
    'value': float(table[2, SITES.index('attn_residual'), k]),
  } in rows
  assert {
    'step': 3,
    'layer': -1,
    'site': 'embedding',
    'stat': 'grad_var',
    'value': float(table[0, 0, 5]),
  } in rows
  assert {'step': 4, 'layer': 1, 'site': 'weight/q', 'stat': 'grad_norm', 'value': 1.0} in rows
  assert {'step': 4, 'layer': -1, 'site': 'weight/q', 'stat': 'grad_kurtosis', 'value': 3.0} in rows


def test_packed_moments_cross_to_the_host_as_one_array_and_read_as_the_moments():
  """What the train step returns (`pack_moments`) is one float32 vector, fetched in one transfer, that
  reads as the moments it packs, and the collector makes the same records of it as of the moments."""
  moments = _fake_moments(depth=3)
  packed = jax.jit(instrument_lib.pack_moments)(moments)
  assert len(jax.tree.leaves(packed)) == 1 and packed.flat.dtype == jnp.float32
  host = jax.device_get(packed)
  assert isinstance(host, instrument_lib.PackedMoments) and isinstance(host.flat, np.ndarray)
  assert set(host) == {'activations', 'weights'} and 'activations' in host and host.get('nope') is None
  for want, got in zip(jax.tree.leaves(moments), jax.tree.leaves(host.unpack()), strict=True):
    np.testing.assert_array_equal(got, want)
  # Records in the order `jax.device_get` of the moments themselves gives (a tree's dicts by sorted key).
  records = list(collector_lib.moments_to_records(7, jax.device_get(moments)))
  assert list(collector_lib.moments_to_records(7, host)) == records
  assert jax.device_get(instrument_lib.pack_moments({})).flat.shape == (0,)


def test_the_host_copy_of_a_step_starts_when_its_moments_are_added(monkeypatch):
  """`start_host_copy` asks every device array of a tree for its host copy (nothing else), and
  `Collector.add` does so for the moments it queues: the train loop adds a step's moments right after
  dispatching it, so the copy is queued before the next step."""
  copied = []
  monkeypatch.setattr(type(jnp.ones(1)), 'copy_to_host_async', lambda self: copied.append(self.shape))
  instrument_lib.start_host_copy({'a': jnp.ones(3), 'b': [jnp.zeros((2, 2)), np.ones(4), 1.5], 'c': None})
  assert sorted(copied) == [(2, 2), (3,)]
  copied.clear()
  collector = instrument_lib.Collector(keep_records=False)
  collector.add(1, jax.jit(instrument_lib.pack_moments)(_fake_moments(depth=2)))
  assert copied == [(len(collector._pending[0][1].flat),)]
  assert len(collector.flush()) == 7 * (1 + 4 * 2) + 2 + 1


def test_collector_remembers_the_keys_of_its_newest_steps_only():
  """A long run's de-duplication keeps SEEN_STEPS steps of keys, not every step's; a second copy of a
  record of one of those steps (a callback that remat re-ran) is still dropped."""
  collector = instrument_lib.Collector(keep_records=False)
  for step in range(1, 51):
    collector.add(step, _fake_moments(depth=2))
    collector.flush()
  assert sorted(collector._seen) == [49, 50] and collector.num_duplicates == 0
  table = _fake_moments(depth=2)['activations']
  collector.receive(49, 0, SITES.index('attn_branch'), table[1, SITES.index('attn_branch')])
  assert collector.flush() == [] and collector.num_duplicates == len(probe_lib.ACTIVATION_STATS)


def test_a_callback_keeps_a_copy_and_the_flush_makes_its_records(monkeypatch):
  """A callback's step waits for it, so `receive` and `receive_table` only keep a copy of what arrived
  (XLA may reuse the buffer once the callback returns); `flush` makes the records of it."""
  table = np.asarray(_fake_moments(depth=2)['activations'], np.float32)
  expected = {(r['layer'], r['site'], r['stat']): r['value'] for r in _records_of(table)}
  made = []
  for name in ('moments_to_records', 'site_records'):
    make = getattr(collector_lib, name)
    monkeypatch.setattr(collector_lib, name, lambda *a, make=make: made.append(1) or make(*a))
  collector = instrument_lib.Collector()
  collector.receive_table(np.int32(5), table)
  site = SITES.index('ffn_branch')
  row = table[2, site].copy()
  collector.receive(np.int32(6), np.int32(1), np.int32(site), row)
  assert not made  # nothing made in the callbacks
  table[...], row[...] = -7.0, -7.0  # the buffers reused
  by_step = collections.defaultdict(dict)
  for r in collector.flush():
    by_step[r['step']][r['layer'], r['site'], r['stat']] = r['value']
  assert len(made) == 2 and by_step[5] == expected
  assert by_step[6] == {key: v for key, v in expected.items() if key[:2] == (1, 'ffn_branch')}


def _records_of(table):
  collector = instrument_lib.Collector()
  collector.add(0, {'activations': table.copy()})
  return collector.flush()


def test_a_jsonl_line_is_json_dumps_of_its_record_byte_for_byte():
  values = [0.1, -0.0, 1e16, 1.5e-320, 3.0, np.nan, np.inf, -np.inf, float(np.float32(0.1))]
  for value in values:
    for site in ('embedding', 'weight/qkv'):
      record = {'step': 12, 'layer': -1, 'site': site, 'stat': 'grad_norm', 'value': float(value)}
      expected = json.dumps({**record, 'value': instrument_lib.json_value(value)}) + '\n'
      assert instrument_lib.collector.jsonl_line(record) == expected


def _tensorboard_scalars(directory):
  """{(step, tag): value} of every scalar in the event files of `directory` (TFRecord framing: length,
  its CRC, the serialized Event, its CRC)."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  scalars = {}
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), 'rb') as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack('<Q', data[pos : pos + 8])
      event = Event.FromString(data[pos + 12 : pos + 12 + length])
      pos += 12 + length + 4
      scalars.update(
        {
          (event.step, v.tag): v.simple_value
          for v in event.summary.value
          if v.WhichOneof('value') == 'simple_value'
        }
      )
  return scalars


def test_collector_writes_every_finite_record_to_tensorboard(tmp_path):
  collector = instrument_lib.Collector(str(tmp_path))
  moments = _fake_moments(depth=2)
  moments['activations'][1, 1, 0] = np.nan  # layer 0, attn_branch, mean: not written
  collector.add(3, moments)
  collector.add(5, _fake_moments(depth=2, offset=0.5))
  collector.close()
  scalars = _tensorboard_scalars(tmp_path / 'tensorboard')
  where = lambda r: 'all' if r['layer'] == -1 else f'layer_{r["layer"]:03d}'  # noqa: E731
  expected = {
    (r['step'], f'moments/{r["site"]}/{r["stat"]}/{where(r)}'): r['value']
    for r in collector.records
    if np.isfinite(r['value'])
  }
  assert len(expected) == len(collector.records) - 1
  assert scalars.keys() == expected.keys()
  np.testing.assert_allclose([scalars[k] for k in expected], list(expected.values()), rtol=1e-6)


def test_is_instrumented_step():
  assert [s for s in range(1, 11) if instrument_lib.is_instrumented_step(s, 4)] == [1, 4, 8]
  assert not any(instrument_lib.is_instrumented_step(s, 0) for s in range(1, 11))


# ------------------------------------------------------------------------------------------------
# The instrumented train step: exactly once, on one device and on a mesh; off means off.
# ------------------------------------------------------------------------------------------------

DEPTH = 3


def _train_setup(remat, instrument=False, moments_receiver=None, moments_per_site=True, **overrides):
  config = tiny_config('gpt', depth=DEPTH, remat=remat, dropout=0.1, **overrides)
  step_fn, state, batch, _AXES[remat] = tiny_train_step(
    config,
    8,
    use_dropout=True,
    instrument=instrument,
    moments_receiver=moments_receiver,
    moments_per_site=moments_per_site,
  )
  return step_fn, state, batch


_AXES = {}  # logical axes of the model of _train_setup (by remat policy), for the sharded runs


def _expected_keys(steps):
  act_stats = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS
  keys = set()
  for step in steps:
    keys |= {(step, -1, 'embedding', s) for s in act_stats}
    keys |= {(step, n, site, s) for n in range(DEPTH) for site in LAYER_SITES for s in act_stats}
    for kind in stats_lib.WEIGHT_TYPES:  # Pre-LN: 'norms' = pre_attn_norm + pre_ffn_norm.
      keys |= {(step, n, f'weight/{kind}', 'grad_norm') for n in range(DEPTH)}
      keys |= {(step, -1, f'weight/{kind}', s) for s in stats_lib.DISTRIBUTION_STATS}
  return keys


@functools.cache
def _run_instrumented(remat, num_devices, delivery='return', per_site=True, fused_ops='auto'):
  """Two instrumented train steps (loop steps 1 and 2) under jit + scan + grad, into one collector;
  the per-site statistics returned from the step or sent by jax.debug.callback (per probe site, or
  the whole table once per step)."""
  collector = instrument_lib.Collector()
  receiver = collector if delivery == 'callback' else None
  step_fn, state, batch = _train_setup(
    remat, instrument=True, moments_receiver=receiver, moments_per_site=per_site, fused_ops=fused_ops
  )
  if num_devices == 1:
    jitted, mesh_context = jax.jit(step_fn), contextlib.nullcontext()
  else:  # data × fsdp × tensor = 2 × 2 × 2: batch, model width and heads all sharded.
    mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:num_devices])
    state_sh = sharding_lib.state_shardings(state, _AXES[remat], mesh)
    jitted = jax.jit(
      step_fn,
      in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
      out_shardings=(state_sh, sharding_lib.replicated(mesh)),
    )
    state, mesh_context = jax.device_put(state, state_sh), sharding_lib.use_mesh(mesh)  # as the loop does
  with mesh_context:
    for step in (1, 2):
      state, metrics = jitted(state, batch)
      collector.add(step, metrics['moments'])
  jax.effects_barrier()  # delivery='callback': wait for callbacks still in flight.
  collector.flush()
  return collector


@functools.cache
def _returned(remat, num_devices):
  """`_run_instrumented` with the statistics returned from the step, made once per test process for the
  tests below, which only read it."""
  return _run_instrumented(remat, num_devices)


@pytest.mark.parametrize(
  'remat,num_devices',
  [
    ('none', 1),
    ('full', 8),
    pytest.param('full', 1, marks=pytest.mark.slow),
    pytest.param('none', 8, marks=pytest.mark.slow),
  ],
)
def test_every_statistic_arrives_exactly_once(remat, num_devices):
  assert len(jax.devices()) >= num_devices
  collector = _returned(remat, num_devices)
  keys = [(r['step'], r['layer'], r['site'], r['stat']) for r in collector.records]
  assert set(keys) == _expected_keys(steps=(1, 2))  # nothing missing, nothing extra
  assert len(keys) == len(set(keys)) and collector.num_duplicates == 0  # exactly once
  assert all(np.isfinite(r['value']) for r in collector.records)


@pytest.mark.parametrize(
  'remat,num_devices,per_site',
  [
    ('none', 1, False),
    ('none', 1, True),
    ('full', 8, True),
    # Slow: each factor of these three (remat, 8 devices, per-site delivery) is covered by a case above;
    # per-site callbacks on 8 devices without remat take ~50 s on 2 cores, the others ~18 s.
    pytest.param('full', 1, False, marks=pytest.mark.slow),
    pytest.param('none', 8, True, marks=pytest.mark.slow),
    pytest.param('full', 1, True, marks=pytest.mark.slow),
  ],
)
def test_callback_delivery_arrives_exactly_once_with_the_same_values(remat, num_devices, per_site):
  """instrument.delivery='callback': a jax.debug.callback per site from the backward pass of the
  scanned layers (none from the forward pass, which remat re-runs), or, as on one device, the whole
  table in one callback per step: every record arrives once, none twice."""
  collector = _run_instrumented(remat, num_devices, 'callback', per_site)
  keys = [(r['step'], r['layer'], r['site'], r['stat']) for r in collector.records]
  assert set(keys) == _expected_keys(steps=(1, 2))
  assert len(keys) == len(set(keys)) and collector.num_duplicates == 0
  returned = {
    (r['step'], r['layer'], r['site'], r['stat']): r['value'] for r in _returned(remat, num_devices).records
  }
  for r in collector.records:
    key = (r['step'], r['layer'], r['site'], r['stat'])
    np.testing.assert_allclose(r['value'], returned[key], rtol=2e-3, atol=1e-12, err_msg=str(key))


def test_statistics_do_not_depend_on_mesh_or_remat():
  one = {(r['step'], r['layer'], r['site'], r['stat']): r['value'] for r in _returned('none', 1).records}
  for remat, num_devices in [('full', 1), ('none', 8), ('full', 8)]:
    other = {
      (r['step'], r['layer'], r['site'], r['stat']): r['value'] for r in _returned(remat, num_devices).records
    }
    assert one.keys() == other.keys()
    for key in one:
      np.testing.assert_allclose(other[key], one[key], rtol=2e-3, atol=1e-12, err_msg=str(key))


@pytest.mark.skipif(len(jax.devices()) < 8, reason='needs 8 devices (the CPU simulates them)')
def test_statistics_on_a_mesh_with_the_kernels_are_those_on_one_device_without():
  """The norm-and-cast and GELU kernels in an instrumented step run per device on a mesh (Pallas'
  interpreter here): the same statistics as the plain math on one device."""
  one = {(r['step'], r['layer'], r['site'], r['stat']): r['value'] for r in _returned('none', 1).records}
  mesh = {
    (r['step'], r['layer'], r['site'], r['stat']): r['value']
    for r in _run_instrumented('none', 8, fused_ops='pallas').records
  }
  assert one.keys() == mesh.keys()
  for key in one:
    np.testing.assert_allclose(mesh[key], one[key], rtol=2e-3, atol=1e-12, err_msg=str(key))


def test_statistics_match_a_direct_computation():
  """The table that leaves the remat'ed scan through the stats sink equals the statistics of the layer
  outputs computed layer by layer, and of the loss gradient w.r.t. them."""
  config = tiny_config('gpt', depth=DEPTH, remat='full')
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(8), (4, 16), 0, 256)

  def loss_fn(params, probe):
    return nnx.merge(graphdef, params, rest)(tokens, probe=probe).mean()

  got = jax.jit(lambda p: instrument_lib.value_and_grad(loss_fn, p)[2]['activations'])(params)
  layer_graphdef, layer_state = nnx.split(model.trunk.stack.layers)

  @jax.jit
  def reference():
    # Forward: the layers applied one by one, outside the scan.
    x, outputs = model.embed(tokens), []
    for n in range(DEPTH):
      layer = nnx.merge(layer_graphdef, jax.tree.map(lambda a: a[n], layer_state))
      x = layer(x, None, layer=jnp.asarray(n))
      outputs.append(stats_lib.forward_stats(x))
    # Backward: d(loss)/d(delta_n) for a zero delta_n added to the output of layer n.
    add_delta = lambda d: lambda site, x, n: x + d[n] if site == 'ffn_residual' else x  # noqa: E731
    grads = jax.grad(lambda d: loss_fn(params, add_delta(d)))(jnp.zeros((DEPTH,) + x.shape))
    return [{**outputs[n], **stats_lib.grad_stats(grads[n])} for n in range(DEPTH)]

  names = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS
  for n, expected in enumerate(reference()):
    row = got[n + 1, SITES.index('ffn_residual')]
    for k, name in enumerate(names):
      np.testing.assert_allclose(row[k], expected[name], rtol=1e-4, atol=1e-7, err_msg=f'{name} {n}')


def test_statistics_with_the_fused_kernels_are_those_of_the_plain_math():
  """With model.fused_ops='pallas' an instrumented step keeps the norm-and-cast and GELU kernels (run in
  Pallas' interpreter here): every site's statistics, forward and backward, are those of the plain math
  up to rounding, the stream between the attention's residual add and its norm included."""

  def table(fused_ops):
    config = tiny_config('gpt', depth=DEPTH, fused_ops=fused_ops)
    model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(8), (4, 16), 0, 256)

    def loss_fn(params, probe):
      return nnx.merge(graphdef, params, rest)(tokens, probe=probe).mean()

    return jax.jit(lambda p: instrument_lib.value_and_grad(loss_fn, p)[2]['activations'])(params)

  fused, plain = table('pallas'), table('none')
  chex.assert_equal_shape([fused, plain])
  np.testing.assert_allclose(fused, plain, rtol=2e-4, atol=1e-7)


def test_the_statistics_operations_carry_their_scope_in_the_compiled_program():
  """Every operation the statistics add is named STATISTICS_SCOPE in the compiled step's metadata (what
  benchmarks/hlo_traffic.py reads to tell their kernels from the step's); the plain step has none."""
  config = tiny_config('gpt', depth=DEPTH)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(8), (4, 16), 0, 256)

  def loss_fn(params, probe):
    return nnx.merge(graphdef, params, rest)(tokens, probe=probe).mean()

  def op_names(fn) -> set[str]:
    hlo = jax.jit(fn).lower(params).compile().as_text()
    return set(re.findall(r'op_name="([^"]*)"', hlo))

  scoped = f'{probe_lib.STATISTICS_SCOPE}/'
  instrumented = op_names(lambda p: instrument_lib.value_and_grad(loss_fn, p)[2])
  assert any(scoped in name for name in instrumented)
  # The scope covers the statistics of each pass: the forward sums, the gradient's, the weights'.
  assert any(scoped in name and 'transpose(' not in name for name in instrumented)
  assert any(scoped in name and 'transpose(' in name for name in instrumented)
  unprobed = lambda site, x, layer: x  # noqa: E731
  assert not any(scoped in name for name in op_names(jax.grad(lambda p: loss_fn(p, unprobed))))


# Slow (~10 s): by default the sampled table of the partial-sum path is checked against the whole
# tensors' in tests/instrument/test_stats.py, the unrolled stack's per-layer entries in
# tests/models/test_models.py (test_a_scanned_probe_gets_each_layers_entry), and remat's recomputed
# taps in test_statistics_do_not_depend_on_mesh_or_remat.
@pytest.mark.parametrize(
  'sample_rows,scan_layers,remat',
  [(0, True, 'none'), pytest.param(24, False, 'full', marks=pytest.mark.slow)],
)
def test_layer_statistics_from_partial_sums_are_the_per_site_statistics(
  sample_rows, scan_layers, remat, monkeypatch
):
  """A stacked model's layer sites return partial sums from the layer scan (or its unrolled loop),
  finished after the loop; the same model probed by a plain function (which the stack cannot give
  per-layer sinks) returns each site's finished statistics into the table: every entry of the two
  tables agrees, whether a layer's forward sums leave with its last site's tap or each with its own."""
  config = tiny_config('gpt', depth=DEPTH, remat=remat)
  config.model.scan_layers = scan_layers
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(8), (4, 16), 0, 256)

  def loss_fn(params, probe):
    return nnx.merge(graphdef, params, rest)(tokens, probe=probe).mean()

  def per_site_loss_fn(params, probe):
    return loss_fn(params, lambda site, x, layer: probe(site, x, layer))

  def table(loss_fn):
    return instrument_lib.value_and_grad(loss_fn, params, weights=False, sample_rows=sample_rows)[2]

  shape, last_site = probe_lib._layer_sites(loss_fn, params)
  assert shape == (4, 16, config.model.width) and probe_lib.LAYER_SITES[last_site] == 'ffn_residual'
  from_sums = jax.jit(lambda: table(loss_fn)['activations'])()
  per_site = jax.jit(lambda: table(per_site_loss_fn)['activations'])()
  chex.assert_type(from_sums, jnp.float32)
  assert np.all(np.asarray(per_site[1:, 1:]) != 0)  # every layer site measured by its own tap
  np.testing.assert_allclose(from_sums, per_site, rtol=1e-4, atol=1e-6)
  monkeypatch.setattr(probe_lib, '_layer_sites', lambda loss_fn, params: (shape, None))
  each_site_sums = jax.jit(lambda: table(loss_fn)['activations'])()
  np.testing.assert_allclose(each_site_sums, per_site, rtol=1e-4, atol=1e-6)


def test_a_layer_whose_sites_repeat_sends_each_sites_sums_with_its_own_tap():
  """A layer that probes a site twice (a forked block, say) has no last site: each site's forward sums
  then leave with its own tap."""
  config = tiny_config('gpt', depth=DEPTH)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(8), (4, 16), 0, 256)

  def twice(params, probe):
    def probe_twice(site, x, layer):
      return probe(site, probe(site, x, layer), layer) if site == 'attn_branch' else probe(site, x, layer)

    return nnx.merge(graphdef, params, rest)(tokens, probe=probe_twice).mean()

  assert probe_lib._layer_sites(twice, params) == ((4, 16, config.model.width), None)


def test_what_per_site_callbacks_in_the_layer_scan_do(remat='full'):
  """Evidence for dsjax/instrument/README.md: a `jax.debug.callback` per probe site inside the scanned layers.

  On an 8-device mesh it runs once per call (lowered with a MAXIMAL sharding: device 0 runs it with
  the gathered operands), but twice per layer under remat: the backward pass recomputes the layer,
  callback included. (Usable with de-duplication, at 4·depth host round trips per forward pass.)
  """
  arrivals = {}

  def record(layer, value, *, site):
    del value
    arrivals[(int(layer), site)] = arrivals.get((int(layer), site), 0) + 1

  def callback_probe(site, x, layer):
    jax.debug.callback(record, layer, x.var(), site=site)
    return x

  config = tiny_config('gpt', depth=DEPTH, remat=remat)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  params = nnx.to_pure_dict(params)
  params = jax.device_put(
    params, sharding_lib.state_shardings({'params': params}, sharding_lib.logical_axes(model), mesh)['params']
  )
  tokens = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding_lib.batch_sharding(mesh))
  loss = lambda p: nnx.merge(graphdef, p, rest)(tokens, probe=callback_probe).mean()  # noqa: E731
  with jax.set_mesh(mesh):
    jax.block_until_ready(jax.jit(jax.grad(loss))(params))
  jax.effects_barrier()
  in_scan = {k: count for k, count in arrivals.items() if k[0] >= 0}
  assert len(in_scan) == DEPTH * len(LAYER_SITES)
  assert set(in_scan.values()) == {2}  # forward pass + recomputation in the backward pass
  assert arrivals[(-1, 'embedding')] == 1  # outside the remat'ed scan: once, on the whole mesh


def test_off_means_off():
  """The plain step computes no statistics and has no callbacks; the instrumented one has the table."""
  plain_fn, state, batch = _train_setup('full')
  instrumented_fn, _, _ = _train_setup('full', instrument=True)
  table_type = f'f32[{DEPTH + 1},{len(SITES)},{len(stats_lib.FORWARD_STATS) + len(stats_lib.GRAD_STATS)}]'
  plain_jaxpr = str(jax.make_jaxpr(plain_fn)(state, batch))
  plain_hlo = jax.jit(plain_fn).lower(state, batch).as_text()
  assert table_type not in plain_jaxpr and 'callback' not in plain_jaxpr + plain_hlo
  assert 'moments' not in jax.eval_shape(plain_fn, state, batch)[1]
  assert table_type in str(jax.make_jaxpr(instrumented_fn)(state, batch))  # positive control


# The callback path's exactly-once delivery is checked above without the loop; through the loop, slow.
@pytest.mark.parametrize('delivery', ['return', pytest.param('callback', marks=pytest.mark.slow)])
def test_training_loop_writes_moments_at_the_instrumented_steps(tmp_path, delivery):
  from dsjax.train import loop

  config = tiny_config('gpt', depth=2)
  config.total_steps, config.instrument.every = 4, 2
  config.instrument.delivery = delivery
  loop.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:1])
  rows = instrument_lib.read_jsonl(os.path.join(tmp_path, 'moments.jsonl'))
  keys = [(r['step'], r['layer'], r['site'], r['stat']) for r in rows]
  assert len(keys) == len(set(keys))
  assert {k[0] for k in keys} == {1, 2, 4}  # step 1 (= initialisation) and every 2nd step
  assert {k for k in keys if k[0] == 4} == {(4,) + k[1:] for k in keys if k[0] == 1}
  assert os.listdir(os.path.join(tmp_path, 'tensorboard'))


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_moments_cli_reads_a_checkpoint(tmp_path):
  """`dsjax.moments --checkpoint=WORKDIR` measures the trained model, not the initial one."""
  from dsjax import moments
  from dsjax.train import loop

  config = tiny_config('gpt', depth=2)
  config.total_steps = 3
  loop.train_and_evaluate(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  at_init = moments.run(config, str(tmp_path / 'init'), num_batches=1)
  trained = moments.run(config, str(tmp_path / 'trained'), num_batches=1, checkpoint=str(tmp_path / 'run'))
  assert trained['layers'][0]['grad_var']['measured'] != at_init['layers'][0]['grad_var']['measured']
  with pytest.raises(ValueError, match='holds no checkpoint'):
    moments.run(config, str(tmp_path / 'none'), num_batches=1, checkpoint=str(tmp_path / 'init'))
  config.model.depth, config.total_steps = 3, 2  # reading needs the architecture, not total_steps
  with pytest.raises(
    ValueError,
    match=r'--checkpoint=\S+ holds a checkpoint .* another architecture.*'
    r'model.depth: 2 → 3; pass the --config and --config.\* overrides it was trained with',
  ):
    moments.run(config, str(tmp_path / 'other'), num_batches=1, checkpoint=str(tmp_path / 'run'))
  config.model.depth = 2
  moments.run(config, str(tmp_path / 'fewer_steps'), num_batches=1, checkpoint=str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'init' / 'checkpoints') and not os.path.exists(tmp_path / 'none')


# ------------------------------------------------------------------------------------------------
# The moments CLI and the theory adapter.
# ------------------------------------------------------------------------------------------------


def test_moments_cli_writes_json_and_png(tmp_path):
  from dsjax import moments

  config = tiny_config('gpt', depth=3, dropout=0.1)
  result = moments.run(config, str(tmp_path), num_batches=2)
  with open(os.path.join(tmp_path, 'moments.json')) as f:
    saved = json.load(f)
  assert os.path.getsize(os.path.join(tmp_path, 'moments.png')) > 0
  assert [row['layer'] for row in saved['layers']] == [0, 1, 2]
  for row in saved['layers']:
    for name in ('forward_var', 'grad_var', 'corr_seq', 'grad_corr_seq'):
      assert np.isfinite(row[name]['measured']) and np.isfinite(row[name]['predicted'])
  assert saved['config']['model']['depth'] == 3 and saved['settings']['num_batches'] == 2
  # The gradient prediction starts from the gradient measured at the last layer.
  last = saved['layers'][-1]['grad_var']
  np.testing.assert_allclose(last['predicted'], last['measured'], rtol=1e-6)
  assert set(result['summary']) == set(moments.QUANTITIES)
  assert 'median' in moments.format_summary(result)


def test_theory_adapter_reads_scales_and_weight_variances_from_the_model():
  from dsjax.instrument import theory_adapter

  config = tiny_config('gpt', depth=4, width=64)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  model.trunk.stack.layers.branch_ffn[...] = jnp.asarray([1.0, 0.5, 0.25, 0.0])
  desc = theory_adapter.describe(config, model, TEXT_INFO)
  np.testing.assert_allclose(desc.scale['branch_ffn'], [1.0, 0.5, 0.25, 0.0])
  np.testing.assert_allclose(desc.scale['skip_attn'], 1.0)
  np.testing.assert_allclose(desc.weight_var['q'], 2 / (64 + 64), rtol=0.05)  # Xavier
  np.testing.assert_allclose(desc.weight_var['ffn2'], 2 / (256 + 64), rtol=0.05)
  assert (desc.block, desc.causal, desc.mlp_hidden, desc.seq_len) == ('preln', True, 256, 16)


def test_moments_table_of_a_run(tmp_path):
  from experiments import moments_table

  rows = [
    {'step': s, 'layer': n, 'site': 'ffn_residual', 'stat': 'corr_seq', 'value': 0.1 * s + n}
    for s in (1, 50)
    for n in (0, 3)
  ]
  with open(tmp_path / 'moments.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  table = moments_table.moments_table(str(tmp_path), [0, 3, 7], ['ffn_residual/corr_seq'])
  assert '| ffn_residual/corr_seq | 50 | 5 | 8 | – |' in table
  with pytest.raises(SystemExit, match='instrument.every'):
    moments_table.moments_table(str(tmp_path / 'none'), [0], ['ffn_residual/corr_seq'])
