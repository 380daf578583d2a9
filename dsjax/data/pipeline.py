"""Deterministic, resumable, multi-host input pipelines on Grain.

A pipeline is an iterator of numpy batch dicts: a chain of lazy `grain.MapDataset` transformations
iterated through a Grain `DatasetIterator`. Grain works on the *index space*: it samples which example (or
text window) each row of the global stream is, draws per-row random choices, batches, shards and keeps
the iterator state; a batch-level `map` then reads the batch's rows from the TFDS data source with one
`__getitems__` call (batched reads are about twice as fast as Grain's per-element ones).

Which examples land in the batch of global step `t` is a pure function of (seed, t, global batch size B):
  * training, images: Grain's per-epoch permutation of the split, repeated; step `t` takes positions
    [t * B, (t + 1) * B) of that stream, across epoch ends; the optional flip is a `random_map` on it;
  * training, text: Grain's shuffled stream over the window *start offsets* of the split's byte stream
    (every offset once per epoch); a row is the window of seq_len + 1 bytes at its start;
  * evaluation: one pass in stored order, padded with all-zero rows to whole global batches, with a
    float32 'mask' (1 = real row) that makes averages exact.

Process `p` of `P` reads only rows [p * B/P, (p + 1) * B/P) of every global batch, so the shares
concatenate to the single-process batch and a run's data does not depend on the number of hosts. The
state is the Grain iterator's (`{'next_index': t}`) plus identifying fields checked on restore, so
`set_state(get_state())` resumes bitwise exactly, even with another number of processes. Grain seeds are
derived from the 64-bit run seed with `random_bits` (Philox), one per purpose.

Why each of these choices, in detail: docs/data.md, "How a batch is chosen".
"""

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import logging
from PIL import Image

from dsjax.data import config as config_lib
from dsjax.data import corpus as corpus_lib
from dsjax.data import random_bits, sources
from dsjax.data import tokenizer as tokenizer_lib

Batch = dict[str, np.ndarray]
Row = dict[str, Any]

# Text splits with more documents than this are not loaded into memory for
# training; instead each row starts at a document of the shuffled document
# stream and continues through the following documents (in stored order).
# Evaluation splits are always loaded whole.
MAX_IN_MEMORY_TEXT_DOCUMENTS = 1_000_000
_READ_CHUNK = 4096  # Documents per data source read when loading a split.
_STATE_VERSION = 2  # 1: the hand-written pipeline's {'step': t}.

# How Grain reads batches. No threads and no prefetch by default: a batch is
# read when it is requested, which is enough on small machines because the
# training loop dispatches the jitted step asynchronously and so already
# overlaps reading with the device. Threads (e.g. ReadOptions(num_threads=2,
# prefetch_buffer_size=2)) read ahead in parallel and give the same batches:
# Grain's prefetch returns elements in index order.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _grain_seed(seed: int, purpose: random_bits.Purpose) -> int:
  """32-bit seed of one Grain transformation, from the 64-bit run seed."""
  word = random_bits.random_words(seed, purpose, 0, 1)[0]
  return int(word >> np.uint64(32))


def _as_bytes(text: Any) -> bytes:
  """UTF-8 bytes of a decoded TFDS text feature (bytes, str or 0-d array)."""
  if isinstance(text, np.ndarray):
    text = text.item()
  if isinstance(text, str):
    return text.encode('utf-8')
  return bytes(text)


def _resize_and_centre_crop(image: np.ndarray, size: int) -> np.ndarray:
  """(h, w, c) -> (size, size, c) float32: bilinear resize, centre crop.

  The shorter side is resized to `size` (keeping the aspect ratio), then the
  centre square is cut out. PIL's bilinear filter widens with the scale
  factor, so downscaling is antialiased.
  """
  height, width, _ = image.shape
  scale = size / min(height, width)
  new_height = max(size, round(height * scale))
  new_width = max(size, round(width * scale))
  channels = [
    np.asarray(
      Image.fromarray(image[:, :, c].astype(np.float32)).resize(
        (new_width, new_height), Image.Resampling.BILINEAR
      )
    )
    for c in range(image.shape[-1])
  ]
  resized = np.stack(channels, axis=-1)  # (new_height, new_width, c)
  top, left = (new_height - size) // 2, (new_width - size) // 2
  return resized[top : top + size, left : left + size]


