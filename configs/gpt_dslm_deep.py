r"""Deep-narrow DeepScaleLM GPT: 96 Pre-LN layers of width 32 on the embedded Python-documentation bytes.

Command (2-core CPU, no network):

  python -m dsjax.main --config=configs/gpt_dslm_deep.py --workdir=/tmp/gpt_dslm_deep

Expected runtime: 1m19s wall on the 2-core CPU (2026-12-03).
Expected result: eval loss 2.351 nats/byte (3.39 bits/byte) after 300 steps (measured 2026-12-03, seed 0;
2.374 with the previous input pipeline, another training order); the vanilla Post-LN model of the same
shape: 3.249, the vanilla Pre-LN one 2.889 (experiments/dslm_results.md §2, the same day).

Every residual add is x ← λ·x + β·Drop(f(LN(x))) with β² = 2/96, and the weights come from `dsjax.theory`
(Kedia et al. 2024, arXiv:2403.09635, §3.5 and Appendix M), so the forward and backward variances stay
bounded through all 96 layers at initialisation. `experiments/dslm_vs_postln.py` trains this config next
to the vanilla Post-LN (Xavier) model of the same shape and optimizer, which stays on the unigram plateau
(loss ≈ 3.26 nats/byte, the byte entropy of the corpus). Fold the trained scales into a plain Pre-LN
checkpoint with `python -m dsjax.export --workdir=/tmp/gpt_dslm_deep --out=/tmp/gpt_dslm_deep_vanilla`.

Two choices differ from the `model.dslm` defaults, both the DSLM reference code's: the LM head is tied to
the token table and the final hidden state is scaled by 1/sqrt(σe²·d) ('sqrt_embed_var_d'), so the
initial logits have variance 1. With the paper's 1/sqrt(d) the logits start at variance σe² = 0.45 and
the head learns ~2× slower per step (at 12 layers, 200 steps: eval loss 3.01 untied/1/sqrt(d), 2.63
tied/1/sqrt(d), 2.52 tied/1/sqrt(σe²·d)). Pre-LN rather than Post-LN: at this width and step budget the
96-layer DSLM Post-LN model, like the vanilla one, has not left the unigram plateau after 300 steps
at this lr (it collapses in rank during training); the DSLM Pre-LN model leaves it within ~50 steps.
With `--config.model.block=postln --config.optimizer.lr=1e-3 --config.optimizer.warmup_steps=100` the
DSLM Post-LN model trains too (eval 2.786 at step 300; vanilla Post-LN with that schedule: 3.261) —
experiments/dslm_results.md §2.
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('gpt', optimizer_name='adamw')
  c.total_steps = 300
  c.batch_size = 16
  c.eval_every = 300
  c.eval_batch_size = 128
  c.checkpoint_every = 300
  c.log_every = 10
  c.data.seq_len = 32

  c.model.depth = 96
  c.model.width = 32
  c.model.num_heads = 4
  c.model.block = 'preln'
  c.model.dropout = 0.1  # the paper's p; DSLM's init accounts for it
  c.model.tie_embeddings = True  # as the reference code (see the docstring)
  c.model.scheme = 'dslm'
  c.model.dslm.init = 'simple'  # the paper's §4 runs (see dsjax/schemes/dslm.py)
  c.model.dslm.output_scale = 'sqrt_embed_var_d'  # reference code: logits of variance 1 at init

  c.optimizer.lr = 5e-3
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 30
  c.optimizer.clip_norm = 1.0
  # Cosine to 0, as the result above was measured (the default is the paper's minimum, Qi et al. 2025
  # Table 5: 6e-5).
  c.optimizer.min_lr_ratio = 0.0
  return c
