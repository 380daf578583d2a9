"""The tiny GPT run of tests/e2e/test_multihost.py, as a config file for `python -m dsjax.main`: the same
config trains in the test process (one process, 8 devices) and in two processes of 4 devices each."""

from tests.helpers import tiny_config


def get_config():
  config = tiny_config('gpt', depth=2, width=32, num_heads=4)
  config.total_steps, config.log_every, config.eval_every, config.checkpoint_every = 4, 1, 100, 100
  config.eval_batch_size = 64  # Few evaluation batches: the test is about the training.
  config.mesh.shape = (2, 2, 2)
  return config
