r"""DNT's 2×2 at CPU scale (Qi et al. 2025, arXiv:2507.17501, Table 1): the base config of the sweeps of
experiments/README.md §1–§2. `--config=experiments/configs/dnt.py:TASK,OPTIMIZER` with TASK 'gpt' or
'vit' and OPTIMIZER 'adamw' or 'msgdw'; the base arm is DNT's setting S1 (the standard Pre-Norm
transformer), the arms change `model.dnt_setting` (S5 = DNT) and, for mSGDW, the warm-up.

  python -m dsjax.sweep --config=experiments/configs/dnt.py:gpt,adamw --lrs=1e-3,3e-3,1e-2,3e-2 \
      --seeds=0,1,2 --arm=preln: --arm=dnt:model.dnt_setting=S5 --out=experiments/results/dnt_gpt_adamw

Commands, runtimes and results: experiments/README.md §1.

Settings (Qi et al. 2025, Tables 3–5, through `base_config`'s optimizer defaults):
  * both arms RMSNorm, `model.block='dnt'`, so the norm placement is the only difference;
  * AdamW: betas (0.9, 0.95) GPT / (0.9, 0.99) ViT, weight decay 0.1; mSGDW: momentum 0.9, weight decay
    1e-4 GPT / 2e-4 ViT; GPT gradient clipping 1.0; cosine decay to the paper's minimum learning rate as
    a ratio of the peak (Table 5, GPT AdamW: 6e-5 of 6e-4 = 0.1; the others ≈ 0);
  * warm-up, GPT: Table 5 gives AdamW 2000 iterations and mSGDW none, while the paper's text gives every
    language model 2000 warm-up steps; 2000 steps is more than these runs' length, so AdamW warms up
    over a tenth of the steps, mSGDW not at all unless an arm sets it. ViT: Table 4 and App. B warm
    both optimizers up for 60 of 150 epochs (40%); here both warm up over a tenth of the steps, a
    shorter warm-up than the paper's;
  * GPT: byte-level, embedded Python documentation, 4 layers × 64, 4 heads, seq 64, batch 16, 300
    steps, dropout 0; ViT: the embedded 8×8 digits, 4 × 64, patch 2, batch 64, 300 steps, truncated
    normal init (Table 4).
"""

from dsjax.train.config import base_config

STEPS = 300


def get_config(arg: str = 'gpt,adamw'):
  task, optimizer = arg.split(',')
  c = base_config(task, optimizer_name=optimizer)
  c.total_steps = c.eval_every = c.checkpoint_every = STEPS
  c.model.depth, c.model.width, c.model.num_heads = 4, 64, 4
  c.model.block, c.model.dnt_setting, c.model.norm = 'dnt', 'S1', 'rmsnorm'
  if task == 'gpt':
    c.data.seq_len, c.batch_size, c.eval_batch_size = 64, 16, 256
    c.optimizer.warmup_steps = STEPS // 10 if optimizer == 'adamw' else 0
  else:
    c.model.patch_size = 2
    c.model.init_distribution = 'truncated_normal'
    c.batch_size, c.eval_batch_size = 64, 300
    c.optimizer.warmup_steps = STEPS // 10
  return c
