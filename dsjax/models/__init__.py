"""Models built from a config and an `InitPlan`: ViT for image data, GPT for text data.

The plan (`dsjax.models.plan`) is the model/method contract: a method decides it, the model builds what
it says. `dsjax.schemes.build_model` does both steps for a config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from dsjax.models import layers
from dsjax.models.backend import compiling_for, target_backend
from dsjax.models.config import (
  MODEL_NAMES,
  attention_implementation,
  compute_dtype,
  fused_ops_implementation,
  model_config,
  validate_against_data,
  validate_model,
)
from dsjax.models.gpt import GPT
from dsjax.models.plan import InitPlan, ModelDims, NormLayout
from dsjax.models.transformer import TransformerConfig
from dsjax.models.vit import ViT

__all__ = [
  'MODEL_NAMES',
  'InitPlan',
  'ModelDims',
  'attention_implementation',
  'attention_implementations',
  'build_model',
  'compiling_for',
  'compute_dtype',
  'fused_ops_implementation',
  'model_config',
  'model_dims',
  'model_inputs',
  'nonstandard_residual',
  'set_training_step',
  'target_backend',
  'transformer_config',
  'validate_against_data',
  'validate_model',
]


def transformer_config(model_config, plan: InitPlan | None = None) -> TransformerConfig:
  """The static stack description of `model_config`, with what the plan decides (when given)."""
  m = model_config
  # A concatenation residual's attention has its own width, and so its own head dimension.
  head_dim = None if plan is None or plan.concat is None else plan.concat.attn_width // m.num_heads
  cfg = TransformerConfig(
    depth=m.depth,
    width=m.width,
    num_heads=m.num_heads,
    mlp_hidden=m.mlp_ratio * m.width,
    activation=m.activation,
    dropout=m.dropout,
    attn_dropout=m.attn_dropout,
    norm=m.norm,
    norm_eps=m.norm_eps,
    layout=NormLayout.for_block(m.block, m.dnt_setting, m.get('final_norm', None)),
    causal=(m.name == 'gpt'),
    use_bias=m.use_bias,
    distribution=m.init_distribution,
    remat=m.remat,
    scan_layers=m.scan_layers,
    scan_unroll=m.scan_unroll,
    dtype=compute_dtype(m),
    attention=attention_implementation(m, head_dim=head_dim),
    fused_ops=fused_ops_implementation(m),
    matmul_cast=m.matmul_cast,
  )
  if plan is None:
    return cfg
  return dataclasses.replace(
    cfg,
    distribution=plan.distribution,
    layout=plan.layout or cfg.layout,
    skip_scale=plan.skip,
    branch_scale=plan.branch,
    attn_logit_scale=plan.attn_logit_scale,
    attn_logit_warmup_steps=plan.attn_logit_warmup_steps,
    attn_identity=plan.attn_identity,
    lr_scale=tuple(sorted(plan.lr_scale.items())),
  )


def attention_implementations(model: nnx.Module) -> list[str]:
  """The attention implementations `model` runs, as its attention modules were built ('plain', 'xla',
  'cudnn', 'splash')."""
  return sorted(
    {node.implementation for _, node in nnx.iter_graph(model) if isinstance(node, layers.Attention)}
  )


def set_training_step(model: nnx.Module, step) -> None:
  """Sets what the model's plan makes depend on the training step — the attention logit-scale warm-up
  (`InitPlan.attn_logit_warmup_steps`) — for the step that starts after `step` completed steps (a
  scalar, traced or not). The train step calls it on the model it rebuilds from the state; a model it is
  not called on keeps its values as built, those after the warm-up (evaluation, the measuring tools).
  A model without a step-dependent value is left as it is, and its step computes exactly what it did."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, layers.Attention):
      node.set_training_step(step)


