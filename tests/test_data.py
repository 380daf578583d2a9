"""Tests of dsjax.data: embedded datasets, pipelines, state, sharding, errors.

Everything runs offline in a temporary TFDS data_dir, prepared once per
session. Two tiny extra TFDS builders defined here stand in for "real"
datasets (PNG-encoded images of varying size, a text feature with another
name), so the non-embedded code paths are exercised without any download.
"""

import io
import json
import os
import shutil
import subprocess
import sys

import chex
import numpy as np
import pytest
import tensorflow_datasets as tfds

from dsjax import data
from dsjax.data import embedded
from dsjax.data import pipeline as pipeline_lib
from dsjax.data import random_bits


class DsjaxTestPngImages(tfds.core.GeneratorBasedBuilder):
  """Stand-in for a real image set: PNG images of varying size, 3 classes."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3)),
            'label': tfds.features.ClassLabel(num_classes=3),
        }),
        supervised_keys=('image', 'label'),
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(24, 1),
            'test': self._generate_examples(10, 2)}

  def _generate_examples(self, num, seed):
    from PIL import Image  # pylint: disable=g-import-not-at-top

    rng = np.random.RandomState(seed)
    for i in range(num):
      height, width = rng.randint(10, 20, size=2)
      pixels = rng.randint(0, 256, size=(height, width, 3)).astype(np.uint8)
      png = io.BytesIO()
      Image.fromarray(pixels).save(png, format='PNG')
      yield i, {'image': png.getvalue(), 'label': i % 3}


class DsjaxTestSentences(tfds.core.GeneratorBasedBuilder):
  """Stand-in for a real text set (like lm1b) whose text key is 'sentence'."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {'sentence': tfds.features.Text()}),
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(40, 1),
            'test': self._generate_examples(12, 2)}

  def _generate_examples(self, num, seed):
    rng = np.random.RandomState(seed)
    words = ['ünïcode', 'byte', 'level', 'model', 'sentence', 'the', 'a']
    for i in range(num):
      yield i, {'sentence': ' '.join(rng.choice(words, rng.randint(1, 8)))}


def _config(name, data_dir, **overrides):
  config = data.get_config(name)
  config.data_dir = os.fspath(data_dir)
  config.update(overrides)
  return config


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """A TFDS data_dir with the embedded sets and the stand-ins prepared."""
  directory = tmp_path_factory.mktemp('tfds')
  for name in data.EMBEDDED_DATASETS:  # Prepared on first use.
    data.dataset_info(_config(name, directory))
  for builder_cls in (DsjaxTestPngImages, DsjaxTestSentences):
    builder_cls(data_dir=os.fspath(directory)).download_and_prepare(
        file_format='array_record')
  return directory


@pytest.fixture
def digits(data_dir):
  return _config('sklearn_digits', data_dir)


@pytest.fixture
def docs(data_dir):
  return _config('python_docs_bytes', data_dir, seq_len=32)


