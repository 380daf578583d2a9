r"""ReZero: one learnable residual weight per layer, initialised to zero, no norm.

Bachlechner, Majumder, Mao, Cottrell & McAuley 2021, "ReZero is All You Need: Fast Convergence at Large
Depth" (UAI 2021, arXiv:2003.04887): x_{i+1} = x_i + α_i·F(x_i) and the ReZero Transformer.

Definition as implemented, for layer n of a stack with no norm anywhere (`model.block = 'nonorm'`):

    x ← x + α_n·Drop(Attention(x))
    x ← x + α_n·Drop(FFN(x))           α_n one learnable scalar per layer, shared by both adds,
                                       initialised to `model.rezero.init` (default 0)

so at initialisation every layer is the identity and the stack's output is its input embedding. λ = 1
(fixed); α_n is an `nnx.Param` (trained, never weight-decayed).

Choices where the paper is open:
  * One α per layer shared by the attention and the FFN sublayer, as in the paper's ReZero Transformer
    layer (its reference code keeps one `resweight` per layer); one α per add is SkipInit
    (`dsjax/schemes/skipinit.py`).
  * The weights are Xavier (the Xavier base of `dsjax.schemes.vanilla`); ReZero changes only the
    residual. No final norm (`model.final_norm` may not be set).
"""

from __future__ import annotations

import ml_collections

from dsjax.models.config import number
from dsjax.models.plan import InitPlan, ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.tfixup import check_no_norm
from dsjax.schemes.vanilla import xavier_plan


class ReZero(Scheme):
  name = 'rezero'
  paper = (
    'Bachlechner et al. 2021, ReZero is All You Need: Fast Convergence at Large Depth (UAI 2021, '
    'arXiv:2003.04887)'
  )
  summary = 'no norm; x + α·f(x) with one learnable α per layer shared by both adds, init 0; Xavier weights'
  blocks = ('nonorm',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.init = 0.0  # initial α of every layer: zero (Bachlechner et al. 2021)
    return c

  def validate(self, m):
    super().validate(m)
    check_no_norm(m, self.name)
    number('model.rezero.init', m.rezero.init)

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    base = xavier_plan(m, dims)
    alpha = per_layer(dims.depth, m.rezero.init)
    # Shared: the model keeps one variable per layer, initialised from branch_attn, used at both adds.
    layer = {**base.layer, 'branch_attn': alpha, 'branch_ffn': alpha.copy()}
    return xavier_plan(m, dims, layer=layer, branch=ResidualScale(learnable=True, shared=True))


SCHEME = ReZero()
