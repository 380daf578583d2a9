r"""A per-position theory of the gradient of a causal stack, against the per-position measurement.

  python experiments/dslm_position_theory.py --out=experiments/results/dslm_position_theory [--seed=0]

`dsjax.theory` follows one scalar per statistic: the gradient variance and the mean correlation between
two token positions, as if every position were alike. Under causal attention they are not: key u is
read by the queries t ≥ u only, and the first key by all of them. `experiments/dslm_positions.py`
measured that at 192 layers the gradient at layer 1 sits mostly on the first positions (the DSLM full
init) or on position 0 alone (Xavier Post-LN).
This experiment carries the backward pass as an L×L matrix instead: Γ(u, u') = E[g_u·g_u'] per hidden
unit, for the positions u, u' of one sequence.

The map through one causal attention head (`attention_head_map`), with h_t the gradient at the head's
output after the value projection (E[h_t·h_t'] = d_head·v_var·Γ(t, t')) and n_t = t + 1 keys at query t:

  value path  V_u = Σ_{t ≥ u} A_tu·h_t:  Σ_{t ≠ t'} Γh(t, t')/(n_t·n_t') (× e^κ where u = u', the shared
              key's logit) + Σ_t Γh(t, t)·E[A_tu·A_tu'] (E[P²]/(1 − p) where u = u', else
              (n − e2)/(n²(n − 1)));
  query path  σδ²·c_n·h_u·Mᵀ (the softmax tilt) plus its fluctuation over the n keys;
  key path    Σ_t ∂ℓ_tu·u_t with E[∂ℓ_tu²] ∝ E[P_u²·|e_u − P|²] = m2q + (n − 1)·m22 (exact softmax moments).

These are the terms of `dsjax.theory.components`' causal attention, kept per position instead of
averaged: averaged over positions the map gives that function's gradient variance and covariance. The
key path and the query path's fluctuation weigh each query by E[P_u²·|e_u − P|²]; the factorised weight
E[P²]·E|e_u − P|² (`factorised=True`, kept for comparison) differs where a query sees few keys, and for
the first query, which sees one key and whose logit gradient is zero, it is 1 instead of 0. On Gaussian
inputs the map agrees with a Monte Carlo of the head in plain `jnp` differentiated by `jax.vjp`, and the
factorised weight overshoots the first positions (the script records both; the tests hold the first to
8%).

The other components (LayerNorm, linear, ReLU, dropout) act on each position alone: they scale Γ's
diagonal and off-diagonal by the gains of `dsjax.theory.components`, and each LayerNorm divides
position u by its own input variance, which the forward pass follows per position (the first query's
attention output is its own value, so position 0's branch variance is ~1/r of the others').

The stack is anchored where the scalar prediction is (`dsjax.instrument.theory_adapter`): at the
measured gradient of the last layer, alike at every position, and the measured embedding statistics.
Written to OUT/seed<S>.json: the head map's check against sampling; the factorised key weight's error
(`weighting_comparison`); per case the measured, scalar-theory
and per-position-theory layer-1 / layer-192 gradient ratios, and per band of positions the predicted
share of layer 1's gradient energy and the band's own ratio, beside those measured by
`experiments/dslm_positions.py` (read from experiments/results/dslm_positions/ when present). Reading:
experiments/dslm_results.md §1. Runtime: ~2 minutes on a 2-core CPU (most of it the measurement).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data, moments  # noqa: E402
from dsjax.instrument import theory_adapter  # noqa: E402
from dsjax.theory import components as C  # noqa: E402
from dsjax.theory import model as theory_model  # noqa: E402
from dsjax.theory.components import GradStats, Stats  # noqa: E402
from dsjax.train import state  # noqa: E402
from experiments import dslm_moments, dslm_positions  # noqa: E402

CHECK_BANDS = {'0': (0, 1), '1-3': (1, 4), '4-15': (4, 16), '16-31': (16, 32)}
MEASURED_POSITIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'dslm_positions')


def _suffix(f: np.ndarray) -> np.ndarray:
  """Σ_{t ≥ u} f_t for every u."""
  return np.cumsum(f[::-1])[::-1]


def attention_head_map(
  x: Stats, gamma_LL: np.ndarray, *, d_in, d_head, p, qk_prod, v_var, factorised: bool = False
) -> np.ndarray:
  """Γ at the input of one causal head from Γ at its output (module docstring; notation of
  `dsjax.theory.components._attention_moments`, form='exact'; averaged over positions it gives that
  function's gradient moments). factorised=True weighs the key and query paths by E[P²]·E|e_u − P|²
  instead of E[P_u²·|e_u − P|²] (module docstring)."""
  L = len(gamma_LL)
  s2, mu, r = x.var, x.mean, x.corr_seq
  q2, c2, sd2 = s2 + mu**2, r * s2 + mu**2, (1 - r) * s2
  U, Uc = qk_prod * d_in**2 * q2, qk_prod * d_in**2 * c2
  kappa = sd2 * Uc
  sl2_eff, e_kappa = C._query_spread(sd2 * U, c2, q2, d_head)  # pylint: disable=protected-access
  pos = np.arange(L)
  n = pos + 1.0
  m = C.softmax_moments(sl2_eff, pos + 1)
  e2 = n**2 * m['m2']
  w_key = m['m2q'] + (n - 1) * m['m22']  # E[P_u²·|e_u − P|²]: 0 for the first query
  w_query, key_mean = w_key, (1 - 1 / n) / n
  if factorised:
    w_key, w_query, key_mean = m['m2'], (1 - e2 / n) * e2 / n**2, 1 / n
  later = pos[:, None] <= pos[None, :]  # later[u, t]: query t reads key u
  max_uu = np.maximum(pos[:, None], pos[None, :])

  gh = d_head * v_var * gamma_LL
  gh_diag = np.diag(gh)
  gh_off = gh - np.diag(gh_diag)
  # Value path: pairs of distinct queries (mean weights 1/n), then each query with itself.
  mean_weight_UT = later / n[None, :]
  value = mean_weight_UT @ gh_off @ mean_weight_UT.T
  value[np.diag_indices(L)] *= e_kappa
  same_query = _suffix(gh_diag * np.where(n > 1, (n - e2) / (n**2 * np.maximum(n - 1, 1)), 0.0))[max_uu]
  same_query[np.diag_indices(L)] = _suffix(gh_diag * m['m2'] / (1 - p))
  value += same_query
  # Query path: the tilt σδ²·c_n·h_u·Mᵀ and its fluctuation over the n keys.
  c_n = 1 - e2 / n
  query = qk_prod * d_in * sd2**2 * (np.outer(c_n, c_n) + e_kappa * d_in / n[max_uu]) * gh
  query[np.diag_indices(L)] = (
    qk_prod * d_in * sd2 * (sd2 * c_n**2 + n * w_query * d_in * (p * c2 + sd2) / (1 - p)) * gh_diag
  )
  # Key path (its covariance between keys is O(1/L) and dropped, as in the scalar theory).
  key_weight_UT = later * key_mean[None, :]
  key_shared = np.einsum('ut,ts,us->u', key_weight_UT, gh_off, key_weight_UT)
  key = U * (p * c2 + sd2) * _suffix(gh_diag * w_key) / (1 - p) + kappa * e_kappa * key_shared
  return value + query + np.diag(key)


def _gains(layer, x: Stats) -> tuple[float, float]:
  """A per-position component's gradient gains on Γ's diagonal and off-diagonal (it is linear in both)."""
  _, g = layer(x, GradStats(var=1.0, corr_seq=0.5))
  return g.var, g.cov_seq / 0.5


def _apply(gamma_LL: np.ndarray, gains: tuple[float, float]) -> np.ndarray:
  diag = np.diag(np.diag(gamma_LL))
  return gains[1] * (gamma_LL - diag) + gains[0] * diag


def _per_position_norm(gamma_LL: np.ndarray, relative_var_L: np.ndarray) -> np.ndarray:
  """A LayerNorm divides position u by its own input std: relative to the mean variance the scalar
  gains were computed at."""
  s = 1 / np.sqrt(relative_var_L)
  return gamma_LL * np.outer(s, s)


def _head_profile(x: Stats, *, L, d_in, d_head, p, qk_prod) -> np.ndarray:
  """Forward variance of a causal head's output per query position, relative to its mean."""
  s2, r = x.var, x.corr_seq
  q2, c2, sd2 = s2 + x.mean**2, r * s2 + x.mean**2, (1 - r) * s2
  U = qk_prod * d_in**2 * q2
  n = np.arange(1, L + 1, dtype=np.float64)
  sl2_eff, _ = C._query_spread(sd2 * U, c2, q2, d_head)  # pylint: disable=protected-access
  e2 = np.asarray(C._softmax_e2(sl2_eff, n.astype(int)))  # pylint: disable=protected-access
  var = C._query_output_var(c2, sd2**2 * U / d_in, sd2, e2, n, p)  # pylint: disable=protected-access
  return var / var.mean()


class _Site(NamedTuple):
  """One residual add's forward record, read by the backward pass."""

  k: int  # 0-based over the 2·depth adds: attention at even k, FFN at odd k
  skip: float  # λ
  branch: float  # β
  branch_out: Stats  # the branch output after its dropout
  total: Stats  # λ·x + β·branch_out, before a Post-LN norm
  inputs: list  # (name, input statistics) of the branch's components, in forward order
  stream_var_L: np.ndarray  # per-position variance of the add's input x, relative to its mean
  sum_var_L: np.ndarray  # the same for the sum λ·x + β·branch_out


def propagate_positions(desc, x0: Stats, grad_top: GradStats) -> list[np.ndarray]:
  """Γ at the output of every layer's two sublayers (2·depth entries, attention then FFN per layer;
  the residual add's output for Pre-LN, its LayerNorm's output for Post-LN), from the top.

  The forward statistics are the scalar theory's (`dsjax.theory.components`), with each position's
  variance relative to the mean followed alongside for the LayerNorms."""
  L, d, heads = desc.seq_len, desc.width, desc.num_heads
  w, scale, p, attn_p = desc.weight_var, desc.scale, desc.dropout, desc.attn_dropout
  pre = desc.block == 'preln'
  norm = functools.partial(C.layernorm, d=d, exact=True)
  head_kw = lambda k: dict(d_in=d, d_head=d // heads, qk_prod=w['q'][k // 2] * w['k'][k // 2])  # noqa: E731
  act = {'relu': functools.partial(C.relu, exact=True), 'gelu': C.gelu}[desc.activation]

  def layers(k):
    """(name, component) of add k's branch after its LayerNorm; 'heads' is handled per position."""
    n = k // 2
    if k % 2 == 0:
      return [('heads', None), ('o', functools.partial(C.linear, d_in=d, d_out=d, w_var=w['o'][n]))]
    return [
      ('ffn1', functools.partial(C.linear, d_in=d, d_out=desc.mlp_hidden, w_var=w['ffn1'][n])),
      ('act', act),
      ('ffn2', functools.partial(C.linear, d_in=desc.mlp_hidden, d_out=d, w_var=w['ffn2'][n])),
    ]

  def head_forward(k, h):
    n = k // 2
    out, _ = C.attention_head(
      h,
      GradStats(),
      length=L,
      p=attn_p,
      qk_var=math.sqrt(w['q'][n] * w['k'][n]),
      v_var=w['v'][n],
      causal=True,
      d_in=d,
      d_head=d // heads,
    )
    return Stats(mean=out.mean, var=out.var, corr_seq=out.corr_seq, corr_hidden=0.0)

  sites, x, stream_var_L = [], x0, np.ones(L)
  for k in range(2 * desc.depth):
    skip = scale['skip_attn' if k % 2 == 0 else 'skip_ffn'][k // 2]
    branch = scale['branch_attn' if k % 2 == 0 else 'branch_ffn'][k // 2]
    h = norm(x, GradStats())[0] if pre else x
    inputs = [('norm', x)] if pre else []
    profile_L = np.ones(L)
    for name, f in layers(k):
      inputs.append((name, h))
      if name == 'heads':
        profile_L = _head_profile(h, L=L, p=attn_p, **head_kw(k))
        h = head_forward(k, h)
      else:
        h = f(h, GradStats())[0]
    inputs.append(('dropout', h))
    branch_out = C.dropout(h, GradStats(), p=p)[0]
    total = theory_model._add(x, branch_out, skip, branch)  # pylint: disable=protected-access
    sum_var_L = (skip**2 * x.var * stream_var_L + branch**2 * branch_out.var * profile_L) / total.var
    sites.append(_Site(k, skip, branch, branch_out, total, inputs, stream_var_L, sum_var_L))
    x = total if pre else norm(total, GradStats())[0]
    stream_var_L = sum_var_L if pre else np.ones(L)

  gamma = grad_top.var * ((1 - grad_top.corr_seq) * np.eye(L) + grad_top.corr_seq * np.ones((L, L)))
  grads = [None] * len(sites)
  last = len(sites) - 1
  for site in reversed(sites):
    k = site.k
    grads[k] = gamma
    if not pre:  # the LayerNorm after the add, as `dsjax.theory.model.propagate` has it
      rho = None if k in (0, last) else min(1.0, site.branch**2 * site.branch_out.var / site.total.var)
      norm_gains = _gains(functools.partial(norm, random_fraction=rho), site.total)
      gamma = _per_position_norm(_apply(gamma, norm_gains), site.sum_var_L)
    dropout_input = site.inputs[-1][1]
    g_branch = _apply(site.branch**2 * gamma, _gains(functools.partial(C.dropout, p=p), dropout_input))
    components = dict(layers(k), norm=norm)
    for name, h in reversed(site.inputs[:-1]):
      if name == 'heads':
        # The heads read all d inputs with independent weights: their input gradients add.
        g_branch = heads * attention_head_map(h, g_branch, p=attn_p, v_var=w['v'][k // 2], **head_kw(k))
      else:
        g_branch = _apply(g_branch, _gains(components[name], h))
        if name == 'norm':
          g_branch = _per_position_norm(g_branch, site.stream_var_L)
    gamma = site.skip**2 * gamma + g_branch
  return grads


def monte_carlo_head(gamma_LL: np.ndarray, *, r: float, d_in: int, d_head: int, trials: int, seed: int = 0):
  """Γ at the input of one causal head, by sampling: Gaussian tokens with correlation r, weights of
  variance 1/d_in, output gradients with covariance Γ; plain `jnp`, `jax.vjp`. Returns (Γ_in, the map's
  predictions for the same head with exact and with factorised weights)."""
  L = len(gamma_LL)
  chol_LL = np.linalg.cholesky(gamma_LL)
  mask_LL = jnp.tril(jnp.ones((L, L), bool))

  def head(x_LD, wq, wk, wv):
    logits_LL = (x_LD @ wq) @ (x_LD @ wk).T / math.sqrt(d_head)
    return jax.nn.softmax(jnp.where(mask_LL, logits_LL, -jnp.inf), axis=-1) @ (x_LD @ wv)

  def one(key):
    k = jax.random.split(key, 6)
    x_LD = math.sqrt(r) * jax.random.normal(k[0], (1, d_in)) + math.sqrt(1 - r) * jax.random.normal(
      k[1], (L, d_in)
    )
    wq, wk, wv = (jax.random.normal(k[i], (d_in, d_head)) / math.sqrt(d_in) for i in (2, 3, 4))
    g_LH = chol_LL @ jax.random.normal(k[5], (L, d_head))
    (gx_LD,) = jax.vjp(lambda x: head(x, wq, wk, wv), x_LD)[1](g_LH)
    return gx_LD @ gx_LD.T / d_in

  keys = jax.random.split(jax.random.PRNGKey(seed), trials)
  sampled = np.asarray(jax.lax.map(jax.jit(one), keys, batch_size=min(trials, 500)).mean(0), np.float64)
  predicted = {
    name: attention_head_map(
      Stats(mean=0.0, var=1.0, corr_seq=r),
      gamma_LL,
      d_in=d_in,
      d_head=d_head,
      p=0.0,
      qk_prod=d_in**-2.0,
      v_var=1 / d_in,
      factorised=factorised,
    )
    for name, factorised in (('exact_weights', False), ('factorised_weights', True))
  }
  return sampled, predicted


def check_gamma(L: int, rg: float) -> np.ndarray:
  """An output-gradient covariance heavy on the first positions, with correlation rg between positions."""
  energy = np.ones(L)
  energy[0], energy[1:4] = 20.0, 4.0
  gamma = rg * np.sqrt(np.outer(energy, energy))
  np.fill_diagonal(gamma, energy)
  return gamma


def weighting_comparison(trials: int) -> dict:
  """How far the factorised key weight is off, position-averaged, on gradients alike at every position:
  against sampling (uncorrelated positions, three small heads) and against the exact weight at a GPT
  head's size (d 256, d_head 64, 128 positions, Xavier weights, attention dropout 0.1)."""
  mean_diag = lambda m: float(np.diag(m).mean())  # noqa: E731
  sampled = {}
  for L, d_in, d_head, r in ((32, 64, 16, 0.1), (32, 64, 16, 0.6), (16, 32, 8, 0.1)):
    draws, predicted = monte_carlo_head(np.eye(L), r=r, d_in=d_in, d_head=d_head, trials=trials)
    sampled[f'L={L} d_in={d_in} d_head={d_head} r={r}'] = {
      'sampled': mean_diag(draws),
      **{k: mean_diag(v) for k, v in predicted.items()},
    }
  gpt = {}
  for r in (0.06, 0.3, 0.68):
    for rg in (0.0, 0.13):
      gamma = (1 - rg) * np.eye(128) + rg * np.ones((128, 128))
      kw = dict(d_in=256, d_head=64, p=0.1, qk_prod=256**-2.0, v_var=1 / 256)
      x = Stats(mean=0.0, var=1.0, corr_seq=r)
      factorised = mean_diag(attention_head_map(x, gamma, factorised=True, **kw))
      gpt[f'r={r} rg={rg}'] = factorised / mean_diag(attention_head_map(x, gamma, **kw))
  return {'against_sampling': sampled, 'gpt_head_factorised_over_exact': gpt}


def _bands(energy_L: np.ndarray) -> dict:
  return {f'{lo}-{hi - 1}': float(energy_L[lo:hi].sum() / energy_L.sum()) for lo, hi in dslm_positions.BANDS}


def predict_case(case: str, seed: int, num_batches: int) -> dict:
  """The scalar and the per-position predictions for one case, from `dsjax.moments`' measurement of
  its first `num_batches` batches (the scalar prediction's anchor); 'measured' is that measurement's
  layer-1 / layer-192 ratio (through the instrumentation probe; the plain-`jnp` one of
  `dslm_positions.py` differs from it by float rounding, amplified along the depth)."""
  c = dslm_moments.case_config(case, **dslm_positions.SHAPE, seed=seed)
  info = data.dataset_info(c.data)
  model = moments.load_model(c, info, None)
  batches = [jax.device_put(b) for b in itertools.islice(state.whole_train_batches(c), num_batches)]
  measured, _ = moments.measure(model, c, batches)
  desc = theory_adapter.describe(c, model, info)
  scalar, settings = theory_adapter.predict_described(desc, measured)
  grads = propagate_positions(desc, Stats(**settings['input']), GradStats(**settings['grad_at_last_layer']))
  first, last = np.diag(grads[1]), np.diag(grads[-1])  # layer outputs are the FFN adds
  measured_grad = measured[('ffn_residual', 'grad_var')]
  return {
    'ratio_layer1_over_layer192': {
      'measured': float(measured_grad[0] / measured_grad[desc.depth - 1]),
      'scalar_theory': float(scalar['grad_var'][0] / scalar['grad_var'][-1]),
      'position_theory': float(first.mean() / last.mean()),
    },
    'position_theory_layer1_share': _bands(first),
    'position_theory_band_ratio': {
      f'{lo}-{hi - 1}': float(first[lo:hi].mean() / last[lo:hi].mean()) for lo, hi in dslm_positions.BANDS
    },
    'position_theory_layer1_per_position': (first / first.sum()).tolist(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--seed', type=int, default=0, help='Initial weights, batches and dropout masks.')
  parser.add_argument('--batches', type=int, default=8, help='Batches measured.')
  parser.add_argument('--check_trials', type=int, default=20000, help='Monte Carlo trials of the head map.')
  args = parser.parse_args()
  if args.batches < 1 or args.check_trials < 1:
    sys.exit(f'--batches and --check_trials must be >= 1, got {args.batches}, {args.check_trials}')
  os.makedirs(args.out, exist_ok=True)
  result = {
    'shape': dslm_positions.SHAPE,
    'seed': args.seed,
    'batches': args.batches,
    'check': {},
    'cases': {},
  }
  for rg in (0.0, 0.3):  # the head map against sampling: d_in 64, d_head 16, 32 positions, r 0.1
    sampled, predicted = monte_carlo_head(
      check_gamma(32, rg), r=0.1, d_in=64, d_head=16, trials=args.check_trials
    )
    bands = lambda m: {b: float(np.diag(m)[lo:hi].mean()) for b, (lo, hi) in CHECK_BANDS.items()}  # noqa: E731
    result['check'][f'rg={rg}'] = {'sampled': bands(sampled), **{k: bands(v) for k, v in predicted.items()}}
    print(f'head map check rg={rg}:', result['check'][f'rg={rg}'], flush=True)
  result['weighting'] = weighting_comparison(args.check_trials)
  print('factorised against exact key weights:', result['weighting'], flush=True)
  measured_path = os.path.join(MEASURED_POSITIONS, f'seed{args.seed}.json')
  measured_positions = {}
  if os.path.exists(measured_path):
    with open(measured_path) as f:
      measured_positions = json.load(f)['cases']
  for case in dslm_positions.CASES:
    out = predict_case(case, args.seed, args.batches)
    if case in measured_positions:
      out['measured_layer1_share'] = {
        b: v['layer1_share'] for b, v in measured_positions[case]['bands'].items()
      }
      out['measured_band_ratio'] = {
        b: v['ratio_layer1_over_layer192'] for b, v in measured_positions[case]['bands'].items()
      }
    result['cases'][case] = out
    print(case, json.dumps({k: v for k, v in out.items() if 'per_position' not in k}), flush=True)
  with open(os.path.join(args.out, f'seed{args.seed}.json'), 'w') as f:
    json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