def _take(pipeline, num):
  return [next(pipeline) for _ in range(num)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for batch_a, batch_b in zip(a, b):
    assert batch_a.keys() == batch_b.keys()
    for key in batch_a:
      np.testing.assert_array_equal(batch_a[key], batch_b[key])


def _source(config, split):
  builder, _ = data.sources.open_dataset(config)
  return builder.as_data_source(split=split)


# -- Embedded datasets ---------------------------------------------------------


def test_digits_info_and_split(digits):
  info = data.dataset_info(digits)
  assert info.kind == 'image'
  assert info.num_examples == {'train': 1497, 'test': 300}
  assert (info.num_classes, info.image_shape) == (10, (8, 8, 1))
  assert (info.train_split, info.eval_split) == ('train', 'test')
  split = embedded.digits_split_indices()
  assert not set(split['train']) & set(split['test'])
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  labels = datasets.load_digits().target
  np.testing.assert_array_equal(np.bincount(labels[split['test']]), [30] * 10)


def test_digits_stored_pixels_and_normalisation_constants(digits):
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  train = _source(digits, 'train')
  raw = datasets.load_digits().images[embedded.digits_split_indices()['train']]
  stored = np.stack([r['image'] for r in train.__getitems__(range(len(train)))])
  chex.assert_shape(stored, (1497, 8, 8, 1))
  chex.assert_type(stored, np.uint8)
  np.testing.assert_array_equal(stored[..., 0], np.round(raw * 255 / 16))
  assert abs(stored.mean() - embedded.DIGITS_TRAIN_MEAN) < 0.01
  assert abs(stored.std() - embedded.DIGITS_TRAIN_STD) < 0.01


def test_docs_info_and_corpus(docs):
  info = data.dataset_info(docs)
  assert info.kind == 'text'
  assert (info.vocab_size, info.seq_len, info.separator_byte) == (256, 32, 0)
  assert info.eval_split == 'validation'
  total = sum(info.num_bytes.values())
  assert 0.09 < info.num_bytes['validation'] / total < 0.11
  assert set(info.fingerprint) == {'train', 'validation'}
  # The stored text is the Python documentation, in topic order, split once.
  documents = embedded.python_docs_documents()
  joined = lambda docs: ''.join(text for _, text in docs)
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  topics = pydoc_data.topics.topics
  assert joined(documents['train']) + joined(documents['validation']) == (
      ''.join(topics[name] for name in sorted(topics)))
  stored = [r['text'] for r in _source(docs, 'validation')]
  assert stored == [text.encode() for _, text in documents['validation']]


def test_concurrent_preparation_is_safe(tmp_path):
  # Two processes preparing into one data_dir: both succeed, one dataset.
  script = ('import sys; from dsjax import data; print(data.dataset_info('
            "{'name': 'sklearn_digits', 'data_dir': sys.argv[1]})"
            '.num_examples)')
  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(data.__file__)))
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      filter(None, [repo_root, os.environ.get('PYTHONPATH')]))}
  procs = [subprocess.Popen([sys.executable, '-c', script, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env) for _ in range(2)]
  for proc in procs:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "{'train': 1497, 'test': 300}" in out
  assert sorted(os.listdir(tmp_path / 'sklearn_digits')) == ['1.0.0']


# -- Image pipelines -----------------------------------------------------------


def test_image_train_batch_shapes(digits):
  pipeline = data.make_pipeline(
      digits, split='train', global_batch_size=32, seed=0, process_index=0,
      process_count=1)
  batch = next(pipeline)
  assert set(batch) == {'image', 'label'}
  chex.assert_shape(batch['image'], (32, 8, 8, 1))
  chex.assert_type(batch['image'], np.float32)
  chex.assert_shape(batch['label'], (32,))
  chex.assert_type(batch['label'], np.int32)
  assert batch['label'].min() >= 0 and batch['label'].max() < 10


def test_image_epoch_is_a_permutation_and_normalised(digits):
  # 1497 = 3 * 499: three steps are exactly one epoch.
  pipeline = data.make_pipeline(
      digits, split='train', global_batch_size=499, seed=3, process_index=0,
      process_count=1)
  epoch = _take(pipeline, 3)
  images = np.concatenate([b['image'] for b in epoch])
  assert pipeline.epoch == 1
  assert abs(images.mean()) < 0.01 and abs(images.std() - 1) < 0.01
  source = _source(digits, 'train')
  stored = np.stack([r['image'] for r in source.__getitems__(range(1497))])
  as_rows = lambda x: np.sort(x.reshape(len(x), -1), axis=0)
  restored = images * embedded.DIGITS_TRAIN_STD + embedded.DIGITS_TRAIN_MEAN
  np.testing.assert_allclose(as_rows(restored), as_rows(stored), atol=1e-3)
  # The next epoch uses another permutation.
  assert not np.array_equal(next(pipeline)['image'], epoch[0]['image'])


def test_same_seed_same_batches_other_seed_differs(digits):
  make = lambda seed: data.make_pipeline(
      digits, split='train', global_batch_size=16, seed=seed,
      process_index=0, process_count=1)
  _assert_batches_equal(_take(make(7), 3), _take(make(7), 3))
  assert not np.array_equal(next(make(7))['image'], next(make(8))['image'])


@pytest.mark.parametrize('name', ['sklearn_digits', 'python_docs_bytes'])
def test_state_restore_continues_bitwise(data_dir, name):
  config = _config(name, data_dir, seq_len=16)
  make = lambda: data.make_pipeline(
      config, split='train', global_batch_size=64, seed=5, process_index=0,
      process_count=1)
  pipeline = make()
  _take(pipeline, 30)  # 30 * 64 > 1497: past an epoch boundary for digits.
  state = json.loads(json.dumps(pipeline.get_state()))
  expected = _take(pipeline, 4)
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 4), expected)
  # A state from another pipeline is refused.
  other = data.make_pipeline(config, split='train', global_batch_size=64,
                             seed=6, process_index=0, process_count=1)
  with pytest.raises(ValueError, match='seed'):
    other.set_state(state)


