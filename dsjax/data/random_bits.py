"""Counter-based random numbers that are identical on every machine.

Everything random in the input pipeline (epoch permutations, text window
offsets, flips, the digits train/test split) is a pure function of
``(seed, purpose, index)``. We draw it from the *raw* output of NumPy's Philox
bit generator, keyed by those integers:

* Philox-4x64 is a fixed, published algorithm (Random123), so its raw 64-bit
  words do not depend on the NumPy version. The higher-level ``Generator``
  methods (``permutation``, ``integers``) carry no such guarantee (NEP 19), so
  we build what we need from the raw words ourselves.
* Keying by ``(seed, purpose, index)`` gives random access: the numbers for
  step 10_000 are computed directly, without replaying steps 0..9_999. This is
  what makes resuming from a saved ``{'step': ...}`` bitwise exact.
"""

import enum

import numpy as np

# The index occupies the low 48 bits of the second key word, the purpose the
# bits above it. 2**48 steps or epochs is far beyond any run.
_INDEX_BITS = 48
_MAX_SEED = 2**64 - 1


class Purpose(enum.IntEnum):
  """What a stream of random words is used for (keeps streams independent)."""

  EPOCH_PERMUTATION = 1  # index = epoch
  TEXT_OFFSETS = 2  # index = global step
  FLIPS = 3  # index = global step
  DATASET_SPLIT = 4  # index = a dataset-specific integer (e.g. class id)


def check_seed(seed) -> int:
  """Returns `seed` as a Python int, or raises ValueError if unusable."""
  if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f'seed must be a non-negative integer, got {seed!r}')
  if not 0 <= int(seed) <= _MAX_SEED:
    raise ValueError(f'seed must be in [0, 2**64), got {seed}')
  return int(seed)


def random_words(seed: int, purpose: Purpose, index: int, num: int) -> np.ndarray:
  """Returns `num` uint64 words determined only by (seed, purpose, index)."""
  if not 0 <= index < 2**_INDEX_BITS:
    raise ValueError(f'random stream index out of range: {index}')
  key = np.array([seed, (int(purpose) << _INDEX_BITS) | index], np.uint64)
  return np.random.Philox(key=key).random_raw(num)


def permutation(seed: int, purpose: Purpose, index: int, num: int) -> np.ndarray:
  """A permutation of range(num) (int64) determined by (seed, purpose, index).

  Sorting i.i.d. random 64-bit keys gives a uniform permutation (ties have
  probability ~num**2 / 2**65 and are broken by position, deterministically).
  """
  return np.argsort(random_words(seed, purpose, index, num), kind='stable')
