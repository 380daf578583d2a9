r"""Value-SkipInit: no attention skip; the attention matrix starts as the identity.

He, Martens, Zhang, Botev, Brock, Smith & Teh 2023, "Deep Transformers without Shortcuts: Modifying
Self-attention for Faithful Signal Propagation" (ICLR 2023, arXiv:2302.10322), the Value-SkipInit
attention.

Definition as implemented, per layer:

    attention add    x ← Attn'(x)                      the skip of the attention add removed (λ = 0,
                                                        a fixed constant), branch scale 1
    Attn'            (α·I + β·A(X))·V(X), then W_O       α, β learnable scalars, α = 1, β = 0 at
                                                        initialisation (`InitPlan.attn_identity`)
    FFN add          x ← x + FFN(x)                    kept as in the block
    weights          Xavier (`vanilla.xavier_plan`)

At initialisation the attention sub-block is therefore the linear map x ↦ W_O·W_V·x applied to every
token separately (the identity attention matrix), so the attention cannot mix tokens and cannot drive
the token correlation up (rank collapse) before training moves β away from 0.

Choices the paper leaves open (or sets differently):
  * The paper studies transformers without any shortcut; here, as in the comparison of Kedia et al.
    2024 (Table 11), only the attention skip is removed and the MLP skip is kept.
  * Blocks: Pre-LN (first, the natural one), Post-LN and no normalisation. α and β are not weight-decayed
    (only kernels and the token table are).
"""

from __future__ import annotations

from dsjax.models.plan import ModelDims, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan


class ValueSkipInit(Scheme):
  name = 'value_skipinit'
  paper = (
    'He et al. 2023, Deep Transformers without Shortcuts: Modifying Self-attention for Faithful '
    'Signal Propagation (ICLR 2023, arXiv:2302.10322)'
  )
  summary = 'attention skip removed; attention matrix α·I + β·A(X), learnable α = 1, β = 0 at init'
  blocks = ('preln', 'postln', 'nonorm')

  def init_plan(self, m, dims: ModelDims, prepared=None):
    base = xavier_plan(m, dims)
    layer = {**base.layer, 'skip_attn': per_layer(dims.depth, 0.0)}
    return xavier_plan(m, dims, layer=layer, attn_identity=True)


SCHEME = ValueSkipInit()