@pytest.mark.parametrize('name,train', [
    ('sklearn_digits', True), ('sklearn_digits', False),
    ('python_docs_bytes', True), ('python_docs_bytes', False),
    ('dsjax_test_png_images', True), ('dsjax_test_sentences', True),
])
def test_process_shares_concatenate_to_global_batch(data_dir, name, train):
  config = _config(name, data_dir, seq_len=16, image_size=12,
                   text_key='sentence' if 'sentences' in name else 'text')
  if name in data.EMBEDDED_DATASETS:
    config.image_size = None
  make = lambda index, count: data.make_pipeline(  # Default split.
      config, global_batch_size=8, seed=1, process_index=index,
      process_count=count, train=train)
  single = _take(make(0, 1), 3)
  shares = [_take(make(index, 2), 3) for index in range(2)]
  for step in range(3):
    for key in single[step]:
      assert shares[0][step][key].shape[0] == 4
      np.testing.assert_array_equal(
          np.concatenate([shares[0][step][key], shares[1][step][key]]),
          single[step][key])


def test_resume_with_another_process_count(digits):
  make = lambda index, count: data.make_pipeline(
      digits, split='train', global_batch_size=8, seed=2,
      process_index=index, process_count=count)
  single = make(0, 1)
  _take(single, 5)
  state = single.get_state()
  expected = next(single)
  second_host = make(1, 2)
  second_host.set_state(state)
  np.testing.assert_array_equal(next(second_host)['label'],
                                expected['label'][4:])


def test_image_eval_covers_each_example_once(digits):
  pipeline = data.make_pipeline(
      digits, split='test', global_batch_size=64, process_index=0,
      process_count=1, train=False)
  batches = list(pipeline)
  assert len(batches) == len(pipeline) == 5  # ceil(300 / 64)
  mask = np.concatenate([b['mask'] for b in batches])
  chex.assert_type(mask, np.float32)
  assert mask.sum() == 300 and np.all(mask[:300] == 1)
  labels = np.concatenate([b['label'] for b in batches])[:300]
  stored = [r['label'] for r in _source(digits, 'test')]
  np.testing.assert_array_equal(labels, stored)  # Stored order, each once.
  assert np.all(batches[-1]['image'][mask[-64:] == 0] == 0)
  # Iterating again runs a fresh, identical pass.
  _assert_batches_equal(list(pipeline), batches)


def test_eval_with_two_processes_masks_the_same_rows(digits):
  make = lambda index: data.make_pipeline(
      digits, split='test', global_batch_size=64, process_index=index,
      process_count=2, train=False)
  shares = [list(make(index)) for index in range(2)]
  assert len(shares[0]) == len(shares[1]) == 5  # Same number of steps.
  mask = np.concatenate([np.concatenate([a['mask'], b['mask']])
                         for a, b in zip(*shares)])
  assert mask.sum() == 300


