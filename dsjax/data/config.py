"""The `data` section of an experiment config, and its validation."""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict


def get_config(name: str = 'sklearn_digits') -> ml_collections.ConfigDict:
  """Default `data` config. Every field is optional in user configs."""
  config = ml_collections.ConfigDict()
  # Any TFDS name (optionally 'name:version' or 'name/config:version'), one
  # of the embedded offline datasets: 'sklearn_digits', 'python_docs_bytes',
  # 'python_stdlib', or 'text:GLOB' for your own UTF-8 text files (plain
  # text, one document per file, or JSON Lines with the text under
  # `text_key`, one document per line).
  config.name = name
  # Where TFDS datasets live; None -> TFDS default (~/tensorflow_datasets or
  # $TFDS_DATA_DIR).
  config.data_dir = config_dict.placeholder(str)
  # Try to download and prepare missing (non-embedded) datasets. Off by
  # default: preparing real datasets needs network and TensorFlow.
  config.download = False
  # Text: tokens per training window (batches hold seq_len + 1 tokens).
  config.seq_len = 128
  # Images: if set, resize (shorter side) and centre-crop to this size.
  config.image_size = config_dict.placeholder(int)
  # Text: feature holding the document text in real TFDS text datasets, or
  # the key of each JSON Lines record of 'text:GLOB'.
  config.text_key = 'text'
  # Text: 'bytes' (every UTF-8 byte is a token, vocabulary 256) or the path
  # of a Hugging Face `tokenizers` JSON file, e.g. one trained by
  # `python -m dsjax.tokenizer`. Read from the local file only.
  config.tokenizer = 'bytes'
  # Images: random left-right flips when training.
  config.augment = False
  # The splits trained on and evaluated on; None: the dataset's own ('train', and 'validation' where it
  # has one, else 'test'). A TFDS split may be a slice ('train[:80%]', 'validation[50%:]'); the corpora
  # read from files ('python_stdlib', 'text:GLOB') have 'train', 'validation' and 'test' only.
  # `python -m dsjax.sweep` sets both to keep the split it reports on unseen (docs/sweeps.md).
  config.train_split = config_dict.placeholder(str)
  config.eval_split = config_dict.placeholder(str)
  return config


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """A validated, immutable copy of the `data` config."""

  name: str
  data_dir: str | None
  download: bool
  seq_len: int
  image_size: int | None
  text_key: str
  augment: bool
  tokenizer: str = 'bytes'
  train_split: str | None = None
  eval_split: str | None = None


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def parse_config(data_config: Mapping[str, Any] | DataConfig) -> DataConfig:
  """The `data` section as a DataConfig: validated (`validate_data_config`) unless it already is one.

  A run validates its section once and passes the DataConfig down, so the pipelines and dataset
  descriptions it makes (every evaluation makes one) do not check it again.
  """
  if isinstance(data_config, DataConfig):
    return data_config
  return validate_data_config(data_config)


def validate_data_config(data_config: Mapping[str, Any]) -> DataConfig:
  """Validates a `data` ConfigDict (or dict); raises one-line ValueErrors.

  Missing fields take the defaults of `get_config()`.
  """
  defaults = get_config()
  if isinstance(data_config, ml_collections.ConfigDict):
    data_config = data_config.to_dict()
  if not isinstance(data_config, Mapping):
    raise ValueError(f'data config must be a ConfigDict or dict, got {type(data_config)}')
  unknown = sorted(set(data_config) - set(defaults))
  if unknown:
    raise ValueError(f'unknown data config keys {unknown}; known: {sorted(defaults)}')
  get = lambda key: data_config.get(key, defaults[key])

  name = get('name')
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f'data.name must be a non-empty string, got {name!r}')
  data_dir = get('data_dir')
  if data_dir is not None:
    if not isinstance(data_dir, (str, os.PathLike)) or not os.fspath(data_dir):
      raise ValueError(f'data.data_dir must be None or a path, got {data_dir!r}')
    data_dir = os.fspath(data_dir)
  download = get('download')
  if not isinstance(download, bool):
    raise ValueError(f'data.download must be a bool, got {download!r}')
  seq_len = get('seq_len')
  if not _is_int(seq_len) or seq_len <= 0:
    raise ValueError(f'data.seq_len must be a positive integer, got {seq_len!r}')
  image_size = get('image_size')
  if image_size is not None and (not _is_int(image_size) or image_size <= 0):
    raise ValueError(f'data.image_size must be None or a positive integer, got {image_size!r}')
  text_key = get('text_key')
  if not isinstance(text_key, str) or not text_key:
    raise ValueError(f'data.text_key must be a non-empty string, got {text_key!r}')
  augment = get('augment')
  if not isinstance(augment, bool):
    raise ValueError(f'data.augment must be a bool, got {augment!r}')
  tokenizer = get('tokenizer')
  if isinstance(tokenizer, os.PathLike):
    tokenizer = os.fspath(tokenizer)
  if not isinstance(tokenizer, str) or not tokenizer.strip():
    raise ValueError(f"data.tokenizer must be 'bytes' or the path of a tokenizer file, got {tokenizer!r}")
  splits = {key: get(key) for key in ('train_split', 'eval_split')}
  for key, split in splits.items():
    if split is not None and (not isinstance(split, str) or not split.strip()):
      raise ValueError(f"data.{key} must be None or a split such as 'train' or 'train[:80%]', got {split!r}")
  return DataConfig(
    name=name.strip(),
    data_dir=data_dir,
    download=download,
    seq_len=seq_len,
    image_size=image_size,
    text_key=text_key,
    augment=augment,
    tokenizer=tokenizer.strip(),
    **{key: None if split is None else split.strip() for key, split in splits.items()},
  )
