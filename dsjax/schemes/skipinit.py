r"""SkipInit: a learnable scalar at the end of every residual branch, initialised to zero, no norm.

De & Smith 2020, "Batch Normalization Biases Residual Blocks Towards the Identity Function in Deep
Networks" (NeurIPS 2020, arXiv:2002.10444), the SkipInit initialisation.

Definition as implemented, for every residual add of a stack with no norm anywhere (`model.block =
'nonorm'`):

    x ← x + α·Drop(f(x)),     α a learnable scalar, one per add (attention and FFN of every layer),
                              initialised to `model.skipinit.init` (default 0)

so at initialisation every residual block is the identity and the stack's output is its input
embedding. λ = 1 (fixed); α is an `nnx.Param` (trained, never weight-decayed).

Choices where the paper is open:
  * The paper introduces SkipInit for residual networks without batch normalisation; for a Transformer
    each attention and each FFN block is one residual branch with its own α (the per-layer shared α is
    ReZero, `dsjax/schemes/rezero.py`).
  * The paper initialises α to zero or to a small constant; `init` holds it (default 0).
  * The weights are Xavier (the Xavier base of `dsjax.schemes.vanilla`): SkipInit changes only the
    residual branch scale. No final norm (`model.final_norm` may not be set).
"""

from __future__ import annotations

import ml_collections

from dsjax.models.config import number
from dsjax.models.plan import InitPlan, ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.tfixup import check_no_norm
from dsjax.schemes.vanilla import xavier_plan


class SkipInit(Scheme):
  name = 'skipinit'
  paper = (
    'De & Smith 2020, Batch Normalization Biases Residual Blocks Towards the Identity Function in '
    'Deep Networks (NeurIPS 2020, arXiv:2002.10444)'
  )
  summary = 'no norm; x + α·f(x) with a learnable scalar α per residual add, init 0; Xavier weights'
  blocks = ('nonorm',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.init = 0.0  # initial α of every add: zero (De & Smith 2020, SkipInit)
    return c

  def validate(self, m):
    super().validate(m)
    check_no_norm(m, self.name)
    number('model.skipinit.init', m.skipinit.init)

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    base = xavier_plan(m, dims)
    alpha = per_layer(dims.depth, m.skipinit.init)
    layer = {**base.layer, 'branch_attn': alpha, 'branch_ffn': alpha.copy()}
    return xavier_plan(m, dims, layer=layer, branch=ResidualScale(learnable=True))


SCHEME = SkipInit()
