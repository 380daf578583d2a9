"""The per-position gradient theory of `experiments/dslm_position_theory.py` holds together.

Its causal-head map, averaged over positions, is `dsjax.theory.components`' causal attention; it
matches a Monte Carlo of the head (plain `jnp`, `jax.vjp`) on every band of positions, where the
factorised weighting of the key path overshoots the first positions; and the whole stack runs from a
model description.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax.instrument import theory_adapter  # noqa: E402
from dsjax.theory import components as C  # noqa: E402
from dsjax.theory.components import GradStats, Stats  # noqa: E402
from experiments import dslm_position_theory as T  # noqa: E402

HEAD = dict(d_in=64, d_head=16, p=0.1, qk_prod=64**-2.0, v_var=3 / 64)


@pytest.mark.parametrize('r, rg', [(0.1, 0.3), (0.6, 0.0)])
def test_the_map_averages_to_the_scalar_theory(r, rg):
  x, L, g2 = Stats(mean=0.0, var=1.3, corr_seq=r), 16, 0.7
  gamma = g2 * ((1 - rg) * np.eye(L) + rg * np.ones((L, L)))
  m = T.attention_head_map(x, gamma, **HEAD)
  _, _, var_g, cov_g = C._attention_moments(  # pylint: disable=protected-access
    x, GradStats(var=g2, corr_seq=rg), length=L, causal=True, form='exact', **HEAD
  )
  np.testing.assert_allclose(np.diag(m).mean(), var_g, rtol=1e-12)
  np.testing.assert_allclose((m.sum() - np.trace(m)) / (L * (L - 1)), cov_g, rtol=1e-12)


def test_exact_weights_match_sampling_where_factorised_ones_overshoot():
  sampled, predicted = T.monte_carlo_head(T.check_gamma(16, 0.0), r=0.1, d_in=32, d_head=8, trials=4000)
  for lo, hi in ((0, 1), (1, 4), (4, 16)):
    band = lambda m: np.diag(m)[lo:hi].mean()  # noqa: E731
    assert band(predicted['exact_weights']) == pytest.approx(band(sampled), rel=0.08), (lo, hi)
  # The first query's logit gradient is zero; the factorised key path counts it at position 0.
  assert np.diag(predicted['factorised_weights'])[0] > 1.3 * np.diag(sampled)[0]


@pytest.mark.parametrize('block', ['preln', 'postln'])
def test_the_stack_concentrates_the_gradient_on_the_first_positions(block):
  depth, L, d = 8, 16, 32
  desc = theory_adapter.ModelDescription(
    depth=depth,
    width=d,
    num_heads=2,
    mlp_hidden=4 * d,
    seq_len=L,
    dropout=0.1,
    attn_dropout=0.1,
    activation='relu',
    causal=True,
    block=block,
    weight_var={name: np.full(depth, 1 / d) for name in ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')},
    scale={
      name: np.full(depth, 0.9 if 'skip' in name else 0.45)
      for name in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn')
    },
    vocab_size=None,
    embedding_var=None,
  )
  grads = T.propagate_positions(
    desc, Stats(mean=0.0, var=1.0, corr_seq=0.05), GradStats(var=1.0, corr_seq=0.1)
  )
  assert len(grads) == 2 * depth
  top, bottom = np.diag(grads[-1]), np.diag(grads[1])
  np.testing.assert_allclose(top, 1.0)
  assert np.all(np.isfinite(bottom)) and np.all(bottom > 0)
  assert bottom[0] / bottom.sum() > 2 * top[0] / top.sum()
