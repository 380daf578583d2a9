r"""The matmuls of the default GPT's train step, one at a time, in XLA (through JAX) and in PyTorch on the
CPU: where the two runtimes' kernels differ in speed.

  python benchmarks/cpu_matmul_kernels.py [--repeats=40] [--pause=0.05] [--json=FILE]

Needs PyTorch beside dsjax (`pip install torch`; not a dependency of dsjax). The shapes are those of
`configs/gpt_preln.py` (batch 32 × seq 128 = 4096 tokens, width 128, FFN 512, 4 heads of 32, byte
vocabulary), each product in the three forms a train step runs: the forward x·W, the input gradient
dy·Wᵀ and the weight gradient xᵀ·dy (a product whose left operand is stored transposed: XLA's CPU
backend hands those to a different kernel than the other two), the latter as dsjax's dense layer
computes it (`dsjax.models.fast_matmul.matmul_last_axis`; a narrowing layer's also in XLA's plain form) and
as PyTorch's `nn.Linear` does, dyᵀ·x. q, k and v are timed as one (d, 3·d) kernel; the model multiplies
their stack as (d, 3, d), which keeps a sharding of its last axis, and which XLA may lower differently.
The attention products are batched over
batch × heads with full 128 × 128 score matrices: q·kᵀ, p·v and the value gradient pᵀ·dO. Each
product is compiled once (`jax.jit`) or called as PyTorch eager does (`torch.matmul` on views). The two
alternate: each round times `CALLS_PER_ROUND` calls back to back of one, then of the other, in
alternating order, after `--pause` seconds of idle (PyTorch's OpenMP threads spin for a while after
their work and would take cores from XLA's next call; a single call after idle would time the wake-up).
The median per call over `--repeats` rounds is reported with the ratio XLA/PyTorch. The last line
weights the linear-layer rows by how often one train step runs them.

Run it under `taskset -c 0` to compare one core with one core: JAX then sizes its thread pool, and
PyTorch its OpenMP threads, to the one core.
"""

from __future__ import annotations

import statistics
import time

from dsjax.train import host_memory

host_memory.keep_freed_memory()  # as every dsjax command does; before JAX or PyTorch start threads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

from dsjax.models import fast_matmul  # noqa: E402

torch = paired.require_torch(__file__)

TOKENS, WIDTH, FFN, VOCAB, BATCH_HEADS, SEQ, HEAD_DIM, DEPTH = 4096, 128, 512, 256, 32 * 4, 128, 32, 4
CALLS_PER_ROUND, WARMUP_ROUNDS = 10, 2
# The linear layers: (name, d_in, d_out, layers that have one).
LINEAR = [
  ('qkv', WIDTH, 3 * WIDTH, DEPTH),
  ('out', WIDTH, WIDTH, DEPTH),
  ('ffn1', WIDTH, FFN, DEPTH),
  ('ffn2', FFN, WIDTH, DEPTH),
  ('head', WIDTH, VOCAB, 1),
]


def products():
  """(name, lhs shape, rhs shape, form, times per step): form 'nn' = a·b, 'nt' = a·bᵀ, 'tn' = aᵀ·b,
  over the last two axes (leading axes batched); 'weight_grad' = a dense layer's weight gradient from
  its input a and output gradient b: in XLA aᵀ·b as dsjax computes it (for a narrowing layer,
  d_in > d_out, as (bᵀ·a)ᵀ: `dsjax.models.fast_matmul`), in PyTorch bᵀ·a as `nn.Linear`'s backward does
  (its weight is stored (d_out, d_in)); 'weight_grad_plain' the same with XLA's plain aᵀ·b."""
  rows = []
  for name, d_in, d_out, per_step in LINEAR:
    rows += [
      (f'{name} forward x·W', (TOKENS, d_in), (d_in, d_out), 'nn', per_step),
      (f'{name} input grad dy·Wᵀ', (TOKENS, d_out), (d_in, d_out), 'nt', per_step),
      (f'{name} weight grad xᵀ·dy', (TOKENS, d_in), (TOKENS, d_out), 'weight_grad', per_step),
    ]
    if d_in > d_out:  # dsjax's CPU form differs from the plain one: time both
      rows.append(
        (f'{name} weight grad, plain form', (TOKENS, d_in), (TOKENS, d_out), 'weight_grad_plain', None)
      )
  b, l, k = BATCH_HEADS, SEQ, HEAD_DIM
  rows += [
    ('attention q·kᵀ (batched)', (b, l, k), (b, l, k), 'nt', None),
    ('attention p·v (batched)', (b, l, l), (b, l, k), 'nn', None),
    ('attention pᵀ·dO (batched)', (b, l, l), (b, l, k), 'tn', None),
  ]
  return rows


