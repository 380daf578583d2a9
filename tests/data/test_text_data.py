"""Tests of text beyond bytes: subword tokenizers, the corpora read from files (`text:GLOB`,
`python_stdlib`), the tokenized cache, and bits per byte.

Everything runs on a tiny corpus written to a temporary directory (about 60 KB in 48 files) with a
300-token tokenizer; only `python_stdlib`'s description reads the real standard library (no tokenizing).
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from dsjax import data
from dsjax import tokenizer as tokenizer_cli
from dsjax.data import corpus as corpus_lib
from dsjax.data import tokenizer as tokenizer_lib
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import loop
from tests.helpers import tiny_config, write_text_corpus

VOCAB_SIZE = 300


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  return write_text_corpus(tmp_path_factory.mktemp('corpus'))


@pytest.fixture(scope='module')
def trained(corpus_dir, tmp_path_factory):
  """(tokenizer.json path, tokenizer_info) trained on the corpus's train split."""
  out = tmp_path_factory.mktemp('tokenizer')
  info = tokenizer_cli.train(f'text:{corpus_dir}/*.txt', VOCAB_SIZE, str(out))
  return str(out / tokenizer_cli.TOKENIZER_FILE), info


def _config(corpus_dir, data_dir, tokenizer='bytes', seq_len=16, **overrides):
  config = data.get_config(f'text:{corpus_dir}/*.txt')
  config.data_dir, config.tokenizer, config.seq_len = os.fspath(data_dir), tokenizer, seq_len
  config.update(overrides)
  return config


