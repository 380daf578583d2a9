"""Model construction from an ml_collections config: ViT for image data, GPT for text data."""

from __future__ import annotations

import dataclasses

from flax import nnx

from dsjax import schemes
from dsjax.models.gpt import GPT
from dsjax.models.transformer import NormLayout, TransformerConfig
from dsjax.models.vit import ViT

MODEL_NAMES = ('vit', 'gpt')


def transformer_config(model_config) -> TransformerConfig:
  m = model_config
  return TransformerConfig(
      depth=m.depth, width=m.width, num_heads=m.num_heads, mlp_hidden=m.mlp_ratio * m.width,
      activation=m.activation, dropout=m.dropout, attn_dropout=m.attn_dropout, norm=m.norm,
      norm_eps=m.norm_eps,
      layout=NormLayout.for_block(m.block, m.dnt_setting, m.get('final_norm', None)),
      causal=(m.name == 'gpt'), use_bias=m.use_bias, distribution=m.init_distribution,
      remat=m.remat)


def model_dims(config, data_info) -> schemes.ModelDims:
  """The sizes the init schemes (and the theory) need, from the model config and the dataset."""
  m = config.model
  if m.name == 'vit':
    h, w, c = data_info.image_shape
    num_patches = (h // m.patch_size) * (w // m.patch_size)
    return schemes.ModelDims(
        kind='vit', depth=m.depth, width=m.width, num_heads=m.num_heads, mlp_hidden=m.mlp_ratio * m.width,
        input_dim=m.patch_size * m.patch_size * c, num_outputs=data_info.num_classes,
        seq_len=num_patches + (m.pooling == 'cls'), num_embedding_tables=2)
  return schemes.ModelDims(
      kind='gpt', depth=m.depth, width=m.width, num_heads=m.num_heads, mlp_hidden=m.mlp_ratio * m.width,
      input_dim=data_info.vocab_size, num_outputs=data_info.vocab_size, seq_len=config.data.seq_len,
      num_embedding_tables=2)


def build_model(config, data_info, rngs: nnx.Rngs, input_moments: dict | None = None) -> nnx.Module:
  """Creates the model named by `config.model.name`, initialised by `config.model.scheme`.

  `input_moments`: measured {'var', 'corr_seq'} of the embedded input, for schemes that use them
  (DSLM with `model.dslm.input_corr='measure'`; see `dsjax.schemes.dslm.input_moments_for_run`).
  """
  m = config.model
  dims = model_dims(config, data_info)
  plan = schemes.make_init_plan(m, dims, input_moments)
  # The scheme, not the raw config, has the last word on how weights are drawn and what is learnable.
  cfg = dataclasses.replace(transformer_config(m), distribution=plan.distribution,
                            learnable_skip_scale=plan.learnable_skip_scale,
                            learnable_branch_scale=plan.learnable_branch_scale)
  if m.name == 'vit':
    return ViT(cfg, plan, image_shape=data_info.image_shape, patch_size=m.patch_size,
               num_classes=data_info.num_classes, pos_embedding=m.pos_embedding, pooling=m.pooling,
               rngs=rngs)
  if m.name == 'gpt':
    return GPT(cfg, plan, vocab_size=data_info.vocab_size, max_len=config.data.seq_len,
               tie_embeddings=m.tie_embeddings, rngs=rngs)
  raise ValueError(f'model.name must be one of {list(MODEL_NAMES)}, got {m.name!r}')
