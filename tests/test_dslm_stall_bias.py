"""experiments/dslm_stall_bias.py: without the bias its independent loop trains as `dsjax.main` does (its
optimizers are dsjax's, update for update), its gradients are the plain reference's, a uniform bias leaves
the first loss as it is, the centred logits' gradient is the one written out by hand, its summaries read
the runs, and the plain reference's residual sums' parts add up."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax import data as data_lib  # noqa: E402
from dsjax import schemes  # noqa: E402
from dsjax.train import loop, optimizers  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import dslm_stall_bias  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402


def _config(block: str = 'postln'):
  c = tiny_config('gpt', block=block, dropout=0.1, activation='relu', depth=3)
  c.model.scheme = 'dslm'
  c.model.tie_embeddings = True
  c.optimizer.schedule, c.optimizer.min_lr_ratio, c.optimizer.warmup_steps = 'linear', 0.01, 2
  c.optimizer.lr, c.optimizer.b2, c.optimizer.weight_decay = 3e-3, 0.999, 0.01
  c.total_steps, c.log_every = 4, 1
  return c


def _tiny_arm_and_batch():
  """The tiny arm's model, spec, parameters and constants, and a random batch with its dropout masks."""
  config = _config()
  info, model, spec = dslm_stall_bias.arm_model(config)
  params, constants = ref.split_model(model)
  tokens_BL1 = jax.random.randint(jax.random.key(3), (2, 17), 0, info.vocab_size)
  masks = ref.dropout_masks(spec, step_lib.dropout_key_for_step(config.seed, 0), 2, 16)
  return model, spec, params, constants, tokens_BL1, masks


# Slow (25 s): its parts run by default, the optimizers update for update with dsjax's
# (test_the_optimizer_is_dsjaxs_update_for_update) and the gradients against the plain reference's
# (test_the_measured_gradients_are_the_plain_references).
@pytest.mark.slow
def test_without_the_bias_the_loop_trains_as_dsjax(tmp_path):
  config = _config()
  loop.train_and_evaluate(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    logged = [r for r in map(json.loads, f) if 'train/loss' in r]
  ours = dslm_stall_bias.train(config, 'none', updates=4, measure_every=2)
  np.testing.assert_allclose(ours['train_losses'], [r['train/loss'] for r in logged], rtol=1e-5)
  np.testing.assert_allclose(ours['grad_norms'], [r['train/grad_norm'] for r in logged], rtol=1e-4)
  assert [row['updates'] for row in ours['rows']] == [0, 2, 3]
  assert all(row['logit_shared'] < row['logit_variance'] for row in ours['rows'])


def test_logit_parts_split_the_shared_logits_and_their_loss():
  vocab, targets_BL = 5, np.array([[0, 0, 1, 2], [0, 1, 0, 3]])
  flat = dslm_stall_bias.logit_parts(np.zeros((2, 4, vocab)), targets_BL)
  np.testing.assert_allclose(flat['shared_logit_loss'], np.log(vocab))
  assert flat['logit_variance'] == flat['logit_shared'] == 0
  # shared logits at the targets' log-frequencies give their entropy (the unigram loss), whatever varies
  # from position to position around them
  frequencies_V = np.bincount(targets_BL.ravel(), minlength=vocab) / targets_BL.size
  log_f_V = np.log(np.maximum(frequencies_V, 1e-30))
  wobble_BLV = np.random.default_rng(0).normal(size=(2, 4, vocab))
  parts = dslm_stall_bias.logit_parts(log_f_V + wobble_BLV - wobble_BLV.mean(axis=(0, 1)), targets_BL)
  entropy = -(frequencies_V[frequencies_V > 0] * np.log(frequencies_V[frequencies_V > 0])).sum()
  np.testing.assert_allclose(parts['shared_logit_loss'], entropy, rtol=1e-6)
  np.testing.assert_allclose(parts['logit_shared'], log_f_V.var())


@pytest.mark.parametrize('name', dslm_stall_bias.OPTIMIZERS)
def test_the_optimizer_is_dsjaxs_update_for_update(name):
  """20 updates of random gradients through the warm-up and the decay: the same parameters, and the same
  weight-decay mask (the matrices and the token table), with AdamW and with mSGDW."""
  config = _config()
  config.total_steps, config.optimizer.warmup_steps, config.optimizer.weight_decay = 20, 3, 0.1
  if name == 'msgdw':
    config.optimizer.update(name='msgdw', **dslm_stall_bias.MSGDW)
    config.optimizer.lr, config.optimizer.weight_decay = 0.3, 0.1  # a decay large enough to show
  params, _ = ref.split_model(
    schemes.build_model(config, data_lib.dataset_info(config.data), nnx.Rngs(params=0))
  )
  ours, theirs = dslm_stall_bias.make_optimizer(config), optimizers.make_optimizer(config.optimizer, 20)[0]

  @jax.jit  # One compilation, not one per operation.
  def random_grads(i):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), i), len(leaves))
    return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])

  def step(tx):
    @jax.jit
    def apply(grads, s, p):
      u, s = tx.update(grads, s, p)
      return optax.apply_updates(p, u), s

    return apply

  step_ours, step_theirs = step(ours), step(theirs)
  p_ours, p_theirs = params, params
  s_ours, s_theirs = jax.jit(ours.init)(params), jax.jit(theirs.init)(params)
  for i in range(20):
    grads = random_grads(i)
    p_ours, s_ours = step_ours(grads, s_ours, p_ours)
    p_theirs, s_theirs = step_theirs(grads, s_theirs, p_theirs)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p_ours, p_theirs)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), p_ours, params)
  assert min(jax.tree.leaves(moved)) > 0


