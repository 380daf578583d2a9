r"""DS-Init: depth-scaled uniform initialisation of every weight matrix in a layer.

Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with Depth-Scaled Initialization and Merged
Attention" (EMNLP 2019, arXiv:1908.11365), the depth-scaled initialisation (DS-Init).

Definition as implemented, for layer l = 1, ..., N (1-indexed from the input) and every weight matrix
W ∈ R^{d_in × d_out} of that layer (queries, keys, values, attention output, both FFN matrices):

    W ~ U(−γ·α/sqrt(l), +γ·α/sqrt(l)),     γ = sqrt(6 / (d_in + d_out))     (Xavier-uniform bound)

i.e. Xavier-uniform shrunk by α/sqrt(l); `model.dsinit.alpha` is the paper's α ∈ [0, 1] (default 1).
The plan stores standard deviations and draws with `distribution='uniform'` (U(±a) has standard
deviation a/sqrt(3)), so the per-layer std is sqrt(2/(d_in+d_out))·α/sqrt(l). Biases are 0, LayerNorm
gains 1 and residual scales λ = β = 1 (the plain Post-LN or Pre-LN stack).

Choices where the paper is open:
  * Embeddings and the output head are not part of DS-Init (the paper scales the layers' weights only);
    they get Xavier-uniform as every other matrix of the base model: the GPT token and position tables
    as (vocabulary → width) matrices, the ViT patch embedding as a Linear, the ViT learned position
    table std 0.02 (the Xavier base of `dsjax.schemes.vanilla`), all drawn uniformly.
  * Every draw of a DS-Init model is uniform, whatever `model.init_distribution` says: the paper defines
    the method with the uniform distribution.
  * The paper's models are Post-LN encoder–decoders (the merged-attention sublayer, MAtt, is a separate
    proposal and not implemented); l counts the layers of our single stack. The paper analyses Post-LN;
    'preln' is allowed for comparisons.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from dsjax.models.config import number
from dsjax.models.plan import InitPlan, ModelDims, unit_scales, xavier_layer_stds
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan


def depth_scales(depth: int, alpha: float) -> np.ndarray:
  """α/sqrt(l) for l = 1, ..., depth."""
  return (alpha / np.sqrt(np.arange(1, depth + 1, dtype=np.float64))).astype(np.float32)


class DSInit(Scheme):
  name = 'dsinit'
  paper = (
    'Zhang, Titov & Sennrich 2019, Improving Deep Transformer with Depth-Scaled Initialization and '
    'Merged Attention (EMNLP 2019, arXiv:1908.11365)'
  )
  summary = 'every weight of layer l ~ U(±γ·α/sqrt(l)), γ = sqrt(6/(d_in+d_out)) (Xavier-uniform / sqrt(l))'
  blocks = ('postln', 'preln')

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.alpha = 1.0  # α of U(±γ·α/sqrt(l)), α ∈ [0, 1] (Zhang et al. 2019, DS-Init); 0, which
    # zeroes every weight, is rejected
    return c

  def validate(self, m):
    super().validate(m)
    number('model.dsinit.alpha', m.dsinit.alpha, low=0, low_open=True, high=1)

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    scale = depth_scales(dims.depth, m.dsinit.alpha)
    layer = {name: std * scale for name, std in xavier_layer_stds(dims).items()}
    return xavier_plan(m, dims, distribution='uniform', layer={**layer, **unit_scales(dims.depth)})


SCHEME = DSInit()
