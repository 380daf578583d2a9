"""experiments/dslm_stall_shared.py: it trains the run `dslm_stall_bias.py` trains, its split of the token
table's gradient into the head's and the input embedding's is the one each use gives alone, its parts of
the table's update add up to the optimizer's, at a small lr its first-order parts add up to the shared
logits' loss's change and each part applied alone changes it by its first-order part, and its summary sums
what it says; a bad flag ends it in one line."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from experiments import dslm_stall_bias, dslm_stall_shared  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402
from tests.helpers import REPO_ROOT, subprocess_env, tiny_config  # noqa: E402


def _config(lr: float):
  c = tiny_config('gpt', block='postln', dropout=0.1, activation='relu', depth=3)
  c.model.scheme, c.model.tie_embeddings = 'vanilla', True
  c.optimizer.update(name='msgdw', **dslm_stall_bias.MSGDW)
  c.optimizer.schedule, c.optimizer.min_lr_ratio, c.optimizer.warmup_steps = 'linear', 0.01, 2
  c.optimizer.lr, c.optimizer.clip_norm = lr, 1.0
  c.total_steps = 5
  return c


def test_the_head_gradient_is_the_table_as_output_layer_alone():
  config = _config(0.3)
  _, model, spec = dslm_stall_bias.arm_model(config)
  params, constants = ref.split_model(model)
  tokens_BL1 = jax.random.randint(jax.random.key(1), (2, 17), 0, params['token_embed'].shape[0])
  masks = ref.dropout_masks(spec, jax.random.key(2), 2, 16)
  loss = dslm_stall_bias.make_loss(spec, constants, 'centred')
  tied = jax.grad(loss)(params, tokens_BL1, masks)['token_embed']
  head = dslm_stall_shared.make_head_grad(spec, constants, 'centred')(params, tokens_BL1, masks)

  # the input embedding's part on its own: the table differentiated with its use as the head held fixed
  def loss_of_input_table(table):
    tree = dslm_stall_bias.reference_tree({**params, 'token_embed': table}, constants)
    tree['head'] = {'kernel': jax.lax.stop_gradient(table).T}
    untied = dataclasses.replace(spec, tied=False)
    z_BLV = dslm_stall_bias.centred_gradient(ref.logits(tree, tokens_BL1[:, :-1], untied, masks))
    return ref.cross_entropy(z_BLV, tokens_BL1[:, 1:])

  given_input = jax.grad(loss_of_input_table)(params['token_embed'])
  np.testing.assert_allclose(head + given_input, tied, rtol=1e-4, atol=1e-7)
  assert float(jnp.abs(head).max()) > 0 and float(jnp.abs(given_input).max()) > 0


def test_it_trains_the_bias_loops_run_and_its_parts_add_up():
  config = _config(1e-3)  # an lr small enough for the first order
  ours = dslm_stall_shared.train(config, updates=4, logit_grad='centred')
  theirs = dslm_stall_bias.train(config, 'none', updates=4, measure_every=10, logit_grad='centred')
  np.testing.assert_allclose(ours['train_losses'], theirs['train_losses'], rtol=1e-6)
  np.testing.assert_allclose(ours['grad_norms'], theirs['grad_norms'], rtol=1e-5)
  for row in ours['attribution']:
    assert row['table_split_error'] < 1e-5
    change = row['shared_loss_after'] - row['shared_loss_before']
    first_order = sum(row['first_order'].values())
    assert first_order == pytest.approx(change, rel=0.1, abs=1e-6), row
    # at this lr each part alone changes the loss by its first-order part
    for name, value in row['alone'].items():
      assert value == pytest.approx(row['first_order'][name], rel=0.1, abs=2e-7), (name, row)
  assert [r['update'] for r in ours['attribution']] == [1, 2, 3, 4]
  assert ours['attribution'][0]['first_order']['head'] == 0.0  # the warm-up's lr at the first update is 0


def test_a_bad_flag_is_one_line_and_writes_nothing(tmp_path):
  out = tmp_path / 'run.json'
  result = subprocess.run(
    [sys.executable, 'experiments/dslm_stall_shared.py', '--updates=0', f'--out={out}'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    env=subprocess_env(),
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ['dslm_stall_shared.py: error: --updates must be ≥ 1, got 0']
  assert not out.exists()


def test_adam_is_refused():
  config = _config(0.3)
  config.optimizer.name = 'adamw'
  with pytest.raises(ValueError, match='mSGDW'):
    dslm_stall_shared.train(config, updates=1)


def test_the_summary_sums_the_windows(tmp_path):
  parts = dict(zip(dslm_stall_shared.PARTS, (0.05, 0.02, 0.0, 0.03, 0.0)))
  rows = [
    {
      'update': u,
      'shared_loss_before': 8.0 + 0.1 * (u - 1),
      'shared_loss_after': 8.0 + 0.1 * u,
      'first_order': parts,
      'alone': {k: 2 * v for k, v in parts.items()},
      'table_split_error': 1e-7,
    }
    for u in range(1, 11)
  ]
  path = tmp_path / 'run.json'
  path.write_text(json.dumps({'attribution': rows}))
  lines = dslm_stall_shared.summary([str(path)], windows=((1, 10), (11, 20))).splitlines()
  assert len(lines) == 3  # the header, its rule, and the one complete window
  assert lines[2] == (
    '| run | 1–10 | 8.000 → 9.000 | +1.000 | +2.000 | +1.000 (+0.500) | +0.400 (+0.200) | +0.000 (+0.000) '
    '| +0.600 (+0.300) | +0.000 (+0.000) |'
  )