def test_real_style_png_dataset_resize_and_flip(data_dir):
  config = _config('dsjax_test_png_images', data_dir, image_size=12,
                   augment=True)
  info = data.dataset_info(config)
  assert (info.image_shape, info.num_classes) == ((12, 12, 3), 3)
  assert info.image_mean == (127.5,) * 3  # Unknown dataset: maps to [-1, 1].
  make = lambda augment: data.make_pipeline(
      _config('dsjax_test_png_images', data_dir, image_size=12,
              augment=augment),
      split='train', global_batch_size=8, seed=0, process_index=0,
      process_count=1)
  flipped, plain = next(make(True)), next(make(False))
  chex.assert_shape(flipped['image'], (8, 12, 12, 3))
  np.testing.assert_array_equal(flipped['label'], plain['label'])
  is_flip = [np.array_equal(f, p[:, ::-1]) and not np.array_equal(f, p)
             for f, p in zip(flipped['image'], plain['image'])]
  is_same = [np.array_equal(f, p)
             for f, p in zip(flipped['image'], plain['image'])]
  assert all(a or b for a, b in zip(is_flip, is_same))
  assert any(is_flip) and any(is_same)
  # Variable-size images need a target size.
  with pytest.raises(ValueError, match='data.image_size'):
    data.dataset_info(_config('dsjax_test_png_images', data_dir))


def test_resize_and_centre_crop():
  image = np.arange(6 * 10 * 1, dtype=np.uint8).reshape(6, 10, 1)
  out = pipeline_lib._resize_and_centre_crop(image, 6)
  chex.assert_shape(out, (6, 6, 1))
  np.testing.assert_array_equal(out[..., 0], image[:, 2:8, 0])


# -- Text pipelines ------------------------------------------------------------


def test_text_train_windows(docs):
  pipeline = data.make_pipeline(
      docs, split='train', global_batch_size=16, seed=0, process_index=0,
      process_count=1)
  batch = next(pipeline)
  assert set(batch) == {'tokens'}
  chex.assert_shape(batch['tokens'], (16, 33))
  chex.assert_type(batch['tokens'], np.int32)
  stream = pipeline.stream.tobytes()
  for row in batch['tokens']:
    assert row.astype(np.uint8).tobytes() in stream
  info = data.dataset_info(docs)
  # Documents joined by one separator byte each.
  assert len(stream) == info.num_bytes['train'] + info.num_examples['train'] - 1


def test_text_eval_windows_tile_the_validation_stream(docs):
  pipeline = data.make_pipeline(
      docs, split='validation', global_batch_size=64, process_index=0,
      process_count=1, train=False)
  batches = list(pipeline)
  tokens = np.concatenate([b['tokens'] for b in batches])
  mask = np.concatenate([b['mask'] for b in batches]).astype(bool)
  stream = pipeline.stream
  num_windows = (len(stream) - 1) // 32
  assert mask.sum() == num_windows and np.all(mask[:num_windows])
  real = tokens[mask]
  # Consecutive windows share one byte: every target appears exactly once.
  np.testing.assert_array_equal(real[:, 1:].ravel(),
                                stream[1:1 + num_windows * 32])
  np.testing.assert_array_equal(real[:, 0], stream[0:num_windows * 32:32])
  assert np.all(tokens[~mask] == 0)


def test_text_with_other_key_and_document_mode(data_dir, monkeypatch):
  config = _config('dsjax_test_sentences', data_dir, text_key='sentence',
                   seq_len=20)
  info = data.dataset_info(config)
  assert (info.kind, info.eval_split, info.num_bytes) == ('text', 'test', None)
  make = lambda: data.make_pipeline(
      config, split='train', global_batch_size=8, seed=0, process_index=0,
      process_count=1)
  in_memory = make()
  assert in_memory.streamed
  # Large-corpus mode: rows start at documents of an epoch permutation.
  monkeypatch.setattr(pipeline_lib, 'MAX_IN_MEMORY_TEXT_DOCUMENTS', 10)
  by_document = make()
  assert not by_document.streamed
  batches = _take(by_document, 6)  # 48 rows > 40 documents: two epochs.
  sentences = [r['sentence'] for r in _source(config, 'train')]
  joined = b'\0'.join(sentences * 2)
  for batch in batches:
    chex.assert_shape(batch['tokens'], (8, 21))
    for row in batch['tokens']:
      window = row.astype(np.uint8).tobytes()
      assert window in joined
      assert any(window.startswith(s[:21]) for s in sentences)
  state = by_document.get_state()
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 2), _take(by_document, 2))