def test_msgdw_replaces_the_arms_adamw_and_nothing_else():
  args = ('64x32', 'postln', 'dslm', 0.3, 0, dslm_stall_bias.TOKENIZER)
  adamw, msgdw = dslm_stall_bias.arm_config(*args), dslm_stall_bias.arm_config(*args, optimizer='msgdw')
  o = msgdw.optimizer
  assert (o.name, o.momentum, o.nesterov, o.weight_decay) == ('msgdw', 0.9, False, 1e-4)
  for key in ('lr', 'schedule', 'warmup_steps', 'min_lr_ratio', 'clip_norm'):
    assert msgdw.optimizer[key] == adamw.optimizer[key], key
  assert msgdw.model == adamw.model and msgdw.data == adamw.data


def test_the_measured_gradients_are_the_plain_references():
  model, spec, params, constants, tokens, masks = _tiny_arm_and_batch()
  row = dslm_stall_bias.measure(
    jax.grad(dslm_stall_bias.make_loss(spec, constants), argnums=3),
    params,
    constants,
    tokens,
    spec,
    masks,
    [0, 1, 2],
  )
  g_NBLD = np.asarray(ref.layer_output_grads(ref.reference_tree(model), tokens, spec, masks), np.float64)
  var_N = g_NBLD.var(axis=(1, 2, 3))
  np.testing.assert_allclose(row['grad_var_over_last'], var_N / var_N[-1], rtol=1e-5)


# Slow (12 s): the bias's loop runs by default in test_it_trains_the_bias_loops_run_and_its_parts_add_up
# (tests/test_dslm_stall_shared.py).
@pytest.mark.slow
def test_a_uniform_bias_leaves_the_first_loss_as_it_is(monkeypatch):
  config = _config()
  monkeypatch.setattr(
    dslm_stall_bias.gpu_decisive,
    'train_log_frequencies',
    lambda config, vocab: np.full(vocab, -np.log(vocab)),
  )
  with_bias = dslm_stall_bias.train(config, 'unigram', updates=1, measure_every=1)
  without = dslm_stall_bias.train(config, 'none', updates=1, measure_every=1)
  # a constant bias shifts every logit alike: the same loss as without it, before any update
  assert with_bias['train_losses'][0] == pytest.approx(without['train_losses'][0], rel=1e-6)


def test_the_centred_gradient_is_the_identity_less_the_mean_over_positions():
  z_BLV = jax.random.normal(jax.random.key(0), (2, 5, 7))
  c_BLV = jax.random.normal(jax.random.key(1), (2, 5, 7))
  np.testing.assert_array_equal(dslm_stall_bias.centred_gradient(z_BLV), z_BLV)
  grad = jax.grad(lambda z: (dslm_stall_bias.centred_gradient(z) * c_BLV).sum())(z_BLV)
  np.testing.assert_allclose(grad, c_BLV - c_BLV.mean(axis=(0, 1)), atol=1e-6)


