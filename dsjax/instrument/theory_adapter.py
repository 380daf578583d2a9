"""Predicted per-layer moments of a dsjax model: maps a config + model onto `dsjax.theory.model.propagate`.

`describe(config, model, data_info)` reads what the theory needs from the config and from the model
itself — the residual scales λ/β of both adds of every layer (stored in the model by the scheme) and the
per-layer weight variances (the empirical mean square of each kernel, so it holds for any scheme and for
a restored checkpoint) — into a `ModelDescription`; `predict(...)` calls `propagate` with it.

Where the prediction starts:
  * forward: the stream entering the first layer, i.e. the embedding output after its dropout —
    measured at the probe site 'embedding' (`input_moments='measured'`, default) or the theory's
    Zipf estimate (`'theory'`, Kedia et al. 2024 App. A.1; a poor model of byte-level text);
  * backward: the gradient measured at the output of the last layer. The theory's gradient recursion
    is relative (it maps the gradient at the top to every layer), so the predicted gradient variance
    equals the measured one at the last layer by construction and the error measures the propagation.
Biases are ignored (zero at initialisation) and norm gains taken as 1. The theory covers Pre-LN and
Post-LN stacks with LayerNorm (RMSNorm is the same for zero-mean inputs); DNT blocks are rejected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dsjax.instrument.collector import NO_LAYER
from dsjax.instrument.probe import EMBEDDING_SITE
from dsjax.models import model_dims, nonstandard_residual, transformer_config
from dsjax.theory import components as th
from dsjax.theory import model as theory_model
from dsjax.theory.components import GradStats, Stats


@dataclasses.dataclass(frozen=True)
class ModelDescription:
  """What `propagate` needs about a model; per-layer arrays have shape (depth,)."""

  depth: int
  width: int
  num_heads: int
  mlp_hidden: int
  seq_len: int
  dropout: float
  attn_dropout: float
  activation: str
  causal: bool
  block: str  # 'preln' | 'postln' | 'dnt'
  weight_var: dict[str, np.ndarray]  # 'q', 'k', 'v', 'o', 'ffn1', 'ffn2'
  scale: dict[str, np.ndarray]  # 'skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'
  vocab_size: int | None
  embedding_var: float | None  # variance of one embedding table entry (GPT)


def coverage_gap(config, model) -> str | None:
  """Why `dsjax.theory` cannot predict this model's moments, or None when it can.

  The theory covers Pre-LN and Post-LN stacks (`model.block`) whose residual adds scale by one scalar
  λ and β each, with softmax attention at the 1/sqrt(d_head) logit scale."""
  if config.model.block not in theory_model.BLOCKS:
    return f'model.block={config.model.block!r} (the theory covers {list(theory_model.BLOCKS)})'
  return nonstandard_residual(model)


def describe(config, model, data_info) -> ModelDescription:
  """Sizes from the config; λ/β and weight variances (mean square of each kernel) from the model."""
  cfg = transformer_config(config.model)
  layers = model.trunk.stack.layers
  kernels = {
    'q': layers.attn.q,
    'k': layers.attn.k,
    'v': layers.attn.v,
    'o': layers.attn.o,
    'ffn1': layers.ffn.ffn1,
    'ffn2': layers.ffn.ffn2,
  }
  weight_var = {
    name: np.mean(np.square(np.asarray(dense.kernel[...], np.float64)), axis=(1, 2))
    for name, dense in kernels.items()
  }
  scale = {name: np.asarray(value, np.float64) for name, value in layers.scales().items()}
  is_gpt = config.model.name == 'gpt'
  return ModelDescription(
    depth=cfg.depth,
    width=cfg.width,
    num_heads=cfg.num_heads,
    mlp_hidden=cfg.mlp_hidden,
    # tokens: GPT context, ViT patches (+ CLS)
    seq_len=model_dims(config.model, data_info, seq_len=config.data.seq_len).seq_len,
    dropout=cfg.dropout,
    attn_dropout=cfg.attn_dropout,
    activation=cfg.activation,
    causal=cfg.causal,
    block=config.model.block,
    weight_var=weight_var,
    scale=scale,
    vocab_size=data_info.vocab_size if is_gpt else None,
    # float64 on the host: numpy reduces a bfloat16 array (param_dtype='bfloat16') in bfloat16.
    embedding_var=float(np.var(np.asarray(model.token_embed[...], np.float64))) if is_gpt else None,
  )


def embedding_moments(measured) -> dict[str, float]:
  """{statistic: value} at the probe site 'embedding' (layer −1) of `dsjax.moments.measure`'s output."""
  return {stat: by_layer[NO_LAYER] for (site, stat), by_layer in measured.items() if site == EMBEDDING_SITE}


