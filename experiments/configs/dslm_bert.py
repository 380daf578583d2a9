r"""The DSLM paper's BERT recipe at CPU scale (Kedia et al. 2024, arXiv:2403.09635, Table 25): the base
config of the sweeps of experiments/README.md §4 (DSLM against the vanilla model at constant N·d²,
Table 4) and §7 (prior methods, Table 11). `--config=experiments/configs/dslm_bert.py:DEPTHxWIDTH`.

  python -m dsjax.sweep --config=experiments/configs/dslm_bert.py:4x64 --lrs=1e-3,3e-3,1e-2,3e-2 \
      --seeds=0,1,2 --arm=vanilla_postln: --arm=dslm_postln:model.scheme=dslm \
      --out=experiments/results/dslm_depth_4x64

Commands, runtimes and results: experiments/README.md §4 and §7.

The base arm is the paper's baseline: a vanilla Post-LN model with BERT's initialisation (every weight
and both embedding tables N(0, 0.02²), `model.vanilla.init='bert'`: BERT's original settings, which
the paper's baseline keeps, §4.1; Table 14's "Fixed σ = 0.02" row is that init with DSLM's λ, β).
Optimisation as Table 25 (all of BERT's settings except the learning rate): Adam betas (0.9, 0.999),
decoupled weight decay 0.01 (BERT's), warm-up over the first 1% of the steps, then linear decay to 1%
of the peak (Table 25's minimum lr is 1e-5 at peaks of 1e-4–1e-3; its decay ends at 98% of the steps,
this one at the end), gradient clipping 1.0, dropout 0.1.
The paper trains 10⁵ steps at batch 256 × 256 tokens; here a byte-level GPT (causal; Table 8 is the
paper's decoder counterpart of Table 4) on the embedded Python documentation, seq 64, batch 16, 300
steps, tied input/output embeddings (DSLM's output scale, `model.dslm`).
"""

from dsjax.train.config import base_config

STEPS = 300


def get_config(shape: str = '16x32'):
  depth, width = (int(x) for x in shape.split('x'))
  c = base_config('gpt', optimizer_name='adamw')
  c.total_steps = c.eval_every = c.checkpoint_every = STEPS
  c.data.seq_len, c.batch_size, c.eval_batch_size = 64, 16, 256
  c.model.depth, c.model.width, c.model.num_heads = depth, width, max(1, width // 16)
  c.model.block, c.model.scheme = 'postln', 'vanilla'
  c.model.vanilla.init = 'bert'
  c.model.dropout = 0.1
  c.model.tie_embeddings = True
  c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999
  c.optimizer.weight_decay, c.optimizer.clip_norm = 0.01, 1.0
  c.optimizer.warmup_steps = max(1, STEPS // 100)
  c.optimizer.schedule, c.optimizer.min_lr_ratio = 'linear', 0.01
  return c
