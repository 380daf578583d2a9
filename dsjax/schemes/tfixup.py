r"""T-Fixup: an initialisation that trains a Transformer without LayerNorm (and without warmup).

Huang, Perez, Ba & Volkovs 2020, "Improving Transformer Optimization Through Better Initialization"
(ICML 2020), the three-step T-Fixup procedure; reference code github.com/layer6ai-labs/T-Fixup.

Definition as implemented, for a stack of N layers of width d with no norm anywhere (`model.block =
'nonorm'`: no pre/post/final LayerNorm), λ = β = 1 at every residual add:

  1. Xavier (Glorot & Bengio 2010) for every matrix except the input embeddings, which are drawn
     Gaussian N(0, d^{-1/2}), i.e. standard deviation d^{-1/4}.
  2. Decoder rule — GPT (causal, decoder-only): the value and output projections of every attention
     block, both FFN matrices and the input embeddings × (9N)^{-1/4}.
  3. Encoder rule — ViT (bidirectional, encoder-only): the value and output projections of every
     attention block and both FFN matrices × 0.67·N^{-1/4}; the input embeddings × (9N)^{-1/4}, as the
     paper's step 2 scales "input embeddings x and y in encoder and decoder" (and its reference code
     scales the encoder's embedding table by (9·N_enc)^{-1/4}).

  Queries and keys keep plain Xavier; biases are 0. The constants 0.67 and 9 are
  `model.tfixup.encoder_scale` and `model.tfixup.decoder_factor`; `model.tfixup.scale_embeddings =
  False` leaves the embeddings at N(0, d^{-1/2}).

T-Fixup is meant to train without learning-rate warmup (and without LayerNorm): the paper trains its
models with the post-warmup learning rate from step 0. This method sets the initialisation only; the
optimizer is configured as usual, so set `optimizer.warmup_steps` yourself to follow the recipe.

Choices where the paper is open (which tables are the "input embeddings", the ViT patch kernel, N, the
paper's N(0, d^{-1/2}) against the reference code's scaled lookup): docs/methods.md, "T-Fixup".
"""

from __future__ import annotations

import math

import ml_collections

from dsjax.models.config import boolean, number
from dsjax.models.plan import InitPlan, ModelDims, unit_scales, xavier_layer_stds
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

# The weights the T-Fixup rules scale in every layer (V, attention output, both FFN matrices).
SCALED = ('v', 'o', 'ffn1', 'ffn2')


def check_no_norm(m, scheme_name: str) -> None:
  """A 'nonorm' method keeps the model free of every norm, including a final one set by model.final_norm."""
  if m.get('final_norm', None):
    raise ValueError(
      f"model.final_norm must be unset or False with model.scheme='{scheme_name}' (the method "
      f'has no norm anywhere), got {m.final_norm!r}'
    )


def layer_scale(m, dims: ModelDims) -> float:
  """The factor on V, O, FFN1, FFN2: (9N)^{-1/4} for a decoder (GPT), 0.67·N^{-1/4} for an encoder (ViT)."""
  c, n = m.tfixup, dims.depth
  if dims.kind == 'gpt':
    return (c.decoder_factor * n) ** -0.25
  return c.encoder_scale * n**-0.25


def embedding_scale(m, dims: ModelDims) -> float:
  """The factor on the input embeddings: (9N)^{-1/4} (both rules), or 1 without `scale_embeddings`."""
  c = m.tfixup
  return (c.decoder_factor * dims.depth) ** -0.25 if c.scale_embeddings else 1.0


class TFixup(Scheme):
  name = 'tfixup'
  paper = (
    'Huang, Perez, Ba & Volkovs 2020, Improving Transformer Optimization Through Better '
    'Initialization (ICML 2020)'
  )
  summary = (
    'no LayerNorm; Xavier, embeddings N(0, d^{-1/2}); V, O, FFN × (9N)^{-1/4} (GPT) or '
    '0.67·N^{-1/4} (ViT), embeddings × (9N)^{-1/4}; meant to train without warmup'
  )
  blocks = ('nonorm',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.encoder_scale = 0.67  # encoder V, O, FFN × 0.67·N^{-1/4} (Huang et al. 2020, T-Fixup step 3)
    c.decoder_factor = 9.0  # decoder V, O, FFN and the embeddings × (9N)^{-1/4} (T-Fixup step 2)
    c.scale_embeddings = True  # input embeddings × (9N)^{-1/4} in encoder and decoder (T-Fixup step 2)
    return c

  def validate(self, m):
    super().validate(m)
    check_no_norm(m, self.name)
    number('model.tfixup.encoder_scale', m.tfixup.encoder_scale, low=0, low_open=True)
    number('model.tfixup.decoder_factor', m.tfixup.decoder_factor, low=0, low_open=True)
    boolean('model.tfixup.scale_embeddings', m.tfixup.scale_embeddings)

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    scale = layer_scale(m, dims)
    layer = xavier_layer_stds(dims)
    for name in SCALED:
      layer[name] = layer[name] * scale
    table_std = dims.width**-0.25 * embedding_scale(m, dims)
    # ViT: a Linear of unit-variance pixels whose outputs get a table row's variance (docstring).
    input_std = table_std / math.sqrt(dims.input_dim) if dims.kind == 'vit' else table_std
    return xavier_plan(
      m, dims, layer={**layer, **unit_scales(dims.depth)}, input_std=input_std, pos_std=table_std
    )


SCHEME = TFixup()
