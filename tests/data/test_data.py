"""Tests of dsjax.data: embedded datasets, Grain pipelines, state, sharding.

Everything runs offline in a temporary TFDS data_dir, prepared once per
session. Two tiny extra TFDS builders defined here stand in for "real"
datasets (PNG-encoded images of varying size, a text feature with another
name), so the non-embedded code paths are exercised without any download.
"""

import io
import json
import os
import pydoc_data.topics
import shutil
import subprocess
import sys

import chex
import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from sklearn import datasets as sklearn_datasets

from dsjax import data
from dsjax.data import embedded, random_bits
from dsjax.data import pipeline as pipeline_lib
from tests.helpers import subprocess_env

# Training rows 0..7 of sklearn_digits 'train' with seed 0 (Grain's order).
PINNED_DIGITS_ORDER = [1391, 146, 87, 924, 1480, 318, 487, 658]


class DsjaxTestPngImages(tfds.core.GeneratorBasedBuilder):
  """Stand-in for a real image set: PNG images of varying size, 3 classes."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          'image': tfds.features.Image(shape=(None, None, 3)),
          'label': tfds.features.ClassLabel(num_classes=3),
        }
      ),
      supervised_keys=('image', 'label'),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(24, 1), 'test': self._generate_examples(10, 2)}

  def _generate_examples(self, num, seed):
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
      features=tfds.features.FeaturesDict({'sentence': tfds.features.Text()}),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(40, 1), 'test': self._generate_examples(12, 2)}

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
    builder_cls(data_dir=os.fspath(directory)).download_and_prepare(file_format='array_record')
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
  labels = sklearn_datasets.load_digits().target
  np.testing.assert_array_equal(np.bincount(labels[split['test']]), [30] * 10)


def test_digits_stored_pixels_and_normalisation_constants(digits):
  train = _source(digits, 'train')
  raw = sklearn_datasets.load_digits().images[embedded.digits_split_indices()['train']]
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
  topics = pydoc_data.topics.topics
  assert joined(documents['train']) + joined(documents['validation']) == (
    ''.join(topics[name] for name in sorted(topics))
  )
  stored = [r['text'] for r in _source(docs, 'validation')]
  assert stored == [text.encode() for _, text in documents['validation']]


def test_concurrent_preparation_is_safe(tmp_path):
  # Two processes preparing into one data_dir: both succeed, one dataset.
  script = (
    'import sys; from dsjax import data; print(data.dataset_info('
    "{'name': 'sklearn_digits', 'data_dir': sys.argv[1]})"
    '.num_examples)'
  )
  env = subprocess_env()
  procs = [
    subprocess.Popen(
      [sys.executable, '-c', script, str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for _ in range(2)
  ]
  for proc in procs:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "{'train': 1497, 'test': 300}" in out
  assert sorted(os.listdir(tmp_path / 'sklearn_digits')) == ['1.0.0']


# -- Image pipelines -----------------------------------------------------------


def test_image_train_batch_shapes(digits):
  pipeline = data.make_pipeline(
    digits, split='train', global_batch_size=32, seed=0, process_index=0, process_count=1
  )
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
    digits, split='train', global_batch_size=499, seed=3, process_index=0, process_count=1
  )
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
    digits, split='train', global_batch_size=16, seed=seed, process_index=0, process_count=1
  )
  _assert_batches_equal(_take(make(7), 3), _take(make(7), 3))
  assert not np.array_equal(next(make(7))['image'], next(make(8))['image'])
  # Grain reseeds epoch e with seed + e; the run seed is hashed first, so
  # epoch 1 of seed 7 is not epoch 0 of seed 8.
  rows_7 = make(7)._train_rows()  # pylint: disable=protected-access
  rows_8 = make(8)._train_rows()  # pylint: disable=protected-access
  epoch_1_of_7 = [int(rows_7[1497 + i]['index']) for i in range(16)]
  epoch_0_of_8 = [int(rows_8[i]['index']) for i in range(16)]
  assert epoch_1_of_7 != epoch_0_of_8


def test_grain_order_is_pinned(digits):
  # The order is Grain's (index_shuffle, random_map generators): pin the
  # first rows so that a Grain upgrade that changes it is noticed. Update the
  # numbers when such a change is intended.
  pipeline = data.make_pipeline(
    digits, split='train', global_batch_size=8, seed=0, process_index=0, process_count=1
  )
  rows = pipeline._train_rows()  # pylint: disable=protected-access
  assert [int(rows[i]['index']) for i in range(8)] == PINNED_DIGITS_ORDER
  stored = _source(digits, 'train').__getitems__(PINNED_DIGITS_ORDER)
  np.testing.assert_array_equal(next(pipeline)['label'], [r['label'] for r in stored])


@pytest.mark.parametrize('name', ['sklearn_digits', 'python_docs_bytes'])
def test_state_restore_continues_bitwise(data_dir, name):
  config = _config(name, data_dir, seq_len=16)
  make = lambda: data.make_pipeline(
    config, split='train', global_batch_size=64, seed=5, process_index=0, process_count=1
  )
  pipeline = make()
  _take(pipeline, 30)  # 30 * 64 > 1497: past an epoch boundary for digits.
  state = json.loads(json.dumps(pipeline.get_state()))
  assert state['iterator'] == {'next_index': 30}  # Grain's iterator state.
  expected = _take(pipeline, 4)
  resumed = make()
  resumed.set_state(state)
  assert resumed.step == 30
  _assert_batches_equal(_take(resumed, 4), expected)
  # Restoring rewinds a pipeline that has moved on, too.
  pipeline.set_state(state)
  _assert_batches_equal(_take(pipeline, 4), expected)
  # A state from another pipeline, or not a state, is refused in one line.
  other = data.make_pipeline(
    config, split='train', global_batch_size=64, seed=6, process_index=0, process_count=1
  )
  with pytest.raises(ValueError, match='seed: state has 5, pipeline has 6'):
    other.set_state(state)
  for bad in (
    {**state, 'iterator': {'next_index': -1}},
    {**state, 'iterator': None},
    {**state, 'version': 1, 'step': 30},
  ):
    with pytest.raises(ValueError) as error:
      resumed.set_state(bad)
    assert '\n' not in str(error.value)


def test_eval_state_resumes_mid_pass(digits):
  make = lambda: data.make_pipeline(
    digits, split='test', global_batch_size=64, process_index=0, process_count=1, train=False
  )
  full = list(make())
  pipeline = make()
  _take(pipeline, 2)
  state = json.loads(json.dumps(pipeline.get_state()))
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(list(resumed), full[2:])
  with pytest.raises(ValueError, match='next_index'):
    resumed.set_state({**state, 'iterator': {'next_index': 6}})  # 5 batches.


@pytest.mark.parametrize(
  'name,train',
  [
    ('sklearn_digits', True),
    ('sklearn_digits', False),
    ('python_docs_bytes', True),
    ('python_docs_bytes', False),
    ('dsjax_test_png_images', True),
    ('dsjax_test_sentences', True),
  ],
)
def test_process_shares_concatenate_to_global_batch(data_dir, name, train):
  config = _config(
    name,
    data_dir,
    seq_len=16,
    image_size=12,
    text_key='sentence' if 'sentences' in name else 'text',
    augment=name == 'dsjax_test_png_images',
  )  # With flips.
  if name in data.EMBEDDED_DATASETS:
    config.image_size = None
  make = lambda index, count: data.make_pipeline(  # Default split.
    config, global_batch_size=8, seed=1, process_index=index, process_count=count, train=train
  )
  single = _take(make(0, 1), 3)
  shares = [_take(make(index, 2), 3) for index in range(2)]
  for step in range(3):
    for key in single[step]:
      assert shares[0][step][key].shape[0] == 4
      np.testing.assert_array_equal(
        np.concatenate([shares[0][step][key], shares[1][step][key]]), single[step][key]
      )


class _CountingSource:
  """Wraps a data source and records the indices read from it."""

  def __init__(self, source):
    self.source = source
    self.read = []

  def __len__(self):
    return len(self.source)

  def __getitems__(self, indices):
    self.read += list(indices)
    return self.source.__getitems__(indices)


@pytest.mark.parametrize('train', [True, False])
def test_each_process_reads_only_its_rows(digits, train):
  make = lambda index, count: data.make_pipeline(
    digits, global_batch_size=16, seed=4, process_index=index, process_count=count, train=train
  )
  single = make(0, 1)
  expected = np.concatenate([b['label'] for b in _take(single, 3)])
  for index in range(4):
    share = make(index, 4)
    share._source = counting = _CountingSource(share._source)  # pylint: disable=protected-access
    labels = np.concatenate([b['label'] for b in _take(share, 3)])
    assert len(counting.read) == 3 * 4  # Read lazily, per batch, its rows.
    stored = np.array(
      [r['label'] for r in _source(digits, 'train' if train else 'test').__getitems__(counting.read)]
    )
    np.testing.assert_array_equal(labels, stored)
    rows = np.arange(48).reshape(3, 16)[:, index * 4 : (index + 1) * 4]
    np.testing.assert_array_equal(labels, expected[rows.ravel()])


def test_threaded_reading_gives_the_same_batches(digits, monkeypatch):
  make = lambda: data.make_pipeline(
    digits, split='train', global_batch_size=32, seed=1, process_index=1, process_count=2
  )
  expected = _take(make(), 5)
  monkeypatch.setattr(pipeline_lib, 'READ_OPTIONS', grain.ReadOptions(num_threads=2, prefetch_buffer_size=3))
  threaded = make()
  _assert_batches_equal(_take(threaded, 5), expected)
  state = threaded.get_state()  # Counts returned, not prefetched, batches.
  assert state['iterator'] == {'next_index': 5}
  _take(threaded, 2)
  threaded.set_state(state)
  _assert_batches_equal(_take(threaded, 2), _take(make(), 7)[5:])


def test_resume_with_another_process_count(digits):
  make = lambda index, count: data.make_pipeline(
    digits, split='train', global_batch_size=8, seed=2, process_index=index, process_count=count
  )
  single = make(0, 1)
  _take(single, 5)
  state = single.get_state()
  expected = next(single)
  second_host = make(1, 2)
  second_host.set_state(state)
  np.testing.assert_array_equal(next(second_host)['label'], expected['label'][4:])


def test_image_eval_covers_each_example_once(digits):
  pipeline = data.make_pipeline(
    digits, split='test', global_batch_size=64, process_index=0, process_count=1, train=False
  )
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
    digits, split='test', global_batch_size=64, process_index=index, process_count=2, train=False
  )
  shares = [list(make(index)) for index in range(2)]
  assert len(shares[0]) == len(shares[1]) == 5  # Same number of steps.
  mask = np.concatenate([np.concatenate([a['mask'], b['mask']]) for a, b in zip(*shares)])
  assert mask.sum() == 300


def test_real_style_png_dataset_resize_and_flip(data_dir):
  config = _config('dsjax_test_png_images', data_dir, image_size=12, augment=True)
  info = data.dataset_info(config)
  assert (info.image_shape, info.num_classes) == ((12, 12, 3), 3)
  assert info.image_mean == (127.5,) * 3  # Unknown dataset: maps to [-1, 1].
  make = lambda augment: data.make_pipeline(
    _config('dsjax_test_png_images', data_dir, image_size=12, augment=augment),
    split='train',
    global_batch_size=8,
    seed=0,
    process_index=0,
    process_count=1,
  )
  flipped, plain = next(make(True)), next(make(False))
  chex.assert_shape(flipped['image'], (8, 12, 12, 3))
  chex.assert_type(flipped['image'], np.float32)
  np.testing.assert_array_equal(flipped['label'], plain['label'])
  is_flip = [
    np.array_equal(f, p[:, ::-1]) and not np.array_equal(f, p)
    for f, p in zip(flipped['image'], plain['image'])
  ]
  is_same = [np.array_equal(f, p) for f, p in zip(flipped['image'], plain['image'])]
  assert all(a or b for a, b in zip(is_flip, is_same))
  assert any(is_flip) and any(is_same)
  # A row's flip is drawn per stream position (Grain random_map), so it does
  # not depend on the batch the row lands in.
  halves = data.make_pipeline(
    _config('dsjax_test_png_images', data_dir, image_size=12, augment=True),
    split='train',
    global_batch_size=4,
    seed=0,
    process_index=0,
    process_count=1,
  )
  np.testing.assert_array_equal(np.concatenate([b['image'] for b in _take(halves, 2)]), flipped['image'])
  # Another seed flips other rows.
  reseeded = data.make_pipeline(
    _config('dsjax_test_png_images', data_dir, image_size=12, augment=True),
    split='train',
    global_batch_size=8,
    seed=1,
    process_index=0,
    process_count=1,
  )
  assert not np.array_equal(next(reseeded)['image'], flipped['image'])
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
    docs, split='train', global_batch_size=16, seed=0, process_index=0, process_count=1
  )
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


def test_text_train_windows_are_a_shuffle_of_the_start_offsets(data_dir):
  # Rows are Grain's shuffled stream over window starts: one epoch uses each
  # start once, the next epoch is another order.
  config = _config('dsjax_test_sentences', data_dir, text_key='sentence', seq_len=20)
  make = lambda seed: data.make_pipeline(
    config, split='train', global_batch_size=8, seed=seed, process_index=0, process_count=1
  )
  pipeline = make(3)
  stream = pipeline.stream
  num_starts = len(stream) - 20
  rows = pipeline._train_rows()  # pylint: disable=protected-access
  starts = np.array([rows[i] for i in range(2 * num_starts)])
  np.testing.assert_array_equal(np.sort(starts[:num_starts]), np.arange(num_starts))
  np.testing.assert_array_equal(np.sort(starts[num_starts:]), np.arange(num_starts))
  assert not np.array_equal(starts[:num_starts], starts[num_starts:])
  tokens = np.concatenate([b['tokens'] for b in _take(pipeline, 3)])
  np.testing.assert_array_equal(tokens, stream[starts[:24, None] + np.arange(21)])
  other = make(4)._train_rows()  # pylint: disable=protected-access
  assert [other[i] for i in range(8)] != list(starts[:8])


def test_text_eval_windows_tile_the_validation_stream(docs):
  pipeline = data.make_pipeline(
    docs, split='validation', global_batch_size=64, process_index=0, process_count=1, train=False
  )
  batches = list(pipeline)
  tokens = np.concatenate([b['tokens'] for b in batches])
  mask = np.concatenate([b['mask'] for b in batches]).astype(bool)
  stream = pipeline.stream
  num_windows = (len(stream) - 1) // 32
  assert mask.sum() == num_windows and np.all(mask[:num_windows])
  real = tokens[mask]
  # Consecutive windows share one byte: every target appears exactly once.
  np.testing.assert_array_equal(real[:, 1:].ravel(), stream[1 : 1 + num_windows * 32])
  np.testing.assert_array_equal(real[:, 0], stream[0 : num_windows * 32 : 32])
  assert np.all(tokens[~mask] == 0)


def test_text_with_other_key_and_document_mode(data_dir, monkeypatch):
  config = _config('dsjax_test_sentences', data_dir, text_key='sentence', seq_len=20)
  info = data.dataset_info(config)
  assert (info.kind, info.eval_split, info.num_bytes) == ('text', 'test', None)
  make = lambda: data.make_pipeline(
    config, split='train', global_batch_size=8, seed=0, process_index=0, process_count=1
  )
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
    data.make_pipeline(
      _config('cifar10', tmp_path), split='train', global_batch_size=8, process_index=0, process_count=1
    )
  message = str(error.value)
  assert isinstance(error.value, ValueError)
  assert 'cifar10' in message and str(tmp_path) in message
  assert 'tfds build cifar10' in message and 'array_record' in message
  assert '\n' not in message


def test_unknown_dataset_error(tmp_path):
  with pytest.raises(data.DatasetNotFoundError, match="'no_such_dataset'.*sklearn_digits"):
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
  with pytest.raises(data.DatasetNotFoundError, match='tfrecord.*rebuild it as array_record'):
    data.dataset_info(_config('dsjax_test_sentences', tmp_path, text_key='sentence'))


@pytest.mark.parametrize(
  'overrides,message',
  [
    (dict(seq_len=0), 'data.seq_len must be a positive integer, got 0'),
    (dict(image_size=-3), 'data.image_size must be None or a positive'),
    (dict(download='yes'), 'data.download must be a bool'),
    (dict(name=''), 'data.name must be a non-empty string'),
    (dict(eval_split=''), 'data.eval_split must be None or a split'),
    (dict(train_split=3), 'data.train_split must be None or a split'),
  ],
)
def test_bad_config_values(data_dir, overrides, message):
  config = {'name': 'python_docs_bytes', 'data_dir': os.fspath(data_dir), **overrides}
  with pytest.raises(ValueError, match=message):
    data.make_pipeline(config, split='train', global_batch_size=8, process_index=0, process_count=1)


def test_bad_pipeline_arguments(digits):
  make = lambda **kw: data.make_pipeline(
    digits, **{'split': 'train', 'global_batch_size': 8, 'process_index': 0, 'process_count': 1, **kw}
  )
  with pytest.raises(ValueError, match='divisible by process_count'):
    make(global_batch_size=9, process_count=2)
  with pytest.raises(ValueError, match='process_index must be < '):
    make(process_index=2, process_count=2)
  with pytest.raises(ValueError, match="split 'validation' is not in"):
    make(split='validation')
  with pytest.raises(ValueError, match='seed'):
    make(seed=-1)
  with pytest.raises(ValueError, match='unknown data config keys'):
    data.make_pipeline({'name': 'sklearn_digits', 'seqlen': 3}, split='train', global_batch_size=8)
  digits.augment = True
  with pytest.raises(ValueError, match='data.augment'):
    make()


def test_config_splits_replace_the_datasets_own(digits):
  """data.train_split and data.eval_split are the splits a pipeline reads when none is named."""
  make = lambda config, train: data.make_pipeline(
    config, global_batch_size=8, process_index=0, process_count=1, train=train
  )
  assert (make(digits, True).split, make(digits, False).split) == ('train', 'test')
  digits.train_split, digits.eval_split = 'train[:80%]', 'train[80%:]'
  train, evaluation = make(digits, True), make(digits, False)
  assert (train.split, evaluation.split) == ('train[:80%]', 'train[80%:]')
  assert evaluation.num_eval_rows == 299 and len(train._source) == 1198


def test_random_bits_are_fixed():
  # Philox raw output is a fixed algorithm: pin it, so that a NumPy change
  # (which would silently change every data order) is caught.
  words = random_bits.random_words(3, random_bits.Purpose.TEXT_OFFSETS, 5, 2)
  np.testing.assert_array_equal(words, np.array([1419007209105727032, 8906194455581044852], np.uint64))
  perm = random_bits.permutation(0, random_bits.Purpose.EPOCH_PERMUTATION, 0, 10)
  np.testing.assert_array_equal(perm, [0, 8, 6, 9, 5, 2, 3, 1, 7, 4])
