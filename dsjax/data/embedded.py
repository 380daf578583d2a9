"""Two small TFDS datasets built from data already on every machine.

They let every experiment, test and CI job run with no network and no
pre-downloaded data. Both are ordinary TFDS builders (registered with TFDS when
this module is imported) and are prepared on first use, in `array_record`
format, into the data_dir. Preparing needs neither TensorFlow nor network.

`sklearn_digits` (image classification)
  The 1,797 8x8 grey handwritten digits bundled with scikit-learn
  (`sklearn.datasets.load_digits`, a copy of the test part of the UCI "Optical
  Recognition of Handwritten Digits" set). Pixel values 0..16 are rescaled to
  uint8 0..255 with round((v * 255) / 16) (exact integer arithmetic) and
  stored as a uint8 Tensor of shape (8, 8, 1); we use a plain Tensor feature
  instead of `tfds.features.Image` because encoding PNGs needs TensorFlow.
  Split: for each class, 30 examples chosen by a Philox permutation keyed by
  (seed 0, class) go to `test`; the rest go to `train`. That gives a class
  balanced test set of 300 and a train set of 1,497. Examples keep the
  scikit-learn order inside each split (shuffling is disabled), so the stored
  order is identical on every machine.

`python_docs_bytes` (byte-level text)
  The English reference documentation that ships with CPython in
  `pydoc_data.topics` (what `help('if')` prints): 79 topics, 466,117 UTF-8
  bytes with Python 3.11.7. Each example is one document {'topic', 'text'};
  topics are ordered by name. The corpus is cut once, enwik8-style, into a
  contiguous 90% `train` / 10% `validation`: the cut is the first newline at or
  after 90% of the corpus bytes, so the topic containing it contributes its
  head to `train` and its tail to `validation`. The text is exactly the
  Python documentation, hence deterministic for a given Python version; patch
  releases may edit the docs, so the Python version and a SHA-256 of each split
  are stored in the dataset's metadata (see `DatasetInfo.fingerprint`) to let
  multi-host runs check that every host prepared the same bytes.
"""

import hashlib
import sys

import numpy as np
import tensorflow_datasets as tfds

from dsjax.data import random_bits

# Scaled pixel values, in 0..255 units, of the `train` split of
# `sklearn_digits` (checked by tests/data/test_data.py). Used to normalise images.
DIGITS_TRAIN_MEAN = 77.91
DIGITS_TRAIN_STD = 95.94

_DIGITS_TEST_PER_CLASS = 30
_DOCS_VALIDATION_FRACTION = 0.1


def _scale_digit_pixels(images_0_16: np.ndarray) -> np.ndarray:
  """Maps scikit-learn's 0..16 pixel values to uint8 0..255 (16 -> 255)."""
  values = images_0_16.astype(np.int64)
  return ((values * 255 + 8) // 16).astype(np.uint8)


def digits_split_indices() -> dict[str, np.ndarray]:
  """Indices into `load_digits()` of each split, sorted ascending."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top

  labels = datasets.load_digits().target
  test = []
  for label in range(10):
    members = np.flatnonzero(labels == label)
    order = random_bits.permutation(0, random_bits.Purpose.DATASET_SPLIT, label, len(members))
    test.append(members[order[:_DIGITS_TEST_PER_CLASS]])
  test = np.sort(np.concatenate(test))
  train = np.setdiff1d(np.arange(len(labels)), test)
  return {'train': train, 'test': test}


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
  """scikit-learn's 8x8 handwritten digits, 1,497 train / 300 test."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        "scikit-learn's copy of the UCI optical handwritten digits: 8x8 "
        'grey images (0..16 rescaled to 0..255), 10 classes. Test = 30 '
        'examples per class chosen by a seeded Philox permutation.'
      ),
      features=tfds.features.FeaturesDict(
        {
          'image': tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
          'label': tfds.features.ClassLabel(names=[str(d) for d in range(10)]),
        }
      ),
      supervised_keys=('image', 'label'),
      homepage='https://scikit-learn.org/stable/datasets/toy_dataset.html',
      citation=(
        '@misc{alpaydin1998optdigits, author={Alpaydin, E. and Kaynak, '
        'C.}, title={Optical Recognition of Handwritten Digits}, '
        'year={1998}, howpublished={UCI Machine Learning Repository}}'
      ),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the data ships with scikit-learn.
    return {split: self._generate_examples(indices) for split, indices in digits_split_indices().items()}

  def _generate_examples(self, indices):
    from sklearn import datasets  # pylint: disable=g-import-not-at-top

    digits = datasets.load_digits()
    images = _scale_digit_pixels(digits.images)[..., None]  # (N, 8, 8, 1)
    for index in indices:
      # Integer keys: with shuffling disabled TFDS stores examples sorted by
      # key, i.e. in scikit-learn order.
      yield (
        int(index),
        {
          'image': images[index],
          'label': int(digits.target[index]),
        },
      )


