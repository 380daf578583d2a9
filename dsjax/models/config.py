"""The `model` config section: its keys with defaults, their allowed values and their checks, in one place.

The method keys (`model.scheme` and its own section, e.g. `model.dslm`) are added and checked by
`dsjax.schemes`; everything else about the architecture is here.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import ml_collections
from absl import logging
from ml_collections import config_dict

from dsjax.models.backend import compiling_for_another, target_backend
from dsjax.models.layers import ACTIVATIONS, ATTENTION_IMPLEMENTATIONS, MATMUL_CASTS
from dsjax.models.plan import BLOCKS, DNT_SETTINGS
from dsjax.models.transformer import REMAT_POLICIES
from dsjax.models.vit import POOLINGS, POS_EMBEDDINGS

MODEL_NAMES = ('vit', 'gpt')
NORMS = ('layernorm', 'rmsnorm')
INIT_DISTRIBUTIONS = ('normal', 'truncated_normal', 'uniform')


def model_config(model_name: str) -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.name = model_name  # 'vit' | 'gpt'
  m.depth = 6  # N layers; a layer = attention add + FFN add
  m.width = 128  # d
  m.num_heads = 4
  m.mlp_ratio = 4  # FFN hidden = mlp_ratio · d
  m.block = 'preln'  # 'preln' | 'postln' | 'dnt' | 'nonorm' (no norm anywhere)
  m.dnt_setting = 'S5'  # DNT norm placement S1–S5 (Qi et al. 2025, §4.4, Fig. 7); block='dnt'
  m.final_norm = config_dict.placeholder(bool)  # None: the block's default (preln/dnt on, postln off)
  m.norm = 'layernorm'  # 'layernorm' | 'rmsnorm'
  m.norm_eps = 1e-6
  m.activation = 'gelu'  # 'gelu' (exact, x·Φ(x)) | 'relu'
  m.dropout = 0.0  # embedding and every branch output
  m.attn_dropout = 0.0  # attention probabilities
  m.use_bias = True
  m.init_distribution = 'normal'  # 'normal' | 'truncated_normal' | 'uniform' (every weight's draw)
  # How a step is computed (none of these changes the parameters; a run may resume with others).
  m.dtype = 'auto'  # branch compute: 'float32' | 'bfloat16' | 'auto' (bf16 on GPU/TPU, f32 on CPU)
  m.param_dtype = 'float32'  # storage of the weight matrices: 'float32' | 'bfloat16' (vectors stay f32)
  m.attention = 'auto'  # 'auto' | 'plain' (the math as written) | 'xla' | 'cudnn' | 'splash'
  m.fused_ops = 'auto'  # 'auto' (fused_ops_implementation) | 'none' | 'pallas' (fused norm and GELU kernels)
  # 'none' | 'float8_e4m3fn' | 'float8_e5m2': every weight matmul's inputs (activations and weights)
  # and the embedding, position and class-token tables rounded to this format unscaled, computed in
  # `dtype` (layers.direct_cast): FP8 inference by direct casting (Kedia et al. 2024, arXiv:2403.09635,
  # §4.6, Table 12). Attention's own products, norms, biases and the residual stream stay unrounded.
  m.matmul_cast = 'none'
  m.remat = 'none'  # 'none' | 'full' | a jax.checkpoint_policies name ('dots_saveable': keep matmuls)
  m.scan_layers = True  # False: a Python loop over the layers instead of jax.lax.scan
  m.scan_unroll = 1  # layers per scan iteration
  # ViT only.
  m.patch_size = 2
  m.pos_embedding = 'learned'  # 'learned' | 'sincos2d'
  m.pooling = 'gap'  # 'gap' | 'cls'
  # GPT only.
  m.tie_embeddings = False
  return m


# Model keys that a resumed run may change: they alter how a step is computed (regularisation,
# rematerialisation), not the parameters or what they mean. Every other model key is part of the
# architecture that a checkpoint was trained with.
RESUMABLE_KEYS = (
  'dropout',
  'attn_dropout',
  'remat',
  'dtype',
  'attention',
  'fused_ops',
  'matmul_cast',
  'scan_layers',
  'scan_unroll',
)

DTYPES = ('float32', 'bfloat16')
ATTENTIONS = ('auto', *ATTENTION_IMPLEMENTATIONS)
FUSED_OPS = ('auto', 'none', 'pallas')


def one_of(key: str, value, allowed):
  if value not in allowed:
    raise ValueError(f'{key} must be one of {list(allowed)}, got {value!r}')


def positive_int(key: str, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{key} must be a positive integer, got {value!r}')


def is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x and abs(x) != float('inf')


def number(
  key: str,
  value,
  *,
  low: float | None = None,
  high: float | None = None,
  low_open: bool = False,
  high_open: bool = False,
) -> None:
  """Checks that `value` is a finite number in the interval [low, high] (ends open where asked)."""
  ok = is_number(value)
  if ok and low is not None:
    ok = value > low if low_open else value >= low
  if ok and high is not None:
    ok = value < high if high_open else value <= high
  if not ok:
    lo = '' if low is None else f'{"(" if low_open else "["}{low}'
    hi = '' if high is None else f'{high}{")" if high_open else "]"}'
    where = (
      f' in {lo}, {hi}'
      if lo and hi
      else (
        f' {">" if low_open else ">="} {low}'
        if lo
        else (f' {"<" if high_open else "<="} {high}' if hi else '')
      )
    )
    raise ValueError(f'{key} must be a number{where}, got {value!r}')


def boolean(key: str, value):
  if not isinstance(value, bool):
    raise ValueError(f'{key} must be True or False, got {value!r}')


def validate_model(m) -> None:
  """One-line ValueErrors for the architecture keys of the `model` section."""
  one_of('model.name', m.name, MODEL_NAMES)
  for key in ('depth', 'width', 'num_heads', 'mlp_ratio', 'patch_size'):
    positive_int(f'model.{key}', m[key])
  if m.width % m.num_heads:
    raise ValueError(f'model.width ({m.width}) must be divisible by model.num_heads ({m.num_heads})')
  one_of('model.block', m.block, BLOCKS)
  one_of('model.dnt_setting', m.dnt_setting, DNT_SETTINGS)
  one_of('model.norm', m.norm, NORMS)
  number('model.norm_eps', m.norm_eps, low=0, low_open=True)
  one_of('model.activation', m.activation, sorted(ACTIVATIONS))
  number('model.dropout', m.dropout, low=0, high=1, high_open=True)
  number('model.attn_dropout', m.attn_dropout, low=0, high=1, high_open=True)
  one_of('model.init_distribution', m.init_distribution, INIT_DISTRIBUTIONS)
  one_of('model.dtype', m.dtype, ('auto',) + DTYPES)
  one_of('model.param_dtype', m.param_dtype, DTYPES)
  one_of('model.attention', m.attention, ATTENTIONS)
  attention_implementation(m)  # Checks that an explicit 'cudnn' or 'splash' can run here.
  one_of('model.fused_ops', m.fused_ops, FUSED_OPS)
  fused_ops_implementation(m)  # Warns where an explicit 'pallas' runs in the interpreter.
  one_of('model.matmul_cast', m.matmul_cast, MATMUL_CASTS)
  one_of('model.remat', m.remat, REMAT_POLICIES)
  boolean('model.scan_layers', m.scan_layers)
  positive_int('model.scan_unroll', m.scan_unroll)
  one_of('model.pos_embedding', m.pos_embedding, POS_EMBEDDINGS)
  one_of('model.pooling', m.pooling, POOLINGS)
  if m.name == 'vit' and m.pos_embedding == 'sincos2d' and m.width % 4:
    raise ValueError(f'model.width must be divisible by 4 with model.pos_embedding=sincos2d, got {m.width}')


def compute_dtype(m, backend: str | None = None) -> str:
  """`model.dtype` with 'auto' resolved: bfloat16 on accelerators (GPU, TPU), float32 on the CPU (which
  has no fast bf16 matmuls, and where the theory's checks run)."""
  if m.dtype != 'auto':
    return m.dtype
  return 'float32' if (backend or target_backend()) == 'cpu' else 'bfloat16'


def attention_implementation(m, backend: str | None = None, *, head_dim: int | None = None) -> str:
  """`model.attention` resolved to the implementation the attention modules run, a key of
  `dsjax.models.layers.ATTENTION_IMPLEMENTATIONS` ('plain' | 'xla' | 'cudnn' | 'splash').

  'plain' and 'xla' are taken as they are. 'auto' takes the backend's fused kernel where it applies,
  and 'xla' (the query-blocked form with its CPU-tuned derivative, `dsjax.models.attention_xla`)
  elsewhere, the CPU included:
    * on a GPU, cuDNN's flash attention (`jax.nn.dot_product_attention`): an NVIDIA GPU of compute
      capability 8.0 or newer (jax does not check the capability itself), bf16 compute, no attention
      dropout (the kernel never forms the probabilities to drop), a head dimension the kernel supports
      (a multiple of 8, at most 128);
    * on a TPU, the Pallas splash-attention kernel (`dsjax.models.tpu_attention`): no attention dropout.
  An explicit 'cudnn' that cannot apply is an error; so is an explicit 'splash' with attention dropout.
  Off a TPU an explicit 'splash' runs the kernel in Pallas' interpreter: the TPU's blocks, masks and
  padding on any machine, slowly (for checking them, as the tests do on a CPU).
  `head_dim`: the attention's head dimension where it is not model.width / model.num_heads (a
  concatenation residual's attention width). `backend` given (e.g. 'gpu' from a machine without one):
  resolved for that backend, its GPU taken to be a capable one.
  """
  if m.attention in ('plain', 'xla'):
    return m.attention
  gpu_capable = _flash_attention_gpu() if backend is None else True
  backend = backend or target_backend()
  no_dropout = {'model.attn_dropout': (m.attn_dropout > 0, 'must be 0 (the fused kernels have no dropout)')}
  if m.attention == 'splash' or (m.attention == 'auto' and backend == 'tpu'):
    if backend != 'tpu':
      _warn_splash_interpreted(backend)
    return _fused_or_xla(m.attention, 'splash', no_dropout)
  head_dim = m.width // m.num_heads if head_dim is None else head_dim
  blockers = {
    **no_dropout,
    'model.dtype': (compute_dtype(m, backend) != 'bfloat16', 'must be bfloat16 (or auto on a GPU)'),
    'model.width / model.num_heads': (
      head_dim % 8 or head_dim > 128,
      f'(the head dimension, {head_dim}) must be a multiple of 8 and at most 128',
    ),
    'the backend': (backend != 'gpu', f'must be a GPU, not {backend}'),
    'the GPU': (
      backend == 'gpu' and not gpu_capable,
      'must be an NVIDIA GPU of compute capability 8.0 or newer',
    ),
  }
  return _fused_or_xla(m.attention, 'cudnn', blockers)


# The narrowest model width at which the fused kernels have been measured faster than XLA's own fusions
# on a GPU (benchmarks/README.md, "GPU: one H200": GPT-2 small and ViT-B/16, width 768, bfloat16).
FUSED_OPS_AUTO_MIN_WIDTH = 768


def fused_ops_implementation(m, backend: str | None = None) -> str:
  """`model.fused_ops` resolved: 'none' (the plain math, fused by XLA as it chooses) or 'pallas'
  (`dsjax.models.fused_ops`: a Pre-LN or DNT layer's residual add with the norm and cast after it, a
  layer's first norm with its cast, and the FFN's bias with its exact GELU, each one Pallas kernel
  forward and one backward; the same math up to rounding).

  'auto' takes the kernels where a GPU measurement has shown them faster: an NVIDIA GPU of compute
  capability ≥ 8.0 (Triton's), branches in bfloat16, and a width of at least
  `FUSED_OPS_AUTO_MIN_WIDTH` (at width 768 the step was 5% shorter; narrower models are unmeasured);
  elsewhere, a TPU and the CPU included, the plain math. An explicit 'pallas' off a GPU runs the
  kernels in Pallas' interpreter: the same function, many times slower (for checking them, as the
  tests do on a CPU). `backend`: resolved for that backend.
  """
  if m.fused_ops == 'none':
    return 'none'
  asked_for = backend
  backend = backend or target_backend()
  if m.fused_ops == 'auto':
    measured_faster = (
      backend == 'gpu'
      # Triton's GPUs; a backend named by the caller is taken as one (as attention_implementation does).
      and (asked_for is not None or _flash_attention_gpu())
      and compute_dtype(m, backend) == 'bfloat16'
      and m.width >= FUSED_OPS_AUTO_MIN_WIDTH
    )
    return 'pallas' if measured_faster else 'none'
  if backend != 'gpu':
    _warn_fused_ops_interpreted(backend)
  return 'pallas'


@functools.cache
def _warn_fused_ops_interpreted(backend: str) -> None:
  logging.warning(
    "model.fused_ops=pallas on %s runs the GPU kernels in Pallas' interpreter: the same function, "
    'many times slower (model.fused_ops=auto runs the plain math)',
    backend,
  )


@functools.cache
def _warn_splash_interpreted(backend: str) -> None:
  logging.warning(
    "model.attention=splash on %s runs the TPU kernel in Pallas' interpreter: the same "
    'function, many times slower (model.attention=auto picks the fast path here)',
    backend,
  )


def _fused_or_xla(requested: str, fused: str, blockers: dict[str, tuple[Any, str]]) -> str:
  """`fused` unless one of `blockers` ({key: (blocks, why)}) blocks it: then 'xla' for 'auto', and for
  an explicit request the first blocker's one-line error."""
  blocked = [(key, why) for key, (is_blocked, why) in blockers.items() if is_blocked]
  if requested == fused and blocked:
    key, why = blocked[0]
    raise ValueError(f'model.attention={fused} needs {key} that {why}')
  return 'xla' if blocked else fused


def _flash_attention_gpu() -> bool:
  """Whether this machine's GPU runs cuDNN's flash attention: CUDA (a ROCm GPU is also jax's 'gpu'
  backend, with a capability like 'gfx90a') of compute capability 8.0 (Ampere) or newer. True where
  there is no GPU to ask (the backend check decides there)."""
  if compiling_for_another() or jax.default_backend() != 'gpu':
    return True
  capability = getattr(jax.devices()[0], 'compute_capability', None)
  try:
    return float(capability) >= 8.0
  except (TypeError, ValueError):
    return False


def validate_against_data(m, data_name: str, data_info) -> None:
  """Checks that need the dataset's shapes (known before compilation, after the dataset is found)."""
  if m.name == 'vit':
    if data_info.kind != 'image':
      raise ValueError(
        f'model.name=vit needs an image dataset, but data.name={data_name!r} is {data_info.kind}'
      )
    h, w, _ = data_info.image_shape
    if h % m.patch_size or w % m.patch_size:
      raise ValueError(f'model.patch_size ({m.patch_size}) must divide the image size {h}x{w}')
  elif data_info.kind != 'text':
    raise ValueError(f'model.name=gpt needs a text dataset, but data.name={data_name!r} is {data_info.kind}')
