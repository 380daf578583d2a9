"""Whole-model moments (Kedia et al. 2024, Apps. E, F, M): vanilla Pre-LN/Post-LN shapes, DSLM flatness."""

import math

import numpy as np
import pytest

from dsjax.theory import GradStats, Stats
from dsjax.theory import components as C
from dsjax.theory import model as M

P = 0.1
WIDTH, HEADS, SEQ = 256, 4, 256
EMBEDDING = Stats(var=1 - P, corr_seq=C.embedding_corr(vocab_size=32000, num_tables=3))


def test_stable_correlation_xavier():
  r, rg = M.stable_correlation(c1=2.2, c2=0.4, dropout=0.1)
  assert r == pytest.approx(0.88, abs=0.01)
  assert rg == pytest.approx(0.87, abs=0.01)
  r_exact, _ = M.stable_correlation(c1=2.2, c2=0.4, dropout=0.1, exact=True)
  assert r_exact == pytest.approx(r, abs=2e-3)


def test_stable_correlation_without_dropout_collapses():
  r, rg = M.stable_correlation(c1=2.2, c2=0.4, dropout=0.0)
  assert r > 0.99 and rg > 0.99


def test_block_constants():
  c1, c2 = M.block_constants(256, 0.1, 1 / 256, 2 / 256, 0.5 / 256, 0.25 / 256)
  assert c1 == pytest.approx(2 / 0.9)
  assert c2 == pytest.approx(2 * 0.5 * 0.25 / 0.9)


def test_ffn_unit_weight_var_relu_closed_form_and_gelu_unit_output():
  d = 256
  relu = M.ffn_unit_weight_var(d, 4 * d, 0.1)
  assert relu == pytest.approx(math.sqrt(0.9 / 2) / d)
  for activation in ('relu', 'gelu'):
    for input_var in (1.0, 2.5):
      w = M.ffn_unit_weight_var(d, 4 * d, 0.1, activation, input_var=input_var)
      out, _ = C.ffn_block(
        Stats(var=input_var, corr_seq=0.3),
        GradStats(),
        d=d,
        hidden=4 * d,
        p=0.1,
        w1_var=w,
        w2_var=w,
        activation=activation,
      )
      assert out.var == pytest.approx(1.0, rel=1e-9)
  assert M.ffn_unit_weight_var(d, 4 * d, 0.1, 'gelu') != pytest.approx(relu, rel=0.01)


def test_dslm_layer_correlations_recurrence():
  r_in, depth = 0.227, 24
  r = M.dslm_layer_correlations(depth, P, r_in)
  assert r[0] == pytest.approx(r_in * (1 - P))  # the stream entering layer 0
  lam2, beta2 = 1 - 2 / depth, 2 / depth
  expected, var = r_in * (1 - P), 1.0
  for n in range(depth):
    assert r[n] == pytest.approx(expected)
    expected = (lam2 * expected * var + beta2 * (1 - P)) / (lam2 * var + beta2)
    ffn = (1 - P) * (expected + (math.sqrt(1 - expected**2) - expected * math.acos(expected)) / math.pi)
    expected = lam2 * expected + beta2 * ffn
  assert np.all(np.diff(r) > 0) and r[-1] < 1 - P
  gelu = M.dslm_layer_correlations(depth, P, r_in, activation='gelu')
  assert not np.allclose(gelu, r)


def test_dslm_residual_scales():
  lam, beta = M.dslm_residual_scales(192)
  assert lam**2 + beta**2 == pytest.approx(1.0)
  assert beta**2 == pytest.approx(2 / 192)
  with pytest.raises(ValueError, match='depth'):
    M.dslm_residual_scales(2, k=2.0)


def _dslm(block, depth=192, **kwargs):
  lam, beta = M.dslm_residual_scales(depth)
  weights = M.dslm_weight_vars(depth, WIDTH, P, EMBEDDING.corr_seq)
  return M.propagate(
    depth=depth,
    width=WIDTH,
    num_heads=HEADS,
    seq_len=SEQ,
    dropout=P,
    block=block,
    skip_scale_attn=lam,
    branch_scale_attn=beta,
    skip_scale_ffn=lam,
    branch_scale_ffn=beta,
    weight_vars=weights,
    input=EMBEDDING,
    **kwargs,
  )