def input_stats(desc: ModelDescription, measured, input_moments: str) -> Stats:
  """Moments of the stream entering the first layer."""
  if input_moments == 'measured':
    m = embedding_moments(measured)
    return Stats(
      mean=m['mean'],
      var=m['var'],
      corr_seq=float(np.clip(m['corr_seq'], -1, 1)),
      corr_hidden=float(np.clip(m['corr_hidden'], -1, 1)),
    )
  if desc.vocab_size is None:
    raise ValueError("input_moments='theory' needs a token embedding (GPT); measure the input of a ViT")
  # Token + learned position table, both with the token table's variance; after the embedding dropout.
  return th.embedding(vocab_size=desc.vocab_size, num_tables=2, table_var=desc.embedding_var, p=desc.dropout)


def predict(
  config,
  model,
  data_info,
  measured,
  *,
  input_moments: str = 'measured',
  form: str = 'exact',
  causal: bool | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Predicted per-layer moments of the layer outputs and the settings used (for moments.json).

  `measured`: {(site, stat): {layer: value}} from `dsjax.moments.measure`. `form`: the theory's
  formulas, 'exact' (default) | 'paper' | 'simple' (see `dsjax.theory.model.propagate`). `causal`
  overrides the model's attention mask (None: the model's own; e.g. False for GPT weights run without
  the mask).
  """
  desc = describe(config, model, data_info)
  if causal is not None:
    desc = dataclasses.replace(desc, causal=causal)
  return predict_described(desc, measured, input_moments=input_moments, form=form)


def predict_described(
  desc: ModelDescription, measured, *, input_moments: str = 'measured', form: str = 'exact'
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """`predict` for a model already described (`describe`): e.g. described once before training, and
  predicted from the moments its first instrumented step measures (`dsjax.instrument.monitor`)."""
  if desc.block not in theory_model.BLOCKS:
    raise ValueError(f'the theory covers model.block in {list(theory_model.BLOCKS)}, got {desc.block!r}')
  x0 = input_stats(desc, measured, input_moments)
  last = desc.depth - 1
  g_top = GradStats(
    var=measured[('ffn_residual', 'grad_var')][last],
    corr_seq=float(np.clip(measured[('ffn_residual', 'grad_corr_seq')][last], -1, 1)),
  )
  result = theory_model.propagate(
    depth=desc.depth,
    width=desc.width,
    num_heads=desc.num_heads,
    seq_len=desc.seq_len,
    mlp_ratio=desc.mlp_hidden // desc.width,
    dropout=desc.dropout,
    attn_dropout=desc.attn_dropout,
    activation=desc.activation,
    block=desc.block,
    causal=desc.causal,
    skip_scale_attn=desc.scale['skip_attn'],
    branch_scale_attn=desc.scale['branch_attn'],
    skip_scale_ffn=desc.scale['skip_ffn'],
    branch_scale_ffn=desc.scale['branch_ffn'],
    weight_vars=desc.weight_var,
    # x0 is already after the embedding dropout, and g_top already below the final norm.
    input=x0,
    embedding_dropout=False,
    output_grad=g_top,
    final_norm=False,
    form=form,
  )
  predicted = {
    'forward_var': result.layer_var,
    'corr_seq': result.layer_corr_seq,
    'grad_var': result.layer_grad_var,
    'grad_corr_seq': result.layer_grad_corr_seq,
    'attn_branch_var': result.branch_var[0::2],
    'ffn_branch_var': result.branch_var[1::2],
  }
  settings = {
    'input_moments': input_moments,
    'input': dataclasses.asdict(x0),
    'grad_at_last_layer': dataclasses.asdict(g_top),
    'theory': f'dsjax.theory.model.propagate(form={form!r})',
  }
  return predicted, settings
