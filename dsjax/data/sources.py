"""Finding TFDS datasets, preparing the embedded ones, and describing them.

Everything is read through TFDS *data sources* (random access over
`array_record` or `parquet` files), which work without TensorFlow. Problems
are reported as one `DatasetNotFoundError` with a one-line message saying what
was looked for, where, and what to run, instead of a trace from inside TFDS.
"""

import contextlib
import dataclasses
import functools
import glob
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from dsjax.data import config as config_lib
from dsjax.data import corpus as corpus_lib
from dsjax.data import embedded
from dsjax.data import tokenizer as tokenizer_lib

# Byte-level text: every UTF-8 byte is a token, and documents are joined with
# this byte (NUL never occurs in real text, so it acts as end-of-document).
TEXT_VOCAB_SIZE = 256
DOCUMENT_SEPARATOR_BYTE = 0

# Per-channel pixel mean / std in 0..255 units, used to normalise images to
# roughly zero mean and unit variance. Datasets not listed are mapped to
# [-1, 1] (mean 127.5, std 127.5).
_IMAGE_STATS = {
  'sklearn_digits': ((embedded.DIGITS_TRAIN_MEAN,), (embedded.DIGITS_TRAIN_STD,)),
  'mnist': ((0.1307 * 255,), (0.3081 * 255,)),
  'fashion_mnist': ((0.2860 * 255,), (0.3530 * 255,)),
  'cifar10': ((0.4914 * 255, 0.4822 * 255, 0.4465 * 255), (0.2470 * 255, 0.2435 * 255, 0.2616 * 255)),
  'cifar100': ((0.5071 * 255, 0.4865 * 255, 0.4409 * 255), (0.2673 * 255, 0.2564 * 255, 0.2762 * 255)),
  'imagenet2012': ((0.485 * 255, 0.456 * 255, 0.406 * 255), (0.229 * 255, 0.224 * 255, 0.225 * 255)),
}
_DEFAULT_IMAGE_STATS = (127.5, 127.5)

# Datasets where a left-right flip changes the meaning of an image.
_NO_FLIP_DATASETS = ('sklearn_digits', 'mnist', 'emnist', 'kmnist', 'fashion_mnist', 'svhn_cropped')