def model_dims(model_config, data_info, *, seq_len: int) -> ModelDims:
  """The sizes the init schemes (and the theory) need, from the model config and the dataset
  (`seq_len`: a language model's context, the `data.seq_len` of a run)."""
  m = model_config
  common = dict(
    depth=m.depth,
    width=m.width,
    num_heads=m.num_heads,
    mlp_hidden=m.mlp_ratio * m.width,
    num_embedding_tables=2,
  )
  if m.name == 'vit':
    h, w, c = data_info.image_shape
    num_patches = (h // m.patch_size) * (w // m.patch_size)
    return ModelDims(
      kind='vit',
      input_dim=m.patch_size * m.patch_size * c,
      num_outputs=data_info.num_classes,
      seq_len=num_patches + (m.pooling == 'cls'),
      **common,
    )
  return ModelDims(
    kind='gpt', input_dim=data_info.vocab_size, num_outputs=data_info.vocab_size, seq_len=seq_len, **common
  )


def model_inputs(model_name: str, batch: dict[str, Any]) -> jax.Array:
  """What the model sees of a batch: the images (ViT) or every token but the last (GPT)."""
  return batch['image'] if model_name == 'vit' else batch['tokens'][:, :-1]


def build_model(model_config, data_info, plan: InitPlan, rngs: nnx.Rngs, *, seq_len: int) -> nnx.Module:
  """Creates the model named by `model_config.name` exactly as `plan` says (`seq_len`: a language
  model's context, the length of its position table)."""
  m = model_config
  cfg = transformer_config(m, plan)
  if m.name == 'vit':
    model = ViT(
      cfg,
      plan,
      image_shape=data_info.image_shape,
      patch_size=m.patch_size,
      num_classes=data_info.num_classes,
      pos_embedding=m.pos_embedding,
      pooling=m.pooling,
      rngs=rngs,
    )
  elif m.name == 'gpt':
    model = GPT(
      cfg, plan, vocab_size=data_info.vocab_size, max_len=seq_len, tie_embeddings=m.tie_embeddings, rngs=rngs
    )
  else:
    raise ValueError(f'model.name must be one of {list(MODEL_NAMES)}, got {m.name!r}')
  return cast_params(model, m.param_dtype)


def cast_params(model: nnx.Module, param_dtype: str) -> nnx.Module:
  """Stores the weight matrices in `param_dtype` (drawn in float32, then rounded); vector and scalar
  parameters (norm gains and biases, dense biases, learnable residual scales) stay float32.

  A bfloat16 parameter has 8 significant bits, and there is no float32 master copy: an update smaller
  than about 2^-9 of the value rounds away, and so does decoupled weight decay once lr·wd < 2^-9. The
  matrices' updates are mostly far larger than that; a norm gain near 1 under Adam at lr 6e-4 would
  never move, which is why vectors keep float32. The optimizer's state is float32 either way
  (`dsjax.train.optimizers`). float32 (the default) is the safe choice; bfloat16 halves the memory of
  the weights when that is the limit. A matrix is a parameter with two or more axes longer than 1 per
  layer (the shape's last len(axes) dimensions: the `axes` metadata leaves out the stacked layer axis),
  so ViT's (1, 1, d) class token stays float32 as well."""
  if param_dtype == 'float32':
    return model
  for _, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.Param) and _is_matrix(variable):
      variable.set_value(variable.get_value().astype(param_dtype))
  return model


def _is_matrix(variable: nnx.Param) -> bool:
  shape, axes = variable.get_value().shape, variable.get_metadata().get('axes', ())
  per_layer = shape[len(shape) - len(axes) :]
  return sum(size > 1 for size in per_layer) >= 2


def nonstandard_residual(model: nnx.Module) -> str | None:
  """What keeps `model` from being a plain residual stack — scanned layers of one width, one scalar λ
  and β per add, softmax attention at the 1/sqrt(d_head) logit scale — or None. Both the theory's
  prediction (`dsjax.instrument.theory_adapter`) and folding (`dsjax.export`) need a plain stack."""
  stack = getattr(model.trunk, 'stack', None)
  if stack is None:
    return 'the residual is a concatenation, not an addition'
  attn = stack.layers.attn
  if attn.mix_identity is not None:
    return 'the attention matrix is α·I + β·A(X)'
  if not np.isclose(attn.logit_scale, attn.head_dim**-0.5):
    return f'the attention logit scale is {attn.logit_scale:.4g}, not 1/sqrt(d_head)'
  if any(np.ndim(v) > 1 for v in stack.layers.scales().values()):
    return 'the residual scales are vectors'
  return None