def _take(pipeline, num):
  return [next(pipeline) for _ in range(num)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for batch_a, batch_b in zip(a, b):
    assert batch_a.keys() == batch_b.keys()
    for key in batch_a:
      np.testing.assert_array_equal(batch_a[key], batch_b[key])


# -- Splits and corpora --------------------------------------------------------------------------


def test_split_is_a_pure_function_of_the_key():
  splits = [corpus_lib.split_of(f'dir/file_{i}.py') for i in range(2000)]
  assert splits == [corpus_lib.split_of(f'dir/file_{i}.py') for i in range(2000)]
  counts = {split: splits.count(split) for split in corpus_lib.SPLITS}
  assert 60 <= counts['validation'] <= 140 and 60 <= counts['test'] <= 140  # 5% each of 2000.


def test_text_glob_corpus_split_and_identity(corpus_dir, tmp_path):
  info = data.dataset_info(_config(corpus_dir, tmp_path))
  assert info.kind == 'text' and info.vocab_size == 256 and info.tokenized
  assert sum(info.num_examples.values()) == 48 and all(info.num_examples[s] for s in ('train', 'validation'))
  total = sum(len((corpus_dir / f).read_bytes()) for f in os.listdir(corpus_dir))
  assert sum(info.num_bytes.values()) == total
  # The same files elsewhere are the same corpus; a changed file is another one.
  copy = write_text_corpus(tmp_path / 'copy')
  assert data.dataset_info(_config(copy, tmp_path)).corpus_sha256 == info.corpus_sha256
  (copy / 'file_000.txt').write_text('changed', encoding='utf-8')
  assert data.dataset_info(_config(copy, tmp_path)).corpus_sha256 != info.corpus_sha256


def test_json_lines_records_are_documents(tmp_path):
  lines = [json.dumps({'body': f'record {i} ' * 20, 'id': i}) for i in range(60)]
  (tmp_path / 'a.jsonl').write_text('\n'.join(lines) + '\n', encoding='utf-8')
  config = data.get_config(f'text:{tmp_path}/*.jsonl')
  config.update(data_dir=os.fspath(tmp_path / 'cache'), text_key='body', seq_len=8)
  info = data.dataset_info(config)
  assert sum(info.num_examples.values()) == 60
  corpus = corpus_lib.open_corpus(config.name, 'body')
  assert corpus.keys['validation'][0].startswith('a.jsonl:')
  documents = list(corpus.documents('validation'))
  assert documents[0].startswith(b'record ')
  batch = next(data.make_pipeline(config, global_batch_size=4, process_index=0, process_count=1))
  assert batch['tokens'].shape == (4, 9)


def test_python_stdlib_description():
  info = data.dataset_info({'name': 'python_stdlib'})
  corpus = corpus_lib.open_corpus('python_stdlib', 'text')
  assert info.python_version == corpus.python_version and info.corpus_sha256 == corpus.identity
  assert sum(info.num_examples.values()) > 500 and sum(info.num_bytes.values()) > 5_000_000
  assert all(
    key.endswith('.py') and 'site-packages' not in key for keys in corpus.keys.values() for key in keys
  )
  assert set(info.fingerprint) == set(corpus_lib.SPLITS)


# -- Tokenizers --------------------------------------------------------------------------------


def test_training_is_deterministic_and_reports_compression(corpus_dir, trained, tmp_path, capsys):
  path, info = trained
  again = tokenizer_cli.train(f'text:{corpus_dir}/*.txt', VOCAB_SIZE, str(tmp_path / 'again'))
  digest = lambda p: hashlib.sha256(open(p, 'rb').read()).hexdigest()
  assert digest(path) == digest(tmp_path / 'again' / 'tokenizer.json') == again['sha256'] == info['sha256']
  assert info['vocab_size'] == VOCAB_SIZE and info['validation']['bytes_per_token'] > 1.5
  assert 'bytes per token' in capsys.readouterr().out
  tokenizer = tokenizer_lib.load(path)
  assert tokenizer.vocab_size == VOCAB_SIZE and tokenizer.separator == 0
  text = 'def value(self):\n    return ünïcode λ'
  (ids,) = tokenizer.encode_documents([text.encode()])
  assert tokenizer.decode(ids) == text
  # Every token's byte count is that of its text.
  sizes = tokenizer.token_num_bytes()
  assert sizes[ids].sum() == len(text.encode())


def test_subword_pipeline_windows_state_and_shares(corpus_dir, trained, tmp_path):
  path, _ = trained
  config = _config(corpus_dir, tmp_path, tokenizer=path)
  info = data.dataset_info(config)
  assert info.vocab_size == VOCAB_SIZE and info.tokenizer_sha256 == tokenizer_lib.file_sha256(path)
  make = lambda seed=3, index=0, count=1, train=True: data.make_pipeline(
    config, global_batch_size=8, seed=seed, process_index=index, process_count=count, train=train
  )
  pipeline = make()
  assert isinstance(pipeline.stream, np.memmap)  # Read by index from the cache.
  batches = _take(pipeline, 5)
  assert batches[0]['tokens'].shape == (8, 17) and batches[0]['tokens'].max() < VOCAB_SIZE
  _assert_batches_equal(_take(make(), 5), batches)  # Same seed, same batches (from the cache).
  assert not np.array_equal(next(make(seed=4))['tokens'], batches[0]['tokens'])
  # Rows are windows of the token stream of the train split.
  stream = np.asarray(pipeline.stream)
  row = batches[0]['tokens'][0]
  starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream, 17) == row, axis=1))
  assert len(starts) >= 1
  # Resume bit-exactly from a JSON round trip of the state, which names the corpus and the tokenizer.
  state = json.loads(json.dumps(pipeline.get_state()))
  assert state['corpus'] == info.corpus_sha256 and state['tokenizer'] == info.tokenizer_sha256
  expected = _take(pipeline, 3)
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 3), expected)
  bytes_level = data.make_pipeline(
    _config(corpus_dir, tmp_path), global_batch_size=8, seed=3, process_index=0, process_count=1
  )
  with pytest.raises(ValueError, match='tokenizer: state has'):
    bytes_level.set_state(state)
  # Two processes' shares concatenate to the one-process batch, training and evaluation.
  for train in (True, False):
    single = _take(make(train=train), 3)
    shares = [_take(make(index=i, count=2, train=train), 3) for i in range(2)]
    for step in range(3):
      for key in single[step]:
        np.testing.assert_array_equal(
          np.concatenate([shares[0][step][key], shares[1][step][key]]), single[step][key]
        )


def test_eval_windows_tile_the_stream_and_count_its_bytes(corpus_dir, trained, tmp_path):
  path, _ = trained
  config = _config(corpus_dir, tmp_path, tokenizer=path, seq_len=32)
  pipeline = data.make_pipeline(config, global_batch_size=8, process_index=0, process_count=1, train=False)
  rows = np.concatenate([b['tokens'][b['mask'] > 0] for b in pipeline])
  stream = np.asarray(pipeline.stream)
  n = pipeline.num_eval_rows
  np.testing.assert_array_equal(rows[:, 1:].reshape(-1), stream[1 : n * 32 + 1])
  # Bits per byte count the bytes of the predicted tokens: the validation text's bytes, but for the first
  # token's, the unpredicted tail's, and one per separator.
  tokenizer = tokenizer_lib.load(path)
  assert pipeline.target_num_bytes == tokenizer.token_num_bytes()[stream[1 : n * 32 + 1]].sum()
  info = data.dataset_info(config)
  separators = info.num_examples['validation'] - 1
  assert abs(pipeline.target_num_bytes - info.num_bytes['validation'] - separators) < 32 * 8
  byte_level = data.make_pipeline(
    _config(corpus_dir, tmp_path, seq_len=32),
    global_batch_size=8,
    process_index=0,
    process_count=1,
    train=False,
  )
  assert byte_level.target_num_bytes == byte_level.num_eval_rows * 32


