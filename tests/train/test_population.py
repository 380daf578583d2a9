"""The population trainer: a member is the run the real loop does with its lr and seed."""

import numpy as np
import pytest

from dsjax.train import config as config_lib
from dsjax.train import loop, population


def _tiny_gpt(optimizer: str):
  c = config_lib.base_config('gpt', optimizer_name=optimizer)
  c.model.depth, c.model.width, c.model.num_heads = 2, 32, 2
  c.data.seq_len = 32
  c.batch_size, c.eval_batch_size = 8, 64
  c.total_steps = c.eval_every = c.checkpoint_every = 6
  c.optimizer.warmup_steps = 2
  return c


@pytest.mark.slow  # ~35 s: two runs of the real loop next to the population.
def test_member_matches_the_loop(tmp_path):
  c = _tiny_gpt('msgdw')
  c.model.block, c.model.dnt_setting, c.model.norm = 'dnt', 'S5', 'rmsnorm'
  lrs, seeds = (0.3, 0.05), (0, 1)
  result = population.train(c, population.grid(lrs, seeds), verbose=False)
  for member in result['members'][::3]:  # (0.3, seed 0) and (0.05, seed 1)
    run = c.copy_and_resolve_references()
    run.optimizer.lr, run.seed = member['lr'], member['seed']
    final = loop.train_and_evaluate(run, str(tmp_path / f'{member["lr"]}_{member["seed"]}'))
    np.testing.assert_allclose(member['final']['eval/loss'], final['eval/loss'], rtol=2e-5)
  assert not any(m['diverged'] for m in result['members'])
  assert len({m['final']['eval/loss'] for m in result['members']}) == 4  # lrs and seeds both matter.


@pytest.mark.slow
def test_divergent_member_is_reported_and_others_train():
  c = _tiny_gpt('adamw')
  result = population.train(c, population.grid((1e-3, 1e4), (0,)), verbose=False)
  ok, bad = result['members']
  assert not ok['diverged'] and np.isfinite(ok['final']['eval/loss'])
  assert bad['diverged'] or bad['final']['eval/loss'] > ok['final']['eval/loss']


def test_a_member_on_its_splits_is_the_loop_on_them(tmp_path):
  """The fast variant: one member, three steps, trained on one split, reported on another."""
  c = _tiny_gpt('adamw')
  c.total_steps = c.eval_every = c.checkpoint_every = 3
  c.optimizer.warmup_steps = 1
  c.data.train_split, c.data.eval_split = 'train', 'validation[:50%]'
  c.optimizer.clip_norm = 1e-6  # Every step's gradient is clipped, and counted.
  member = population.train(c, population.grid([3e-3], [1]), report_split='validation[50%:]', verbose=False)
  member = member['members'][0]
  run = c.copy_and_resolve_references()
  run.optimizer.lr, run.seed, run.data.eval_split = 3e-3, 1, 'validation[50%:]'
  final = loop.train_and_evaluate(run, str(tmp_path / 'run'))
  np.testing.assert_allclose(member['report']['eval/loss'], final['eval/loss'], atol=2e-5)
  assert member['final']['eval/loss'] != member['report']['eval/loss']  # two different splits
  assert member['clipped_steps'] == 3


def test_model_variants_evaluate_the_final_state_in_another_model():
  """A variant with the run's own key value is the run's evaluation; an FP8 cast moves the loss a little;
  a key that changes the parameters is refused before anything trains."""
  c = _tiny_gpt('adamw')
  c.total_steps = c.eval_every = c.checkpoint_every = 3
  variants = {'same': {'matmul_cast': 'none'}, 'e5m2': {'matmul_cast': 'float8_e5m2'}}
  (member,) = population.train(c, population.grid([1e-3], [0]), model_variants=variants, verbose=False)[
    'members'
  ]
  assert member['final/same'] == member['final']
  loss, cast = member['final']['eval/loss'], member['final/e5m2']['eval/loss']
  assert cast != loss and abs(cast - loss) < 0.1 * loss
  with pytest.raises(ValueError, match=r"model_variants: only \[.*\] may change, got \['depth'\]"):
    population.train(c, population.grid([1e-3], [0]), model_variants={'deeper': {'depth': 4}}, verbose=False)
  with pytest.raises(ValueError, match=r'model.matmul_cast must be one of'):
    population.train(
      c, population.grid([1e-3], [0]), model_variants={'e': {'matmul_cast': 'fp8'}}, verbose=False
    )