class Pipeline(Iterator[Batch]):
  """Common part: sharding, Grain iteration, state, evaluation padding.

  Subclasses describe the rows of training as an endless Grain MapDataset in
  global order (`_train_rows`: per row, what to read) and read a batch of
  such descriptions (`_read_train`); for evaluation they read rows at stored
  positions (`_read_eval`). This class shards, pads and iterates.
  """

  def __init__(
    self,
    *,
    info: sources.DatasetInfo,
    split: str,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
    train: bool,
  ):
    self.info = info
    self.split = split
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.train = train
    self.local_batch_size = global_batch_size // process_count
    self.step = 0  # Global batches produced so far.
    self._dataset = None  # grain.MapDataset of local batches; built lazily.
    self._iterator = None  # Its grain.DatasetIterator, made on first use.

  # -- Subclass interface --------------------------------------------------

  @property
  def num_eval_rows(self) -> int:
    """Rows of one evaluation pass (examples, or text windows)."""
    raise NotImplementedError

  def _train_rows(self) -> grain.MapDataset:
    """Endless MapDataset: element i describes row i of the global stream."""
    raise NotImplementedError

  def _read_train(self, rows_b: Any) -> Batch:
    """Training batch for `rows_b`, b `_train_rows` elements stacked by Grain
    (a dict of (b,) arrays, or a (b,) array)."""
    raise NotImplementedError

  def _read_eval(self, positions_n: np.ndarray) -> Batch:
    """Evaluation rows at stored `positions_n` (n,), all < num_eval_rows."""
    raise NotImplementedError

  def _extra_state(self) -> dict[str, Any]:
    return {}

  # -- Grain datasets --------------------------------------------------------

  def _shard(self, rows: grain.MapDataset) -> grain.MapDataset:
    """Rows in global order -> this process' share of each global batch.

    Local batch k holds rows [k * b, (k + 1) * b), so global batch t is local
    batches t * P .. t * P + P - 1 and this process' share is the one at
    t * P + process_index.
    """
    batches = rows.batch(self.local_batch_size)
    return batches[self.process_index :: self.process_count]

  def _eval_dataset(self) -> grain.MapDataset:
    """One pass in stored order, padded to whole global batches."""
    rows = grain.MapDataset.range(self.num_eval_rows).map(
      lambda position: {'position': position, 'mask': np.float32(1)}
    )
    num_padding = self.num_batches * self.global_batch_size - len(rows)
    if num_padding:
      padding = grain.MapDataset.range(num_padding).map(lambda _: {'position': 0, 'mask': np.float32(0)})
      rows = grain.MapDataset.concatenate([rows, padding])
    return self._shard(rows).map(self._read_eval_padded)

  def _read_eval_padded(self, rows_b: Batch) -> Batch:
    """Reads the real rows (mask 1); padding rows are all zeros."""
    mask_b = rows_b['mask']
    real_b = mask_b > 0
    real = self._read_eval(rows_b['position'][real_b])
    batch = {}
    for key, values_n in real.items():
      batch[key] = np.zeros((len(mask_b), *values_n.shape[1:]), values_n.dtype)
      batch[key][real_b] = values_n
    batch['mask'] = mask_b
    return batch

  @property
  def dataset(self) -> grain.MapDataset:
    """Grain MapDataset of this process' batches (index = global step)."""
    if self._dataset is None:
      self._dataset = (
        self._shard(self._train_rows()).map(self._read_train) if self.train else self._eval_dataset()
      )
    return self._dataset

  def _restart(self, iterator_state: dict[str, Any] | None = None) -> None:
    """A fresh Grain iterator, at the start or at `iterator_state`."""
    if self._iterator is not None:
      self._iterator.close()
    self._iterator = iter(self.dataset.to_iter_dataset(READ_OPTIONS))
    self.step = 0
    if iterator_state is not None:
      self._iterator.set_state(iterator_state)
      self.step = iterator_state['next_index']

  # -- Iteration -------------------------------------------------------------

  @property
  def num_batches(self) -> int | None:
    """Batches in one evaluation pass; None when training (infinite)."""
    if self.train:
      return None
    return -(-self.num_eval_rows // self.global_batch_size)

  def __len__(self) -> int:
    if self.train:
      raise TypeError('a training pipeline is infinite')
    return self.num_batches

  def __iter__(self) -> Iterator[Batch]:
    # Iterating an exhausted evaluation pipeline starts a new pass, so
    # `for batch in eval_pipeline` can be repeated; training pipelines (and
    # partly consumed evaluation ones) continue from their current step.
    if not self.train and self.step >= self.num_batches:
      self.reset()
    return self

  def __next__(self) -> Batch:
    if not self.train and self.step >= self.num_batches:
      raise StopIteration
    if self._iterator is None:
      self._restart()
    batch = next(self._iterator)
    self.step += 1
    return batch

  def reset(self) -> None:
    """Back to the first batch."""
    self._restart()

  # -- State -----------------------------------------------------------------

  def _identity(self) -> dict[str, Any]:
    return {
      'dataset': self.info.name,
      'split': self.split,
      'train': self.train,
      'seed': self.seed,
      'global_batch_size': self.global_batch_size,
      **self._extra_state(),
    }

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable state: the Grain iterator's plus identifying fields.

    The process index/count are not part of it: the iterator counts global
    batches, so a run may resume with a different number of processes and
    still see the same global batches.
    """
    if self._iterator is None:
      self._restart()
    return {'version': _STATE_VERSION, 'iterator': self._iterator.get_state(), **self._identity()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores `get_state()` output; the next batch is then bitwise equal."""
    if state.get('version') != _STATE_VERSION:
      raise ValueError(f'unsupported pipeline state version in {state}')
    mismatched = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
    if mismatched:
      details = ', '.join(f'{k}: state has {a!r}, pipeline has {b!r}' for k, (a, b) in mismatched.items())
      raise ValueError(f'pipeline state is for another pipeline ({details})')
    iterator_state = state.get('iterator')
    next_index = iterator_state.get('next_index') if isinstance(iterator_state, dict) else None
    limit = None if self.train else self.num_batches
    if (
      isinstance(next_index, bool)
      or not isinstance(next_index, int)
      or next_index < 0
      or (limit is not None and next_index > limit)
    ):
      raise ValueError(
        f"pipeline state 'iterator' must be {{'next_index': "
        f'int in [0, {limit or "inf"}]}}, got '
        f'{iterator_state!r}'
      )
    self._restart(iterator_state)


class ImagePipeline(Pipeline):
  """Batches {'image': float32 (b, H, W, C), 'label': int32 (b,)}.

  Images are read per batch through the random-access data source (only this
  process' rows), resized if `data.image_size` is set, optionally flipped,
  and normalised with the per-channel constants in `info.image_mean/std`.
  """

  def __init__(self, *, source: Sequence[Any], augment: bool, **kwargs):
    super().__init__(**kwargs)
    self._source = source
    self._augment = augment and self.train
    self._num_examples = len(source)
    self._image_key = self.info.feature_keys['image']
    self._label_key = self.info.feature_keys['label']
    self._mean = np.asarray(self.info.image_mean, np.float32)
    self._std = np.asarray(self.info.image_std, np.float32)

  @property
  def num_eval_rows(self) -> int:
    return self._num_examples

  @property
  def epoch(self) -> int:
    """Epoch of the next batch's first row."""
    return self.step * self.global_batch_size // self._num_examples

  def _read(self, indices_n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (n, H, W, C) in 0..255, labels int32 (n,))."""
    records = self._source.__getitems__([int(i) for i in indices_n])
    height, width, _ = self.info.image_shape
    images = []
    for record in records:
      image_hwc = np.asarray(record[self._image_key])
      if image_hwc.ndim == 2:  # Some decoders drop a single channel axis.
        image_hwc = image_hwc[..., None]
      if image_hwc.shape[:2] != (height, width):
        image_hwc = _resize_and_centre_crop(image_hwc, height)
      images.append(image_hwc.astype(np.float32))
    labels_n = np.array([record[self._label_key] for record in records], np.int32)
    if not records:
      return np.zeros((0, *self.info.image_shape), np.float32), labels_n
    return np.stack(images), labels_n

  def _normalise(self, images_nhwc: np.ndarray) -> np.ndarray:
    return (images_nhwc - self._mean) / self._std

  @staticmethod
  def _draw_flip(index: int, rng: np.random.Generator) -> Row:
    """Row description with a flip of probability 1/2.

    `rng` is Grain's random_map generator, keyed by (seed, stream position),
    so a row's flip does not depend on the batch or process it lands in.
    """
    return {'index': index, 'flip': rng.random() < 0.5}

  def _train_rows(self) -> grain.MapDataset:
    indices = (
      grain.MapDataset.range(self._num_examples)
      .shuffle(seed=_grain_seed(self.seed, random_bits.Purpose.EPOCH_PERMUTATION))
      .repeat()
    )
    if self._augment:
      return indices.random_map(self._draw_flip, seed=_grain_seed(self.seed, random_bits.Purpose.FLIPS))
    return indices.map(lambda index: {'index': index})

  def _read_train(self, rows_b: Batch) -> Batch:
    images_bhwc, labels_b = self._read(rows_b['index'])
    if 'flip' in rows_b:
      images_bhwc = np.where(rows_b['flip'][:, None, None, None], images_bhwc[:, :, ::-1], images_bhwc)
    return {'image': self._normalise(images_bhwc), 'label': labels_b}

  def _read_eval(self, positions_n: np.ndarray) -> Batch:
    images_nhwc, labels_n = self._read(positions_n)
    return {'image': self._normalise(images_nhwc), 'label': labels_n}


def _read_byte_stream(source: Sequence[Any], text_key: str) -> np.ndarray:
  """All documents of a split, UTF-8, joined by the separator: uint8 (n,)."""
  documents = []
  for start in range(0, len(source), _READ_CHUNK):
    chunk = range(start, min(start + _READ_CHUNK, len(source)))
    documents += [_as_bytes(r[text_key]) for r in source.__getitems__(chunk)]
  separator = bytes([sources.DOCUMENT_SEPARATOR_BYTE])
  return np.frombuffer(separator.join(documents), np.uint8)


class TextPipeline(Pipeline):
  """Batches {'tokens': int32 (b, seq_len + 1)} of a split's token stream.

  Byte level (TFDS text with data.tokenizer='bytes'): token = byte value
  (vocab 256); documents are joined with `sources.DOCUMENT_SEPARATOR_BYTE`
  and the split is read into memory. Otherwise `stream` is the split's
  tokens, memory-mapped from the cache of `dsjax.data.corpus` (documents
  joined by the tokenizer's separator), and only the windows a batch needs
  are read. A model reads tokens[:, :-1] and predicts tokens[:, 1:].

  Evaluation windows are stream[i * L : i * L + L + 1] for i < (n - 1) // L,
  so every token after the first is a target exactly once, except the final
  incomplete window's tokens (fewer than L), which are left out.
  """

  def __init__(
    self,
    *,
    source: Sequence[Any] | None,
    seq_len: int,
    stream: np.ndarray | None = None,
    token_num_bytes: np.ndarray | None = None,
    **kwargs,
  ):
    super().__init__(**kwargs)
    self.seq_len = seq_len
    self._source = source
    self._text_key = self.info.feature_keys['text']
    self._window = np.arange(seq_len + 1)  # Offsets inside a window.
    self._token_num_bytes = token_num_bytes
    self.streamed = stream is not None or not self.train or len(source) <= MAX_IN_MEMORY_TEXT_DOCUMENTS
    if stream is not None:
      self.stream = stream  # A memory-mapped token stream.
    elif self.streamed:
      self.stream = _read_byte_stream(source, self._text_key)  # uint8 (n,)
    else:
      self.stream = None
    if self.stream is not None and len(self.stream) < seq_len + 1:
      unit = 'bytes' if stream is None else 'tokens'
      raise ValueError(
        f'split {self.split!r} of {self.info.name} has '
        f'{len(self.stream)} {unit}, fewer than data.seq_len + 1 = '
        f'{seq_len + 1}'
      )

  def _extra_state(self) -> dict[str, Any]:
    # Tokenized text also names its corpus and tokenizer, so a run does not
    # resume on other text (byte-level TFDS states keep their old fields).
    if not self.info.tokenized:
      return {'seq_len': self.seq_len}
    return {
      'seq_len': self.seq_len,
      'corpus': self.info.corpus_sha256,
      'tokenizer': self.info.tokenizer_sha256,
    }

  @property
  def num_eval_rows(self) -> int:
    return (len(self.stream) - 1) // self.seq_len

  @functools.cached_property
  def target_num_bytes(self) -> int:
    """UTF-8 bytes of the tokens one evaluation pass predicts (a separator
    counts as one byte): eval loss sum / (this * ln 2) is bits per byte."""
    num_targets = self.num_eval_rows * self.seq_len
    if self._token_num_bytes is None:
      return num_targets
    total, chunk = 0, 1 << 22
    for start in range(1, num_targets + 1, chunk):
      tokens = np.asarray(self.stream[start : min(start + chunk, num_targets + 1)])
      total += int(self._token_num_bytes[tokens].sum())
    return total

  def _windows(self, starts_n: np.ndarray) -> np.ndarray:
    """int32 (n, seq_len + 1) windows of the stream starting at `starts_n`."""
    return self.stream[starts_n[:, None] + self._window].astype(np.int32)

  def _train_rows(self) -> grain.MapDataset:
    if self.streamed:  # Rows are window starts; all windows fit the stream.
      num_rows = len(self.stream) - self.seq_len
      purpose = random_bits.Purpose.TEXT_OFFSETS
    else:  # Rows are the documents the windows start at.
      num_rows = len(self._source)
      purpose = random_bits.Purpose.EPOCH_PERMUTATION
    return grain.MapDataset.range(num_rows).shuffle(seed=_grain_seed(self.seed, purpose)).repeat()

  def _read_train(self, rows_b: np.ndarray) -> Batch:
    if self.streamed:
      return {'tokens': self._windows(rows_b)}
    return {'tokens': self._document_windows(rows_b)}

  def _document_windows(self, documents_n: np.ndarray) -> np.ndarray:
    """int32 (n, seq_len + 1): windows starting at `documents_n` (n,),
    continuing into the following documents."""
    needed = self.seq_len + 1
    pieces = [bytearray() for _ in documents_n]
    next_document = [int(d) for d in documents_n]
    pending = list(range(len(documents_n)))
    while pending:
      records = self._source.__getitems__([next_document[r] for r in pending])
      still_short = []
      for row, record in zip(pending, records):
        if pieces[row]:
          pieces[row].append(sources.DOCUMENT_SEPARATOR_BYTE)
        pieces[row] += _as_bytes(record[self._text_key])
        if len(pieces[row]) < needed:
          next_document[row] = (next_document[row] + 1) % len(self._source)
          still_short.append(row)
      pending = still_short
    return np.stack([np.frombuffer(bytes(p[:needed]), np.uint8) for p in pieces]).astype(np.int32)

  def _read_eval(self, positions_n: np.ndarray) -> Batch:
    return {'tokens': self._windows(positions_n * self.seq_len)}


def _check_int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')
  return int(value)


def make_pipeline(
  data_config,
  *,
  split: str | None = None,
  global_batch_size: int,
  seed: int = 0,
  process_index: int | None = None,
  process_count: int | None = None,
  train: bool = True,
) -> Pipeline:
  """Builds the input pipeline of one process.

  Args:
    data_config: the `data` ConfigDict (see `dsjax.data.config.get_config`).
    split: TFDS split, e.g. 'train', 'test', 'validation' (slices such as
      'train[:90%]' work too). None: `data.train_split` when training, else
      `data.eval_split`, and where those are None `info.train_split` or
      `info.eval_split` (datasets differ: digits has 'test', the Python docs
      corpus 'validation').
    global_batch_size: rows per step summed over all processes; must be
      divisible by `process_count`.
    seed: selects the training order (shuffles, window offsets, flips).
    process_index: this process, default `jax.process_index()`.
    process_count: number of processes, default `jax.process_count()`.
    train: True: endless shuffled stream (with augmentation if configured).
      False: one pass over the split in stored order, padded, with 'mask'.

  Returns:
    An iterator of batches holding global_batch_size // process_count rows:
    image datasets {'image': float32 (b, H, W, C), 'label': int32 (b,)},
    text datasets {'tokens': int32 (b, seq_len + 1)}, plus
    'mask': float32 (b,) when `train` is False.
  """
  config = config_lib.parse_config(data_config)
  global_batch_size = _check_int('global_batch_size', global_batch_size, 1)
  seed = random_bits.check_seed(seed)
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  process_count = _check_int('process_count', process_count, 1)
  process_index = _check_int('process_index', process_index, 0)
  if process_index >= process_count:
    raise ValueError(f'process_index must be < process_count ({process_count}), got {process_index}')
  if global_batch_size % process_count:
    raise ValueError(
      f'global_batch_size ({global_batch_size}) must be divisible by process_count ({process_count})'
    )

  builder, info = sources.open_dataset(config)
  if split is None:
    split = (config.train_split or info.train_split) if train else (config.eval_split or info.eval_split)
  common = dict(
    info=info,
    split=split,
    global_batch_size=global_batch_size,
    seed=seed,
    process_index=process_index,
    process_count=process_count,
    train=train,
  )
  if info.tokenized:
    return _tokenized_pipeline(config, builder, info, split, common)
  base_split = split.split('[')[0]
  if base_split not in info.num_examples:
    raise ValueError(f'split {split!r} is not in dataset {info.name}; available: {sorted(info.num_examples)}')
  source = builder.as_data_source(split=split)
  if not len(source):
    raise ValueError(f'split {split!r} of {info.name} is empty')

  common['source'] = source
  if info.kind == 'image':
    return ImagePipeline(augment=config.augment, **common)
  return TextPipeline(seq_len=config.seq_len, **common)


def tfds_documents(source: Sequence[Any], text_key: str):
  """The UTF-8 documents of a TFDS split, in stored order."""
  for start in range(0, len(source), _READ_CHUNK):
    chunk = range(start, min(start + _READ_CHUNK, len(source)))
    for record in source.__getitems__(chunk):
      yield _as_bytes(record[text_key])


def _tokenized_pipeline(
  config: config_lib.DataConfig, builder, info: sources.DatasetInfo, split: str, common: dict[str, Any]
) -> TextPipeline:
  """A TextPipeline over the split's cached token stream (`dsjax.data.corpus`), tokenized first if
  this (corpus, tokenizer) has not been."""
  tokenizer = tokenizer_lib.load(config.tokenizer)
  if builder is None:  # python_stdlib or text:GLOB.
    if split not in corpus_lib.SPLITS:
      raise ValueError(f'split {split!r} is not in dataset {info.name}; available: {list(corpus_lib.SPLITS)}')
    text = corpus_lib.open_corpus(config.name, config.text_key)
    documents, total_bytes, directory = text.documents(split), text.num_bytes[split], info.data_dir
  else:  # A TFDS text dataset read with a subword tokenizer.
    if split.split('[')[0] not in info.num_examples:
      raise ValueError(
        f'split {split!r} is not in dataset {info.name}; available: {sorted(info.num_examples)}'
      )
    source = builder.as_data_source(split=split)
    documents = tfds_documents(source, info.feature_keys['text'])
    total_bytes = (info.num_bytes or {}).get(split)
    directory = corpus_lib.cache_dir(config.data_dir, info.name, info.corpus_sha256, tokenizer)
  file_name = ''.join(c if c.isalnum() else '_' for c in split)  # 'train[:90%]' -> 'train___90__'
  stream = corpus_lib.tokenize_split(documents, tokenizer, directory, file_name, logging.info, total_bytes)
  return TextPipeline(
    source=None,
    seq_len=config.seq_len,
    stream=stream.tokens,
    token_num_bytes=tokenizer.token_num_bytes(),
    **common,
  )