def test_the_centred_loss_gives_the_layers_the_centred_cross_entropy_gradient():
  """The loss is unchanged; the layer gradients are the logits' VJP of the cross-entropy's gradient less
  its mean over positions, written out by hand (softmax − one-hot, over the number of positions)."""
  model, spec, params, constants, tokens_BL1, masks = _tiny_arm_and_batch()
  deltas_NBLD = jnp.zeros((spec.depth, 2, 16, spec.width))
  full = dslm_stall_bias.make_loss(spec, constants)
  centred = dslm_stall_bias.make_loss(spec, constants, 'centred')
  assert centred(params, tokens_BL1, masks) == full(params, tokens_BL1, masks)

  tree = ref.reference_tree(model)
  z_BLV, vjp = jax.vjp(lambda d: ref.logits(tree, tokens_BL1[:, :-1], spec, masks, d), deltas_NBLD)
  g_BLV = (jax.nn.softmax(z_BLV) - jax.nn.one_hot(tokens_BL1[:, 1:], z_BLV.shape[-1])) / (2 * 16)
  (expected_NBLD,) = vjp(g_BLV - g_BLV.mean(axis=(0, 1)))
  got_NBLD = jax.grad(centred, argnums=3)(params, tokens_BL1, masks, deltas_NBLD)
  np.testing.assert_allclose(got_NBLD, expected_NBLD, rtol=1e-4, atol=1e-5 * np.abs(expected_NBLD).max())
  # and the frequencies' part is not negligible here: without the centring the gradients differ
  assert not np.allclose(jax.grad(full, argnums=3)(params, tokens_BL1, masks, deltas_NBLD), got_NBLD)


def test_a_runs_variant_names_what_it_changed():
  run = {'bias': 'none'}
  assert dslm_stall_bias.variant(run) == 'none'
  run.update(logit_grad='centred', logit_scale=0.17)
  assert dslm_stall_bias.variant(run) == 'none centred logits ×0.17'
  assert dslm_stall_bias.variant({'bias': 'unigram', 'logit_grad': 'full', 'logit_scale': 1.0}) == 'unigram'
  assert dslm_stall_bias.variant({'bias': 'none', 'dslm_k': 2.0}) == 'none'
  run = {'bias': 'none', 'logit_grad': 'centred', 'dslm_k': 32.0}
  assert dslm_stall_bias.variant(run) == 'none centred k=32'
  assert dslm_stall_bias.variant({'bias': 'none', 'optimizer': 'adamw'}) == 'none'
  run = {'bias': 'none', 'logit_grad': 'centred', 'optimizer': 'msgdw'}
  assert dslm_stall_bias.variant(run) == 'none centred mSGDW'


def test_dslm_k_is_set_for_dslm_and_refused_for_vanilla():
  args = ('64x32', 'postln', 'dslm', 3e-3, 0, dslm_stall_bias.TOKENIZER)
  assert dslm_stall_bias.arm_config(*args, dslm_k=32.0).model.dslm.k == 32.0
  assert dslm_stall_bias.arm_config(*args).model.dslm.k == 2.0
  with pytest.raises(ValueError, match='--dslm_k: only with --scheme=dslm'):
    dslm_stall_bias.arm_config('64x32', 'postln', 'vanilla', 3e-3, 0, dslm_stall_bias.TOKENIZER, 32.0)


def test_the_initial_logit_spread_splits_off_the_part_every_position_shares():
  spread = dslm_stall_bias.initial_logit_spread(_config())
  assert 0 <= spread['logit_shared'] < spread['logit_variance'] and np.isfinite(spread['logit_variance'])


def test_only_the_sweeps_optimizer_is_implemented():
  config = _config()
  config.optimizer.schedule = 'cosine'
  with pytest.raises(ValueError, match='linear schedule'):
    dslm_stall_bias.make_optimizer(config)


