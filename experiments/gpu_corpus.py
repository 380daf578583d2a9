r"""Packs the running Python's `python_stdlib` corpus — the files dsjax reads as its documents, the
undecodable ones left out — into a tar.gz, so that a machine with another Python trains on the same text:
unpacked into DIR there, `--config.data.name='text:DIR/python_stdlib/**/*.py'` has the same documents
(keys are paths relative to the library's root), the same splits and the same corpus hash.

  python experiments/gpu_corpus.py .gpu/python_stdlib.tar.gz

`experiments/gpu_decisive_device.sh` unpacks it on a GPU machine (experiments/README.md §11).
"""

from __future__ import annotations

import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax.data import corpus as corpus_lib  # noqa: E402

ARCHIVE_ROOT = 'python_stdlib'


def pack(path: str) -> corpus_lib.Corpus:
  corpus = corpus_lib.open_corpus(corpus_lib.PYTHON_STDLIB, 'text')
  keys = sorted(key for split in corpus.keys.values() for key in split)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with tarfile.open(path + '.incomplete', 'w:gz') as tar:
    for key in keys:
      tar.add(os.path.join(corpus.root, key), arcname=f'{ARCHIVE_ROOT}/{key}', recursive=False)
  os.replace(path + '.incomplete', path)
  return corpus


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit('usage: python experiments/gpu_corpus.py OUT.tar.gz')
  packed = pack(sys.argv[1])
  files = sum(map(len, packed.keys.values()))
  print(
    f'{sys.argv[1]}: {files} files of Python {packed.python_version} ({sum(packed.num_bytes.values()):,} '
    f'bytes), corpus sha256 {packed.identity[:16]}…'
  )