@pytest.mark.parametrize('block', ['preln', 'postln'])
def test_dslm_forward_moments_are_flat_over_192_layers(block):
  prop = _dslm(block)
  assert prop.stream_in.var == pytest.approx(1.0)
  np.testing.assert_allclose(prop.var, 1.0, rtol=0.01)


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('top_corr', [0.0, 0.5, 0.8])
def test_dslm_gradient_is_bounded(block, top_corr):
  # Appendix E.3/E.4: per layer the gradient variance changes by 1 + β²·(C6 − 1), C6 = rg/r, so over
  # the stack by e^{k(C6−1)}: bounded whatever the depth, but not flat unless rg ≈ r everywhere.
  prop = _dslm(block, output_grad=GradStats(var=1.0, corr_seq=top_corr))
  ratio = prop.grad_var / prop.grad_var[-1]
  assert np.all(ratio > math.exp(-2)) and np.all(ratio < math.exp(2))


def test_vanilla_preln_forward_variance_grows_linearly():
  depth = 96
  prop = M.propagate(depth=depth, width=WIDTH, num_heads=HEADS, seq_len=SEQ, dropout=P, input=EMBEDDING)
  var = prop.layer_var
  # Once the correlation has settled, every layer adds C1·r + C2 (Appendix E.1): var_n = var_0 + n·C3.
  c1, c2 = M.block_constants(WIDTH, P, 1 / WIDTH, 1 / WIDTH, 2 / (5 * WIDTH), 2 / (5 * WIDTH))
  r = prop.layer_corr_seq[-1]
  np.testing.assert_allclose(np.diff(var[depth // 2 :]), c1 * r + c2, rtol=0.02)
  n = np.arange(1, depth + 1)
  fit = np.polyval(np.polyfit(n, var, 1), n)
  assert 1 - np.sum((var - fit) ** 2) / np.sum((var - var.mean()) ** 2) > 0.999


def test_vanilla_preln_gradient_grows_towards_the_input():
  depth = 96
  prop = M.propagate(
    depth=depth,
    width=WIDTH,
    num_heads=HEADS,
    seq_len=SEQ,
    dropout=P,
    input=EMBEDDING,
    output_grad=GradStats(var=1.0, corr_seq=0.85),
  )
  g = prop.layer_grad_var
  assert np.all(np.diff(g) < 0)  # larger towards the input
  # Hyperbolic: log g falls linearly in log n with slope ≈ −C_g, C_g = (C1·(1−p)·rg + C2)/(C1·r + C2).
  n = np.arange(1, depth + 1)
  slope = np.polyfit(np.log(n[4:]), np.log(g[4:]), 1)[0]
  assert -1.3 < slope < -0.8


def test_vanilla_postln_gradient_changes_exponentially():
  depth = 96
  prop = M.propagate(
    depth=depth,
    width=WIDTH,
    num_heads=HEADS,
    seq_len=SEQ,
    dropout=P,
    block='postln',
    input=EMBEDDING,
    output_grad=GradStats(var=1.0, corr_seq=0.85),
  )
  np.testing.assert_allclose(prop.var, 1.0)
  log_g = np.log(prop.layer_grad_var)
  n = np.arange(depth)
  coeffs = np.polyfit(n[8:-8], log_g[8:-8], 1)
  residual = log_g[8:-8] - np.polyval(coeffs, n[8:-8])
  assert abs(coeffs[0]) * depth > 1.0  # changes by more than e over the stack
  assert np.max(np.abs(residual)) < 0.05 * abs(coeffs[0]) * depth


def test_propagate_sites_and_layer_views():
  prop = M.propagate(depth=3, width=64, num_heads=2, seq_len=32, dropout=0.0, causal=True)
  assert prop.var.shape == (6,) and prop.layer_var.shape == (3,)
  np.testing.assert_array_equal(prop.layer_grad_var, prop.grad_var[1::2])
  assert prop.depth == 3


@pytest.mark.parametrize(
  'kwargs, name',
  [
    (dict(depth=0), 'depth'),
    (dict(block='deepnorm'), 'block'),
    (dict(dropout=1.0), 'dropout'),
    (dict(num_heads=3), 'num_heads'),
    (dict(skip_scale_attn=np.ones(5)), 'skip_scale_attn'),
    (dict(weight_vars=dict(q=1.0, k=1.0, v=1.0, o=1.0, ffn1=1.0)), 'weight_vars'),
    (dict(weight_vars=dict(q=1.0, k=1.0, v=-1.0, o=1.0, ffn1=1.0, ffn2=1.0)), 'weight_vars'),
    (dict(activation='swish'), 'activation'),
    (dict(seq_len=1), 'seq_len'),
  ],
)
def test_propagate_rejects_invalid_arguments(kwargs, name):
  base = dict(depth=4, width=64, num_heads=4, seq_len=32)
  with pytest.raises(ValueError, match=name):
    M.propagate(**{**base, **kwargs})