def test_residual_sum_parts_add_up_and_split_the_shared_part():
  rng = np.random.default_rng(0)
  shared_B1D = rng.normal(size=(3, 1, 8))
  x_BLD = rng.normal(size=(3, 10, 8)) + 2.0 * shared_B1D
  h_BLD = 0.5 * rng.normal(size=(3, 10, 8)) + shared_B1D  # shares the sequence's direction with x
  parts = dict(
    zip(ref.SUM_PARTS, np.asarray(ref._sum_parts(0.9, jnp.asarray(x_BLD), 0.3, jnp.asarray(h_BLD))))
  )
  sum_BLD = 0.9 * x_BLD + 0.3 * h_BLD
  total = parts['skip_var'] + parts['branch_var'] + parts['cross_shared'] + parts['cross_own']
  assert total == pytest.approx(sum_BLD.var(-1).mean(), rel=1e-5)
  xc = x_BLD - x_BLD.mean(-1, keepdims=True)
  hc = h_BLD - h_BLD.mean(-1, keepdims=True)
  assert parts['cross_shared'] == pytest.approx(2 * 0.9 * 0.3 * (xc.mean(1) * hc.mean(1)).mean(), rel=1e-5)
  assert parts['skip_shared_fraction'] > 0.6 and parts['cross_shared'] > 5 * abs(parts['cross_own'])


def test_the_summary_table_reads_the_runs(tmp_path):
  rows = [
    {
      'updates': u,
      'layers': [0, 16, 32, 63],
      'grad_var_over_last': [10.0**-u, 1, 1, 1],
      'corr_seq': [0, 0.5, 0.9, 0.99],
    }
    for u in (0, 10, 20)
  ]
  run = {
    'arm': {'shape': '64x32', 'block': 'postln', 'scheme': 'dslm', 'lr': 3e-3, 'seed': 1},
    'bias': 'none',
    'rows': rows,
    'train_losses': [8.0] * 16 + [7.0] * 5,
  }
  (tmp_path / 'r.json').write_text(json.dumps(run))
  line = dslm_stall_bias.summary_table([str(tmp_path / 'r.json')]).splitlines()[-1]
  cells = [c.strip() for c in line.strip('|').split('|')]
  assert cells == [
    'dslm postln 64x32, lr 0.003, update 20',
    'none',
    '1',
    '1e-10 / 1e-20 / –',
    '0.50 / 0.90 / 0.99',
    '7.000',
  ]


def test_the_contrasts_compare_each_variant_with_no_bias(tmp_path):
  paths = []
  for variant, ratios in (('none', (1e-12, 1e-10)), ('unigram', (0.5, 0.7)), ('centred', (1e-3, 1e-1))):
    bias = 'none' if variant == 'centred' else variant
    for seed, ratio in enumerate(ratios):
      row = {
        'updates': 40,
        'layers': [0, 16, 32, 63],
        'grad_var_over_last': [ratio, 1, 1, 1],
        'corr_seq': [0, 0.5, 0.9, 0.99 if bias == 'none' else 0.5],
        'residual_sum_parts': {'ffn': {'cross_shared': [0.0, 0.1, 0.3 + seed / 10, 0.2]}},
      }
      # An earlier measurement, and one after `update`, which the measures so far must not read.
      earlier = {**row, 'updates': 10, 'grad_var_over_last': [1e-20, 1, 1, 1], 'corr_seq': [0, 0, 0, 0.95]}
      later = {**row, 'updates': 50, 'grad_var_over_last': [1e20, 1, 1, 1], 'corr_seq': [0, 0, 0, 1.0]}
      run = {
        'arm': {'shape': '64x32', 'block': 'postln', 'scheme': 'dslm', 'lr': 3e-3, 'seed': seed},
        'bias': bias,
        'logit_grad': 'centred' if variant == 'centred' else 'full',
        'rows': [earlier, row, later],
        'train_losses': [7.0] * 51,
      }
      paths.append(str(tmp_path / f'{variant}_{seed}.json'))
      with open(paths[-1], 'w') as f:
        json.dump(run, f)
  lines = dslm_stall_bias.contrast_lines(paths).splitlines()
  assert len(lines) == 7
  lowest = next(line for line in lines if 'lowest log10 gradient ratio so far' in line)
  assert 'none -20.00 ± 0.00' in lowest and 'unigram − none +0.00' in lowest
  highest = next(line for line in lines if 'highest log10 gradient ratio so far' in line)
  assert 'none -11.00 ± 1.41' in highest and 'unigram − none +10.' in highest
  peak = next(line for line in lines if 'highest token correlation' in line)
  assert 'none 0.99 ± 0.00' in peak and 'unigram 0.95 ± 0.00' in peak
  ratio_line = next(line for line in lines if ', log10 gradient ratio:' in line)
  assert 'none -11.00 ± 1.41 (-12.00–-10.00), n 2' in ratio_line and 'unigram − none +10.' in ratio_line
  assert 'centred − none +9.00' in ratio_line
  against_the_bias = dslm_stall_bias.contrast_lines(paths, baseline='unigram')
  assert 'none − unigram -10.' in against_the_bias and 'centred − unigram' in against_the_bias
  last_line = next(line for line in lines if 'correlation, last layer' in line)
  assert 'unigram − none -0.49 [-0.49, -0.49]' in last_line
  # at update 10, the earlier measurement alone
  at_10 = dslm_stall_bias.contrast_lines(paths, update=10)
  assert 'at update 10, log10 gradient ratio: none -20.00 ± 0.00' in at_10 and 'at update 40' not in at_10