def dense_weight_grad(x_ND: jax.Array, dy_NO: jax.Array) -> jax.Array:
  """The kernel's cotangent of dsjax's dense matmul alone (its forward product is dead code)."""
  kernel = jnp.zeros((x_ND.shape[1], dy_NO.shape[1]), x_ND.dtype)
  _, pullback = jax.vjp(lambda k: fast_matmul.matmul_last_axis(x_ND, k), kernel)
  return pullback(dy_NO)[0]


def jax_product(form: str):
  swap = lambda t: jnp.swapaxes(t, -1, -2)  # noqa: E731
  tn = lambda a, b: swap(a) @ b  # noqa: E731
  return jax.jit(
    {
      'nn': lambda a, b: a @ b,
      'nt': lambda a, b: a @ swap(b),
      'tn': tn,
      'weight_grad': dense_weight_grad,
      'weight_grad_plain': tn,
    }[form]
  )


def torch_product(form: str):
  linear_weight_grad = lambda a, b: b.transpose(-1, -2) @ a  # noqa: E731
  return {
    'nn': lambda a, b: a @ b,
    'nt': lambda a, b: a @ b.transpose(-1, -2),
    'tn': lambda a, b: a.transpose(-1, -2) @ b,
    'weight_grad': linear_weight_grad,
    'weight_grad_plain': linear_weight_grad,
  }[form]


def time_pair(form: str, lhs_shape, rhs_shape, repeats: int, pause: float) -> tuple[float, float]:
  rng = np.random.default_rng(0)
  lhs, rhs = (rng.standard_normal(s, dtype=np.float32) for s in (lhs_shape, rhs_shape))
  jax_fn, jax_args = jax_product(form), (jnp.asarray(lhs), jnp.asarray(rhs))
  torch_fn, torch_args = torch_product(form), (torch.from_numpy(lhs), torch.from_numpy(rhs))
  torch_out = torch_fn(*torch_args).numpy()
  np.testing.assert_allclose(
    np.asarray(jax_fn(*jax_args)),
    torch_out.T if form.startswith('weight_grad') else torch_out,
    rtol=2e-3,
    atol=2e-3,
  )

  def run_xla():
    for _ in range(CALLS_PER_ROUND):
      out = jax_fn(*jax_args)
    out.block_until_ready()

  def run_torch():
    for _ in range(CALLS_PER_ROUND):
      torch_fn(*torch_args)

  times = paired.alternate({'xla': run_xla, 'torch': run_torch}, repeats, WARMUP_ROUNDS, pause)
  per_call_ms = lambda name: 1e3 * statistics.median(times[name]) / CALLS_PER_ROUND  # noqa: E731
  return per_call_ms('xla'), per_call_ms('torch')


def main():
  parser = paired.timing_parser(__doc__.split('\n\n')[0], 'repeats', 'rounds per product')
  args = paired.parse_timing_args(parser, 'repeats')
  print(
    f'jax {jax.__version__} ({jax.default_backend()}), PyTorch {torch.__version__} '
    f'({torch.get_num_threads()} threads), {time.strftime("%Y-%m-%d")}; median ms per product'
  )
  print(f'  {"product":34s} {"shapes":26s} {"XLA":>7s} {"PyTorch":>8s} {"XLA/PyTorch":>11s}')
  rows, step = [], {'xla': 0.0, 'torch': 0.0}
  for name, lhs_shape, rhs_shape, form, per_step in products():
    xla_ms, torch_ms = time_pair(form, lhs_shape, rhs_shape, args.repeats, args.pause)
    rows.append(
      {
        'product': name,
        'lhs': lhs_shape,
        'rhs': rhs_shape,
        'form': form,
        'xla_ms': xla_ms,
        'torch_ms': torch_ms,
        'per_step': per_step,
      }
    )
    if per_step:
      step['xla'] += per_step * xla_ms
      step['torch'] += per_step * torch_ms
    shapes = f'{"x".join(map(str, lhs_shape))}, {"x".join(map(str, rhs_shape))}'
    print(f'  {name:34s} {shapes:26s} {xla_ms:7.2f} {torch_ms:8.2f} {xla_ms / torch_ms:11.2f}')
  print(
    f'  linear-layer matmuls of one train step: XLA {step["xla"]:.1f} ms, PyTorch {step["torch"]:.1f} ms '
    f'({step["xla"] / step["torch"]:.2f})'
  )
  paired.write_json(
    args.json,
    {
      'jax': jax.__version__,
      'torch': torch.__version__,
      'threads': torch.get_num_threads(),
      'date': time.strftime('%Y-%m-%d'),
      'repeats': args.repeats,
      'products': rows,
      'linear_step_ms': step,
    },
  )


if __name__ == '__main__':
  main()