def python_docs_documents() -> dict[str, list[tuple[str, str]]]:
  """The (topic, text) documents of each split of `python_docs_bytes`."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top

  topics = pydoc_data.topics.topics
  documents = [(name, topics[name].encode('utf-8')) for name in sorted(topics)]
  total_bytes = sum(len(text) for _, text in documents)
  cut = int(np.ceil((1 - _DOCS_VALIDATION_FRACTION) * total_bytes))

  train, validation = [], []
  start = 0  # Corpus offset of the current document.
  for name, text in documents:
    end = start + len(text)
    if end <= cut:
      train.append((name, text))
    elif start >= cut:
      validation.append((name, text))
    else:
      # This document holds the cut: split it just after the next newline so
      # both halves stay valid UTF-8 and start/end on whole lines.
      newline = text.find(b'\n', cut - start)
      head_len = len(text) if newline < 0 else newline + 1
      if text[:head_len]:
        train.append((name, text[:head_len]))
      if text[head_len:]:
        validation.append((name, text[head_len:]))
    start = end
  decode = lambda docs: [(name, text.decode('utf-8')) for name, text in docs]
  return {'train': decode(train), 'validation': decode(validation)}


def _sha256_of_documents(documents: list[tuple[str, str]]) -> str:
  digest = hashlib.sha256()
  for _, text in documents:
    digest.update(text.encode('utf-8'))
  return digest.hexdigest()


class PythonDocsBytes(tfds.core.GeneratorBasedBuilder):
  """CPython's pydoc topic documentation, as byte-level text."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}

  def _info(self) -> tfds.core.DatasetInfo:
    documents = python_docs_documents()
    metadata = tfds.core.MetadataDict(
      python_version='.'.join(map(str, sys.version_info[:3])),
      num_bytes={split: sum(len(t.encode('utf-8')) for _, t in docs) for split, docs in documents.items()},
      sha256={split: _sha256_of_documents(docs) for split, docs in documents.items()},
    )
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        'The English reference documentation shipped with CPython '
        '(pydoc_data.topics), one document per topic in name order; '
        'contiguous split: first 90% of bytes train, last 10% validation.'
      ),
      features=tfds.features.FeaturesDict(
        {
          'topic': tfds.features.Text(),
          'text': tfds.features.Text(),
        }
      ),
      homepage='https://docs.python.org/3/reference/',
      metadata=metadata,
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the text ships with Python.
    return {split: self._generate_examples(documents) for split, documents in python_docs_documents().items()}

  def _generate_examples(self, documents):
    for position, (topic, text) in enumerate(documents):
      yield position, {'topic': topic, 'text': text}


# TFDS registers builders under the snake_case of their class names.
EMBEDDED_DATASETS = ('sklearn_digits', 'python_docs_bytes')
EMBEDDED_BUILDERS = {
  'sklearn_digits': SklearnDigits,
  'python_docs_bytes': PythonDocsBytes,
}