# -- Errors --------------------------------------------------------------------


def test_missing_dataset_error(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as error:
    data.make_pipeline(_config('cifar10', tmp_path), split='train',
                       global_batch_size=8, process_index=0, process_count=1)
  message = str(error.value)
  assert isinstance(error.value, ValueError)
  assert 'cifar10' in message and str(tmp_path) in message
  assert 'tfds build cifar10' in message and 'array_record' in message
  assert '\n' not in message


def test_unknown_dataset_error(tmp_path):
  with pytest.raises(data.DatasetNotFoundError,
                     match="'no_such_dataset'.*sklearn_digits"):
    data.dataset_info(_config('no_such_dataset', tmp_path))


def test_tfrecord_only_dataset_error(data_dir, tmp_path):
  # Fake a dataset that was prepared in TFRecord format.
  version_dir = tmp_path / 'dsjax_test_sentences' / '1.0.0'
  shutil.copytree(data_dir / 'dsjax_test_sentences' / '1.0.0', version_dir)
  info_path = version_dir / 'dataset_info.json'
  info = json.loads(info_path.read_text())
  info['fileFormat'] = 'tfrecord'
  info_path.write_text(json.dumps(info))
  for path in version_dir.glob('*.array_record-*'):
    path.rename(str(path).replace('array_record', 'tfrecord'))
  with pytest.raises(data.DatasetNotFoundError,
                     match='tfrecord.*rebuild it as array_record'):
    data.dataset_info(_config('dsjax_test_sentences', tmp_path,
                              text_key='sentence'))


@pytest.mark.parametrize('overrides,message', [
    (dict(seq_len=0), 'data.seq_len must be a positive integer, got 0'),
    (dict(image_size=-3), 'data.image_size must be None or a positive'),
    (dict(download='yes'), 'data.download must be a bool'),
    (dict(name=''), 'data.name must be a non-empty string'),
])
def test_bad_config_values(data_dir, overrides, message):
  config = {'name': 'python_docs_bytes', 'data_dir': os.fspath(data_dir),
            **overrides}
  with pytest.raises(ValueError, match=message):
    data.make_pipeline(config, split='train', global_batch_size=8,
                       process_index=0, process_count=1)


def test_bad_pipeline_arguments(digits):
  make = lambda **kw: data.make_pipeline(
      digits, **{'split': 'train', 'global_batch_size': 8,
                 'process_index': 0, 'process_count': 1, **kw})
  with pytest.raises(ValueError, match='divisible by process_count'):
    make(global_batch_size=9, process_count=2)
  with pytest.raises(ValueError, match='process_index must be < '):
    make(process_index=2, process_count=2)
  with pytest.raises(ValueError, match="split 'validation' is not in"):
    make(split='validation')
  with pytest.raises(ValueError, match='seed'):
    make(seed=-1)
  with pytest.raises(ValueError, match='unknown data config keys'):
    data.make_pipeline({'name': 'sklearn_digits', 'seqlen': 3},
                       split='train', global_batch_size=8)
  digits.augment = True
  with pytest.raises(ValueError, match='data.augment'):
    make()


def test_random_bits_are_fixed():
  # Philox raw output is a fixed algorithm: pin it, so that a NumPy change
  # (which would silently change every data order) is caught.
  words = random_bits.random_words(3, random_bits.Purpose.TEXT_OFFSETS, 5, 2)
  np.testing.assert_array_equal(
      words, np.array([1419007209105727032, 8906194455581044852], np.uint64))
  perm = random_bits.permutation(0, random_bits.Purpose.EPOCH_PERMUTATION, 0,
                                 10)
  np.testing.assert_array_equal(perm, [0, 8, 6, 9, 5, 2, 3, 1, 7, 4])
