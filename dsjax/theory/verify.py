"""Monte Carlo check of `dsjax.theory.components` against simulation: the paper's Table 21.

    python -m dsjax.theory.verify [--quick] [--out DIR] [--only linear,relu,...] [--seed 0]

For every component, configurations are drawn from a grid over the ranges of the paper's Table 22
(Kedia et al. 2024; the values per parameter follow the paper's released scripts), each configuration
is simulated in JAX, and the measured moments are compared with `components.*`. Printed: the
50/90/99th-percentile % error per component and statistic, next to the paper's Table 21. `--out`
writes `verify.json`, {component: {statistic: [p50, p90, p99]}} (plus `verify_records.json`, every
configuration); entries named "component[form]" are the paper's own formulas (or the ReLU polynomial
fit) evaluated on the same simulations, where they differ from the default form. Components beyond
Table 21: the causal single head, the attention block (multi-head, output projection, dropout) and its
causal variant, and the FFN block (ReLU and GeLU). The full run takes ~7 minutes on the 2-core CPU,
`--quick` ~30 seconds.

Simulation. Inputs have the requested mean, variance and token correlation: x_t = mu + sqrt(r·s2)·c +
sqrt((1−r)·s2)·δ_t with c shared by the tokens of a sample and δ_t i.i.d.; the gradient arriving at the
output is injected the same way (variance g2, token correlation rg) as the cotangent of `jax.vjp`.
Weights are i.i.d. N(0, var); dropout masks are exact Bernoulli (p quantised to k/65536). Moments are
pooled over samples, tokens and hidden units.

Variance reduction keeps every single sample's distribution exact and the estimates unbiased: the
shared parts c, c' are stratified (Sobol points or a Latin hypercube), and each weight matrix's norms
along the input's token average and the output's shared directions are stratified across weight draws
(`gaussian_matrices`). Error: the paper's definition, from its released scripts (|m − p|/|m| for
variances; see `percent_error`); the k-th percentile of n sorted errors is element int(n·k/100).

The full run's table, set beside Table 21, the paper's own formulas on the same simulations, and what
they leave out: docs/theory.md, "Checking the formulas". `experiments/table21.py` compares the theories.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np
from scipy import special, stats
from scipy.stats import qmc

from dsjax.theory import components as C

STATISTICS = ('mean', 'var', 'grad_var', 'cov_seq', 'grad_cov_seq', 'cov_hidden')

# Table 21 of the paper (and, for the LayerNorm hidden-dimension covariance, the released simulation
# output). "FFN" in the paper is the Linear layer.
PAPER_TABLE21 = {
  'linear': {
    'mean': [0.0, 0.4, 1.3],
    'var': [0.4, 1.4, 2.8],
    'grad_var': [0.2, 1.0, 2.2],
    'cov_seq': [0.4, 1.4, 2.8],
    'grad_cov_seq': [0.2, 1.0, 2.2],
  },
  'relu': {
    'mean': [0.3, 1.3, 2.3],
    'var': [0.5, 1.9, 3.4],
    'grad_var': [0.6, 1.5, 2.6],
    'cov_seq': [0.3, 1.6, 3.1],
    'grad_cov_seq': [0.2, 1.1, 2.3],
  },
  'gelu': {
    'mean': [0.1, 1.0, 2.4],
    'var': [0.2, 0.6, 1.3],
    'grad_var': [0.2, 0.6, 1.1],
    'cov_seq': [0.1, 0.5, 1.2],
    'grad_cov_seq': [0.1, 0.4, 0.9],
  },
  'layernorm': {
    'mean': [0.0, 0.0, 0.0],
    'var': [0.0, 0.0, 0.0],
    'grad_var': [0.4, 1.5, 3.2],
    'cov_seq': [0.1, 0.5, 1.0],
    'grad_cov_seq': [0.2, 0.9, 2.2],
    'cov_hidden': [0.0, 0.0, 0.0],
  },
  'dropout': {
    'mean': [0.0, 0.1, 0.5],
    'var': [0.1, 0.5, 1.5],
    'grad_var': [0.1, 0.7, 1.5],
    'cov_seq': [0.0, 0.4, 1.3],
    'grad_cov_seq': [0.1, 0.5, 1.2],
  },
  'softmax': {'mean': [0.0, 0.0, 0.0], 'var': [0.2, 0.9, 4.0], 'grad_var': [0.1, 0.6, 4.5]},
  'attention_head': {
    'mean': [0.2, 1.0, 2.5],
    'var': [1.4, 4.1, 7.8],
    'grad_var': [2.2, 13.3, 44.5],
    'cov_seq': [1.3, 3.9, 7.4],
    'grad_cov_seq': [1.6, 4.5, 8.2],
  },
}

_CHUNK_FLOATS = 1 << 23  # elements of the largest array of one simulation chunk (32 MB in float32)
_P_BITS = 65536  # dropout masks compare uint16 random bits with round(p·65536)


# ----------------------------------------------------------------------------------------------------
# Errors and percentiles.


def percent_error(measured: float, predicted: float, scale: float | None = None) -> float:
  """The paper's error (its released `calc_err`), in percent."""
  measured, predicted = float(measured), float(predicted)
  tiny = 1e-300
  if scale is None:
    return 100 * abs(measured - predicted) / max(abs(measured), tiny)
  if predicted == 0:
    return 100 * min(abs(measured), abs(measured) / scale)
  diff = abs(measured - predicted)
  return 100 * min(diff / max(abs(measured), tiny), diff / scale)


def percentiles(errors) -> list[float]:
  """[p50, p90, p99] with the paper's convention: sorted errors, element int(n·k/100)."""
  errors = np.sort(np.asarray(errors, np.float64))
  n = len(errors)
  return [float(errors[min(n - 1, int(n * k / 100))]) for k in (50, 90, 99)]


# ----------------------------------------------------------------------------------------------------
# Simulation kernels (JAX). Imported lazily so that `dsjax.theory` itself never needs JAX.


