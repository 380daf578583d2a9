r"""Times the text path on `python_stdlib`: training a BPE tokenizer, tokenizing the corpus once, and
reading training batches from the memory-mapped token cache.

  python benchmarks/cpu_text_data.py [--vocab_size=4096] [--seq_len=128] [--batch_size=32]
      [--json=benchmarks/results/cpu2_text_data.json]

Everything goes to a fresh temporary directory (the tokenizer, the data dir), so the tokenizing is timed
from scratch. Prints one line per number; `--json` also writes them.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

from absl import flags

from dsjax import data
from dsjax import tokenizer as tokenizer_cli
from dsjax.train import cli

_VOCAB = flags.DEFINE_integer('vocab_size', 4096, 'Tokens of the BPE tokenizer.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 128, 'data.seq_len of the batches read.')
_BATCH = flags.DEFINE_integer('batch_size', 32, 'Rows per batch read.')
_BATCHES = flags.DEFINE_integer('batches', 1000, 'Batches read for the reading time.')
_JSON = flags.DEFINE_string('json', None, 'Also write the results to this JSON file.')


def _max_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {argv[1:]}')
  for flag in (_VOCAB, _SEQ_LEN, _BATCH, _BATCHES):
    if flag.value < 1:
      raise ValueError(f'--{flag.name}={flag.value}: must be a positive integer')
  if _JSON.value:
    cli.create_output_file('--json', _JSON.value)
  results = {'python': sys.version.split()[0], 'cpus': os.cpu_count(), 'vocab_size': _VOCAB.value}
  with tempfile.TemporaryDirectory() as scratch:
    t0 = time.perf_counter()
    info = tokenizer_cli.train('python_stdlib', _VOCAB.value, os.path.join(scratch, 'tokenizer'))
    results['tokenizer_command_s'] = round(time.perf_counter() - t0, 2)
    results['tokenizer_training_s'] = info['seconds']
    results['validation_bytes_per_token'] = info['validation']['bytes_per_token']

    config = data.get_config('python_stdlib')
    config.update(
      data_dir=os.path.join(scratch, 'data'),
      seq_len=_SEQ_LEN.value,
      tokenizer=os.path.join(scratch, 'tokenizer', tokenizer_cli.TOKENIZER_FILE),
    )
    rss_before = _max_rss_mb()
    t0 = time.perf_counter()
    pipeline = data.make_pipeline(
      config, global_batch_size=_BATCH.value, seed=0, process_index=0, process_count=1
    )
    results['tokenize_train_split_s'] = round(time.perf_counter() - t0, 2)
    results['train_tokens'] = len(pipeline.stream)
    next(pipeline)
    t0 = time.perf_counter()
    for _ in range(_BATCHES.value):
      next(pipeline)
    results['read_ms_per_batch'] = round((time.perf_counter() - t0) / _BATCHES.value * 1e3, 4)
    results['batch'] = [_BATCH.value, _SEQ_LEN.value + 1]
    results['max_rss_mb_before_pipeline'] = round(rss_before, 1)
    results['max_rss_mb_after_reading'] = round(_max_rss_mb(), 1)
  for key, value in results.items():
    print(f'{key}: {value}')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  cli.run(main)  # user errors as one line, without a traceback
