r"""Bamboo: a deeper and narrower configuration of a vanilla Pre-LN transformer.

Xue, Chen, Sun, Ren, Zheng, He, Chen, Jiang & You 2023, "A Study on Transformer Configuration and
Training Objective" (ICML 2023, arXiv:2205.10505).

The paper's proposal ("Bamboo") is a shape, not an initialisation: for the same parameter budget, use
more and narrower layers than the conventional configuration (its re-designed Base-level models replace
the usual 12 layers of width 768). The network itself is the standard Pre-LN transformer with its
standard initialisation. Here that is the Xavier plan of `dsjax.schemes.vanilla` on a Pre-LN stack
(λ = β = 1, Xavier weights); the shape is chosen by the config: `configs/gpt_bamboo.py` is the
deeper-narrower counterpart of `configs/gpt_preln.py` at the same number of block parameters.

Choices where the paper is open:
  * The paper motivates Bamboo with masked-autoencoder training (which it finds alleviates the
    over-smoothing of deep, narrow models); this project trains the shape with its own objectives
    (next-token prediction, classification), as the comparison of prior deep-transformer methods in
    Kedia et al. 2024 (Table 11) does with BERT.
  * Registering the shape as a method keeps it in the method table and lets runs name it; the plan is
    exactly `model.scheme='vanilla'` with `model.vanilla.init='xavier'` on a Pre-LN stack.
"""

from __future__ import annotations

from dsjax.models.plan import InitPlan, ModelDims
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan


class Bamboo(Scheme):
  name = 'bamboo'
  paper = (
    'Xue et al. 2023, A Study on Transformer Configuration and Training Objective (ICML 2023, '
    'arXiv:2205.10505)'
  )
  summary = 'vanilla Xavier Pre-LN; the method is the deeper-narrower shape (configs/gpt_bamboo.py)'
  blocks = ('preln',)

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    return xavier_plan(m, dims)


SCHEME = Bamboo()
