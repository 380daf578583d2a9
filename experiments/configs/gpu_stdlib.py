r"""The base configs of the GPU experiments (experiments/README.md, "On a GPU"): GPTs on the Python standard
library (`python_stdlib`) with a 4,096-token BPE tokenizer, at ≥ 20 training tokens per non-embedding
parameter. `experiments/gpu_decisive.py` runs every sweep of them; one of them alone:

  python -m dsjax.sweep --config=experiments/configs/gpu_stdlib.py:depth,16x64 \
      --config.data.tokenizer=TOKENIZER_DIR/tokenizer.json --lrs=3e-4,1e-3,3e-3,1e-2 --seeds=0,1,2 \
      --arm=vanilla_postln: --arm=dslm_postln:model.scheme=dslm --out=/tmp/depth_16x64

`depth,NxD` — DSLM at constant N·d² (Kedia et al. 2024, arXiv:2403.09635, Table 4 for BERT, Table 8 for
GPT): a causal GPT of N layers of width D, head dimension 16 at every shape, so that depth and width are
what changes. The paper gives its decoder recipe only as "trained for 8B tokens" (§4.2), so the
optimisation is its BERT recipe (Table 25; every setting but the lr, and Table 25's decay ends at 98% of
the steps where this one runs to the end): Adam betas (0.9, 0.999), decoupled
weight decay 0.01, warm-up over the first 1% of the steps, linear decay to 1% of the peak, gradient
clipping 1.0, dropout 0.1. The base arm is the paper's baseline as Megatron-LM's GPT draws it: every
weight N(0, 0.02²), the projections into the residual stream scaled by 1/sqrt(2N) (`model.vanilla.init=
'gpt2'`; the paper does not name the GPT baseline's init; its BERT baseline keeps BERT's original
settings, §4.1, whose init is σ = 0.02 without the scaling). Post-LN by default; the arms change
`model.block` and `model.scheme`.

`dnt,OPTIMIZER` — DNT's 2×2 (Qi et al. 2025, arXiv:2507.17501, Table 1): a 4×128 GPT (4 heads; the
largest that the GPU window leaves room for after the depth study), RMSNorm,
`model.block='dnt'`, the base arm S1 (Pre-Norm) and the arm `model.dnt_setting=S5` (DNT), with AdamW
(betas (0.9, 0.95), weight decay 0.1) or mSGDW (momentum 0.9, weight decay 1e-4), gradient clipping 1.0
and cosine decay (Tables 3 and 5). Both optimizers warm up over the same first 5% of the steps: the
paper's text warms every language model up for 2000 steps while its Table 5 lists none for mSGDW; one
warm-up for both makes the optimizer the only change.

Every run: sequences of 256 tokens, batch 64 (16,384 tokens a step), evaluation at the end only (the
sweep's selection and report splits are evaluated then). Steps: 20 tokens per non-embedding parameter,
rounded up to a whole hundred (`steps_for`); `experiments/gpu_decisive.py` prints and records the
parameters, tokens per parameter (embeddings included and not) and epochs of every sweep.

Runtimes and results (one H200; the plan, the windows, the tables and verdicts): experiments/README.md §11.
"""

import math

from dsjax.train.config import base_config

# Where `python -m dsjax.tokenizer --data=python_stdlib --vocab_size=4096 --out=...` writes the tokenizer
# (experiments/gpu_decisive.py passes its own with --config.data.tokenizer).
TOKENIZER = '/tmp/tokenizer_stdlib/tokenizer.json'
VOCAB_SIZE = 4096
SEQ_LEN, BATCH = 256, 64
TOKENS_PER_PARAM = 20
HEAD_DIM = 16  # depth study: constant across shapes
DNT_SHAPE = (4, 128, 4)  # depth, width, heads


def non_embedding_params(depth: int, width: int, mlp_ratio: int = 4, norms_per_layer: int = 2) -> int:
  """q, k, v, o and the two FFN matrices with their biases, and the layer's LayerNorms (gain and bias)."""
  hidden = mlp_ratio * width
  matrices = 4 * width * width + 2 * width * hidden
  biases = 4 * width + hidden + width
  return depth * (matrices + biases + norms_per_layer * 2 * width)


def steps_for(depth: int, width: int) -> int:
  tokens = TOKENS_PER_PARAM * non_embedding_params(depth, width)
  return 100 * math.ceil(tokens / (SEQ_LEN * BATCH) / 100)


def _common(c, steps: int):
  c.total_steps = c.eval_every = c.checkpoint_every = steps
  c.log_every = 50
  c.data.name, c.data.tokenizer = 'python_stdlib', TOKENIZER
  c.data.seq_len, c.batch_size, c.eval_batch_size = SEQ_LEN, BATCH, 256
  c.model.tie_embeddings = True
  c.optimizer.clip_norm = 1.0
  return c


def depth_config(shape: str):
  depth, width = (int(x) for x in shape.split('x'))
  c = _common(base_config('gpt', optimizer_name='adamw'), steps_for(depth, width))
  c.model.depth, c.model.width, c.model.num_heads = depth, width, max(1, width // HEAD_DIM)
  c.model.block, c.model.scheme, c.model.vanilla.init = 'postln', 'vanilla', 'gpt2'
  c.model.dropout = 0.1
  c.optimizer.b1, c.optimizer.b2, c.optimizer.weight_decay = 0.9, 0.999, 0.01
  c.optimizer.warmup_steps = max(1, c.total_steps // 100)
  c.optimizer.schedule, c.optimizer.min_lr_ratio = 'linear', 0.01
  return c


def dnt_config(optimizer: str):
  depth, width, heads = DNT_SHAPE
  c = _common(base_config('gpt', optimizer_name=optimizer), steps_for(depth, width))
  c.model.depth, c.model.width, c.model.num_heads = depth, width, heads
  c.model.block, c.model.dnt_setting, c.model.norm = 'dnt', 'S1', 'rmsnorm'
  c.optimizer.warmup_steps = c.total_steps // 20
  return c


def get_config(arg: str = 'depth,16x64'):
  study, _, value = arg.partition(',')
  if study == 'depth':
    return depth_config(value)
  if study == 'dnt':
    return dnt_config(value)
  raise ValueError(f"experiments/configs/gpu_stdlib.py takes 'depth,NxD' or 'dnt,OPTIMIZER', got {arg!r}")
