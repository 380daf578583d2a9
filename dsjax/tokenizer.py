r"""Trains a subword tokenizer offline on a dataset's train split.

  python -m dsjax.tokenizer --data=python_stdlib --vocab_size=8192 --out=DIR
      [--data_dir=DIR] [--text_key=text]

`--data` is any text `data.name`: 'python_stdlib', 'text:GLOB', 'python_docs_bytes' or a prepared TFDS
text dataset. The tokenizer is byte-level BPE (`dsjax.data.tokenizer.train_bpe`) with `<|endoftext|>`
(id 0) between documents; the same data and flags give the same file, byte for byte. Point a run at it
with `--config.data.tokenizer=DIR/tokenizer.json`.

Writes
  DIR/tokenizer.json       the Hugging Face `tokenizers` file
  DIR/tokenizer_info.json  {"data", "vocab_size", "sha256", "corpus_sha256", "train_bytes", "seconds",
                           "validation": {"bytes", "tokens", "bytes_per_token"}}
and prints a progress line at least every 10 s and, at the end, the compression on the validation split
(UTF-8 bytes per token; byte level is 1.0).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

from absl import flags

from dsjax.data import config as data_config_lib
from dsjax.data import corpus as corpus_lib
from dsjax.data import pipeline as pipeline_lib
from dsjax.data import sources
from dsjax.data import tokenizer as tokenizer_lib
from dsjax.train import cli
from dsjax.train import history as history_lib

TOKENIZER_FILE = 'tokenizer.json'
INFO_FILE = 'tokenizer_info.json'
MAX_VOCAB_SIZE = 1 << 20


def _say(message: str) -> None:
  print(message, flush=True)


class _Ticker:
  """Prints `message()` every `every_s` seconds from a thread while a long call runs."""

  def __init__(self, message, every_s: float = corpus_lib.PROGRESS_EVERY_S):
    self._message, self._every_s = message, every_s
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._tick, daemon=True)

  def _tick(self):
    while not self._done.wait(self._every_s):
      _say(self._message())

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join()


def _split_documents(data: data_config_lib.DataConfig, split: str):
  """(documents of `split` as UTF-8 bytes, their total bytes or None, the text's identity)."""
  builder, info = sources.open_dataset(data)
  if info.kind != 'text':
    raise ValueError(f'--data={data.name} is an image dataset; a tokenizer needs text')
  if builder is None:
    text = corpus_lib.open_corpus(data.name, data.text_key)
    return text.documents(split), text.num_bytes[split], text.identity
  if split not in info.num_examples:
    raise ValueError(f'--data={data.name} has no {split!r} split; it has {sorted(info.num_examples)}')
  source = builder.as_data_source(split=split)
  total = (info.num_bytes or {}).get(split)
  identity = json.dumps([info.name, info.num_examples, info.fingerprint], sort_keys=True)
  return pipeline_lib.tfds_documents(source, info.feature_keys['text']), total, identity


def train(
  data_name: str, vocab_size: int, out: str, data_dir: str | None = None, text_key: str = 'text'
) -> dict:
  """Trains, checks and writes the tokenizer (nothing is written before every check has passed)."""
  if (
    isinstance(vocab_size, bool)
    or not isinstance(vocab_size, int)
    or not (tokenizer_lib.min_vocab_size() <= vocab_size <= MAX_VOCAB_SIZE)
  ):
    raise ValueError(
      f'--vocab_size={vocab_size}: expected an integer in [{tokenizer_lib.min_vocab_size()}, '
      f'{MAX_VOCAB_SIZE}] (the 256 bytes and the end-of-document token come first)'
    )
  cli.check_output_dir('--out', out)
  history_lib.check_not_a_run('--out', out)
  data = data_config_lib.validate_data_config({'name': data_name, 'data_dir': data_dir, 'text_key': text_key})
  documents, train_bytes, identity = _split_documents(data, 'train')
  validation = _split_documents(data, _eval_split(data))

  read = {'bytes': 0, 'documents': 0}

  def counted():
    for document in documents:
      read['bytes'] += len(document)
      read['documents'] += 1
      yield document.decode('utf-8')

  total = f' of {train_bytes / 1e6:.1f}' if train_bytes else ''
  _say(f'Training a {vocab_size}-token byte-level BPE tokenizer on the train split of {data_name}')
  t0 = time.perf_counter()
  with _Ticker(
    lambda: (
      f'  {time.perf_counter() - t0:.0f}s: read {read["bytes"] / 1e6:.1f}{total} MB '
      f'({read["documents"]:,} documents)'
      + (', merging' if train_bytes and read['bytes'] >= train_bytes else '')
    )
  ):
    backend = tokenizer_lib.train_bpe(counted(), vocab_size)
  seconds = time.perf_counter() - t0
  got = backend.get_vocab_size(with_added_tokens=True)
  if got < vocab_size:
    raise ValueError(
      f'--vocab_size={vocab_size} is larger than the train split of {data_name} supports: '
      f'its {read["bytes"]:,} bytes give only {got} tokens (pairs seen at least twice); '
      f'choose --vocab_size={got} or less, or more text'
    )
  _say(f'Trained in {seconds:.1f}s on {read["bytes"]:,} bytes ({read["documents"]:,} documents)')

  serialized = backend.to_str(pretty=True)
  tokenizer = tokenizer_lib.TextTokenizer(
    spec='(trained)', vocab_size=got, separator=0, sha256='', backend=backend
  )
  val_documents, _, _ = validation
  val_bytes = val_tokens = 0
  t1 = time.perf_counter()
  for batch in corpus_lib.batches(val_documents, 64):
    val_bytes += sum(len(d) for d in batch)
    val_tokens += sum(len(ids) for ids in tokenizer.encode_documents(batch))
  bytes_per_token = val_bytes / max(val_tokens, 1)
  info = {
    'data': data_name,
    'vocab_size': got,
    'sha256': hashlib.sha256(serialized.encode()).hexdigest(),
    'corpus_sha256': identity,
    'train_bytes': read['bytes'],
    'seconds': round(seconds, 2),
    'validation': {
      'bytes': val_bytes,
      'tokens': val_tokens,
      'bytes_per_token': round(bytes_per_token, 4),
      'seconds': round(time.perf_counter() - t1, 2),
    },
  }
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, TOKENIZER_FILE)
  with open(path + '.incomplete', 'w') as f:
    f.write(serialized)
  os.replace(path + '.incomplete', path)
  with open(os.path.join(out, INFO_FILE), 'w') as f:
    json.dump(info, f, indent=1)
  _say(
    f'Validation split: {val_bytes:,} bytes -> {val_tokens:,} tokens, {bytes_per_token:.3f} bytes per token'
  )
  _say(f'Wrote {path} (sha256 {info["sha256"][:16]}…); train with --config.data.tokenizer={path}')
  return info


