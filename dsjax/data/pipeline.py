"""Deterministic, resumable, multi-host input pipelines over TFDS data sources.

A pipeline is an iterator of numpy batch dicts. Which examples land in the
batch of global step `t` is a pure function of (seed, t, global batch size):

* Training, images (and very large text sets): the training stream is the
  concatenation of epochs, epoch `e` being a permutation of the split drawn
  from Philox keyed by (seed, e). Global step `t` takes positions
  [t * B, (t + 1) * B) of that stream, so batches run across epoch ends
  without dropping or repeating examples.
* Training, text: row `j` of step `t` is the window of seq_len + 1 bytes
  starting at a random offset of the split's byte stream, the offset drawn
  from Philox keyed by (seed, t) (word `j`).
* Evaluation: one pass in stored order; images one example per row, text
  non-overlapping windows; the last global batch is padded and a float32
  'mask' (1 = real row, 0 = padding) makes averages exact.

Process `p` of `P` gets rows [p * B/P, (p + 1) * B/P) of every global batch and
reads only the examples of those rows. Concatenating the shares in process
order gives the single-process batch, whatever P is; this is the layout that
`jax.make_array_from_process_local_data` expects for a batch-sharded array.

The state is just the global step (plus identifying fields checked on
restore), so `set_state(get_state())` resumes bitwise exactly, even with a
different number of processes.
"""

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dsjax.data import config as config_lib
from dsjax.data import random_bits
from dsjax.data import sources

Batch = dict[str, np.ndarray]

# Text splits with more documents than this are not loaded into memory for
# training; instead each row starts at a document of an epoch permutation and
# continues through the following documents (in stored order). Evaluation
# splits are always loaded whole.
MAX_IN_MEMORY_TEXT_DOCUMENTS = 1_000_000
_READ_CHUNK = 4096  # Documents per data source read when loading a split.
_STATE_VERSION = 1


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
  from PIL import Image  # pylint: disable=g-import-not-at-top

  height, width, _ = image.shape
  scale = size / min(height, width)
  new_height = max(size, round(height * scale))
  new_width = max(size, round(width * scale))
  channels = [
      np.asarray(Image.fromarray(image[:, :, c].astype(np.float32)).resize(
          (new_width, new_height), Image.Resampling.BILINEAR))
      for c in range(image.shape[-1])
  ]
  resized = np.stack(channels, axis=-1)  # (new_height, new_width, c)
  top, left = (new_height - size) // 2, (new_width - size) // 2
  return resized[top:top + size, left:left + size]


