r"""μP, the maximal update parametrisation, for Adam.

Yang, Hu, Babuschkin, Sidor, Liu, Farhi, Ryder, Pachocki, Chen & Gao 2021, "Tensor Programs V: Tuning
Large Neural Networks via Zero-Shot Hyperparameter Transfer" (NeurIPS 2021, arXiv:2203.03466), Table 3
(Adam column) in its equivalent output-multiplier form (the paper's appendix; `MuReadout` and `MuAdam`
of the authors' `mup` package), with 1/d attention.

With width_mult = model.width / base_width (`model.mup.base_width`), μP relative to its base model is

    hidden matrices q, k, v, o, ffn1, ffn2   init variance ∝ 1/fan_in;  Adam lr × 1/width_mult
    input weights (token / patch / position   init and Adam lr independent of width
      embeddings), all biases, norm gains
    readout (LM head / classifier)           init variance independent of width (or zero,
                                             `zero_readout`); its input × 1/width_mult (the
                                             "output multiplier", `InitPlan.output_scale`); Adam lr
                                             independent of width
    attention logits                         q·k × 1/d_head instead of 1/sqrt(d_head)

What the paper leaves open, and our choices — the Xavier plan as the base model, the readout's
multiplier form, base_width = 128, plain 1/d_head, the lr multiplier applied to the decay — with the
reasons: docs/methods.md, "μP".
"""

from __future__ import annotations

import ml_collections

from dsjax.models.config import boolean, positive_int
from dsjax.models.plan import WEIGHT_KEYS, ModelDims, xavier_std
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan


def width_mult(m, dims: ModelDims) -> float:
  return dims.width / m.mup.base_width


class MuP(Scheme):
  name = 'mup'
  paper = (
    'Yang et al. 2021, Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter '
    'Transfer (arXiv:2203.03466), Table 3 (Adam)'
  )
  summary = (
    "Xavier at base width; hidden matrices' Adam lr × 1/width_mult, readout × 1/width_mult "
    '(optionally zero-init), attention logits × 1/d_head'
  )
  blocks = ('preln', 'postln')

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.base_width = 128  # width of the base model (width_mult = model.width / base_width); the
    # paper tunes a small base model and transfers its hyperparameters
    c.zero_readout = False  # readout (head) kernel initialised to zero (paper's option; mup README)
    return c

  def validate(self, m):
    super().validate(m)
    positive_int('model.mup.base_width', m.mup.base_width)
    boolean('model.mup.zero_readout', m.mup.zero_readout)
    if m.name == 'gpt' and m.tie_embeddings and m.mup.zero_readout:
      raise ValueError(
        'model.mup.zero_readout=True needs an untied head (model.tie_embeddings=False): a '
        'tied head is the token table, which cannot start at zero'
      )

  def init_plan(self, m, dims, prepared=None):
    base = m.mup.base_width
    mult = width_mult(m, dims)
    input_std = xavier_std(dims.input_dim, base)
    return xavier_plan(
      m,
      dims,
      input_std=input_std,
      pos_std=input_std if dims.kind == 'gpt' else 0.02,
      head_std=xavier_std(base, dims.num_outputs),
      output_scale=1.0 / mult,
      zero_head=m.mup.zero_readout,
      attn_logit_scale=1.0 / dims.head_dim,
      lr_scale={key: 1.0 / mult for key in WEIGHT_KEYS},
    )


SCHEME = MuP()
