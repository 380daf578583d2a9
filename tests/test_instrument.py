"""Instrumentation tests: statistics against numpy, exactly-once delivery, off-means-off, the collector."""

import contextlib
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsjax import instrument as instrument_lib
from dsjax import models
from dsjax.instrument import stats as stats_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import step as step_lib
from tests.helpers import TEXT_INFO, tiny_config

# ------------------------------------------------------------------------------------------------
# Statistics.
# ------------------------------------------------------------------------------------------------


def _numpy_pair_corr(x_BLD, axis):
  """Brute force: mean over all pairs i ≠ j along `axis` of centred products, over the variance."""
  c = x_BLD - x_BLD.mean()
  c = np.moveaxis(c, axis, -1)                       # (..., n)
  n = c.shape[-1]
  outer = c[..., :, None] * c[..., None, :]          # (..., n, n)
  off_diagonal = outer[..., ~np.eye(n, dtype=bool)]  # (..., n·(n−1))
  return off_diagonal.mean() / (c ** 2).mean()


def _correlated_activations(key, shape, mean, seq_std, hidden_std, noise_std):
  """x = mean + a_{b,i} (shared by all tokens) + e_{b,t} (shared by all hidden units) + noise."""
  b, l, d = shape
  k1, k2, k3 = jax.random.split(key, 3)
  return (mean + seq_std * jax.random.normal(k1, (b, 1, d)) + hidden_std * jax.random.normal(k2, (b, l, 1))
          + noise_std * jax.random.normal(k3, shape))


def test_forward_stats_match_numpy_brute_force():
  x = _correlated_activations(jax.random.key(0), (3, 7, 5), 0.5, 1.0, 0.7, 0.4)
  got = jax.jit(stats_lib.forward_stats)(x)
  xn = np.asarray(x, np.float64)
  np.testing.assert_allclose(got['mean'], xn.mean(), rtol=1e-5)
  np.testing.assert_allclose(got['var'], xn.var(), rtol=1e-5)
  np.testing.assert_allclose(got['corr_seq'], _numpy_pair_corr(xn, axis=1), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got['corr_hidden'], _numpy_pair_corr(xn, axis=2), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got['max_abs'], np.abs(xn).max(), rtol=1e-6)


def test_forward_stats_recover_known_correlations():
  """Variance components 1 (token-shared), 0.5 (hidden-shared), 0.5 (noise): r^l = 0.5, r^d = 0.25."""
  x = _correlated_activations(jax.random.key(1), (64, 64, 64), 3.0, 1.0, np.sqrt(0.5), np.sqrt(0.5))
  got = stats_lib.forward_stats(x)
  np.testing.assert_allclose(got['mean'], 3.0, atol=0.05)
  np.testing.assert_allclose(got['var'], 2.0, rtol=0.05)
  np.testing.assert_allclose(got['corr_seq'], 0.5, atol=0.03)
  np.testing.assert_allclose(got['corr_hidden'], 0.25, atol=0.03)


def test_grad_stats_match_numpy():
  g = _correlated_activations(jax.random.key(2), (2, 6, 4), 0.0, 1e-3, 0.0, 2e-3)
  got = stats_lib.grad_stats(g)
  gn = np.asarray(g, np.float64)
  np.testing.assert_allclose(got['grad_var'], gn.var(), rtol=1e-5)
  np.testing.assert_allclose(got['grad_corr_seq'], _numpy_pair_corr(gn, axis=1), rtol=1e-4)


def test_layernorm_output_has_hidden_correlation_minus_one_over_d_minus_one():
  """SPEC §1.1: after LayerNorm r^d = −1/(d−1) exactly (per-token mean is removed)."""
  x = jax.random.normal(jax.random.key(3), (4, 8, 16))
  y = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
  np.testing.assert_allclose(stats_lib.forward_stats(y)['corr_hidden'], -1 / 15, rtol=1e-4)


