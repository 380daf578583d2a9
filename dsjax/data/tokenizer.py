"""Tokenizers of text data: UTF-8 bytes, or a subword tokenizer read from a local file.

`data.tokenizer = 'bytes'` makes every UTF-8 byte a token (vocabulary 256, documents joined by the byte
0). Any other value is the path of a Hugging Face `tokenizers` JSON file (https://github.com/huggingface/
tokenizers): a maintained Rust library whose files hold the whole pipeline (normalizer, pre-tokenizer,
model, decoder) and whose BPE trainer gives the same file for the same data and settings. It is only
ever loaded with `Tokenizer.from_file`, never from a model hub.

`train_bpe` trains the tokenizers `python -m dsjax.tokenizer` writes: byte-level BPE (the GPT-2 scheme,
Radford et al. 2019, §2.2: every byte has a token, so any text encodes and decodes losslessly; merges
never cross the pre-tokenizer's word boundaries) with one special token, `<|endoftext|>` (id 0), that
separates documents as the byte 0 does at byte level. A file from elsewhere works if it has one of
`END_OF_DOCUMENT_TOKENS`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

BYTES = 'bytes'
END_OF_DOCUMENT = '<|endoftext|>'
# Tokens a tokenizer file may use to separate documents (the first one present is used).
END_OF_DOCUMENT_TOKENS = (END_OF_DOCUMENT, '</s>', '<eos>', '<|end_of_text|>', '[SEP]')
_BYTE_VOCAB_SIZE = 256
_BYTE_SEPARATOR = 0


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  """A tokenizer as the input pipeline uses it.

  Attributes:
    spec: 'bytes' or the tokenizer file's path, as configured.
    vocab_size: number of token ids (embedding rows).
    separator: the token id between documents.
    sha256: 'bytes', or the SHA-256 of the tokenizer file (what a cache and a checkpoint are keyed by).
    backend: the `tokenizers.Tokenizer`, None for bytes.
  """

  spec: str
  vocab_size: int
  separator: int
  sha256: str
  backend: tokenizers.Tokenizer | None = None

  @property
  def is_bytes(self) -> bool:
    return self.backend is None

  def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
    """Token ids of each UTF-8 document (int64 arrays)."""
    if self.backend is None:
      return [np.frombuffer(document, np.uint8).astype(np.int64) for document in documents]
    encodings = self.backend.encode_batch([d.decode('utf-8') for d in documents], add_special_tokens=False)
    return [np.asarray(e.ids, np.int64) for e in encodings]

  def token_num_bytes(self) -> np.ndarray:
    """int64 (vocab_size,): the UTF-8 bytes each token stands for (the separator counts as one byte, like
    the byte 0 between documents at byte level), from which bits per byte are computed."""
    if self.backend is None:
      return np.ones(_BYTE_VOCAB_SIZE, np.int64)
    sizes = np.ones(self.vocab_size, np.int64)
    # A byte-level tokenizer (GPT-2's scheme, what `dsjax.tokenizer` trains) writes each byte as one
    # character of its alphabet, and a token may hold part of a character's bytes, which decoding it
    # alone would replace: its size is its length. Any other tokenizer's tokens are decoded.
    is_byte_level = isinstance(self.backend.pre_tokenizer, pre_tokenizers.ByteLevel) or isinstance(
      self.backend.decoder, decoders.ByteLevel
    )
    byte_level = frozenset(pre_tokenizers.ByteLevel.alphabet()) if is_byte_level else frozenset()
    specials = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
    for token, index in self.backend.get_vocab().items():
      if token in specials:
        continue
      if byte_level and all(c in byte_level for c in token):  # One character per byte.
        sizes[index] = len(token)
      else:
        sizes[index] = max(1, len(self.backend.decode([index], skip_special_tokens=False).encode('utf-8')))
    return sizes

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids]
    if self.backend is None:
      return bytes(ids).decode('utf-8', errors='replace')
    return self.backend.decode(ids, skip_special_tokens=False)


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def load(spec: str) -> TextTokenizer:
  """The tokenizer of `data.tokenizer`; a one-line ValueError for a missing or unreadable file."""
  if spec == BYTES:
    return TextTokenizer(spec=BYTES, vocab_size=_BYTE_VOCAB_SIZE, separator=_BYTE_SEPARATOR, sha256=BYTES)
  path = os.path.expanduser(spec)
  if not os.path.isfile(path):
    raise ValueError(
      f"data.tokenizer={spec}: no such file (expected 'bytes' or the path of a tokenizer "
      'JSON file, e.g. written by `python -m dsjax.tokenizer`)'
    )
  stat = os.stat(path)
  return _load_file(spec, path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_file(spec: str, path: str, size: int, mtime_ns: int) -> TextTokenizer:
  del size, mtime_ns  # Part of the cache key only: a file that changed is read again.
  try:
    backend = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  # The Rust library's parse errors vary.
    first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f'data.tokenizer={spec}: not a readable tokenizers JSON file ({first_line})') from None
  vocab = backend.get_vocab(with_added_tokens=True)
  separator = next((vocab[t] for t in END_OF_DOCUMENT_TOKENS if t in vocab), None)
  if separator is None:
    raise ValueError(
      f'data.tokenizer={spec}: the tokenizer has no end-of-document token (one of '
      f'{list(END_OF_DOCUMENT_TOKENS)}) to separate documents with'
    )
  return TextTokenizer(
    spec=spec,
    vocab_size=backend.get_vocab_size(with_added_tokens=True),
    separator=int(separator),
    sha256=file_sha256(path),
    backend=backend,
  )


def train_bpe(documents: Iterator[str], vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer of `vocab_size` tokens (if the text has enough distinct pairs; fewer
  otherwise) trained on `documents`: deterministic for the same documents in the same order."""
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=2,
    special_tokens=[END_OF_DOCUMENT],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  backend.train_from_iterator(documents, trainer)
  return backend


def min_vocab_size() -> int:
  """The smallest vocabulary `train_bpe` accepts: the 256 bytes and the separator."""
  return _BYTE_VOCAB_SIZE + 1
