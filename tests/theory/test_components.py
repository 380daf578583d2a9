"""Known values, identities and argument checks of dsjax.theory.components (Kedia et al. 2024, App. A–B)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.theory import GradStats, Stats
from dsjax.theory import components as C

X = Stats(mean=0.0, var=1.0, corr_seq=0.4)
G = GradStats(var=2.0, corr_seq=0.3)


# --- Statistics and argument checks ------------------------------------------------------------------


@pytest.mark.parametrize(
  'kwargs, name',
  [
    (dict(var=0.0), 'var'),
    (dict(var=-1.0), 'var'),
    (dict(var=float('nan')), 'var'),
    (dict(corr_seq=1.5), 'corr_seq'),
    (dict(corr_hidden=-1.01), 'corr_hidden'),
    (dict(mean=float('inf')), 'mean'),
  ],
)
def test_stats_validation_names_the_field(kwargs, name):
  with pytest.raises(ValueError, match=name):
    Stats(**kwargs)


@pytest.mark.parametrize('kwargs, name', [(dict(var=0.0), 'var'), (dict(corr_seq=-2.0), 'corr_seq')])
def test_grad_stats_validation_names_the_field(kwargs, name):
  with pytest.raises(ValueError, match=name):
    GradStats(**kwargs)


@pytest.mark.parametrize(
  'call, name',
  [
    (lambda: C.dropout(X, G, p=1.0), 'p'),
    (lambda: C.dropout(X, G, p=-0.1), 'p'),
    (lambda: C.linear(X, G, d_in=0, d_out=4, w_var=1.0), 'd_in'),
    (lambda: C.linear(X, G, d_in=4, d_out=-3, w_var=1.0), 'd_out'),
    (lambda: C.linear(X, G, d_in=4, d_out=4, w_var=0.0), 'w_var'),
    (lambda: C.layernorm(X, G, d=0), 'd'),
    (lambda: C.softmax(X, G, length=1), 'length'),
    (lambda: C.attention_head(X, G, d_in=8, d_head=4, length=16, p=0.0, qk_var=-1.0, v_var=1.0), 'qk_var'),
    (lambda: C.attention_head(X, G, d_in=8, d_head=4, length=16, p=1.2, qk_var=1.0, v_var=1.0), 'p'),
    (
      lambda: C.attention_block(
        X, G, d=10, num_heads=3, length=16, p=0.1, q_var=0.1, k_var=0.1, v_var=0.1, o_var=0.1
      ),
      'num_heads',
    ),
    (
      lambda: C.attention_block(
        X, G, d=8, num_heads=2, length=16, p=0.1, q_var=0.1, k_var=0.1, v_var=0.1, o_var=0.0
      ),
      'o_var',
    ),
    (
      lambda: C.ffn_block(X, G, d=8, hidden=32, p=0.1, w1_var=0.1, w2_var=0.1, activation='tanh'),
      'activation',
    ),
    (lambda: C.ffn_block(X, G, d=8, hidden=0, p=0.1, w1_var=0.1, w2_var=0.1), 'hidden'),
    (lambda: C.embedding_corr(vocab_size=0, num_tables=3), 'vocab_size'),
    (lambda: C.relu(Stats(mean=1.0), G), 'mean'),
    (lambda: C.linear(1.0, G, d_in=4, d_out=4, w_var=1.0), 'x'),
  ],
)
def test_invalid_arguments_raise_value_error_naming_them(call, name):
  with pytest.raises(ValueError, match=name):
    call()


# --- Exact elementwise and linear formulas -----------------------------------------------------------


def test_linear_turns_the_mean_into_token_covariance():
  x = Stats(mean=2.0, var=1.0, corr_seq=0.5)
  out, g_in = C.linear(x, G, d_in=100, d_out=50, w_var=0.01)
  assert out.mean == 0.0
  assert out.var == pytest.approx(100 * 0.01 * (1 + 4))
  assert out.corr_seq == pytest.approx((0.5 + 4) / 5)
  assert out.corr_hidden == 0.0
  assert g_in.var == pytest.approx(50 * 0.01 * 2.0)
  assert g_in.corr_seq == pytest.approx(G.corr_seq)


def test_dropout_moments():
  x = Stats(mean=3.0, var=2.0, corr_seq=0.5, corr_hidden=0.1)
  out, g_in = C.dropout(x, G, p=0.25)
  assert out.mean == 3.0
  assert out.var == pytest.approx((2 + 0.25 * 9) / 0.75)
  assert out.cov_seq == pytest.approx(1.0)  # covariances are unchanged
  assert out.cov_hidden == pytest.approx(0.2)
  assert g_in.var == pytest.approx(2.0 / 0.75)
  assert g_in.corr_seq == pytest.approx(0.3 * 0.75)
  identity = C.dropout(x, G, p=0.0)
  assert identity == (x, G)


def test_relu_at_zero_correlation_uses_the_exact_formula():
  out, g_in = C.relu(Stats(var=1.0, corr_seq=0.0), GradStats(var=1.0, corr_seq=0.6))
  # (π·0 + sqrt(1) − 0·acos(0) − 1)/(π − 1) = 0.
  assert out.corr_seq == pytest.approx(0.0, abs=1e-15)
  assert out.mean == pytest.approx(1 / math.sqrt(2 * math.pi))
  assert out.var == pytest.approx((math.pi - 1) / (2 * math.pi))
  assert g_in.var == pytest.approx(0.5)
  assert g_in.corr_seq == pytest.approx(0.5 * 0.6)  # (1/2 + asin(0)/π)·rg


def test_relu_correlation_known_values_and_fit():
  r = 0.5
  exact = (math.pi * r + math.sqrt(1 - r * r) - r * math.acos(r) - 1) / (math.pi - 1)
  assert C.relu_corr(r) == pytest.approx(exact)
  assert C.relu_corr(1.0) == pytest.approx(1.0)
  assert C.relu_corr(r, exact=False) == pytest.approx(0.7 * r + 0.3 * r * r)
  grid = np.linspace(0, 1, 101)
  assert np.max(np.abs(C.relu_corr(grid) - C.relu_corr(grid, exact=False))) < 0.03
  out, _ = C.relu(Stats(var=2.0, corr_seq=r), G)
  assert out.corr_seq == pytest.approx(exact)


@pytest.mark.parametrize('s2', [0.1, 1.0, 10.0])
def test_gelu_is_self_consistent(s2):
  out, g_in = C.gelu(Stats(var=s2, corr_seq=1.0), GradStats(var=1.0, corr_seq=1.0))
  assert out.corr_seq == pytest.approx(1.0)  # covariance at r = 1 is the variance
  assert g_in.corr_seq == pytest.approx(1.0)
  assert out.mean == pytest.approx(s2 / math.sqrt(2 * math.pi * (s2 + 1)))
  assert C.gelu_second_moment(s2) == pytest.approx(out.var + out.mean**2)


def test_gelu_large_variance_approaches_relu():
  gelu_out, gelu_g = C.gelu(Stats(var=1e6, corr_seq=0.3), G)
  relu_out, relu_g = C.relu(Stats(var=1e6, corr_seq=0.3), G)
  assert gelu_out.var == pytest.approx(relu_out.var, rel=1e-3)
  assert gelu_out.corr_seq == pytest.approx(relu_out.corr_seq, rel=1e-3)
  assert gelu_g.var == pytest.approx(relu_g.var, rel=1e-3)


@pytest.mark.parametrize('exact', [True, False])
def test_layernorm_output_variance_is_one(exact):
  out, g_in = C.layernorm(Stats(mean=5.0, var=4.0, corr_seq=0.5), G, d=100, exact=exact)
  assert out.mean == 0.0 and out.var == 1.0
  assert out.corr_hidden == pytest.approx(-1 / 99)
  if exact:
    assert out.corr_seq == pytest.approx(0.5 * (1 - 0.75 / (2 * 99)))
    assert g_in.var == pytest.approx(2.0 / 4.0 * 98 / 97)
  else:
    assert out.corr_seq == pytest.approx(0.5 * (1 - 1 / 100))
    assert g_in.var == pytest.approx(2.0 / 4.0)
    assert g_in.corr_seq == pytest.approx(G.corr_seq)


# --- Softmax -----------------------------------------------------------------------------------------


def test_softmax_quadrature_is_exact_for_uniform_and_two_logits():
  m = C.softmax_moments(0.0, 7)
  assert m['m2'] == pytest.approx(1 / 49)
  # Two logits: P_1 = sigmoid(δ1 − δ2), δ1 − δ2 ~ N(0, 2σ²); compare with direct quadrature.
  z, w = np.polynomial.hermite.hermgauss(200)
  sigmoid = 1 / (1 + np.exp(-math.sqrt(2) * math.sqrt(2.0) * z))
  direct = np.sum(w * sigmoid**2) / math.sqrt(math.pi)
  assert C.softmax_moments(1.0, 2)['m2'] == pytest.approx(direct, rel=1e-8)


def test_softmax_forms_agree_in_their_regime_and_outputs_sum_to_one():
  x, g = Stats(var=0.01, corr_seq=0.2), GradStats(var=1.0, corr_seq=0.0)
  L = 5000
  outs = {form: C.softmax(x, g, length=L, form=form) for form in C.SOFTMAX_FORMS}
  for out, g_in in outs.values():
    assert out.mean == pytest.approx(1 / L)
    assert out.corr_seq == pytest.approx(-1 / (L - 1))
    assert g_in.corr_seq == pytest.approx(-1 / (L - 1))
  base_out, base_g = outs['quadrature']
  for out, g_in in outs.values():
    assert out.var == pytest.approx(base_out.var, rel=2e-3)
    assert g_in.var == pytest.approx(base_g.var, rel=2e-3)
  # Only the independent part of the entries matters, and the incoming gradient's shared part cancels.
  _, g_corr = C.softmax(x, GradStats(var=1.0, corr_seq=0.5), length=L)
  assert g_corr.var == pytest.approx(0.5 * base_g.var)
  assert C.softmax(Stats(var=0.02, corr_seq=0.6), g, length=L)[0].var == pytest.approx(
    C.softmax(Stats(var=0.008, corr_seq=0.0), g, length=L)[0].var
  )


# --- Embeddings --------------------------------------------------------------------------------------


def test_zipf_embedding_correlation_bert():
  assert C.embedding_corr(vocab_size=32000, num_tables=3) == pytest.approx(0.227, abs=5e-4)
  assert C.embedding_corr(vocab_size=32000, num_tables=3, exact=True) == pytest.approx(0.227, abs=1e-3)


def test_zipf_embedding_correlation_gpt_and_dropout():
  r_word = math.pi**2 / (6 * math.log(50257) ** 2)
  assert C.embedding_corr(vocab_size=50257, num_tables=2) == pytest.approx(r_word / 2)
  stats = C.embedding(vocab_size=50257, num_tables=2, table_var=0.45, p=0.1)
  assert stats.var == pytest.approx(1.0)
  assert stats.corr_seq == pytest.approx(r_word / 2 * 0.9)


# --- Attention ---------------------------------------------------------------------------------------


def test_attention_head_paper_form_is_appendix_a8():
  s2, r, p, L, d_in, d_head, qk, v, g2, rg = 1.0, 0.3, 0.2, 300, 100, 32, 0.003, 0.01, 2.0, 0.4
  out, g_in = C.attention_head(
    Stats(var=s2, corr_seq=r),
    GradStats(var=g2, corr_seq=rg),
    d_in=d_in,
    d_head=d_head,
    length=L,
    p=p,
    qk_var=qk,
    v_var=v,
    form='paper',
  )
  a = d_in * s2 * qk**2
  var = (
    (L - 1) * (1 - r) ** 2 * a * s2**2
    + math.exp((1 - r) * d_in * a * s2) * (4 * (1 - r) ** 2 * a * s2**2 + (1 - r) * s2) / (1 - p)
  ) / L + r * s2
  cov = r * s2 + (2 * (1 - r) ** 2 * a * s2**2 + (1 - r) * s2) / L
  assert out.var == pytest.approx(d_in * v * var)
  assert out.cov_seq == pytest.approx(d_in * v * cov)
  assert g_in.var == pytest.approx(g2 * d_head * v * (1 + (L - 1) * rg * (1 - p)) / (L * (1 - p)))
  assert g_in.cov_seq == pytest.approx(g2 * d_head * v * (1 + (L - 1) * rg) / L)


def test_attention_head_forms_agree_for_uniform_attention():
  x, g = Stats(var=1.0, corr_seq=0.5), GradStats(var=1.0, corr_seq=0.5)
  kw = dict(d_in=256, d_head=64, length=512, p=0.0, qk_var=1e-6, v_var=1 / 256)
  exact, paper = C.attention_head(x, g, **kw), C.attention_head(x, g, **kw, form='paper')
  assert exact[0].var == pytest.approx(paper[0].var, rel=1e-6)
  assert exact[1].var == pytest.approx(paper[1].var, rel=1e-5)


def test_attention_head_gradient_through_the_softmax_matters():
  # Uncorrelated gradients, L >> d_in: the query path σδ²·h·Mᵀ dominates the value path (Table 21's
  # 44.5% error of the paper's gradient formula).
  x, g = Stats(var=1.0, corr_seq=0.0), GradStats(var=1.0, corr_seq=0.0)
  kw = dict(d_in=100, d_head=32, length=1000, p=0.0, qk_var=0.6 / 100, v_var=1 / 100)
  exact = C.attention_head(x, g, **kw)[1].var
  paper = C.attention_head(x, g, **kw, form='paper')[1].var
  assert exact > 2 * paper


def test_causal_attention_with_uniform_weights():
  # qk → 0: position t averages t+1 tokens; key u collects 1/(t+1) from every query t ≥ u.
  L, d_in, d_head, v = 64, 128, 32, 0.02
  out, g_in = C.attention_head(
    Stats(var=1.0, corr_seq=0.0),
    GradStats(var=1.0, corr_seq=0.0),
    d_in=d_in,
    d_head=d_head,
    length=L,
    p=0.0,
    qk_var=1e-8,
    v_var=v,
    causal=True,
  )
  n = np.arange(1, L + 1)
  assert out.var == pytest.approx(d_in * v * np.mean(1 / n), rel=1e-6)
  suffix = np.cumsum((1 / n**2)[::-1])[::-1]
  assert g_in.var == pytest.approx(d_head * v * np.mean(suffix), rel=1e-6)
  # Two positions share min(n_t, n_t') keys: covariance averages 1/max(n_t, n_t') over pairs.
  pairs = L * (L - 1)
  assert out.cov_seq == pytest.approx(d_in * v * 2 * np.sum((n - 1) / n) / pairs, rel=1e-6)


def test_softmax_key_weight_is_zero_for_one_key_and_exact_for_uniform_logits():
  # n²·E[P_1²·|e_1 − P|²]: a softmax over one key is constant; uniform logits give 1 − 1/n.
  n = np.array([1, 2, 5, 40, 200])
  np.testing.assert_allclose(C._softmax_key_weight(0.0, n), 1 - 1 / n, rtol=1e-12)
  assert C._softmax_key_weight(0.8, 1) == 0.0
  # Toward many keys it tends to n²E[P²] (the key's own term dominates).
  assert C._softmax_key_weight(0.8, 4000) == pytest.approx(C._softmax_e2(0.8, 4000), rel=2e-3)


@pytest.mark.parametrize('causal', [True, False])
def test_attention_gradient_through_the_logits_matches_sampling(causal):
  # Logits of variance ~0.9 and uncorrelated tokens, where the logit paths are a third of the gradient:
  # plain jnp, jax.vjp, 4000 draws of inputs and weights (sampling error ~1%).
  L, d_in, d_head, r = 16, 32, 8, 0.1
  mask = jnp.tril(jnp.ones((L, L), bool)) if causal else jnp.ones((L, L), bool)

  def grad_energy(key):
    k = jax.random.split(key, 6)
    x = math.sqrt(r) * jax.random.normal(k[0], (1, d_in)) + math.sqrt(1 - r) * jax.random.normal(
      k[1], (L, d_in)
    )
    wq, wk, wv = (jax.random.normal(k[i], (d_in, d_head)) / math.sqrt(d_in) for i in (2, 3, 4))
    head = lambda x: (
      jax.nn.softmax(jnp.where(mask, (x @ wq) @ (x @ wk).T / math.sqrt(d_head), -jnp.inf)) @ (x @ wv)
    )  # noqa: E731
    (gx,) = jax.vjp(head, x)[1](jax.random.normal(k[5], (L, d_head)))
    return (gx**2).mean()

  sampled = float(
    jax.lax.map(jax.jit(grad_energy), jax.random.split(jax.random.PRNGKey(0), 4000), batch_size=500).mean()
  )
  _, g_in = C.attention_head(
    Stats(var=1.0, corr_seq=r),
    GradStats(),
    d_in=d_in,
    d_head=d_head,
    length=L,
    p=0.0,
    qk_var=1 / d_in,
    v_var=1 / d_in,
    causal=causal,
  )
  assert g_in.var == pytest.approx(sampled, rel=0.04)


def test_causal_attention_first_position_sees_itself_only():
  # L = 2 with dropout: position 0 outputs ξ·x_0·Wv exactly.
  x, g = Stats(var=1.0, corr_seq=0.0), GradStats()
  out, _ = C.attention_head(x, g, d_in=64, d_head=16, length=2, p=0.5, qk_var=1e-8, v_var=1 / 64, causal=True)
  position0 = 1.0 / 0.5
  position1 = C._softmax_e2(1e-20, 2) * 1.0 / (2 * 0.5)
  assert out.var == pytest.approx((position0 + position1) / 2, rel=1e-5)


def test_attention_block_simple_form_is_table_2_with_the_dropout_correction():
  d, p, v, o, r, s2, rg, g2 = 256, 0.1, 1 / 256, 2 / 256, 0.6, 1.0, 0.7, 1.0
  out, g_in = C.attention_block(
    Stats(var=s2, corr_seq=r),
    GradStats(var=g2, corr_seq=rg),
    d=d,
    num_heads=4,
    length=100000,
    p=p,
    q_var=1 / d,
    k_var=1 / d,
    v_var=v,
    o_var=o,
    form='simple',
  )
  c1 = d * d * v * o / (1 - p)
  assert out.var == pytest.approx(c1 * r * s2)
  assert out.corr_seq == pytest.approx(1 - p)
  assert g_in.var == pytest.approx(c1 * (1 - p) * rg * g2, rel=1e-3)
  assert g_in.corr_seq == pytest.approx(1.0, abs=1e-3)


def test_ffn_block_relu_table_2():
  d, p, w1, w2, r, s2, rg = 64, 0.1, 1 / 64, 0.5 / 64, 0.3, 2.0, 0.5
  out, g_in = C.ffn_block(
    Stats(var=s2, corr_seq=r), GradStats(var=1.0, corr_seq=rg), d=d, hidden=4 * d, p=p, w1_var=w1, w2_var=w2
  )
  c2 = 2 * d * d * w1 * w2 / (1 - p)
  assert out.var == pytest.approx(c2 * s2)
  assert out.corr_seq == pytest.approx((1 - p) * (r + (math.sqrt(1 - r * r) - r * math.acos(r)) / math.pi))
  assert g_in.var == pytest.approx(c2)
  assert g_in.corr_seq == pytest.approx((1 - p) * (0.5 + math.asin(r) / math.pi) * rg)
  fit, _ = C.ffn_block(
    Stats(var=s2, corr_seq=r), G, d=d, hidden=4 * d, p=p, w1_var=w1, w2_var=w2, exact=False
  )
  assert fit.corr_seq == pytest.approx(
    (1 - p) * (1 / math.pi + r / 2 + (0.5 - 1 / math.pi) * r * r), abs=0.01
  )


def test_layernorm_random_fraction_zero_is_the_large_d_form():
  x, g = Stats(var=2.0, corr_seq=0.3), GradStats(var=3.0, corr_seq=0.4)
  _, g0 = C.layernorm(x, g, d=32, random_fraction=0.0)
  assert g0.var == pytest.approx(3.0 / 2.0)  # the paper's form
  assert g0.cov_seq == pytest.approx(g.cov_seq / 2.0)
  with pytest.raises(ValueError, match='random_fraction'):
    C.layernorm(x, g, d=32, random_fraction=1.5)


def _simulate_post_ln_backward(d, rho, n=60_000, corr=0.5, seed=0):
  """LayerNorm backward at a Post-LN add s = λ·x + β·h, per pair of tokens: x LayerNorm outputs (norm
  exactly sqrt(d)), h Gaussian, the incoming gradient orthogonal to 1 and x̂; λ² = 1 − ρ, β² = ρ,
  var(h) = 1 (s2 = 1). Returns (var_in / var_out, cov_in / cov_out) of the gradient."""
  rng = np.random.default_rng(seed)
  centre = lambda a: a - a.mean(-1, keepdims=True)  # noqa: E731

  def pair():  # Two token vectors with correlation `corr`.
    z = rng.standard_normal((n, d))
    return z, math.sqrt(corr) * z + math.sqrt(1 - corr) * rng.standard_normal((n, d))

  xs = [centre(v) * 1.0 for v in pair()]
  xs = [v * math.sqrt(d) / np.linalg.norm(v, axis=-1, keepdims=True) for v in xs]
  hs = pair()
  gs = [centre(v) for v in pair()]
  grads_in = []
  for x, h, g in zip(xs, hs, gs):
    x_hat = x / math.sqrt(d)
    g -= (g * x_hat).sum(-1, keepdims=True) * x_hat
    s_c = centre(math.sqrt(1 - rho) * x + math.sqrt(rho) * h)
    s_hat = s_c / np.linalg.norm(s_c, axis=-1, keepdims=True)
    sigma = np.sqrt((s_c**2).mean(-1, keepdims=True))
    grads_in.append((g - (g * s_hat).sum(-1, keepdims=True) * s_hat) / sigma)
  var_ratio = (grads_in[0] ** 2).mean() / (gs[0] ** 2).mean()
  cov_ratio = (grads_in[0] * grads_in[1]).mean() / (gs[0] * gs[1]).mean()
  return var_ratio, cov_ratio


@pytest.mark.parametrize('d,rho', [(32, 0.04), (32, 0.5), (64, 0.1)])
def test_layernorm_backward_of_a_post_ln_add_matches_simulation(d, rho):
  """The finite-d excess of a Post-LN LayerNorm's backward (var and covariance) against simulation, to
  15% of the excess itself; the Gaussian-input form (d−2)/(d−3) is far off for small ρ."""
  var_ratio, cov_ratio = _simulate_post_ln_backward(d, rho)
  g = GradStats(var=1.0, corr_seq=0.5)
  _, g_in = C.layernorm(Stats(var=1.0, corr_seq=0.5), g, d=d, random_fraction=rho)
  assert (g_in.var - 1) == pytest.approx(var_ratio - 1, rel=0.15)
  assert (g_in.cov_seq / g.cov_seq - 1) == pytest.approx(cov_ratio - 1, rel=0.15)
  if rho < 0.2:
    gaussian_excess = C.layernorm(Stats(var=1.0, corr_seq=0.5), g, d=d)[1].var - 1
    assert abs(gaussian_excess - (var_ratio - 1)) > 0.3 * (var_ratio - 1)
