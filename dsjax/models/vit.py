"""Vision transformer: patch embedding, position embedding, transformer trunk, pooling, classifier.

The trunk is the additive stack, or the concatenation stream of `dsjax.models.concat` when the plan asks
for one (then the embeddings have the stream's first width and the classifier reads its last).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.models import layers
from dsjax.models.concat import embedding_and_head_widths, make_trunk
from dsjax.models.partitioning import constrain_batch
from dsjax.models.plan import InitPlan
from dsjax.models.transformer import Probe, TransformerConfig, no_probe

POS_EMBEDDINGS = ('sincos2d', 'learned')
# Every row of the sincos2d table is (sin, cos) pairs, sin² + cos² = 1: its mean square is exactly 1/2.
SINCOS_MEAN_SQUARE = 0.5
POOLINGS = ('gap', 'cls')


def sincos_2d(height: int, width: int, dim: int, temperature: float = 10_000.0) -> np.ndarray:
  """Fixed 2-D sine-cosine position embedding (MoCo v3 / big_vision), shape (height·width, dim)."""
  if dim % 4:
    raise ValueError(f'model.width must be divisible by 4 for sincos2d position embeddings, got {dim}')
  y, x = np.mgrid[:height, :width]
  omega = 1.0 / temperature ** (np.arange(dim // 4) / (dim // 4 - 1 if dim > 4 else 1))
  y = y.reshape(-1)[:, None] * omega[None]
  x = x.reshape(-1)[:, None] * omega[None]
  return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1).astype(np.float32)


def patchify(images_BHWC: jax.Array, patch: int) -> jax.Array:
  """(B, H, W, C) → (B, H/p · W/p, p·p·C); equal to a stride-p convolution's input patches."""
  b, h, w, c = images_BHWC.shape
  x = images_BHWC.reshape(b, h // patch, patch, w // patch, patch, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nnx.Module):
  def __init__(
    self,
    cfg: TransformerConfig,
    plan: InitPlan,
    *,
    image_shape: tuple[int, int, int],
    patch_size: int,
    num_classes: int,
    pos_embedding: str,
    pooling: str,
    rngs: nnx.Rngs,
  ):
    h, w, c = image_shape
    self.patch_size, self.pooling, self.dtype = patch_size, pooling, cfg.dtype
    self.matmul_cast = cfg.matmul_cast
    grid_h, grid_w = h // patch_size, w // patch_size
    d, head_width = embedding_and_head_widths(cfg, plan)
    lr = plan.lr_scale
    self.patch_embed = layers.Dense(
      patch_size * patch_size * c,
      d,
      std=plan.input_std,
      distribution=plan.distribution,
      use_bias=True,
      axes=('patch', 'embed'),
      lr_scale=lr.get('input', 1.0),
      rngs=rngs,
      input_cast=cfg.matmul_cast,
    )
    if pos_embedding == 'learned':
      self.pos_embedding = layers.param(
        layers.init_weight(rngs.params(), (grid_h * grid_w, d), plan.pos_std, plan.distribution),
        (None, 'embed'),
        lr.get('pos', 1.0),
      )
    else:  # Fixed, so not a Param: no gradient, no weight decay.
      self.pos_embedding = layers.constant(jnp.asarray(sincos_2d(grid_h, grid_w, d)), (None, 'embed'))
    self.cls_token = layers.param(jnp.zeros((1, 1, d)), (None, None, 'embed')) if pooling == 'cls' else None
    self.trunk = make_trunk(cfg, plan, rngs=rngs)
    self.head = layers.Dense(
      head_width,
      num_classes,
      std=0.0 if plan.zero_head else plan.head_std,
      distribution=plan.distribution,
      use_bias=True,
      axes=('embed', 'vocab'),
      lr_scale=lr.get('head', 1.0),
      rngs=rngs,
      input_cast=cfg.matmul_cast,
    )

  def embed(self, images_BHWC: jax.Array) -> jax.Array:
    patches_BLP = patchify(images_BHWC, self.patch_size).astype(self.dtype)
    pos_LD = layers.direct_cast(self.pos_embedding[...], self.matmul_cast)
    x_BLD = self.patch_embed(patches_BLP) + pos_LD  # float32 from here (promotion)
    if self.cls_token is not None:
      cls_11D = layers.direct_cast(self.cls_token[...], self.matmul_cast)
      cls_B1D = jnp.broadcast_to(cls_11D, (x_BLD.shape[0], 1, x_BLD.shape[2]))
      x_BLD = jnp.concatenate([cls_B1D, x_BLD], axis=1)
    return x_BLD

  def __call__(
    self, images_BHWC: jax.Array, *, dropout_key: jax.Array | None = None, probe: Probe = no_probe
  ) -> jax.Array:
    """Class logits (B, num_classes), float32 (the head's matmul writes float32, as GPT's does)."""
    x_BLD = self.trunk(self.embed(images_BHWC), dropout_key, probe)
    pooled_BD = x_BLD[:, 0] if self.pooling == 'cls' else x_BLD.mean(axis=1)
    return constrain_batch(self.head(pooled_BD.astype(self.dtype), out_dtype=jnp.float32))