def test_weight_grad_stats():
  depth = 3
  keys = jax.random.split(jax.random.key(4), 4)
  grads = {'attn': {'q': {'kernel': jax.random.normal(keys[0], (depth, 8, 8)), 'bias': jnp.ones((depth, 8))}},
           'ffn': {'ffn1': {'kernel': jax.random.laplace(keys[1], (depth, 8, 32))}},
           'pre_attn_norm': {'scale': jax.random.normal(keys[2], (depth, 8)),
                             'bias': jax.random.normal(keys[3], (depth, 8))}}
  got = stats_lib.weight_grad_stats(grads)
  assert set(got) == {'q', 'ffn1', 'norms'}  # Dense biases are not a weight type.
  q = np.asarray(grads['attn']['q']['kernel'])
  np.testing.assert_allclose(got['q']['grad_norm'], np.sqrt((q ** 2).sum((1, 2))), rtol=1e-5)
  norm = np.concatenate([np.asarray(grads['pre_attn_norm'][k]) for k in ('scale', 'bias')], 1)
  np.testing.assert_allclose(got['norms']['grad_norm'], np.sqrt((norm ** 2).sum(1)), rtol=1e-5)
  np.testing.assert_allclose(got['q']['grad_abs_p90'], np.quantile(np.abs(q), 0.9), rtol=0.02)
  # Gaussian: kurtosis 3; Laplace: 6 (heavier tail), and a larger p99.9/median ratio.
  assert got['ffn1']['grad_kurtosis'] > got['q']['grad_kurtosis']
  assert got['ffn1']['grad_tail_ratio'] > got['q']['grad_tail_ratio']


@pytest.mark.parametrize('distribution', ['normal', 'laplace', 'cauchy'])
def test_abs_quantiles_match_numpy(distribution):
  """The log-histogram quantiles are within 1% of the exact ones, also for very heavy tails."""
  g = getattr(jax.random, distribution)(jax.random.key(5), (200_000,)) * 1e-4
  probs = tuple(stats_lib.GRAD_QUANTILES.values())
  np.testing.assert_allclose(stats_lib.abs_quantiles(g, probs), np.quantile(np.abs(g), probs), rtol=0.01)


def test_distribution_stats_of_a_gaussian():
  got = stats_lib.distribution_stats(jax.random.normal(jax.random.key(6), (400_000,)))
  np.testing.assert_allclose(got['grad_abs_p50'], 0.6745, rtol=0.01)   # median of |N(0,1)|
  np.testing.assert_allclose(got['grad_kurtosis'], 3.0, rtol=0.03)
  np.testing.assert_allclose(got['grad_tail_ratio'], 3.2905 / 0.6745, rtol=0.03)
  assert float(stats_lib.abs_quantiles(jnp.zeros(10), (0.5,))[0]) == 0.0


# ------------------------------------------------------------------------------------------------
# Collector.
# ------------------------------------------------------------------------------------------------


def test_collector_deduplicates_and_writes_jsonl(tmp_path):
  collector = instrument_lib.Collector(str(tmp_path), tensorboard=False)
  var, mean = ('attn_branch', 'var'), ('attn_branch', 'mean')
  collector.receive(3, 1, np.array([2.0, 0.0]), keys=(var, mean))
  collector.receive(3, 1, np.array([9.0]), keys=(var,))                    # duplicate: dropped
  collector.receive(3, 0, np.array([1.0]), keys=(var,))
  collector.receive(3, np.arange(2), np.array([[1.0, 2.0]]), keys=(('weight/q', 'grad_norm'),))
  written = collector.flush()
  collector.receive(3, 0, np.array([5.0]), keys=(var,))                    # late duplicate: dropped
  collector.close()
  assert collector.num_duplicates == 2
  rows = instrument_lib.read_jsonl(os.path.join(tmp_path, 'moments.jsonl'))
  assert rows == written and len(rows) == 5
  assert {'step': 3, 'layer': 1, 'site': 'attn_branch', 'stat': 'var', 'value': 2.0} in rows
  assert {'step': 3, 'layer': 1, 'site': 'weight/q', 'stat': 'grad_norm', 'value': 2.0} in rows