class Pipeline(Iterator[Batch]):
  """Common bookkeeping: steps, process shares, state, evaluation padding."""

  def __init__(self, *, info: sources.DatasetInfo, split: str,
               global_batch_size: int, seed: int, process_index: int,
               process_count: int, train: bool):
    self.info = info
    self.split = split
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.train = train
    self.local_batch_size = global_batch_size // process_count
    self.step = 0  # Global batches produced so far.

  # -- Subclass interface --------------------------------------------------

  @property
  def num_eval_rows(self) -> int:
    """Rows of one evaluation pass (examples, or text windows)."""
    raise NotImplementedError

  def _train_batch(self, step: int, rows: np.ndarray) -> Batch:
    """Training batch of global `step`, for global row indices `rows`."""
    raise NotImplementedError

  def _eval_batch(self, positions: np.ndarray) -> Batch:
    """Evaluation rows at `positions` (all < num_eval_rows)."""
    raise NotImplementedError

  def _empty_eval_rows(self, num: int) -> Batch:
    """`num` all-zero rows, padding the last evaluation batch."""
    raise NotImplementedError

  def _extra_state(self) -> dict[str, Any]:
    return {}

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
    first = self.process_index * self.local_batch_size
    rows = np.arange(first, first + self.local_batch_size)  # This process'.
    if self.train:
      batch = self._train_batch(self.step, rows)
    else:
      positions = self.step * self.global_batch_size + rows
      valid = positions < self.num_eval_rows
      num_valid = int(valid.sum())  # Real rows are a prefix of the share.
      batch = self._eval_batch(positions[:num_valid])
      if num_valid < len(rows):
        padding = self._empty_eval_rows(len(rows) - num_valid)
        batch = {k: np.concatenate([batch[k], padding[k]]) for k in batch}
      batch['mask'] = valid.astype(np.float32)
    self.step += 1
    return batch

  def reset(self) -> None:
    """Back to the first batch."""
    self.step = 0

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
    """JSON-serialisable state: the global step plus identifying fields.

    The process index/count are not part of it: a run may resume with a
    different number of processes and still see the same global batches.
    """
    return {'version': _STATE_VERSION, 'step': self.step, **self._identity()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores `get_state()` output; the next batch is then bitwise equal."""
    if state.get('version') != _STATE_VERSION:
      raise ValueError(f'unsupported pipeline state version in {state}')
    mismatched = {k: (state.get(k), v) for k, v in self._identity().items()
                  if state.get(k) != v}
    if mismatched:
      details = ', '.join(f'{k}: state has {a!r}, pipeline has {b!r}'
                          for k, (a, b) in mismatched.items())
      raise ValueError(f'pipeline state is for another pipeline ({details})')
    step = state['step']
    if not isinstance(step, int) or step < 0:
      raise ValueError(f'pipeline state step must be an int >= 0, got {step}')
    self.step = step


class _EpochOrder:
  """Example index at each position of the endless epoch-permuted stream."""

  def __init__(self, seed: int, num_examples: int):
    self._seed = seed
    self._num_examples = num_examples
    self._permutations = {}  # epoch -> permutation; keeps the last two.

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      if len(self._permutations) >= 2:
        del self._permutations[min(self._permutations)]
      self._permutations[epoch] = random_bits.permutation(
          self._seed, random_bits.Purpose.EPOCH_PERMUTATION, epoch,
          self._num_examples)
    return self._permutations[epoch]

  def __call__(self, positions: np.ndarray) -> np.ndarray:
    epochs, offsets = np.divmod(positions, self._num_examples)
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
      selected = epochs == epoch
      indices[selected] = self._permutation(int(epoch))[offsets[selected]]
    return indices


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
    self._order = _EpochOrder(self.seed, self._num_examples)
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

  def _read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (n, H, W, C) in 0..255, labels int32 (n,))."""
    records = self._source.__getitems__([int(i) for i in indices])
    height, width, _ = self.info.image_shape
    images = []
    for record in records:
      image = np.asarray(record[self._image_key])
      if image.ndim == 2:  # Some decoders drop a single channel axis.
        image = image[..., None]
      if image.shape[:2] != (height, width):
        image = _resize_and_centre_crop(image, height)
      images.append(image.astype(np.float32))
    labels = np.array([record[self._label_key] for record in records],
                      np.int32)
    return np.stack(images), labels

  def _normalise(self, images: np.ndarray) -> np.ndarray:
    return (images - self._mean) / self._std

  def _train_batch(self, step: int, rows: np.ndarray) -> Batch:
    positions = step * self.global_batch_size + rows
    images, labels = self._read(self._order(positions))
    if self._augment:
      words = random_bits.random_words(
          self.seed, random_bits.Purpose.FLIPS, step, self.global_batch_size)
      flip = (words[rows] >> np.uint64(63)) == 1
      images = np.where(flip[:, None, None, None], images[:, :, ::-1], images)
    return {'image': self._normalise(images), 'label': labels}

  def _eval_batch(self, positions: np.ndarray) -> Batch:
    if not len(positions):
      return self._empty_eval_rows(0)
    images, labels = self._read(positions)
    return {'image': self._normalise(images), 'label': labels}

  def _empty_eval_rows(self, num: int) -> Batch:
    return {'image': np.zeros((num, *self.info.image_shape), np.float32),
            'label': np.zeros((num,), np.int32)}


def _read_byte_stream(source: Sequence[Any], text_key: str) -> np.ndarray:
  """All documents of a split, UTF-8, joined by the separator: uint8 (n,)."""
  documents = []
  for start in range(0, len(source), _READ_CHUNK):
    chunk = range(start, min(start + _READ_CHUNK, len(source)))
    documents += [_as_bytes(r[text_key]) for r in source.__getitems__(chunk)]
  separator = bytes([sources.DOCUMENT_SEPARATOR_BYTE])
  return np.frombuffer(separator.join(documents), np.uint8)


class TextPipeline(Pipeline):
  """Batches {'tokens': int32 (b, seq_len + 1)} of UTF-8 bytes.

  Byte-level tokenizer: token = byte value (vocab 256); documents are joined
  with `sources.DOCUMENT_SEPARATOR_BYTE`. A model reads tokens[:, :-1] and
  predicts tokens[:, 1:].

  Evaluation windows are stream[i * L : i * L + L + 1] for i < (n - 1) // L,
  so every byte after the first is a target exactly once, except the final
  incomplete window's bytes (fewer than L), which are left out.
  """

  def __init__(self, *, source: Sequence[Any], seq_len: int, **kwargs):
    super().__init__(**kwargs)
    self.seq_len = seq_len
    self._source = source
    self._text_key = self.info.feature_keys['text']
    self._window = np.arange(seq_len + 1)  # Offsets inside a window.
    self.streamed = not self.train or len(source) <= (
        MAX_IN_MEMORY_TEXT_DOCUMENTS)
    if self.streamed:
      self.stream = _read_byte_stream(source, self._text_key)  # uint8 (n,)
      if len(self.stream) < seq_len + 1:
        raise ValueError(
            f'split {self.split!r} of {self.info.name} has '
            f'{len(self.stream)} bytes, fewer than data.seq_len + 1 = '
            f'{seq_len + 1}')
    else:
      self.stream = None
      self._order = _EpochOrder(self.seed, len(source))

  def _extra_state(self) -> dict[str, Any]:
    return {'seq_len': self.seq_len}

  @property
  def num_eval_rows(self) -> int:
    return (len(self.stream) - 1) // self.seq_len

  def _windows(self, starts: np.ndarray) -> np.ndarray:
    """int32 (n, seq_len + 1) windows of the stream starting at `starts`."""
    return self.stream[starts[:, None] + self._window].astype(np.int32)

  def _train_batch(self, step: int, rows: np.ndarray) -> Batch:
    if not self.streamed:
      positions = step * self.global_batch_size + rows
      return {'tokens': self._document_windows(self._order(positions))}
    num_starts = len(self.stream) - self.seq_len  # Windows fitting the stream.
    words = random_bits.random_words(
        self.seed, random_bits.Purpose.TEXT_OFFSETS, step,
        self.global_batch_size)
    starts = (words[rows] % np.uint64(num_starts)).astype(np.int64)
    return {'tokens': self._windows(starts)}

  def _document_windows(self, documents: np.ndarray) -> np.ndarray:
    """Windows starting at each document, continuing into the next ones."""
    needed = self.seq_len + 1
    pieces = [bytearray() for _ in documents]
    next_document = [int(d) for d in documents]
    pending = list(range(len(documents)))
    while pending:
      records = self._source.__getitems__(
          [next_document[r] for r in pending])
      still_short = []
      for row, record in zip(pending, records):
        if pieces[row]:
          pieces[row].append(sources.DOCUMENT_SEPARATOR_BYTE)
        pieces[row] += _as_bytes(record[self._text_key])
        if len(pieces[row]) < needed:
          next_document[row] = (next_document[row] + 1) % len(self._source)
          still_short.append(row)
      pending = still_short
    return np.stack([np.frombuffer(bytes(p[:needed]), np.uint8)
                     for p in pieces]).astype(np.int32)

  def _eval_batch(self, positions: np.ndarray) -> Batch:
    return {'tokens': self._windows(positions * self.seq_len)}

  def _empty_eval_rows(self, num: int) -> Batch:
    return {'tokens': np.zeros((num, self.seq_len + 1), np.int32)}


def _check_int(name: str, value: Any, minimum: int) -> int:
  if (isinstance(value, (bool, np.bool_))
      or not isinstance(value, (int, np.integer)) or value < minimum):
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')
  return int(value)


def make_pipeline(data_config, *, split: str | None = None,
                  global_batch_size: int,
                  seed: int = 0, process_index: int | None = None,
                  process_count: int | None = None,
                  train: bool = True) -> Pipeline:
  """Builds the input pipeline of one process.

  Args:
    data_config: the `data` ConfigDict (see `dsjax.data.config.get_config`).
    split: TFDS split, e.g. 'train', 'test', 'validation' (slices such as
      'train[:90%]' work too). None: `info.train_split` when training, else
      `info.eval_split` (datasets differ: digits has 'test', the Python docs
      corpus 'validation').
    global_batch_size: rows per step summed over all processes; must be
      divisible by `process_count`.
    seed: selects the training order (permutations, offsets, flips).
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
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top

    process_index = jax.process_index() if process_index is None else (
        process_index)
    process_count = jax.process_count() if process_count is None else (
        process_count)
  process_count = _check_int('process_count', process_count, 1)
  process_index = _check_int('process_index', process_index, 0)
  if process_index >= process_count:
    raise ValueError(f'process_index must be < process_count '
                     f'({process_count}), got {process_index}')
  if global_batch_size % process_count:
    raise ValueError(f'global_batch_size ({global_batch_size}) must be '
                     f'divisible by process_count ({process_count})')

  builder, info = sources.open_dataset(config)
  if split is None:
    split = info.train_split if train else info.eval_split
  base_split = split.split('[')[0]
  if base_split not in info.num_examples:
    raise ValueError(f'split {split!r} is not in dataset {info.name}; '
                     f'available: {sorted(info.num_examples)}')
  source = builder.as_data_source(split=split)
  if not len(source):
    raise ValueError(f'split {split!r} of {info.name} is empty')

  common = dict(info=info, split=split, global_batch_size=global_batch_size,
                seed=seed, process_index=process_index,
                process_count=process_count, train=train, source=source)
  if info.kind == 'image':
    return ImagePipeline(augment=config.augment, **common)
  return TextPipeline(seq_len=config.seq_len, **common)