def test_the_contrasts_read_the_logit_parts_and_the_clipped_updates_where_recorded(tmp_path):
  paths = []
  for seed in (0, 1):
    row = {
      'updates': 4,
      'layers': [0, 63],
      'grad_var_over_last': [0.1, 1],
      'corr_seq': [0, 0.5],
      'residual_sum_parts': {'ffn': {'cross_shared': [0.0, 0.1]}},
      'logit_variance': 0.2,
      'logit_shared': 0.1,
      'shared_logit_loss': 8.5 + seed,
    }
    run = {
      'arm': {'shape': '64x32', 'block': 'postln', 'scheme': 'vanilla', 'lr': 0.3, 'seed': seed},
      'bias': 'none',
      'optimizer': 'msgdw',
      'clip_norm': 1.0,
      'rows': [row],
      'train_losses': [8.0, 8.0, 8.0, 8.0, 7.5 + seed, 9.0],
      # updates 1-4 came before the row; the 6th is after it and must not count
      'grad_norms': [0.5, 1.5, 2.0 + seed, 0.9, 3.0, 3.0],
    }
    paths.append(str(tmp_path / f'{seed}.json'))
    with open(paths[-1], 'w') as f:
      json.dump(run, f)
  lines = dslm_stall_bias.contrast_lines(paths, update=4, baseline='none mSGDW').splitlines()
  line = lambda name: next(x for x in lines if name in x)  # noqa: E731
  assert 'none mSGDW 9.00 ± 0.71 (8.50–9.50), n 2' in line('loss of the shared logits alone')
  assert 'none mSGDW 8.00 ± 0.71 (7.50–8.50), n 2' in line("loss on the update's batch")
  assert 'none mSGDW 2.00 ± 0.00' in line('updates clipped so far')


def test_the_logit_parts_lines_count_the_updates_above_flat_logits_and_the_collapsed_ones(tmp_path):
  flat = np.log(4096)
  rows = [
    {'updates': u, 'layers': [0, 63], 'corr_seq': [0, corr], 'logit_variance': 0.1, 'logit_shared': shared}
    | {'shared_logit_loss': loss}
    for u, corr, shared, loss in ((10, 0.2, 0.0, 9.0), (15, 0.5, 0.05, flat - 0.1), (20, 0.99, 0.099, 9.5))
  ]
  run = {
    'arm': {'shape': '64x32', 'block': 'postln', 'scheme': 'vanilla', 'lr': 0.3, 'seed': 2},
    'bias': 'none',
    'logit_grad': 'centred',
    'rows': rows,
    'train_losses': [8.0] * 20 + [9.45],
  }
  (tmp_path / 'r.json').write_text(json.dumps(run))
  (line,) = dslm_stall_bias.logit_parts_lines([str(tmp_path / 'r.json')]).splitlines()
  assert 'seed 2' in line and f'from update 15 on {flat - 0.1:.2f}–9.50' in line
  assert 'at 1 of 2 measured updates' in line  # update 10 is before from_update
  assert 'at the 1 with the last layer at ≥ 0.97: shared share ≥ 0.990' in line
  assert "loss 9.45–9.45, shared logits' loss 9.50–9.50, |difference| ≤ 0.050" in line