def test_is_instrumented_step():
  assert [s for s in range(1, 11) if instrument_lib.is_instrumented_step(s, 4)] == [1, 4, 8]
  assert not any(instrument_lib.is_instrumented_step(s, 0) for s in range(1, 11))

# ------------------------------------------------------------------------------------------------
# The instrumented train step: exactly once, on one device and on a mesh; off means off.
# ------------------------------------------------------------------------------------------------

DEPTH = 3
SITES = ('attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual')  # per layer


class CountingCollector(instrument_lib.Collector):
  """Also counts raw arrivals per key, to see what the callbacks did before de-duplication."""

  def __init__(self):
    super().__init__(None)
    self.arrivals = {}

  def _add(self, key, value):
    self.arrivals[key] = self.arrivals.get(key, 0) + 1
    super()._add(key, value)


def _train_setup(remat, instrument=None, **overrides):
  config = tiny_config('gpt', depth=DEPTH, remat=remat, dropout=0.1, **overrides)
  model = models.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = params.to_pure_dict(), rest.to_pure_dict()
  tx = optax.sgd(0.1)
  state = {'params': params, 'rest': rest, 'opt_state': tx.init(params), 'step': jnp.zeros((), jnp.int32)}
  step_fn = step_lib.make_train_step(graphdef, tx, step_lib.lm_loss, 0, optax.constant_schedule(0.1),
                                     use_dropout=True, instrument=instrument)
  tokens = jax.random.randint(jax.random.key(7), (8, 17), 0, 256)
  return step_fn, state, {'tokens': tokens}


def _expected_keys(steps):
  act_stats = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS
  keys = set()
  for step in steps:
    keys |= {(step, -1, 'embedding', s) for s in act_stats}
    keys |= {(step, n, site, s) for n in range(DEPTH) for site in SITES for s in act_stats}
    for kind in stats_lib.WEIGHT_TYPES:  # Pre-LN: 'norms' = pre_attn_norm + pre_ffn_norm.
      keys |= {(step, n, f'weight/{kind}', 'grad_norm') for n in range(DEPTH)}
      keys |= {(step, -1, f'weight/{kind}', s) for s in stats_lib.DISTRIBUTION_STATS}
  return keys


@functools.cache
def _run_instrumented(remat, num_devices):
  """Two instrumented train steps (loop steps 1 and 2) under jit + scan + grad, into one collector."""
  collector = CountingCollector()
  step_fn, state, batch = _train_setup(remat, instrument_lib.Instrument(collector))
  if num_devices == 1:
    jitted, mesh_context = jax.jit(step_fn), contextlib.nullcontext()
  else:  # data × fsdp × tensor = 2 × 2 × 2: batch, model width and heads all sharded.
    mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:num_devices])
    state_sh = sharding_lib.tree_shardings(state, mesh)
    jitted = jax.jit(step_fn, in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
                     out_shardings=(state_sh, sharding_lib.replicated(mesh)))
    state, mesh_context = jax.device_put(state, state_sh), jax.set_mesh(mesh)
  with mesh_context:
    for _ in range(2):
      state, _ = jitted(state, batch)
  collector.flush()
  return collector


@pytest.mark.parametrize('num_devices', [1, 8])
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_every_statistic_arrives_exactly_once(remat, num_devices):
  assert len(jax.devices()) >= num_devices
  collector = _run_instrumented(remat, num_devices)
  keys = [(r['step'], r['layer'], r['site'], r['stat']) for r in collector.records]
  assert set(keys) == _expected_keys(steps=(1, 2))     # nothing missing, nothing extra
  assert len(keys) == len(set(keys))                   # exactly once
  assert set(collector.arrivals.values()) == {1}       # even before de-duplication (stats sink)
  assert all(np.isfinite(r['value']) for r in collector.records)


