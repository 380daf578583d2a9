"""`model.attention='splash'`: the Pallas splash-attention kernel for TPUs
(`jax.experimental.pallas.ops.tpu.splash_attention`).

Splash attention is a block-sparse flash attention (Dao et al. 2022, arXiv:2205.14135) for TPUs: it
never forms the B·H·L² probabilities, skips the key blocks the causal mask hides entirely, and keeps
its softmax statistics and accumulators in float32. Its kernels take a sequence length that is a
multiple of their block (`BLOCK`, 128: the lanes of a TPU vector register); a shorter or uneven one
(ViT's patches plus the class token, e.g. 197) is padded to the next multiple, and segment ids keep
the padding positions out of every real position's softmax (each padding query attends to padding
keys only, so no row is empty). The kernel takes no logit scale: q is multiplied by it first (in
float32, then rounded to q's dtype).

Sharding. A Pallas kernel is a custom call XLA cannot partition, so on a mesh of several devices the
kernel runs inside `jax.shard_map`, each device on its own batch rows and heads: the batch over the
mesh axes the logical axis 'batch' maps to and the heads over those of 'heads', read from Flax's
logical axis rules (`flax.core.spmd.logical_axis_rules`; the training loop sets them with its mesh).
A dimension its mesh axes do not divide stays whole on each device of that axis.

Off a TPU the same kernel runs in Pallas' interpreter (`INTERPRET`): slow, but the same blocks, masks
and padding, which is how the tests check it against `dsjax.models.layers.plain_attention` on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from dsjax.models.backend import target_backend
from dsjax.models.partitioning import kernel_spec

# The kernel's blocks of queries and keys, forward and backward (a multiple of the 128 lanes of a TPU
# vector register; the sequence is padded to a multiple of it): the kernel's own default
# (`BlockSizes.get_default`). Larger blocks are a tuning to be measured on a TPU, which has not been done.
BLOCK = 128
# True/False: always/never the Pallas interpreter; None: the interpreter unless the target backend
# (`dsjax.models.backend`) is a TPU.
INTERPRET: bool | None = None


def splash_attention(
  q_BLHK: jax.Array,
  k_BLHK: jax.Array,
  v_BLHK: jax.Array,
  logit_scale: float,
  causal: bool,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """softmax(scale·q·kᵀ (causally masked))·v by the splash kernel; (B, L, H, K) in and out. The kernel
  has no attention dropout: a `dropout_rate` above 0 with a key is an error."""
  if dropout_key is not None and dropout_rate > 0:
    raise ValueError('splash attention has no attention dropout (model.attn_dropout must be 0)')
  l = q_BLHK.shape[1]
  padded = -(-l // BLOCK) * BLOCK
  heads_first = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731 (B, L, H, K) <-> (B, H, L, K)
  pad = lambda t: jnp.pad(t, ((0, 0), (0, 0), (0, padded - l), (0, 0)))  # noqa: E731 (B, H, L, K)
  q_scaled_BLHK = (q_BLHK.astype(jnp.float32) * logit_scale).astype(q_BLHK.dtype)
  q_BHPK, k_BHPK, v_BHPK = (pad(heads_first(t)) for t in (q_scaled_BLHK, k_BLHK, v_BLHK))
  # Segment 1: the real positions; 0: the padding (the same for every example). Without padding none
  # are given: the kernel then skips the segment comparison.
  segmented = padded > l

  def attend(q_BHPK, k_BHPK, v_BHPK):
    kernel = _kernel(q_BHPK.shape[1], padded, causal, _interpret(), segmented)
    segments_P = (jnp.arange(padded) < l).astype(jnp.int32)
    segment_ids = splash.SegmentIds(q=segments_P, kv=segments_P) if segmented else None
    return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=segment_ids))(q_BHPK, k_BHPK, v_BHPK)

  spec = _shard_spec(q_BHPK.shape)
  if spec is not None:
    attend = jax.shard_map(attend, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  return heads_first(attend(q_BHPK, k_BHPK, v_BHPK)[:, :, :l])


def _interpret() -> bool:
  return target_backend() != 'tpu' if INTERPRET is None else INTERPRET


@functools.lru_cache(maxsize=None)
def _kernel(num_heads: int, length: int, causal: bool, interpret: bool, segmented: bool):
  """The splash kernel for `num_heads` heads of `length` positions (a multiple of BLOCK), built once:
  building it analyses the mask block by block on the host. `segmented`: whether it is called with
  segment ids; it is part of the key because one kernel object called with them and later without
  fails in the second call's vmapped gradient (tests/models/test_precision_attention.py lowers both)."""
  del segmented
  # The kernel keeps the mask's block tables as arrays: made inside a trace (the first call may come
  # inside `jax.shard_map`) they would be that trace's tracers, leaked into every later call.
  with jax.ensure_compile_time_eval():
    return _make_kernel(num_heads, length, causal, interpret)


def _make_kernel(num_heads: int, length: int, causal: bool, interpret: bool):
  mask = splash_mask.CausalMask((length, length)) if causal else splash_mask.FullMask((length, length))
  blocks = splash.BlockSizes(
    block_q=BLOCK,
    block_kv=BLOCK,
    block_kv_compute=BLOCK,
    block_q_dkv=BLOCK,
    block_kv_dkv=BLOCK,
    block_kv_dkv_compute=BLOCK,
    block_q_dq=BLOCK,
    block_kv_dq=BLOCK,
  )
  return splash.make_splash_mha(
    splash_mask.MultiHeadMask([mask] * num_heads),
    block_sizes=blocks,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )


def _shard_spec(shape_BHPK: tuple[int, ...]) -> P | None:
  """The q/k/v (and output) spec for `jax.shard_map` over the current mesh, or None without one (or
  on one device): the batch over the mesh axes the logical axis rules give 'batch', the heads over those
  they give 'heads' (`partitioning.kernel_spec`); the training run's checks make both divide. A step
  traced with no current mesh (`jax.set_mesh`) cannot be told from one device here; on several TPUs XLA
  then refuses to partition the kernel."""
  b, h = shape_BHPK[:2]
  return kernel_spec('splash attention', (('batch', b), ('heads', h), (None, 0), (None, 0)))