def _jax():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return jax, jnp


@functools.cache
def _kernels():
  """Builds the jitted simulation kernels once (shapes are static arguments)."""
  jax, jnp = _jax()

  def draw(key, shared, shape, mean, var, corr):
    """mean + sqrt(corr·var)·shared (broadcast over the token axis −2) + sqrt((1−corr)·var)·noise."""
    noise = jax.random.normal(key, shape, jnp.float32)
    return mean + jnp.sqrt(corr * var) * shared[..., None, :] + jnp.sqrt((1 - corr) * var) * noise

  def keep_mask(key, shape, threshold):
    bits = jax.random.bits(key, shape, jnp.uint16).astype(jnp.int32)
    return bits >= threshold.astype(jnp.int32), _P_BITS / (_P_BITS - threshold)

  def moments(z):
    """[mean, E(z−z̄)², token covariance, hidden covariance] of z: (..., L, D), pooled."""
    L, D = z.shape[-2:]
    n = float(z.size)
    mean = jnp.mean(z)
    z = z - mean
    total = jnp.sum(jnp.sum(z * z, axis=-1))
    col = jnp.sum(z, axis=-2)
    tok = (jnp.sum(col * col) - total) / (n * (L - 1))
    if D > 1:
      row = jnp.sum(z, axis=-1)
      hid = (jnp.sum(row * row) - total) / (n * (D - 1))
    else:
      hid = jnp.zeros(())
    return jnp.stack([mean, total / n, tok, hid])

  def unit(v):
    """v/‖v‖ over the last axis; e_0 where v = 0 (any fixed direction keeps the draw exact)."""
    norm = jnp.linalg.norm(v, axis=-1, keepdims=True)
    e0 = jnp.zeros_like(v).at[..., 0].set(1.0)
    return jnp.where(norm > 1e-30, v / jnp.maximum(norm, 1e-30), e0)

  def gaussian_matrices(key, shape, a, bs, strata):
    """bw matrices with i.i.d. N(0, 1) entries, stratified along input direction a and output
    directions bs across the configuration.

    With a unit (bw, n_in) and bs orthonormal (bw, k, n_out), independent of Z:
      Z = Z⊥ + a·ζᵀ + Σ_k η_k·b_kᵀ + Σ_k s_k·a·b_kᵀ,
    Z⊥ ⟂ a and ⟂ every b_k, ζ ⟂ every b_k, η_k ⟂ a, s_k = aᵀZb_k: independent Gaussian pieces.
    Replacing ‖ζ‖ (χ, n_out−k dof), each ‖η_k‖ (χ, n_in−1 dof) and each s_k (normal) by independent
    draws of the same laws leaves Z exactly i.i.d. N(0, 1); drawing them from strata (`strata`:
    (bw, 1 + 2k): ‖ζ‖, then ‖η_k‖, s_k per k) removes the chi-square noise of ‖aᵀW‖² (the variance a
    shared input direction gets), of aᵀW·b_k (the output mean, b = 1/sqrt(n)) and of ‖W b_k‖² (the
    variance a shared gradient direction gets).
    """
    z = jax.random.normal(key, shape, jnp.float32)
    k = bs.shape[1]
    az = jnp.einsum('wi,wio->wo', a, z)
    zb = jnp.einsum('wio,wko->wik', z, bs)
    s0 = jnp.einsum('wik,wi->wk', zb, a)
    zeta = az - jnp.einsum('wk,wko->wo', s0, bs)
    eta = zb - s0[:, None, :] * a[:, :, None]
    z_perp = (
      z
      - a[:, :, None] * az[:, None, :]
      - jnp.einsum('wik,wko->wio', zb, bs)
      + a[:, :, None] * jnp.einsum('wk,wko->wo', s0, bs)[:, None, :]
    )
    zeta = zeta * (strata[:, 0] / jnp.maximum(jnp.linalg.norm(zeta, axis=-1), 1e-30))[:, None]
    eta = eta * (strata[:, 1 : 1 + 2 * k : 2] / jnp.maximum(jnp.linalg.norm(eta, axis=1), 1e-30))[:, None, :]
    s_new = strata[:, 2 : 2 + 2 * k : 2]
    return (
      z_perp
      + a[:, :, None] * zeta[:, None, :]
      + jnp.einsum('wik,wko->wio', eta, bs)
      + a[:, :, None] * jnp.einsum('wk,wko->wo', s_new, bs)[:, None, :]
    )

  def out_directions(cg, bw, n_out):
    """Orthonormal output directions: all-ones (the output mean) and the shared gradient part."""
    ones = unit(jnp.ones((n_out,), jnp.float32))
    gradient = unit(cg[0] - jnp.dot(cg[0], ones) * ones)
    return jnp.broadcast_to(jnp.stack([ones, gradient]), (bw, 2, n_out))

  def per_weight(fn, x, g, ws, n_grad):
    """Outputs of fn(x, w) for every weight draw w and input gradients (vjp with cotangent g) for the
    first n_grad draws (the gradient moments need fewer draws than the output mean)."""

    def both(w):
      y, vjp = jax.vjp(lambda z: fn(z, w), x)
      return y, vjp(g)[0]

    head = jax.tree.map(lambda t: t[:n_grad], ws)
    tail = jax.tree.map(lambda t: t[n_grad:], ws)
    y, gin = jax.vmap(both)(head)
    n_tail = jax.tree.leaves(tail)[0].shape[0]
    if n_tail:
      y = jnp.concatenate([y, jax.vmap(lambda w: fn(x, w))(tail)])
    return y, gin

  def in_direction(x, bw):
    """Unit vector of the token average of the input: its shared part (mean included) plus the
    average of the independent parts — what every output token carries."""
    a = unit(jnp.mean(x, axis=0))
    return jnp.broadcast_to(a, (bw,) + a.shape)

  static = functools.partial(jax.jit, static_argnames=('shape',))

  # Each chunk holds one input draw (x: (1, L, d), its shared parts c, c': (1, d)) and `bw` weight draws.

  @static
  def linear(key, c, cg, strata, theta, *, shape):
    bw, n_grad, L, d_in, d_out = shape
    mean, s2, r, w_std, g2, rg = theta
    kx, kg, kw = jax.random.split(key, 3)
    x = draw(kx, c, (1, L, d_in), mean, s2, r)[0]
    g = draw(kg, cg, (1, L, d_out), 0.0, g2, rg)[0]
    w = w_std * gaussian_matrices(
      kw, (bw, d_in, d_out), in_direction(x, bw), out_directions(cg, bw, d_out), strata
    )
    y, gin = per_weight(lambda z, wb: z @ wb, x, g, w, n_grad)
    return jnp.stack([moments(y), moments(gin)])

  @static
  def elementwise(key, c, cg, theta, *, shape):
    b, L, d, kind = shape
    mean, s2, r, g2, rg, threshold = theta
    kx, kg, km = jax.random.split(key, 3)
    x = draw(kx, c, (b, L, d), mean, s2, r)
    g = draw(kg, cg, (b, L, d), 0.0, g2, rg)
    if kind == 'relu':
      fn = jax.nn.relu
    elif kind == 'gelu':
      fn = lambda z: jax.nn.gelu(z, approximate=False)
    elif kind == 'layernorm':

      def fn(z):
        centred = z - jnp.mean(z, axis=-1, keepdims=True)
        return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-6)
    elif kind == 'dropout':
      keep, scale = keep_mask(km, (b, L, d), threshold)
      fn = lambda z: jnp.where(keep, z * scale, 0.0)
    else:
      raise ValueError(kind)
    y, vjp = jax.vjp(fn, x)
    return jnp.stack([moments(y), moments(vjp(g)[0])])

  @static
  def softmax(key, c, cg, theta, *, shape):
    b, L = shape
    s2, r, g2, rg = theta
    kx, kg = jax.random.split(key)
    # The softmax axis plays the role of the token axis: shapes (b, L, 1).
    x = draw(kx, c, (b, L, 1), 0.0, s2, r)[..., 0]
    g = draw(kg, cg, (b, L, 1), 0.0, g2, rg)[..., 0]
    y, vjp = jax.vjp(lambda z: jax.nn.softmax(z, axis=-1), x)
    return jnp.stack([moments(y[..., None]), moments(vjp(g)[0][..., None])])

  def attention(x, keep, scale, wq, wk, wv, causal):
    """Multi-head attention of one sample. x: (L, d); w*: (d, H, K); keep: (H, L, L)."""
    L = x.shape[0]
    q = jnp.einsum('ld,dhk->hlk', x, wq)
    k = jnp.einsum('ld,dhk->hlk', x, wk)
    v = jnp.einsum('ld,dhk->hlk', x, wv)
    logits = jnp.einsum('hlk,hmk->hlm', q, k) / math.sqrt(q.shape[-1])
    if causal:
      logits = jnp.where(jnp.tril(jnp.ones((L, L), bool)), logits, -jnp.inf)
    probs = jnp.where(keep, jax.nn.softmax(logits, axis=-1) * scale, 0.0)
    return jnp.einsum('hlm,hmk->lhk', probs, v)

  @static
  def attention_head(key, c, cg, strata, theta, *, shape):
    bw, n_grad, L, d_in, d_head, causal = shape
    s2, r, qk_std, v_std, threshold, g2, rg = theta
    kx, kg, km, kq, kv = jax.random.split(key, 5)
    x = draw(kx, c, (1, L, d_in), 0.0, s2, r)[0]
    g = draw(kg, cg, (1, L, d_head), 0.0, g2, rg)[0]
    keep, scale = keep_mask(km, (1, L, L), threshold)
    wqk = qk_std * jax.random.normal(kq, (bw, 2, d_in, 1, d_head), jnp.float32)
    wv = v_std * gaussian_matrices(
      kv, (bw, d_in, d_head), in_direction(x, bw), out_directions(cg, bw, d_head), strata
    )
    fn = lambda z, wb: attention(z, keep, scale, wb[0][0], wb[0][1], wb[1][:, None, :], causal)[:, 0]
    y, gin = per_weight(fn, x, g, (wqk, wv), n_grad)
    return jnp.stack([moments(y), moments(gin)])

  @static
  def attention_block(key, c, cg, strata, theta, *, shape):
    bw, n_grad, L, d, heads, causal = shape
    s2, r, qk_std, v_std, o_std, threshold_attn, threshold, g2, rg = theta
    kx, kg, ka, ko, kq, kv, kw = jax.random.split(key, 7)
    x = draw(kx, c, (1, L, d), 0.0, s2, r)[0]
    g = draw(kg, cg, (1, L, d), 0.0, g2, rg)[0]
    keep_attn, scale_attn = keep_mask(ka, (heads, L, L), threshold_attn)
    keep_out, scale_out = keep_mask(ko, (L, d), threshold)
    wqk = qk_std * jax.random.normal(kq, (bw, 2, d, d), jnp.float32)
    a = in_direction(x, bw)
    # Value projection stratified along the token average of the input; output projection along what
    # the value projection made of it (input side) and along the output mean and shared gradient.
    wv_unit = gaussian_matrices(kv, (bw, d, d), a, jnp.zeros((bw, 0, d)), strata[:, :1])
    a_out = unit(jnp.einsum('wi,wio->wo', a, wv_unit))
    wo = o_std * gaussian_matrices(kw, (bw, d, d), a_out, out_directions(cg, bw, d), strata[:, 1:])
    split = lambda m: m.reshape(d, heads, d // heads)

    def block(z, wb):
      w_qk, w_v, w_o = wb
      heads_out = attention(z, keep_attn, scale_attn, split(w_qk[0]), split(w_qk[1]), split(w_v), causal)
      return jnp.where(keep_out, heads_out.reshape(L, d) @ w_o * scale_out, 0.0)

    y, gin = per_weight(block, x, g, (wqk, v_std * wv_unit, wo), n_grad)
    return jnp.stack([moments(y), moments(gin)])

  @static
  def ffn_block(key, c, cg, strata, theta, *, shape):
    bw, n_grad, L, d, hidden, activation = shape
    s2, r, w1_std, w2_std, threshold, g2, rg = theta
    kx, kg, km, k1, k2 = jax.random.split(key, 5)
    x = draw(kx, c, (1, L, d), 0.0, s2, r)[0]
    g = draw(kg, cg, (1, L, d), 0.0, g2, rg)[0]
    keep, scale = keep_mask(km, (L, d), threshold)
    act = jax.nn.relu if activation == 'relu' else (lambda z: jax.nn.gelu(z, approximate=False))
    w1 = w1_std * gaussian_matrices(
      k1, (bw, d, hidden), in_direction(x, bw), jnp.zeros((bw, 0, hidden)), strata[:, :1]
    )
    # The second matrix sees the token average of the activations (which carries the activation
    # mean): stratify along it, and along the output mean and the shared gradient.
    a2 = unit(jnp.mean(act(jnp.einsum('ld,wdh->wlh', x, w1)), axis=1))
    w2 = w2_std * gaussian_matrices(k2, (bw, hidden, d), a2, out_directions(cg, bw, d), strata[:, 1:])
    fn = lambda z, wb: jnp.where(keep, act(z @ wb[0]) @ wb[1] * scale, 0.0)
    y, gin = per_weight(fn, x, g, (w1, w2), n_grad)
    return jnp.stack([moments(y), moments(gin)])

  return dict(
    linear=linear,
    elementwise=elementwise,
    softmax=softmax,
    attention_head=attention_head,
    attention_block=attention_block,
    ffn_block=ffn_block,
  )


# ----------------------------------------------------------------------------------------------------
# Stratified shared components and the chunked simulation loop.


def _lhs_uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
  """Latin-hypercube uniforms: one point in each of n equal-probability strata, shuffled."""
  return np.clip((rng.permutation(n) + rng.random(n)) / n, 1e-12, 1 - 1e-12)


def _lhs_normals(rng: np.random.Generator, shape) -> np.ndarray:
  """Latin-hypercube standard normals."""
  return special.ndtri(_lhs_uniforms(rng, int(np.prod(shape)))).reshape(shape).astype(np.float32)


def _sobol_normal_pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
  """n pairs of independent standard normals: the first n scrambled 2-D Sobol points, shuffled."""
  sobol = qmc.Sobol(d=2, scramble=True, seed=rng)
  m = math.ceil(math.log2(n))
  # A prefix of a Sobol sequence is still evenly spread when n is not a power of two.
  if 2**m == n:
    points = sobol.random_base2(m)
  else:
    with warnings.catch_warnings():
      warnings.filterwarnings('ignore', message='The balance properties')
      points = sobol.random(n)
  points = np.clip(points[rng.permutation(n)], 1e-12, 1 - 1e-12)
  z = special.ndtri(points).astype(np.float32)
  return z[:, 0], z[:, 1]


def _quantise_p(p: float) -> tuple[float, float]:
  threshold = round(p * _P_BITS)
  return threshold / _P_BITS, float(threshold)


def _pool(chunks: np.ndarray) -> dict[str, float]:
  """Pools per-chunk [mean, var, token cov, hidden cov] (equal sizes) into overall moments."""
  chunks = np.asarray(chunks, np.float64)
  mean = chunks[:, 0].mean()
  between = np.mean((chunks[:, 0] - mean) ** 2)
  return {
    'mean': mean,
    'var': chunks[:, 1].mean() + between,
    'cov_seq': chunks[:, 2].mean() + between,
    'cov_hidden': chunks[:, 3].mean() + between,
  }


def _run_chunks(kernel, shape, theta, key, c_all, cg_all, strata_all=None) -> dict[str, float]:
  jax, jnp = _jax()
  theta = jnp.asarray(theta, jnp.float32)
  extra = [] if strata_all is None else [strata_all]
  results = [
    kernel(jax.random.fold_in(key, i), c_all[i], cg_all[i], *[e[i] for e in extra], theta, shape=shape)
    for i in range(len(c_all))
  ]
  results = np.asarray(jax.device_get(results), np.float64)  # (chunks, 2, 4)
  out, grad = _pool(results[:, 0]), _pool(results[:, 1])
  measured = dict(out)
  measured['grad_var'] = grad['var']
  measured['grad_cov_seq'] = grad['cov_seq']
  return measured


def _simulate_weighted(
  kernel: str,
  shape_tail: tuple,
  theta,
  key,
  rng,
  *,
  d_in: int,
  d_grad: int,
  matrices: list[tuple[int, int, int]],
  columns: int,
  floats_per_draw: int,
  input_draws: int,
  grad_every: int,
) -> dict[str, float]:
  """Chunked simulation of a component with weights: each chunk is one input draw (with its injected
  gradient and dropout masks) pushed through `bw` weight draws.

  columns: output columns wanted in all (weight draws × d_grad, the output width; what the output
  mean's noise averages over); input_draws: at least this many chunks; grad_every: input gradients
  are computed for one weight draw in `grad_every` (at least one per chunk). `matrices`: (n_in, n_out,
  number of stratified output directions) of each stratified matrix, in the kernel's order.
  """
  draws = math.ceil(columns / d_grad)
  capacity = max(1, _CHUNK_FLOATS // floats_per_draw)
  bw = max(1, min(capacity, math.ceil(draws / input_draws)))
  chunks = max(input_draws, math.ceil(draws / bw))
  n_grad = max(1, bw // grad_every)
  c = _lhs_normals(rng, (chunks, 1, d_in))
  cg = _lhs_normals(rng, (chunks, 1, d_grad))

  # The draws that also give gradients (the first n_grad of each chunk) are stratified on their own,
  # and so are the others.
  def uniforms():
    head = _lhs_uniforms(rng, chunks * n_grad).reshape(chunks, n_grad)
    tail = _lhs_uniforms(rng, chunks * (bw - n_grad)).reshape(chunks, bw - n_grad)
    return np.concatenate([head, tail], axis=1)

  strata = []
  for n_in, n_out, k in matrices:
    strata.append(np.sqrt(stats.chi2.ppf(uniforms(), n_out - k)))
    for _ in range(k):
      strata += [np.sqrt(stats.chi2.ppf(uniforms(), n_in - 1)), special.ndtri(uniforms())]
  strata = np.stack(strata, axis=-1).astype(np.float32)
  return _run_chunks(_kernels()[kernel], (bw, n_grad) + shape_tail, theta, key, c, cg, strata)


# ----------------------------------------------------------------------------------------------------
# Components: grids, simulations and predictions.


@dataclasses.dataclass(frozen=True)
class Component:
  """One row block of Table 21."""

  name: str
  shapes: tuple  # static shape parameters (full run)
  quick_shapes: tuple
  grid: dict  # scalar parameter -> values
  configs_per_shape: int
  quick_configs_per_shape: int
  simulate: Callable  # (shape, params, key, rng, quick) -> measured dict
  predict: Callable  # (shape, params) -> predicted dict
  statistics: tuple
  scales: dict  # statistic -> None (relative error) | name of the predicted statistic
  alternatives: dict = dataclasses.field(default_factory=dict)  # label -> predict


def _stats_dict(out: C.Stats, gin: C.GradStats, hidden: bool = False) -> dict[str, float]:
  result = {
    'mean': out.mean,
    'var': out.var,
    'grad_var': gin.var,
    'cov_seq': out.cov_seq,
    'grad_cov_seq': gin.cov_seq,
  }
  if hidden:
    result['cov_hidden'] = out.cov_hidden
  return result


_SCALES = {
  'mean': 'var',
  'var': None,
  'grad_var': None,
  'cov_seq': 'var',
  'grad_cov_seq': 'grad_var',
  'cov_hidden': 'var',
}
_LOG3 = (0.1, 1.0, 10.0)  # logspace(-1, 1, 3): the paper's variances
_THIRDS = (0.0, 1 / 3, 2 / 3)  # linspace(0, 1, 3, endpoint=False)
_FIFTHS = (0.0, 0.2, 0.4, 0.6, 0.8)


# Linear ---------------------------------------------------------------------------------------------


def _simulate_linear(shape, prm, key, rng, quick):
  L, d_in, d_out = shape
  theta = [prm['mean'], prm['s2'], prm['r'], math.sqrt(prm['w_var'] / d_in), prm['g2'], prm['rg']]
  return _simulate_weighted(
    'linear',
    (L, d_in, d_out),
    theta,
    key,
    rng,
    d_in=d_in,
    d_grad=d_out,
    matrices=[(d_in, d_out, 2)],
    columns=(1 << 12) if quick else (1 << 13),
    floats_per_draw=L * max(d_in, d_out),
    input_draws=4 if quick else 16,
    grad_every=4,
  )


def _predict_linear(shape, prm):
  L, d_in, d_out = shape
  out, gin = C.linear(
    C.Stats(prm['mean'], prm['s2'], prm['r']),
    C.GradStats(prm['g2'], prm['rg']),
    d_in=d_in,
    d_out=d_out,
    w_var=prm['w_var'] / d_in,
  )
  return _stats_dict(out, gin, hidden=True)


# Elementwise: ReLU, GeLU, LayerNorm, Dropout ---------------------------------------------------------


def _simulate_elementwise(kind):
  def simulate(shape, prm, key, rng, quick):
    L, d = shape
    # Noise of the shared parts is stratified away; what is left shrinks with columns × tokens.
    columns = (1 << 12) if quick else (1 << 14 if L <= 100 else 1 << 12)
    b = max(1, _CHUNK_FLOATS // (L * d))
    b = min(b, math.ceil(columns / d))
    chunks = math.ceil(columns / (b * d))
    c, cg = _sobol_normal_pairs(rng, chunks * b * d)
    c, cg = c.reshape(chunks, b, d), cg.reshape(chunks, b, d)
    p_eff, threshold = _quantise_p(prm.get('p', 0.0))
    theta = [prm.get('mean', 0.0), prm['s2'], prm['r'], prm['g2'], prm['rg'], threshold]
    return _run_chunks(_kernels()['elementwise'], (b, L, d, kind), theta, key, c, cg)

  return simulate


def _inputs(prm):
  return C.Stats(prm.get('mean', 0.0), prm['s2'], prm['r']), C.GradStats(prm['g2'], prm['rg'])


def _predict_relu(exact):
  return lambda shape, prm: _stats_dict(*C.relu(*_inputs(prm), exact=exact))


def _predict_gelu(shape, prm):
  return _stats_dict(*C.gelu(*_inputs(prm)))


def _predict_layernorm(exact):
  return lambda shape, prm: _stats_dict(*C.layernorm(*_inputs(prm), d=shape[1], exact=exact), hidden=True)


def _predict_dropout(shape, prm):
  return _stats_dict(*C.dropout(*_inputs(prm), p=_quantise_p(prm['p'])[0]), hidden=True)


# Softmax --------------------------------------------------------------------------------------------


def _simulate_softmax(shape, prm, key, rng, quick):
  (L,) = shape
  elements = (1 << 20) if quick else (1 << 21)
  b = min(max(1, _CHUNK_FLOATS // L), max(1, elements // L))
  chunks = math.ceil(elements / (b * L))
  # The shared parts cancel in a softmax; they are drawn anyway so that inputs are as specified.
  c = _lhs_normals(rng, (chunks, b, 1))
  cg = _lhs_normals(rng, (chunks, b, 1))
  theta = [prm['s2'], prm['r'], prm['g2'], prm['rg']]
  return _run_chunks(_kernels()['softmax'], (b, L), theta, key, c, cg)


def _predict_softmax(form):
  def predict(shape, prm):
    out, gin = C.softmax(*_inputs(prm), length=shape[0], form=form)
    return _stats_dict(out, gin)

  return predict


# Single-head attention --------------------------------------------------------------------------------


def _attention_input_draws(causal: bool, quick: bool) -> int:
  # Causal outputs and gradients lean on the first few tokens (position 0 sees only itself), whose
  # norms fluctuate from draw to draw: causal attention needs many more input draws.
  return (32 if quick else 128) if causal else (8 if quick else 32)


def _simulate_head(causal):
  def simulate(shape, prm, key, rng, quick):
    L, d_in, d_head = shape
    _, threshold = _quantise_p(prm['p'])
    theta = [
      prm['s2'],
      prm['r'],
      math.sqrt(prm['qk_var'] / d_in),
      math.sqrt(prm['v_var'] / d_in),
      threshold,
      prm['g2'],
      prm['rg'],
    ]
    return _simulate_weighted(
      'attention_head',
      (L, d_in, d_head, causal),
      theta,
      key,
      rng,
      d_in=d_in,
      d_grad=d_head,
      matrices=[(d_in, d_head, 2)],
      columns=(1 << 10) if quick else (1 << 11),
      floats_per_draw=L * max(L, d_in),
      input_draws=_attention_input_draws(causal, quick),
      grad_every=2,
    )

  return simulate


def _predict_head(causal, form):
  def predict(shape, prm):
    L, d_in, d_head = shape
    out, gin = C.attention_head(
      *_inputs(prm),
      d_in=d_in,
      d_head=d_head,
      length=L,
      p=_quantise_p(prm['p'])[0],
      qk_var=prm['qk_var'] / d_in,
      v_var=prm['v_var'] / d_in,
      causal=causal,
      form=form,
    )
    return _stats_dict(out, gin)

  return predict


# Attention block ------------------------------------------------------------------------------------


def _simulate_attention_block(causal):
  def simulate(shape, prm, key, rng, quick):
    L, d, heads = shape
    _, threshold = _quantise_p(prm['p'])
    std = lambda name: math.sqrt(prm[name] / d)
    theta = [
      prm['s2'],
      prm['r'],
      std('qk_var'),
      std('v_var'),
      std('o_var'),
      threshold,
      threshold,
      prm['g2'],
      prm['rg'],
    ]
    return _simulate_weighted(
      'attention_block',
      (L, d, heads, causal),
      theta,
      key,
      rng,
      d_in=d,
      d_grad=d,
      matrices=[(d, d, 0), (d, d, 2)],
      columns=(1 << 10) if quick else (1 << 12),
      floats_per_draw=max(heads * L * L, 4 * L * d),
      input_draws=_attention_input_draws(causal, quick),
      grad_every=2,
    )

  return simulate


def _predict_attention_block(causal, form):
  def predict(shape, prm):
    L, d, heads = shape
    p = _quantise_p(prm['p'])[0]
    out, gin = C.attention_block(
      *_inputs(prm),
      d=d,
      num_heads=heads,
      length=L,
      p=p,
      q_var=prm['qk_var'] / d,
      k_var=prm['qk_var'] / d,
      v_var=prm['v_var'] / d,
      o_var=prm['o_var'] / d,
      causal=causal,
      form=form,
    )
    return _stats_dict(out, gin)

  return predict


# FFN block ------------------------------------------------------------------------------------------


def _simulate_ffn_block(shape, prm, key, rng, quick):
  L, d, activation = shape
  hidden = 4 * d
  _, threshold = _quantise_p(prm['p'])
  theta = [
    prm['s2'],
    prm['r'],
    math.sqrt(prm['w1_var'] / d),
    math.sqrt(prm['w2_var'] / hidden),
    threshold,
    prm['g2'],
    prm['rg'],
  ]
  return _simulate_weighted(
    'ffn_block',
    (L, d, hidden, activation),
    theta,
    key,
    rng,
    d_in=d,
    d_grad=d,
    matrices=[(d, hidden, 0), (hidden, d, 2)],
    columns=(1 << 11) if quick else (1 << 13),
    floats_per_draw=2 * L * hidden,
    input_draws=4 if quick else 16,
    grad_every=4,
  )


def _predict_ffn_block(exact):
  def predict(shape, prm):
    L, d, activation = shape
    out, gin = C.ffn_block(
      *_inputs(prm),
      d=d,
      hidden=4 * d,
      p=_quantise_p(prm['p'])[0],
      w1_var=prm['w1_var'] / d,
      w2_var=prm['w2_var'] / (4 * d),
      activation=activation,
      exact=exact,
    )
    return _stats_dict(out, gin)

  return predict


_FIVE = ('mean', 'var', 'grad_var', 'cov_seq', 'grad_cov_seq')
_HEAD_SCALES = dict(_SCALES, grad_cov_seq=None)  # the paper's SHA script: relative gradient covariance
_SOFTMAX_SCALES = dict(_SCALES, mean=None)  # the paper's softmax script: relative mean error

_HEAD_GRID = dict(
  s2=(1.0,), r=_THIRDS, v_var=_LOG3, qk_var=(0.01, 0.06, 0.36), p=_THIRDS, g2=_LOG3, rg=_THIRDS
)
# (L, d_in, d_head): every value of the paper's grid (L ∈ {300, 547, 1000}, d_in ∈ {100, 316, 1000},
# d_head ∈ {32, 64, 128, 256}) appears, in 12 of the 36 combinations (each shape compiles once).
_HEAD_SHAPES = (
  (300, 100, 32),
  (300, 316, 64),
  (300, 1000, 128),
  (300, 100, 256),
  (547, 316, 32),
  (547, 1000, 64),
  (547, 100, 128),
  (547, 316, 256),
  (1000, 1000, 32),
  (1000, 100, 64),
  (1000, 316, 128),
  (1000, 1000, 256),
)
# Causal attention needs many input draws (see `_simulate_head`); its grid stops at L = 547.
_CAUSAL_HEAD_SHAPES = (
  (300, 100, 32),
  (300, 316, 64),
  (300, 1000, 128),
  (547, 100, 256),
  (547, 316, 32),
  (547, 1000, 64),
)
_BLOCK_GRID = dict(
  s2=(0.5, 1.0),
  r=_FIFTHS,
  qk_var=(0.25, 1.0),
  v_var=(0.3, 1.0, 3.0),
  o_var=(0.3, 1.0, 3.0),
  p=(0.0, 0.1, 0.3),
  g2=_LOG3,
  rg=_FIFTHS,
)

COMPONENTS = {
  c.name: c
  for c in [
    Component(
      'linear',
      shapes=(
        (100, 100, 316),
        (100, 316, 1000),
        (100, 1000, 100),
        (1000, 100, 1000),
        (1000, 316, 100),
        (1000, 1000, 316),
        (100, 316, 316),
        (1000, 100, 100),
        (100, 1000, 1000),
      ),
      quick_shapes=((100, 100, 316),),
      grid=dict(
        mean=(-10.0, -1.0, 0.0, 1.0, 10.0),
        s2=_LOG3,
        r=_THIRDS,
        w_var=(0.01, 1.0, 100.0),
        g2=_LOG3,
        rg=_THIRDS,
      ),
      configs_per_shape=9,
      quick_configs_per_shape=6,
      simulate=_simulate_linear,
      predict=_predict_linear,
      statistics=STATISTICS,
      scales=_SCALES,
    ),
    Component(
      'relu',
      shapes=((100, 1), (1000, 1)),
      quick_shapes=((100, 1),),
      grid=dict(s2=_LOG3, r=_FIFTHS, g2=_LOG3, rg=_FIFTHS),
      configs_per_shape=40,
      quick_configs_per_shape=6,
      simulate=_simulate_elementwise('relu'),
      predict=_predict_relu(True),
      statistics=_FIVE,
      scales=_SCALES,
      alternatives={'fit': _predict_relu(False)},
    ),
    Component(
      'gelu',
      shapes=((100, 1), (1000, 1)),
      quick_shapes=((100, 1),),
      grid=dict(s2=_LOG3, r=_FIFTHS, g2=_LOG3, rg=_FIFTHS),
      configs_per_shape=40,
      quick_configs_per_shape=6,
      simulate=_simulate_elementwise('gelu'),
      predict=_predict_gelu,
      statistics=_FIVE,
      scales=_SCALES,
    ),
    Component(
      'layernorm',
      shapes=((100, 100), (100, 316), (100, 1000), (1000, 100), (1000, 316), (1000, 1000)),
      quick_shapes=((100, 100),),
      grid=dict(mean=(-10.0, -1.0, 0.0, 1.0, 10.0), s2=_LOG3, r=_FIFTHS, g2=_LOG3, rg=_FIFTHS),
      configs_per_shape=14,
      quick_configs_per_shape=6,
      simulate=_simulate_elementwise('layernorm'),
      predict=_predict_layernorm(True),
      statistics=STATISTICS,
      scales=_SCALES,
      alternatives={'paper': _predict_layernorm(False)},
    ),
    Component(
      'dropout',
      shapes=((100, 100), (100, 316), (100, 1000), (1000, 100), (1000, 316), (1000, 1000)),
      quick_shapes=((100, 100),),
      grid=dict(mean=(-10.0, 0.0, 10.0), s2=_LOG3, r=_THIRDS, g2=_LOG3, rg=_THIRDS, p=_THIRDS),
      configs_per_shape=14,
      quick_configs_per_shape=6,
      simulate=_simulate_elementwise('dropout'),
      predict=_predict_dropout,
      statistics=STATISTICS,
      scales=_SCALES,
    ),
    Component(
      'softmax',
      shapes=((300,), (722,), (1732,), (4162,), (10000,)),
      quick_shapes=((300,),),
      grid=dict(s2=tuple(np.logspace(-4, 0, 5)), r=_FIFTHS, g2=tuple(np.logspace(-1, 1, 5)), rg=(0.0, 0.5)),
      configs_per_shape=16,
      quick_configs_per_shape=6,
      simulate=_simulate_softmax,
      predict=_predict_softmax('quadrature'),
      statistics=_FIVE,
      scales=_SOFTMAX_SCALES,
      alternatives={'lognormal': _predict_softmax('lognormal'), 'simple': _predict_softmax('simple')},
    ),
    Component(
      'attention_head',
      shapes=_HEAD_SHAPES,
      quick_shapes=((300, 100, 32),),
      grid=_HEAD_GRID,
      configs_per_shape=8,
      quick_configs_per_shape=6,
      simulate=_simulate_head(False),
      predict=_predict_head(False, 'exact'),
      statistics=_FIVE,
      scales=_HEAD_SCALES,
      alternatives={'paper': _predict_head(False, 'paper')},
    ),
    Component(
      'attention_head_causal',
      shapes=_CAUSAL_HEAD_SHAPES,
      quick_shapes=((300, 100, 32),),
      grid=_HEAD_GRID,
      configs_per_shape=6,
      quick_configs_per_shape=4,
      simulate=_simulate_head(True),
      predict=_predict_head(True, 'exact'),
      statistics=_FIVE,
      scales=_HEAD_SCALES,
      alternatives={'paper': _predict_head(True, 'paper')},
    ),
    Component(
      'attention_block',
      shapes=((128, 128, 2), (512, 128, 4), (128, 256, 4), (512, 256, 8)),
      quick_shapes=((128, 128, 2),),
      grid=_BLOCK_GRID,
      configs_per_shape=8,
      quick_configs_per_shape=4,
      simulate=_simulate_attention_block(False),
      predict=_predict_attention_block(False, 'exact'),
      statistics=_FIVE,
      scales=_SCALES,
      alternatives={'paper': _predict_attention_block(False, 'paper')},
    ),
    Component(
      'attention_block_causal',
      shapes=((128, 128, 2), (256, 256, 8)),
      quick_shapes=((128, 128, 2),),
      grid=_BLOCK_GRID,
      configs_per_shape=8,
      quick_configs_per_shape=4,
      simulate=_simulate_attention_block(True),
      predict=_predict_attention_block(True, 'exact'),
      statistics=_FIVE,
      scales=_SCALES,
      alternatives={'paper': _predict_attention_block(True, 'paper')},
    ),
    Component(
      'ffn_block',
      shapes=((64, 64, 'gelu'), (256, 64, 'relu'), (64, 256, 'relu'), (256, 256, 'gelu')),
      quick_shapes=((64, 64, 'relu'),),
      grid=dict(
        s2=(0.5, 1.0, 2.0),
        r=_FIFTHS,
        w1_var=(0.5, 1.0, 2.0),
        w2_var=(0.5, 1.0, 2.0),
        p=(0.0, 0.1, 0.3),
        g2=_LOG3,
        rg=_FIFTHS,
      ),
      configs_per_shape=8,
      quick_configs_per_shape=4,
      simulate=_simulate_ffn_block,
      predict=_predict_ffn_block(True),
      statistics=_FIVE,
      scales=_SCALES,
      alternatives={'fit': _predict_ffn_block(False)},
    ),
  ]
}


# ----------------------------------------------------------------------------------------------------
# Driver.


def _configs(component: Component, quick: bool, rng: np.random.Generator):
  """(shape, params) pairs: for each shape, distinct random points of the scalar grid."""
  shapes = component.quick_shapes if quick else component.shapes
  per_shape = component.quick_configs_per_shape if quick else component.configs_per_shape
  names = list(component.grid)
  grid = list(itertools.product(*(component.grid[n] for n in names)))
  for shape in shapes:
    for index in rng.choice(len(grid), size=min(per_shape, len(grid)), replace=False):
      yield shape, {n: float(v) for n, v in zip(names, grid[index])}


def _errors(component: Component, predicted: dict, measured: dict) -> dict[str, float]:
  errors = {}
  for stat in component.statistics:
    scale_name = component.scales[stat]
    scale = None if scale_name is None else predicted[scale_name]
    errors[stat] = percent_error(measured[stat], predicted[stat], scale)
  return errors


def run_component(component: Component, quick: bool, seed: int, log=print) -> dict[str, Any]:
  """Simulates every configuration of one component; returns percentiles and per-config records."""
  jax, _ = _jax()
  rng = np.random.default_rng([seed, sum(map(ord, component.name))])
  key = jax.random.key(seed)
  key = jax.random.fold_in(key, sum(map(ord, component.name)))
  records = []
  start = time.time()
  for i, (shape, prm) in enumerate(_configs(component, quick, rng)):
    measured = component.simulate(shape, prm, jax.random.fold_in(key, i), rng, quick)
    predicted = component.predict(shape, prm)
    record = {
      'shape': list(shape),
      'params': prm,
      'measured': measured,
      'predicted': predicted,
      'errors': _errors(component, predicted, measured),
      'alternatives': {},
    }
    for label, predict in component.alternatives.items():
      record['alternatives'][label] = _errors(component, predict(shape, prm), measured)
    records.append(record)
  table = {stat: percentiles([r['errors'][stat] for r in records]) for stat in component.statistics}
  alternatives = {
    label: {
      stat: percentiles([r['alternatives'][label][stat] for r in records]) for stat in component.statistics
    }
    for label in component.alternatives
  }
  log(f'  {component.name}: {len(records)} configurations in {time.time() - start:.0f}s')
  return {'table': table, 'alternatives': alternatives, 'records': records}


def _fmt(values) -> str:
  return '[' + ', '.join(f'{v:5.1f}' for v in values) + ']'


def format_table(results: dict[str, dict]) -> str:
  """Table 21 layout: measured percentiles next to the paper's."""
  lines = [f'{"component":28s} {"statistic":13s} {"this run  p50/p90/p99":24s} {"paper":22s}']
  for name, result in results.items():
    for label, table in [('', result['table'])] + [(f'[{k}]', v) for k, v in result['alternatives'].items()]:
      for stat, values in table.items():
        paper = PAPER_TABLE21.get(name, {}).get(stat) if not label else None
        paper_text = _fmt(paper) if paper else '—'
        lines.append(f'{name + label:28s} {stat:13s} {_fmt(values):24s} {paper_text}')
  return '\n'.join(lines)


def main(argv=None) -> dict[str, dict]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help='small grids and sample sizes (< 2 min)')
  parser.add_argument('--out', default=None, help='directory for verify.json (and verify_records.json)')
  parser.add_argument('--only', default=None, help='comma-separated component names')
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
  names = list(COMPONENTS) if args.only is None else args.only.split(',')
  unknown = [n for n in names if n not in COMPONENTS]
  if unknown:
    parser.error(f'unknown components {unknown}; choose from {list(COMPONENTS)}')

  start = time.time()
  print(
    f'dsjax.theory.verify: {"quick" if args.quick else "full"} run of {len(names)} components', flush=True
  )
  results = {}
  for name in names:
    results[name] = run_component(COMPONENTS[name], args.quick, args.seed, log=lambda s: print(s, flush=True))
  print(format_table(results))
  print(f'total {time.time() - start:.0f}s')

  summary = {}
  for name, result in results.items():
    summary[name] = result['table']
    for label, table in result['alternatives'].items():
      summary[f'{name}[{label}]'] = table
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'verify.json'), 'w') as f:
      json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, 'verify_records.json'), 'w') as f:
      json.dump({n: r['records'] for n, r in results.items()}, f)
  return summary


if __name__ == '__main__':
  main(sys.argv[1:])
