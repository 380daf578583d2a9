r"""The default GPT's train step written plainly in PyTorch (eager), timed like `dsjax.bench`: a peer to
compare dsjax's CPU speed with.

  python benchmarks/torch_gpt.py [--steps=20] [--threads=N] [--microbatches=M] [--json=FILE]

next to

  python -m dsjax.bench --config=configs/gpt_preln.py --instrument=off --steps=20

Needs PyTorch (`pip install torch`; not a dependency of dsjax). The model is `configs/gpt_preln.py`'s:
byte vocabulary (256), learned position embeddings, 4 Pre-LN layers of width 128 with 4 heads,
separate q/k/v/o projections with biases, FFN 512 with the exact GELU, LayerNorm (eps 1e-6) before
each branch and after the stack, an untied head without bias; float32; mean next-token cross-entropy
over batch 32 × seq 128 of random tokens; gradient clipping at global norm 1 and AdamW (lr 6e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter, as `dsjax.train.optimizers` does).
Attention is `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, what a
straightforward modern implementation uses. Each timed step runs forward, backward, clipping and the
update; the median and min–max over `--steps` steps after 2 warm-up steps are reported.
`--microbatches=M` accumulates the gradient over M microbatches (rows m, m + M, … as dsjax's
`microbatches` splits them) before the one update, the peer of `--config.microbatches=M`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import paired  # benchmarks/paired.py, beside this script

torch = paired.require_torch(__file__)
nn, F = torch.nn, torch.nn.functional

VOCAB, DEPTH, WIDTH, HEADS, SEQ_LEN, BATCH = 256, 4, 128, 4, 128, 32
WARMUP_STEPS = 2


class Block(nn.Module):
  """One Pre-LN layer: x + Attention(LayerNorm(x)), then x + FFN(LayerNorm(x)). The q, k and v projections
  are three `nn.Linear`s, or with `fused_qkv` one (d, 3d) `nn.Linear` (as dsjax computes them: one matmul
  of the stacked kernels); `causal` masks attention to earlier positions (GPT) or not (ViT)."""

  def __init__(
    self,
    d: int,
    heads: int,
    mlp_ratio: int = 4,
    eps: float = 1e-6,
    causal: bool = True,
    fused_qkv: bool = False,
  ):
    super().__init__()
    self.heads, self.causal, self.fused_qkv = heads, causal, fused_qkv
    self.norm1, self.norm2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
    if fused_qkv:
      self.qkv = nn.Linear(d, 3 * d)
    else:
      self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
    self.o = nn.Linear(d, d)
    self.ffn1, self.ffn2 = nn.Linear(d, mlp_ratio * d), nn.Linear(mlp_ratio * d, d)

  def attention(self, x_BLD: torch.Tensor) -> torch.Tensor:
    b, l, d = x_BLD.shape
    split = lambda t: t.view(b, l, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
    if self.fused_qkv:
      q_BLD, k_BLD, v_BLD = self.qkv(x_BLD).chunk(3, dim=-1)
    else:
      q_BLD, k_BLD, v_BLD = self.q(x_BLD), self.k(x_BLD), self.v(x_BLD)
    out_BHLK = F.scaled_dot_product_attention(split(q_BLD), split(k_BLD), split(v_BLD), is_causal=self.causal)
    return self.o(out_BHLK.transpose(1, 2).reshape(b, l, d))

  def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
    x_BLD = x_BLD + self.attention(self.norm1(x_BLD))
    return x_BLD + self.ffn2(F.gelu(self.ffn1(self.norm2(x_BLD))))


class GPT(nn.Module):
  """Token and learned position embeddings, `depth` Pre-LN `Block`s, a final LayerNorm and an untied head
  without bias; by default the shape of `configs/gpt_preln.py` (the module's constants)."""

  def __init__(
    self,
    vocab: int = VOCAB,
    depth: int = DEPTH,
    width: int = WIDTH,
    heads: int = HEADS,
    seq_len: int = SEQ_LEN,
    mlp_ratio: int = 4,
    eps: float = 1e-6,
    fused_qkv: bool = False,
  ):
    super().__init__()
    self.token_embed = nn.Embedding(vocab, width)
    self.pos_embed = nn.Parameter(torch.randn(seq_len, width) * 0.02)
    self.blocks = nn.ModuleList(
      Block(width, heads, mlp_ratio, eps, causal=True, fused_qkv=fused_qkv) for _ in range(depth)
    )
    self.final_norm = nn.LayerNorm(width, eps=eps)
    self.head = nn.Linear(width, vocab, bias=False)

  def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
    x_BLD = self.token_embed(tokens_BL) + self.pos_embed[: tokens_BL.shape[1]]
    for block in self.blocks:
      x_BLD = block(x_BLD)
    return self.head(self.final_norm(x_BLD))


def make_train_step(microbatches: int = 1) -> Callable[[], float]:
  """A new model (seed 0), its optimizer and a batch of random tokens; returns the function that runs one
  train step on them and returns its loss (read back, so the step has finished)."""
  torch.manual_seed(0)
  model = GPT()
  optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
  tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def step() -> float:
    optimizer.zero_grad(set_to_none=True)
    for rows in torch.arange(BATCH).reshape(-1, microbatches).T:  # microbatch m: rows m, m + M, ...
      logits = model(inputs[rows])
      loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1)) / microbatches
      loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()

  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=20, help='Timed steps (after 2 warm-up steps).')
  parser.add_argument('--threads', type=int, default=None, help="torch.set_num_threads (default: torch's).")
  parser.add_argument(
    '--microbatches',
    type=int,
    default=1,
    help='Gradient accumulation: the batch in this many microbatches, one update.',
  )
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  if args.steps < 1:
    parser.error(f'--steps must be >= 1, got {args.steps}')
  if args.microbatches < 1 or BATCH % args.microbatches:
    parser.error(f'--microbatches must be a divisor of the batch size {BATCH}, got {args.microbatches}')
  paired.check_output_args(parser, args)
  if args.threads is not None:
    torch.set_num_threads(args.threads)
  step = make_train_step(args.microbatches)
  times = []
  for i in range(WARMUP_STEPS + args.steps):
    start = time.perf_counter()
    step()
    if i >= WARMUP_STEPS:
      times.append(time.perf_counter() - start)
  results = {
    'torch': torch.__version__,
    'threads': torch.get_num_threads(),
    'steps': args.steps,
    'microbatches': args.microbatches,
    'date': time.strftime('%Y-%m-%d'),
    **paired.step_ms(times),
    'tokens_per_s': BATCH * SEQ_LEN / statistics.median(times),
  }
  print(
    f'PyTorch {results["torch"]} eager, {results["threads"]} threads, GPT {DEPTH}x{WIDTH}, seq {SEQ_LEN}, '
    f'batch {BATCH} ({args.microbatches} microbatch(es)): {paired.step_ms_line(results, args.steps)}, '
    f'{results["tokens_per_s"]:,.0f} tokens/s'
  )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