def test_mesh_and_single_device_measure_the_same_values():
  one = {(r['step'], r['layer'], r['site'], r['stat']): r['value']
         for r in _run_instrumented('none', 1).records}
  eight = {(r['step'], r['layer'], r['site'], r['stat']): r['value']
           for r in _run_instrumented('none', 8).records}
  assert one.keys() == eight.keys()
  for key in one:
    np.testing.assert_allclose(eight[key], one[key], rtol=2e-3, atol=1e-12, err_msg=str(key))


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_what_per_site_callbacks_in_the_layer_scan_do(remat):
  """Why the statistics leave the scan through a stats sink (probe.py), not a callback per site.

  Evidence for jax 0.10: a callback per probe site inside the scanned layers arrives once per layer
  on an 8-device mesh (MAXIMAL sharding: device 0 runs it with the gathered operands), but twice under
  remat (the backward pass recomputes the layer, callback included) — usable with de-duplication, at
  the cost of 4·depth host round trips per forward pass.
  """
  arrivals = {}

  def record(step, layer, value, *, site):
    del value
    key = (int(step), int(layer), site)
    arrivals[key] = arrivals.get(key, 0) + 1

  def callback_probe(site, x, layer):
    jax.debug.callback(record, jnp.int32(1), layer, x.var(), site=site)
    return x

  config = tiny_config('gpt', depth=DEPTH, remat=remat)
  model = models.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  params = jax.device_put(params, sharding_lib.tree_shardings(params, mesh))
  tokens = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding_lib.batch_sharding(mesh))
  loss = lambda p: nnx.merge(graphdef, p, rest)(tokens, probe=callback_probe).mean()  # noqa: E731
  with jax.set_mesh(mesh):
    jax.block_until_ready(jax.jit(jax.grad(loss))(params))
  jax.effects_barrier()
  in_scan = {k: n for k, n in arrivals.items() if k[1] >= 0}
  assert len(in_scan) == DEPTH * len(SITES)
  assert set(in_scan.values()) == ({2} if remat != 'none' else {1})
  assert arrivals[(1, -1, 'embedding')] == 1


def _callback_ops(step_fn, state, batch):
  jaxpr = str(jax.make_jaxpr(step_fn)(state, batch))
  hlo = jax.jit(step_fn).lower(state, batch).as_text()
  return jaxpr.count('debug_callback'), hlo.count('callback')


def test_off_means_no_callbacks_are_compiled():
  plain_fn, state, batch = _train_setup('full')
  assert _callback_ops(plain_fn, state, batch) == (0, 0)
  # Positive control: the same check sees the callbacks of the instrumented step.
  instrumented_fn, _, _ = _train_setup('full', instrument_lib.Instrument(instrument_lib.Collector()))
  in_jaxpr, in_hlo = _callback_ops(instrumented_fn, state, batch)
  assert in_jaxpr > 0 and in_hlo > 0


def test_training_loop_writes_moments_at_the_instrumented_steps(tmp_path):
  from dsjax.train import loop
  config = tiny_config('gpt', depth=2)
  config.total_steps, config.instrument.every = 4, 2
  loop.train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:1])
  rows = instrument_lib.read_jsonl(os.path.join(tmp_path, 'moments.jsonl'))
  keys = [(r['step'], r['layer'], r['site'], r['stat']) for r in rows]
  assert len(keys) == len(set(keys))
  assert {k[0] for k in keys} == {1, 2, 4}   # step 1 (= initialisation) and every 2nd step
  assert {k for k in keys if k[0] == 4} == {(4,) + k[1:] for k in keys if k[0] == 1}
  assert os.listdir(os.path.join(tmp_path, 'tensorboard'))

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
  model = models.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  model.trunk.stack.layers.branch_ffn[...] = jnp.asarray([1.0, 0.5, 0.25, 0.0])
  desc = theory_adapter.describe(config, model, TEXT_INFO)
  np.testing.assert_allclose(desc.scale['branch_ffn'], [1.0, 0.5, 0.25, 0.0])
  np.testing.assert_allclose(desc.scale['skip_attn'], 1.0)
  np.testing.assert_allclose(desc.weight_var['q'], 2 / (64 + 64), rtol=0.05)      # Xavier
  np.testing.assert_allclose(desc.weight_var['ffn2'], 2 / (256 + 64), rtol=0.05)
  assert (desc.block, desc.causal, desc.mlp_hidden, desc.seq_len) == ('preln', True, 256, 16)