def _eval_split(data: data_config_lib.DataConfig) -> str:
  return sources.open_dataset(data)[1].eval_split


def _define_flags():
  # Defined only when run as a program, so that importing dsjax.tokenizer defines no absl flags.
  flags.DEFINE_string(
    'data',
    None,
    "The text dataset (data.name): 'python_stdlib', 'text:GLOB', "
    "'python_docs_bytes' or a prepared TFDS text dataset.",
  )
  flags.DEFINE_integer(
    'vocab_size', None, 'Tokens in the vocabulary (the 256 bytes and <|endoftext|> included).'
  )
  flags.DEFINE_string('out', None, 'Output directory for tokenizer.json and tokenizer_info.json.')
  flags.DEFINE_string('data_dir', None, 'data.data_dir (TFDS datasets; default: TFDS default).')
  flags.DEFINE_string('text_key', 'text', 'data.text_key: the text feature / JSON Lines key.')
  flags.mark_flags_as_required(['data', 'vocab_size', 'out'])


def main(argv):
  del argv
  args = flags.FLAGS
  # --out is created before the training whose result goes there (and removed again if it fails).
  history_lib.check_not_a_run('--out', args.out)
  cli.create_output_dir('--out', args.out)
  train(args.data, args.vocab_size, args.out, args.data_dir, args.text_key)


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