def test_subword_tokenizer_on_a_tfds_text_dataset(trained, tmp_path):
  path, _ = trained
  config = data.get_config('python_docs_bytes')
  config.update(data_dir=os.fspath(tmp_path), tokenizer=path, seq_len=16)
  info = data.dataset_info(config)
  assert info.tokenized and info.vocab_size == VOCAB_SIZE
  pipeline = data.make_pipeline(config, global_batch_size=4, process_index=0, process_count=1, train=False)
  assert isinstance(pipeline.stream, np.memmap) and next(pipeline)['tokens'].max() < VOCAB_SIZE
  # Bytes keep the TFDS path and its state fields.
  config.tokenizer = 'bytes'
  assert not data.dataset_info(config).tokenized


# -- Bad input -----------------------------------------------------------------------------------


def _one_line_error(fn, match):
  with pytest.raises(ValueError, match=match) as error:
    fn()
  assert '\n' not in str(error.value)
  return str(error.value)


def test_bad_inputs_fail_in_one_line(corpus_dir, trained, tmp_path):
  info = lambda **kw: data.dataset_info(_config(corpus_dir, tmp_path, **kw))
  _one_line_error(lambda: info(tokenizer=str(tmp_path / 'missing.json')), 'missing.json: no such file')
  (tmp_path / 'corrupt.json').write_text('{"version": ', encoding='utf-8')
  _one_line_error(lambda: info(tokenizer=str(tmp_path / 'corrupt.json')), 'not a readable tokenizers')
  _one_line_error(lambda: data.dataset_info({'name': f'text:{tmp_path}/nothing/*.txt'}), 'matches no file')
  latin = write_text_corpus(tmp_path / 'latin', num_files=30)
  (latin / 'file_007.txt').write_bytes('café'.encode('latin-1'))
  _one_line_error(lambda: data.dataset_info({'name': f'text:{latin}/*.txt'}), 'file_007.txt is not UTF-8')
  out = tmp_path / 'too_big'
  _one_line_error(
    lambda: tokenizer_cli.train(f'text:{corpus_dir}/*.txt', 100_000, str(out)), 'larger than the train split'
  )
  _one_line_error(lambda: tokenizer_cli.train(f'text:{corpus_dir}/*.txt', 100, str(out)), '--vocab_size=100')
  assert not out.exists()


def _snapshot(root):
  return {
    str(p.relative_to(root)): (None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns))
    for p in sorted(root.rglob('*'))
    if p.name != checkpoint_lib.LOCK_FILE
  }


def test_a_run_reports_bits_per_byte_and_refuses_other_text_on_resume(corpus_dir, trained, tmp_path):
  path, _ = trained
  config = tiny_config('gpt')
  config.total_steps = config.eval_every = config.checkpoint_every = config.log_every = 2
  config.eval_batch_size = 64
  config.data.update(name=f'text:{corpus_dir}/*.txt', data_dir=os.fspath(tmp_path / 'cache'), tokenizer=path)
  workdir = tmp_path / 'run'
  final = loop.train_and_evaluate(config, str(workdir))
  with open(workdir / 'metrics.jsonl') as f:
    last = [json.loads(line) for line in f][-1]
  assert last['eval/loss'] == pytest.approx(final['eval/loss'])
  assert 0 < last['eval/bits_per_byte'] < last['eval/loss']  # More than one byte per token.
  assert last['train/tokens'] == 2 * 8 * 16
  assert 0 < last['train/tokens_per_param'] < 1
  config.total_steps = 4
  for key, value, differing in (
    ('tokenizer', 'bytes', 'data.tokenizer_sha256'),
    ('name', f'text:{corpus_dir}/file_00*.txt', 'data.corpus_sha256'),
  ):
    resumed = tmp_path / f'resumed_{key}'  # A copy each: a failed run in this process keeps its lock.
    shutil.copytree(workdir, resumed)
    before = _snapshot(resumed)
    other = config.copy_and_resolve_references()
    other.data[key] = value
    message = _one_line_error(lambda: loop.train_and_evaluate(other, str(resumed)), 'other data')
    assert differing in message
    assert _snapshot(resumed) == before