class DatasetNotFoundError(ValueError):
  """A dataset is unknown, not prepared, or not readable without TensorFlow."""


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a model and a training loop need to know about a dataset.

  Attributes:
    name: the TFDS name, as configured (e.g. 'cifar10', 'lm1b:1.1.0').
    kind: 'image' (classification) or 'text' (language modelling).
    num_examples: examples per split, e.g. {'train': 1497, 'test': 300}. For
      text, an example is one document.
    train_split: the split to train on ('train').
    eval_split: the split to evaluate on ('validation' if present, else
      'test', else 'train').
    data_dir: the directory holding the prepared files (name/version level).
    num_classes: image only, number of labels.
    image_shape: image only, (H, W, C) of the images in batches, i.e. after
      resizing to `data.image_size`.
    image_mean: image only, per-channel mean subtracted (0..255 units).
    image_std: image only, per-channel std divided by (0..255 units).
    vocab_size: text only, 256 (bytes) or the tokenizer's vocabulary.
    seq_len: text only, tokens per window; batches hold seq_len + 1 tokens.
    separator_byte: text only, the byte inserted between documents.
    num_bytes: text only, UTF-8 bytes per split when known without reading the
      data (embedded corpus), else None.
    fingerprint: SHA-256 of each split's bytes when recorded at preparation
      (embedded corpus), else None. Compare across hosts to check they all
      prepared the same data.
    feature_keys: the TFDS feature names used, e.g. {'image': 'image',
      'label': 'label'} or {'text': 'text'}.
    tokenizer: text only, `data.tokenizer` ('bytes' or a file's path).
    tokenizer_sha256: text only, 'bytes' or the SHA-256 of the tokenizer file.
    separator_token: text only, the token id between documents.
    corpus_sha256: the identity of the text that is tokenized (python_stdlib
      and text:GLOB: a SHA-256 of their documents; TFDS datasets read with a
      subword tokenizer: of their name, version and sizes), else None.
    python_version: python_stdlib only, the Python whose library it is.
  """

  name: str
  kind: str
  num_examples: Mapping[str, int]
  train_split: str
  eval_split: str
  data_dir: str
  num_classes: int | None = None
  image_shape: tuple[int, int, int] | None = None
  image_mean: tuple[float, ...] | None = None
  image_std: tuple[float, ...] | None = None
  vocab_size: int | None = None
  seq_len: int | None = None
  separator_byte: int | None = None
  num_bytes: Mapping[str, int] | None = None
  fingerprint: Mapping[str, str] | None = None
  feature_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
  tokenizer: str | None = None
  tokenizer_sha256: str | None = None
  separator_token: int | None = None
  corpus_sha256: str | None = None
  python_version: str | None = None

  @property
  def tokenized(self) -> bool:
    """Whether the text is read from a token stream cached on disk (`dsjax.data.corpus`) rather than
    as bytes from TFDS."""
    return self.kind == 'text' and self.corpus_sha256 is not None

  def checkpoint_identity(self) -> dict[str, Any]:
    """What a checkpoint records of the data beyond its config keys: the text's and the tokenizer's
    hashes and the vocabulary, where they are not the byte-level defaults (so checkpoints of runs on
    TFDS bytes keep their identity)."""
    identity = {}
    if self.corpus_sha256 is not None:
      identity['data.corpus_sha256'] = self.corpus_sha256
    if self.corpus_sha256 is not None or self.tokenizer_sha256 not in (None, tokenizer_lib.BYTES):
      identity['data.tokenizer_sha256'] = self.tokenizer_sha256
      identity['data.vocab_size'] = self.vocab_size
    return identity


def _base_name(name: str) -> str:
  """'imagenet2012/subset:1.0.0' -> 'imagenet2012'."""
  return name.split(':')[0].split('/')[0]


def _searched_dirs(data_dir: str | None) -> list[str]:
  if data_dir is not None:
    return [os.fspath(data_dir)]
  try:
    dirs = tfds.core.utils.file_utils.list_data_dirs(given_data_dir=None)
  except Exception:  # pylint: disable=broad-except  # Private TFDS helper.
    dirs = [tfds.core.constants.DATA_DIR]
  return [os.path.expanduser(os.fspath(d)) for d in dirs]


def _prepared_versions(root: str, base_name: str) -> list[str]:
  """'name[/config]/version' of every prepared variant under root/base_name."""
  patterns = [os.path.join(root, base_name, *['*'] * depth, 'dataset_info.json') for depth in (1, 2)]
  return sorted(
    os.path.relpath(os.path.dirname(path), root) for pattern in patterns for path in glob.glob(pattern)
  )


def _build_command(name: str, data_dir: str) -> str:
  return f'`tfds build {name.split(":")[0]} --data_dir={data_dir} --file_format=array_record`'


def _unknown_dataset_error(name: str) -> DatasetNotFoundError:
  return DatasetNotFoundError(
    f"Unknown dataset data.name='{name}': it is neither a TFDS dataset nor "
    f'one of the embedded offline datasets {list(embedded.EMBEDDED_DATASETS)}'
    f" or '{corpus_lib.PYTHON_STDLIB}' or 'text:GLOB'; see `tfds.list_builders()` for TFDS names."
  )


def _not_prepared_error(name: str, builder, data_dir: str | None) -> DatasetNotFoundError:
  searched = _searched_dirs(data_dir)
  others = []
  for root in searched:
    others += _prepared_versions(root, _base_name(name))
  hint = ''
  if others:
    as_name = lambda variant: ':'.join(variant.rsplit('/', 1))
    hint = (
      f" Prepared variants found: {', '.join(others)} (select one with data.name='{as_name(others[-1])}')."
    )
  target = os.fspath(builder.data_dir_root)  # Where TFDS looked last.
  return DatasetNotFoundError(
    f"Dataset '{name}' (version {builder.version}) is not prepared in "
    f'data_dir {", ".join(searched)}.{hint} Prepare it with '
    f'{_build_command(name, target)} (building needs TensorFlow and network '
    'on the preparing machine only; reading here does not), or set '
    'data.download=True.'
  )


def _not_random_access_error(name: str, builder) -> DatasetNotFoundError:
  formats = sorted(f.value for f in builder.info.available_file_formats())
  return DatasetNotFoundError(
    f"Dataset '{name}' in {builder.data_dir} is stored as {formats}, which "
    'cannot be read without TensorFlow; rebuild it as array_record on a '
    f'machine with TensorFlow: {_build_command(name, "NEW_DATA_DIR")}, or '
    f'`tfds convert_format --dataset_version_dir={builder.data_dir} '
    '--out_file_format=array_record`.'
  )


@contextlib.contextmanager
def _quiet_progress_bars():
  was_active = getattr(tfds.core.utils.tqdm_utils, '_active', True)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(was_active)


def _prepare(builder, name: str, is_embedded: bool) -> None:
  """download_and_prepare in array_record, once across processes.

  TFDS writes into an `incomplete.*` sibling directory and renames it into
  place at the end, so readers never see a half-written dataset; the lock
  additionally stops two processes sharing a data_dir from both generating.
  """
  lock = os.path.join(os.fspath(builder.data_dir_root), f'.{_base_name(name)}.prepare.lock')
  with corpus_lib.file_lock(lock):  # Concurrent processes prepare it once.
    if builder.is_prepared():  # Another process finished while we waited.
      return
    logging.info('Preparing %s into %s', name, builder.data_dir_root)
    if not is_embedded:  # A real download: keep TFDS' progress reporting.
      builder.download_and_prepare(file_format='array_record')
      return
    # The embedded sets take about a second: no progress bars or status
    # prints (they go to the log), and no `downloads/` dir in data_dir.
    with (
      _quiet_progress_bars(),
      tempfile.TemporaryDirectory() as scratch,
      contextlib.redirect_stdout(io.StringIO()) as tfds_stdout,
    ):
      builder.download_and_prepare(download_dir=scratch, file_format='array_record')
    logging.info('%s', tfds_stdout.getvalue().strip())


def _random_access(builder) -> bool:
  formats = builder.info.available_file_formats()
  return bool(formats & set(tfds.core.FileFormat.with_random_access()))


@functools.lru_cache(maxsize=32)
def _open_builder(name: str, data_dir: str | None, download: bool):
  """Returns a prepared, randomly accessible TFDS builder, or raises."""
  is_embedded = _base_name(name) in embedded.EMBEDDED_DATASETS
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise _unknown_dataset_error(name) from None
  except Exception as e:  # Anything else from TFDS: keep it on one line.
    raise DatasetNotFoundError(
      f"Could not load TFDS builder for data.name='{name}' "
      f'(data_dir {data_dir}): {type(e).__name__}: '
      f'{str(e).splitlines()[0] if str(e) else ""}'
    ) from e

  if not builder.is_prepared():
    if not (is_embedded or download):
      raise _not_prepared_error(name, builder, data_dir)
    try:
      _prepare(builder, name, is_embedded)
    except Exception as e:
      message = str(e).splitlines()[0] if str(e) else ''
      advice = (
        'check that data.data_dir is writable'
        if is_embedded
        else (
          'real TFDS datasets usually need TensorFlow and network to build: '
          f'run {_build_command(name, builder.data_dir_root)} on a machine '
          'that has them'
        )
      )
      raise DatasetNotFoundError(
        f"Preparing dataset '{name}' into {builder.data_dir_root} failed "
        f'({type(e).__name__}: {message}); {advice}.'
      ) from e
    # Re-open so the builder reflects the files on disk.
    builder = tfds.builder(name, data_dir=data_dir)
  if not _random_access(builder):
    raise _not_random_access_error(name, builder)
  return builder


def _stored_metadata(builder) -> dict[str, Any]:
  """metadata.json as written at preparation time ({} if absent)."""
  path = os.path.join(os.fspath(builder.data_dir), 'metadata.json')
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _pick_eval_split(splits: Sequence[str]) -> str:
  for split in ('validation', 'test', 'train'):
    if split in splits:
      return split
  return sorted(splits)[0]


def _image_feature_shape(feature) -> tuple[Any, ...] | None:
  """(H, W, C) of an image-like feature, else None."""
  if isinstance(feature, tfds.features.Image):
    return tuple(feature.shape)
  if (
    isinstance(feature, tfds.features.Tensor)
    and len(feature.shape) == 3
    and np.dtype(feature.np_dtype) == np.uint8
  ):
    return tuple(feature.shape)
  return None


def _is_text_feature(feature) -> bool:
  if isinstance(feature, tfds.features.Text):
    return True
  return (
    isinstance(feature, tfds.features.Tensor)
    and feature.shape == ()
    and np.dtype(feature.np_dtype).kind in 'OSU'
  )


def _describe(name: str, builder, config: config_lib.DataConfig) -> DatasetInfo:
  features = builder.info.features
  feature_names = set(features.keys()) if hasattr(features, 'keys') else set()
  num_examples = {split: info.num_examples for split, info in builder.info.splits.items()}
  common = dict(
    name=name,
    num_examples=num_examples,
    train_split='train' if 'train' in num_examples or not num_examples else sorted(num_examples)[0],
    eval_split=(_pick_eval_split(list(num_examples)) if num_examples else 'validation'),
    data_dir=os.fspath(builder.data_dir),
  )

  image_key, label_key = 'image', 'label'
  supervised = builder.info.supervised_keys
  if isinstance(supervised, tuple) and len(supervised) == 2 and all(isinstance(k, str) for k in supervised):
    image_key, label_key = supervised
  image_shape = _image_feature_shape(features[image_key]) if image_key in feature_names else None
  if (
    image_shape is not None
    and label_key in feature_names
    and isinstance(features[label_key], tfds.features.ClassLabel)
  ):
    height, width, channels = image_shape
    if config.image_size is not None:
      height = width = config.image_size
    if height is None or width is None:
      raise ValueError(
        f'data.image_size must be set for dataset {name}, whose images have variable shape {image_shape}'
      )
    if config.augment and _base_name(name) in _NO_FLIP_DATASETS:
      raise ValueError(
        f'data.augment=True flips images left-right, which changes the '
        f'meaning of {name} images; set data.augment=False'
      )
    mean, std = _IMAGE_STATS.get(_base_name(name), _DEFAULT_IMAGE_STATS)
    if not isinstance(mean, tuple):
      mean, std = (mean,) * channels, (std,) * channels
    return DatasetInfo(
      kind='image',
      num_classes=features[label_key].num_classes,
      image_shape=(height, width, channels),
      image_mean=tuple(float(m) for m in mean),
      image_std=tuple(float(s) for s in std),
      feature_keys={'image': image_key, 'label': label_key},
      **common,
    )

  if config.text_key in feature_names and _is_text_feature(features[config.text_key]):
    metadata = _stored_metadata(builder)
    tokenizer = tokenizer_lib.load(config.tokenizer)
    if tokenizer.is_bytes:
      return DatasetInfo(
        kind='text',
        vocab_size=TEXT_VOCAB_SIZE,
        seq_len=config.seq_len,
        separator_byte=DOCUMENT_SEPARATOR_BYTE,
        num_bytes=metadata.get('num_bytes'),
        fingerprint=metadata.get('sha256'),
        feature_keys={'text': config.text_key},
        tokenizer=tokenizer.spec,
        tokenizer_sha256=tokenizer.sha256,
        separator_token=DOCUMENT_SEPARATOR_BYTE,
        **common,
      )
    # A subword tokenizer: the splits are tokenized once into a cache keyed
    # by what identifies the prepared data.
    key = json.dumps(
      [name, str(builder.version), num_examples, config.text_key, metadata.get('sha256')], sort_keys=True
    )
    return DatasetInfo(
      kind='text',
      vocab_size=tokenizer.vocab_size,
      seq_len=config.seq_len,
      num_bytes=metadata.get('num_bytes'),
      fingerprint=metadata.get('sha256'),
      feature_keys={'text': config.text_key},
      tokenizer=tokenizer.spec,
      tokenizer_sha256=tokenizer.sha256,
      separator_token=tokenizer.separator,
      corpus_sha256=hashlib.sha256(key.encode()).hexdigest(),
      python_version=metadata.get('python_version'),
      **common,
    )

  raise ValueError(
    f'Dataset {name} is neither image classification (an image feature '
    f'{image_key!r} and a ClassLabel {label_key!r}) nor text (a text '
    f'feature data.text_key={config.text_key!r}); its features are '
    f'{sorted(feature_names)}'
  )


def _describe_corpus(config: config_lib.DataConfig) -> DatasetInfo:
  """DatasetInfo of `python_stdlib` or `text:GLOB` (`dsjax.data.corpus`)."""
  corpus = corpus_lib.open_corpus(config.name, config.text_key)
  tokenizer = tokenizer_lib.load(config.tokenizer)
  return DatasetInfo(
    name=config.name,
    kind='text',
    num_examples={split: len(keys) for split, keys in corpus.keys.items()},
    train_split='train',
    eval_split='validation',
    data_dir=corpus_lib.cache_dir(config.data_dir, config.name, corpus.identity, tokenizer),
    vocab_size=tokenizer.vocab_size,
    seq_len=config.seq_len,
    separator_byte=(DOCUMENT_SEPARATOR_BYTE if tokenizer.is_bytes else None),
    num_bytes=dict(corpus.num_bytes),
    fingerprint=dict(corpus.sha256),
    feature_keys={'text': config.text_key},
    tokenizer=tokenizer.spec,
    tokenizer_sha256=tokenizer.sha256,
    separator_token=tokenizer.separator,
    corpus_sha256=corpus.identity,
    python_version=corpus.python_version,
  )


def open_dataset(data_config) -> tuple[Any, DatasetInfo]:
  """(prepared TFDS builder, DatasetInfo) for a `data` config; the builder
  is None for the corpora read from files (`dsjax.data.corpus`)."""
  config = config_lib.parse_config(data_config)
  if corpus_lib.is_corpus(config.name):
    return None, _describe_corpus(config)
  builder = _open_builder(config.name, config.data_dir, config.download)
  return builder, _describe(config.name, builder, config)


def dataset_info(data_config, require_prepared: bool = True) -> DatasetInfo:
  """Describes the configured dataset, preparing it first if it is embedded.

  `require_prepared=False` (a benchmark on random inputs of the dataset's
  shape) describes a registered TFDS dataset that is not prepared from its
  builder's own metadata (feature shapes, classes), reading no data; its
  `num_examples` is then empty.

  Raises:
    DatasetNotFoundError: unknown name, not prepared (and not downloadable),
      or stored in a format that needs TensorFlow.
    ValueError: invalid config values, or an unsupported dataset.
  """
  config = config_lib.parse_config(data_config)
  if (
    not require_prepared
    and _base_name(config.name) not in embedded.EMBEDDED_DATASETS
    and not corpus_lib.is_corpus(config.name)
  ):
    try:
      builder = tfds.builder(config.name, data_dir=config.data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise _unknown_dataset_error(config.name) from None
    if not builder.is_prepared():
      return _describe(config.name, builder, config)
  return open_dataset(config)[1]
