"""Input pipeline: TFDS data sources (no TensorFlow needed), three embedded
offline datasets, text corpora read from files (`python_stdlib`,
`text:GLOB`, see `dsjax.data.corpus`), subword tokenizers
(`dsjax.data.tokenizer`), and deterministic, resumable, multi-host batch
iterators built on Grain (index sampling, sharding, batching and iterator
state).

    from dsjax.data import dataset_info, make_pipeline
    info = dataset_info(config.data)
    train = make_pipeline(config.data, split=info.train_split,
                          global_batch_size=256, seed=0)
    batch = next(train)         # this process' rows, numpy arrays
    state = train.get_state()   # JSON-serialisable; train.set_state(state)

Importing this package registers the embedded TFDS datasets
`sklearn_digits` and `python_docs_bytes` (see `dsjax.data.embedded`).
"""

from dsjax.data.config import get_config
from dsjax.data.embedded import EMBEDDED_DATASETS
from dsjax.data.pipeline import ImagePipeline, Pipeline, TextPipeline, make_pipeline
from dsjax.data.sources import (
  DOCUMENT_SEPARATOR_BYTE,
  TEXT_VOCAB_SIZE,
  DatasetInfo,
  DatasetNotFoundError,
  dataset_info,
)

__all__ = [
  'DOCUMENT_SEPARATOR_BYTE',
  'DatasetInfo',
  'DatasetNotFoundError',
  'EMBEDDED_DATASETS',
  'ImagePipeline',
  'Pipeline',
  'TEXT_VOCAB_SIZE',
  'TextPipeline',
  'dataset_info',
  'get_config',
  'make_pipeline',
]
