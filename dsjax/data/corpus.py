"""Text corpora read straight from files, and token streams tokenized once and cached on disk.

Two corpora need no TFDS preparation:

`python_stdlib`
  The `.py` files of the running Python's standard library (`sysconfig.get_paths()['stdlib']`), test
  suites included, `site-packages` and `dist-packages` left out: 1,786 files and 31,512,085 bytes on
  Python 3.11.7. Files that are not UTF-8 (on 3.11.7 four test files written in other encodings on
  purpose) are left out and counted. One document per file, in path order.
`text:GLOB`
  Your own UTF-8 files matching GLOB (`**` recurses): a plain-text file is one document; a `.jsonl` /
  `.ndjson` file holds one JSON object per line, whose `data.text_key` string is one document.

Both split by a hash of each document's key (its path relative to the corpus root; for JSON Lines
`path:line`), so a file keeps its split when others are added or removed: SHA-256 buckets 0–4 of 100 go to
`validation`, 5–9 to `test`, the rest to `train`. The corpus's identity is a SHA-256 over every split's
keys and bytes, recorded (with the Python version for `python_stdlib`) in `DatasetInfo`, in the input
pipeline's state and in checkpoints, so a run does not resume on other text.

A split is tokenized once per (corpus, tokenizer) into `DATA_DIR/dsjax_text/<corpus>/<tokenizer>/
<split>.tokens` (the documents' token ids joined by the separator, as raw uint8/uint16/uint32, plus a
JSON file of counts written last, as the mark of a complete file) and read back with `np.memmap`: a
process reads the windows it needs by index, and its memory does not grow with the corpus. TFDS text
datasets with a subword tokenizer take the same path, keyed by their name, version, split and size.

Why not a TFDS builder, as `python_docs_bytes` has: training reads token windows, not documents, so the
one file a run needs is the token stream; a builder would add a second copy of the 31 MB of text and a
preparation step, while the files are already on disk (or are the user's own), and a flat token array is
what `np.memmap` and Grain's index sampler read by index with no decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dsjax.data import tokenizer as tokenizer_lib

PYTHON_STDLIB = 'python_stdlib'
TEXT_PREFIX = 'text:'
SPLITS = ('train', 'validation', 'test')
_VALIDATION_BUCKETS = range(0, 5)  # of 100
_TEST_BUCKETS = range(5, 10)
_JSON_LINES_SUFFIXES = ('.jsonl', '.ndjson')
_STDLIB_SKIPPED_DIRS = ('site-packages', 'dist-packages', '__pycache__')
_CACHE_DIR = 'dsjax_text'
_TOKENIZE_BATCH = 64  # Documents per tokenizer call.
PROGRESS_EVERY_S = 10.0

Progress = Callable[[str], None]


def is_corpus(name: str) -> bool:
  """Whether `data.name` is read from files by this module rather than by TFDS."""
  return name == PYTHON_STDLIB or name.startswith(TEXT_PREFIX)


def split_of(key: str) -> str:
  """The split of the document with `key`: a pure function of the key."""
  bucket = int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'big') % 100
  if bucket in _VALIDATION_BUCKETS:
    return 'validation'
  if bucket in _TEST_BUCKETS:
    return 'test'
  return 'train'


def default_data_dir(data_dir: str | None) -> str:
  """`data.data_dir`, or TFDS's default ($TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
  if data_dir is not None:
    return os.path.expanduser(data_dir)
  return os.path.expanduser(os.environ.get('TFDS_DATA_DIR') or os.path.join('~', 'tensorflow_datasets'))


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A corpus of UTF-8 documents found in files; the documents themselves are read when needed.

  Attributes:
    name: `data.name`.
    root: the directory document keys are relative to.
    keys: per split, the keys of its documents in stored order (path order, then line order).
    num_bytes: per split, UTF-8 bytes of its documents.
    sha256: per split, SHA-256 over its documents' keys and bytes.
    identity: SHA-256 of the whole corpus (its splits' hashes).
    python_version: `python_stdlib` only, the Python whose library it is.
    skipped: `python_stdlib` only, files left out because they are not UTF-8.
    text_key: JSON Lines only, the key of the text in each record.
  """

  name: str
  root: str
  keys: Mapping[str, tuple[str, ...]]
  num_bytes: Mapping[str, int]
  sha256: Mapping[str, str]
  identity: str
  python_version: str | None = None
  skipped: tuple[str, ...] = ()
  text_key: str | None = None

  def documents(self, split: str) -> Iterator[bytes]:
    """The split's documents (UTF-8 bytes) in stored order."""
    wanted = set(self.keys[split])
    for key, document in _read_documents(
      self.root, self._files(), self.text_key, skip_undecodable=bool(self.skipped)
    ):
      if key in wanted:
        yield document

  def _files(self) -> list[str]:
    return sorted(
      {
        key.rsplit(':', 1)[0] if _is_json_lines(key.rsplit(':', 1)[0]) else key
        for keys in self.keys.values()
        for key in keys
      }
    )


def _is_json_lines(path: str) -> bool:
  return path.endswith(_JSON_LINES_SUFFIXES)


def _not_utf8(path: str, error: UnicodeDecodeError, where: str = '') -> ValueError:
  return ValueError(
    f'{path}{where} is not UTF-8 text (invalid byte {error.object[error.start]:#04x} at '
    f'byte offset {error.start}); convert it to UTF-8 or leave it out of the glob'
  )


def _read_documents(
  root: str, files: Sequence[str], text_key: str | None, skip_undecodable: bool = False
) -> Iterator[tuple[str, bytes]]:
  """(key, UTF-8 bytes) of every document of `files` (relative to `root`), in order. A file that is not
  UTF-8 is a ValueError naming it, or skipped with `skip_undecodable`."""
  for relative in files:
    path = os.path.join(root, relative)
    with open(path, 'rb') as f:
      content = f.read()
    if not _is_json_lines(relative):
      try:
        content.decode('utf-8')
      except UnicodeDecodeError as e:
        if skip_undecodable:
          continue
        raise _not_utf8(path, e) from None
      yield relative, content
      continue
    for number, line in enumerate(content.splitlines(), start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line.decode('utf-8'))
      except UnicodeDecodeError as e:
        raise _not_utf8(path, e, f' line {number}') from None
      except json.JSONDecodeError as e:
        raise ValueError(
          f'{path} line {number} is not JSON ({e.msg}); JSON Lines files hold one JSON object per line'
        ) from None
      text = record.get(text_key) if isinstance(record, dict) else None
      if not isinstance(text, str):
        raise ValueError(f'{path} line {number} has no string under data.text_key={text_key!r}')
      yield f'{relative}:{number}', text.encode('utf-8')


def _scan(
  name: str,
  root: str,
  files: Sequence[str],
  text_key: str | None,
  skip_undecodable: bool,
  python_version: str | None = None,
) -> Corpus:
  keys = {split: [] for split in SPLITS}
  num_bytes = dict.fromkeys(SPLITS, 0)
  digests = {split: hashlib.sha256() for split in SPLITS}
  seen_files = set()
  for key, document in _read_documents(root, files, text_key, skip_undecodable):
    split = split_of(key)
    keys[split].append(key)
    num_bytes[split] += len(document)
    encoded_key = key.encode('utf-8')
    digests[split].update(len(encoded_key).to_bytes(8, 'little') + encoded_key)
    digests[split].update(len(document).to_bytes(8, 'little') + document)
    seen_files.add(key.rsplit(':', 1)[0] if _is_json_lines(key.rsplit(':', 1)[0]) else key)
  sha256 = {split: digest.hexdigest() for split, digest in digests.items()}
  identity = hashlib.sha256(json.dumps(sha256, sort_keys=True).encode()).hexdigest()
  skipped = tuple(f for f in files if f not in seen_files and not _is_json_lines(f))
  return Corpus(
    name=name,
    root=root,
    keys={s: tuple(k) for s, k in keys.items()},
    num_bytes=num_bytes,
    sha256=sha256,
    identity=identity,
    python_version=python_version,
    skipped=skipped if skip_undecodable else (),
    text_key=text_key,
  )


def stdlib_files(root: str) -> list[str]:
  """The `.py` files of the standard library at `root`, relative, in sorted path order."""
  files = []
  for directory, subdirectories, names in os.walk(root):
    subdirectories[:] = sorted(d for d in subdirectories if d not in _STDLIB_SKIPPED_DIRS)
    relative = os.path.relpath(directory, root)
    files += [
      os.path.normpath(os.path.join(relative, n)).replace(os.sep, '/') for n in names if n.endswith('.py')
    ]
  return sorted(files)


@functools.lru_cache(maxsize=4)
def _python_stdlib(root: str, python_version: str) -> Corpus:
  return _scan(
    PYTHON_STDLIB, root, stdlib_files(root), None, skip_undecodable=True, python_version=python_version
  )


@functools.lru_cache(maxsize=16)
def _text_files(
  name: str, root: str, files: tuple[str, ...], text_key: str, signature: tuple[Any, ...]
) -> Corpus:
  del signature  # Part of the cache key only: a file that changed is read again.
  return _scan(name, root, files, text_key, skip_undecodable=False)


def open_corpus(name: str, text_key: str) -> Corpus:
  """The corpus of `data.name` ('python_stdlib' or 'text:GLOB'); one-line ValueErrors."""
  if name == PYTHON_STDLIB:
    return _python_stdlib(sysconfig.get_paths()['stdlib'], '.'.join(map(str, sys.version_info[:3])))
  pattern = name[len(TEXT_PREFIX) :]
  if not pattern:
    raise ValueError("data.name='text:': give a glob of text files after 'text:', e.g. 'text:corpus/*.txt'")
  paths = sorted(
    os.path.abspath(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
  )
  if not paths:
    raise ValueError(f'data.name={name!r}: the glob {pattern!r} matches no file')
  root = os.path.commonpath([os.path.dirname(p) for p in paths])
  files = tuple(os.path.relpath(p, root).replace(os.sep, '/') for p in paths)
  signature = tuple((os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
  corpus = _text_files(name, root, files, text_key, signature)
  num_documents = sum(map(len, corpus.keys.values()))
  for split in ('train', 'validation'):
    if not corpus.keys[split]:
      raise ValueError(
        f'data.name={name!r}: none of its {num_documents} documents falls into the {split!r} split (a '
        'hash of each file name, or of path:line for JSON Lines, puts 5% into validation); give more '
        'files or JSON Lines records'
      )
  return corpus


# ------------------------------------------------------------------------------------------------
# Token streams, tokenized once.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """A split's tokens (memory-mapped, read-only) and its counts."""

  tokens: np.ndarray  # (num_tokens,) uint8/uint16/uint32: documents joined by the separator
  num_bytes: int  # UTF-8 bytes of the split's documents (separators not counted)
  num_documents: int
  path: str


def token_dtype(vocab_size: int) -> np.dtype:
  for dtype in (np.uint8, np.uint16, np.uint32):
    if vocab_size <= np.iinfo(dtype).max + 1:
      return np.dtype(dtype)
  raise ValueError(f'a vocabulary of {vocab_size} tokens does not fit 32 bits')


@contextlib.contextmanager
def file_lock(path: str):
  """Exclusive advisory lock on the file `path`, so that processes sharing a directory write into it once."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'a') as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock_file, fcntl.LOCK_UN)


def cache_dir(
  data_dir: str | None, corpus_name: str, corpus_identity: str, tokenizer: tokenizer_lib.TextTokenizer
) -> str:
  """Where a corpus's splits tokenized by `tokenizer` are cached."""
  slug = ''.join(c if c.isalnum() or c in '-_.' else '_' for c in corpus_name.split(':')[0])
  return os.path.join(
    default_data_dir(data_dir), _CACHE_DIR, f'{slug}-{corpus_identity[:16]}', tokenizer.sha256[:16]
  )


def _open_stream(directory: str, split: str) -> TokenStream | None:
  meta_path = os.path.join(directory, f'{split}.json')
  if not os.path.exists(meta_path):
    return None
  with open(meta_path) as f:
    meta = json.load(f)
  path = os.path.join(directory, f'{split}.tokens')
  tokens = (
    np.memmap(path, dtype=np.dtype(meta['dtype']), mode='r', shape=(meta['num_tokens'],))
    if meta['num_tokens']
    else np.zeros(0, np.dtype(meta['dtype']))
  )
  return TokenStream(
    tokens=tokens, num_bytes=meta['num_bytes'], num_documents=meta['num_documents'], path=path
  )


def batches(documents: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
  batch = []
  for document in documents:
    batch.append(document)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def tokenize_split(
  documents: Iterator[bytes],
  tokenizer: tokenizer_lib.TextTokenizer,
  directory: str,
  split: str,
  progress: Progress,
  total_bytes: int | None = None,
) -> TokenStream:
  """The split's token stream, from the cache in `directory` or tokenized into it now (once across
  processes sharing the directory: the others wait for the first)."""
  stream = _open_stream(directory, split)
  if stream is not None:
    return stream
  with file_lock(os.path.join(directory, f'.{split}.lock')):
    stream = _open_stream(directory, split)  # Another process finished while we waited.
    if stream is not None:
      return stream
    dtype = token_dtype(tokenizer.vocab_size)
    separator = np.asarray([tokenizer.separator], dtype)
    path = os.path.join(directory, f'{split}.tokens')
    num_tokens = num_bytes = num_documents = 0
    t0 = last_report = time.perf_counter()
    with open(path + '.incomplete', 'wb') as f:
      for batch in batches(documents, _TOKENIZE_BATCH):
        for ids in tokenizer.encode_documents(batch):
          if num_documents:
            f.write(separator.tobytes())
            num_tokens += 1
          f.write(ids.astype(dtype).tobytes())
          num_tokens += len(ids)
          num_documents += 1
        num_bytes += sum(len(d) for d in batch)
        if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
          last_report = time.perf_counter()
          done = f' of {total_bytes / 1e6:.1f}' if total_bytes else ''
          progress(
            f'Tokenizing {split}: {num_bytes / 1e6:.1f}{done} MB, {num_tokens:,} tokens, '
            f'{last_report - t0:.0f}s'
          )
    os.replace(path + '.incomplete', path)
    meta = {
      'num_tokens': num_tokens,
      'num_bytes': num_bytes,
      'num_documents': num_documents,
      'dtype': dtype.name,
      'tokenizer': tokenizer.spec,
      'tokenizer_sha256': tokenizer.sha256,
      'seconds': round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(directory, f'{split}.json.incomplete'), 'w') as f:
      json.dump(meta, f)
    os.replace(os.path.join(directory, f'{split}.json.incomplete'), os.path.join(directory, f'{split}.json'))
    progress(
      f'Tokenized {split} ({num_bytes:,} bytes, {num_documents:,} documents) into {num_tokens:,} '
      f'tokens in {meta["seconds"]:.1f}s: {path}'
    )
  return _open_stream(directory, split)
