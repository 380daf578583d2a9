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

What the paper leaves open, and our choices:
  * The constants. μP fixes how each scale changes with width, not its value at the base width. We take
    the Xavier plan (`vanilla.xavier_plan`, Glorot & Bengio 2010) as the base model: at width =
    base_width every weight has exactly the vanilla Xavier std. Xavier's 2/(fan_in + fan_out) is ∝
    1/fan_in for every hidden matrix (fan_out/fan_in is fixed as the width grows), so the hidden
    matrices keep the Xavier formula at every width; the input, position and head stds are frozen at
    their base-width Xavier values (the head as `MuReadout` does by rescaling the standard init by
    sqrt(width_mult)). The learned ViT position table keeps the base plan's 0.02.
  * The readout form: the paper's Table 3 puts 1/fan_in² on the output-weight variance and 1/fan_in on
    its Adam lr; we use the equivalent multiplier form (base-width variance, input × 1/width_mult,
    unscaled lr), which also works with tied embeddings (the tied table keeps its input-weight lr) and
    is what `InitPlan.output_scale` expresses. With a ViT classifier bias, the multiplier acts before
    the bias, as in `MuReadout`.
  * base_width = 128 (the model config's default width, so a default-width model is its own base).
    Only the ratio width/base_width matters; the FFN width follows model.mlp_ratio at both widths.
  * The attention multiplier: plain 1/d_head (the `mup` package uses 8/d_head to agree with
    1/sqrt(d_head) at d_head = 64; we keep the paper's form).
  * Adam's decoupled weight decay: the optimizer multiplies a parameter's whole update, decay included,
    by its lr multiplier, so the decay of hidden matrices is also × 1/width_mult (as with a PyTorch
    per-group learning rate; the `mup` package's MuAdamW instead multiplies their weight decay by
    width_mult to keep lr·wd fixed).
  * Not implemented: zero-initialised queries (an option of the `mup` package's README), SGD's μP.
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
  paper = ('Yang et al. 2021, Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter '
           'Transfer (arXiv:2203.03466), Table 3 (Adam)')
  summary = ("Xavier at base width; hidden matrices' Adam lr × 1/width_mult, readout × 1/width_mult "
             '(optionally zero-init), attention logits × 1/d_head')
  blocks = ('preln', 'postln')

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.base_width = 128            # width of the base model (width_mult = model.width / base_width); the
                                  # paper tunes a small base model and transfers its hyperparameters
    c.zero_readout = False        # readout (head) kernel initialised to zero (paper's option; mup README)
    return c

  def validate(self, m):
    super().validate(m)
    positive_int('model.mup.base_width', m.mup.base_width)
    boolean('model.mup.zero_readout', m.mup.zero_readout)
    if m.name == 'gpt' and m.tie_embeddings and m.mup.zero_readout:
      raise ValueError('model.mup.zero_readout=True needs an untied head (model.tie_embeddings=False): a '
                       'tied head is the token table, which cannot start at zero')

  def init_plan(self, m, dims, prepared=None):
    base = m.mup.base_width
    mult = width_mult(m, dims)
    input_std = xavier_std(dims.input_dim, base)
    return xavier_plan(
        m, dims,
        input_std=input_std, pos_std=input_std if dims.kind == 'gpt' else 0.02,
        head_std=xavier_std(base, dims.num_outputs), output_scale=1.0 / mult,
        zero_head=m.mup.zero_readout, attn_logit_scale=1.0 / dims.head_dim,
        lr_scale={key: 1.0 / mult for key in WEIGHT_KEYS})


SCHEME = MuP()
