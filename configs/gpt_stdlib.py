r"""Pre-LN GPT on the Python standard library (`python_stdlib`, about 31 MB) with a 4,096-token BPE tokenizer.

Commands (the tokenizer first, once; the corpus is tokenized into the data dir on the first run):

  python -m dsjax.tokenizer --data=python_stdlib --vocab_size=4096 --out=/tmp/tokenizer_stdlib
  python -m dsjax.main --config=configs/gpt_stdlib.py --workdir=/tmp/gpt_stdlib

and the byte-level GPT on the same corpus, for comparison in bits per byte:

  python -m dsjax.main --config=configs/gpt_stdlib.py --workdir=/tmp/gpt_stdlib_bytes \
      --config.data.tokenizer=bytes

Expected runtime on these 2 cores (shared with other work, 2026-11-27): the tokenizer 7 s (5.5 s training
it), the run 3m29s wall (tokenizing the corpus once 13 s; 600 steps at about 3.8 steps/s; the evaluation
pass over the validation split 10 s); the byte-level run 2m25s (about 5 steps/s: a 256-row output layer
instead of 4,096).
Expected result (seed 0, step 600, both runs 600 steps of 32 × 128 tokens, 2.46M tokens):

  4,096-token BPE (3.22 bytes per token)   eval 4.812 nats/token   2.158 bits per byte   1.32 tokens/param
  bytes                                    eval 2.130 nats/byte    3.074 bits per byte   2.81 tokens/param

At the same number of steps and tokens the BPE model has read 3.2 times as much text, which is most of its
lead; `eval/bits_per_byte` is what compares the two (docs/data.md, "Text: corpora, tokenizers and bits per
byte"). The corpus is the running Python's library, so the numbers move a little between Python versions.
The model is configs/gpt_preln.py's; the optimisation is DNT's AdamW GPT recipe (Qi et al. 2025,
arXiv:2507.17501, Tables 3 and 5) with a 60-step warm-up and cosine decay to 0 for this length.
"""

from dsjax.train.config import base_config

# Where `python -m dsjax.tokenizer ... --out=/tmp/tokenizer_stdlib` writes the tokenizer.
TOKENIZER = '/tmp/tokenizer_stdlib/tokenizer.json'


def get_config():
  c = base_config('gpt', optimizer_name='adamw')
  c.total_steps = 600
  c.batch_size = 32
  c.eval_every = 600
  c.checkpoint_every = 600
  c.log_every = 100

  c.data.name = 'python_stdlib'
  c.data.tokenizer = TOKENIZER
  c.data.seq_len = 128

  # The model of configs/gpt_preln.py: 4 layers of width 128, the stack in one scan iteration.
  c.model.depth = 4
  c.model.width = 128
  c.model.num_heads = 4
  c.model.block = 'preln'
  c.model.scan_unroll = 4

  # DNT AdamW GPT: lr 6e-4, wd 0.1, betas (0.9, 0.95) (Qi et al. 2025, Tables 3, 5); cosine to 0.
  c.optimizer.lr = 6e-4
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 60
  c.optimizer.clip_norm = 1.0
  c.optimizer.min_lr_ratio = 0.0
  return c
