r"""The `torch.compile` peer of `dsjax.bench` on a GPU: a dsjax config's GPT or ViT written plainly in
PyTorch, compiled, in bfloat16 autocast, and timed as `dsjax.bench` times its step.

  python benchmarks/torch_compiled.py --config=configs/gpt2_small.py [--set=batch_size=32] [--steps=20]
                                      [--vit=plain|timm] [--compile=on|off] [--device=cuda|cpu] [--json=FILE]

Needs PyTorch (and timm for `--vit=timm`); neither is a dependency of dsjax. The shape comes from the
config (`model.depth`, `width`, `num_heads`, `mlp_ratio`, `norm_eps`, `patch_size`; `data.seq_len` or
`data.image_size`; `batch_size`) and the vocabulary or number of classes from the dataset's description,
as `dsjax.bench` reads them. The config must be the architecture these peers write (`check_architecture`):
the plain Pre-LN model (`model.block='preln'`, `scheme` the plain one, `norm='layernorm'`, `use_bias`,
`activation='gelu'`, no dropout), an untied GPT head, a ViT with learned position embeddings and
class-token pooling.
  * GPT: `benchmarks/torch_gpt.py`'s model at the config's shape, q/k/v as one (d, 3d) projection (dsjax
    too computes them in one matmul), `scaled_dot_product_attention(is_causal=True)`, exact GELU, learned
    position embeddings, an untied head without bias.
  * ViT, `--vit=plain`: patches by a strided convolution, a class token and learned position embeddings,
    the same layers without the mask, a final LayerNorm and a linear head on the class token (ViT-B/16 of
    Dosovitskiy et al. 2021 at the config's shape). `--vit=timm`: timm's `VisionTransformer` of the same
    shape (class-token pooling, q/k/v bias, LayerNorm eps 1e-6), the model behind timm's ViT-B/16.
The step: the forward pass under `torch.autocast(bfloat16)` (float32 parameters; autocast runs the matmuls
and attention in bfloat16 and the norms' statistics, softmax and loss in float32), mean cross-entropy,
backward, clipping at `optimizer.clip_norm` (when set), and AdamW with the config's lr, betas, eps and
weight decay on every parameter (as `dsjax.train.optimizers` does), PyTorch's fused kernel on a GPU. The
model and the loss are compiled by `torch.compile` (default mode); the optimizer step runs uncompiled, as
the fused kernel it already is. `--device=cpu --compile=off` runs the same step eagerly in float32 (a check).

Timing: the first step, compilation included, is reported as `first_step_s`; 2 warm-up steps follow, then
`--steps` timed steps, each waited for (its loss read back): median and min–max. Then, as `dsjax.bench`
does, 3 runs of `--steps` steps pipelined (`pipelined_*`: each loss read back after the next step is
queued, through pinned memory so that reading it does not wait for that next step, `LossReader`): per
run its mean step, the median and min–max of the runs. Model FLOPs as
`dsjax.bench` counts them (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, App. B: 6·N + 12·depth·d·L per
position, N every parameter but the token and position embeddings and the class token), MFU against the
peaks `dsjax.bench` uses for the device, and peak device memory (`torch.cuda.max_memory_allocated`).
benchmarks/README.md quotes the rows; `benchmarks/gpu_speed.sh` runs them beside dsjax's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

# dsjax is imported only to read configs and device peaks: keep jax off the GPU that PyTorch times.
os.environ['JAX_PLATFORMS'] = 'cpu'

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # paired.py and torch_gpt.py, beside this
import paired  # noqa: E402

torch = paired.require_torch(__file__)
import torch_gpt  # noqa: E402

try:  # the peer the ViT target is set against (`--vit=timm`); optional
  import timm
except ModuleNotFoundError:
  timm = None

from dsjax import bench, schemes  # noqa: E402
from dsjax.train import config as config_lib  # noqa: E402

nn, F = torch.nn, torch.nn.functional
WARMUP_STEPS = 2
PIPELINED_RUNS = 3  # as dsjax.bench
# Parameters that are looked up, not multiplied: left out of N as `dsjax.bench.LOOKED_UP_PARAMS` does.
LOOKED_UP = ('token_embed', 'pos_embed', 'cls_token')


class ViT(nn.Module):
  """Patch embedding (a convolution with stride = patch), a class token, learned position embeddings,
  Pre-LN `torch_gpt.Block`s without the causal mask, a final LayerNorm and a head on the class token."""

  def __init__(self, image_size, patch, channels, classes, depth, width, heads, mlp_ratio, eps):
    super().__init__()
    self.patch_embed = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
    self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
    self.pos_embed = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, width) * 0.02)
    self.blocks = nn.ModuleList(
      torch_gpt.Block(width, heads, mlp_ratio, eps, causal=False, fused_qkv=True) for _ in range(depth)
    )
    self.final_norm = nn.LayerNorm(width, eps=eps)
    self.head = nn.Linear(width, classes)

  def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
    x_BLD = self.patch_embed(images_BCHW).flatten(2).transpose(1, 2)
    x_BLD = torch.cat([self.cls_token.expand(x_BLD.shape[0], -1, -1), x_BLD], dim=1) + self.pos_embed
    for block in self.blocks:
      x_BLD = block(x_BLD)
    return self.head(self.final_norm(x_BLD)[:, 0])


def check_architecture(config) -> None:
  """One line naming the first config key whose value these peers do not write."""
  m = config.model
  required = {
    'model.block': (m.block, 'preln'),
    'model.norm': (m.norm, 'layernorm'),
    'model.activation': (m.activation, 'gelu'),
    'model.use_bias': (m.use_bias, True),
    'model.dropout': (m.dropout, 0.0),
    'model.attn_dropout': (m.attn_dropout, 0.0),
    'model.scheme': (m.scheme, schemes.PLAIN),
  }
  if m.name == 'gpt':
    required['model.tie_embeddings'] = (m.tie_embeddings, False)
  else:
    required['model.pooling'] = (m.pooling, 'cls')
    required['model.pos_embedding'] = (m.pos_embedding, 'learned')
  for key, (value, allowed) in required.items():
    if value != allowed:
      raise ValueError(f'{key} must be {allowed!r} for the PyTorch peer, got {value!r}')


def build(config, data_info, vit: str) -> tuple[nn.Module, dict]:
  """The model (seed 0) and what one batch of it holds: shapes, positions per example, classes."""
  m = config.model
  torch.manual_seed(0)
  if m.name == 'gpt':
    model = torch_gpt.GPT(
      data_info.vocab_size, m.depth, m.width, m.num_heads, config.data.seq_len, m.mlp_ratio, m.norm_eps, True
    )
    return model, {'positions': config.data.seq_len, 'classes': data_info.vocab_size}
  size, _, channels = data_info.image_shape
  if vit == 'timm':
    model = timm.models.VisionTransformer(
      img_size=size,
      patch_size=m.patch_size,
      in_chans=channels,
      num_classes=data_info.num_classes,
      embed_dim=m.width,
      depth=m.depth,
      num_heads=m.num_heads,
      mlp_ratio=m.mlp_ratio,
      qkv_bias=True,
      class_token=True,
      global_pool='token',
    )
  else:
    model = ViT(
      size,
      m.patch_size,
      channels,
      data_info.num_classes,
      m.depth,
      m.width,
      m.num_heads,
      m.mlp_ratio,
      m.norm_eps,
    )
  return model, {'positions': (size // m.patch_size) ** 2 + 1, 'classes': data_info.num_classes}


def matmul_params(model: nn.Module) -> int:
  """N of the model FLOPs: every parameter but the looked-up ones (`LOOKED_UP`)."""
  return sum(p.numel() for name, p in model.named_parameters() if not any(k in name for k in LOOKED_UP))


def make_train_step(config, data_info, args):
  """The model, its batch of random inputs and the function that runs one train step and returns its
  loss (read back, so the step has finished); also the model's matmul parameters and positions."""
  device = torch.device(args.device)
  model, dims = build(config, data_info, args.vit)
  model = model.to(device)
  o = config.optimizer
  optimizer = torch.optim.AdamW(
    model.parameters(),
    lr=o.lr,
    betas=(o.b1, o.b2),
    eps=o.eps,
    weight_decay=o.weight_decay,
    fused=device.type == 'cuda',
  )
  generator = torch.Generator().manual_seed(0)
  if config.model.name == 'gpt':
    tokens = torch.randint(
      0, dims['classes'], (config.batch_size, config.data.seq_len + 1), generator=generator
    )
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
  else:
    size, _, channels = data_info.image_shape
    inputs = torch.randn(config.batch_size, channels, size, size, generator=generator).to(device)
    targets = torch.randint(0, dims['classes'], (config.batch_size,), generator=generator).to(device)
  use_bf16 = device.type == 'cuda'

  def loss_fn(inputs, targets):
    with torch.autocast(device.type, torch.bfloat16, enabled=use_bf16):
      logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, dims['classes']), targets.reshape(-1))

  # The loss compiled with the model, as a torch.compile training script would.
  compiled_loss_fn = torch.compile(loss_fn) if args.compile == 'on' else loss_fn

  def step():
    """One step, queued on the device; its loss (a tensor, not read back)."""
    optimizer.zero_grad(set_to_none=True)
    loss = compiled_loss_fn(inputs, targets)
    loss.backward()
    if o.clip_norm:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
    optimizer.step()
    return loss.detach()

  return step, matmul_params(model), dims['positions']


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  paired.add_config_args(parser)
  parser.add_argument(
    '--steps', type=int, default=20, help='Timed steps (after the first and 2 warm-up steps).'
  )
  parser.add_argument('--vit', default='plain', help="ViT configs: 'plain' (written here) or 'timm'.")
  parser.add_argument('--compile', default='on', help="'on' (torch.compile) or 'off' (eager).")
  parser.add_argument('--device', default='cuda', help="'cuda' or 'cpu'.")
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  for flag, allowed in (('vit', ('plain', 'timm')), ('compile', ('on', 'off')), ('device', ('cuda', 'cpu'))):
    if getattr(args, flag) not in allowed:
      parser.error(f'--{flag} must be one of {list(allowed)}, got {getattr(args, flag)!r}')
  if args.steps < 1:
    parser.error(f'--steps must be >= 1, got {args.steps}')
  paired.check_output_args(parser, args)
  if args.vit == 'timm' and timm is None:
    parser.error('--vit=timm needs timm beside PyTorch: pip install timm')
  if args.device == 'cuda' and not torch.cuda.is_available():
    parser.error('--device=cuda: PyTorch sees no GPU (--device=cpu runs the step on the CPU)')
  config = paired.config_from_args(parser, args)
  try:
    check_architecture(config)
    data_info = config_lib.validate_single_device_run(config, training=True, require_data=False)
  except ValueError as e:
    parser.error(str(e))
  return args, config, data_info


def time_steps(step, steps: int) -> tuple[float, list[float]]:
  """Seconds of the first step (compilation included), and of each of `steps` steps timed after
  `WARMUP_STEPS` more, each waited for (its loss read back)."""
  start = time.perf_counter()
  step().item()
  first_step_s = time.perf_counter() - start
  times = []
  for i in range(WARMUP_STEPS + steps):
    start = time.perf_counter()
    step().item()
    if i >= WARMUP_STEPS:
      times.append(time.perf_counter() - start)
  return first_step_s, times


class LossReader:
  """Reads a step's loss back without waiting for the steps queued after it, as `jax.device_get` of an
  earlier step's metrics does: on a GPU the loss is copied into pinned host memory right after its step
  is queued, and reading it waits for that copy alone. (`loss.item()` would queue its copy behind every
  step queued since, and so wait for them too.) Two buffers, used in turn: the one being read is never
  the one the newest step writes."""

  def __init__(self, device):
    self.on_gpu = device.type == 'cuda'
    if self.on_gpu:
      self.buffers = [torch.empty((), dtype=torch.float32).pin_memory() for _ in range(2)]
      self.copied = [torch.cuda.Event() for _ in range(2)]
    self.turn = 0

  def queue(self, loss):
    """Starts reading `loss`; returns a function that gives its value."""
    if not self.on_gpu:
      return loss.item
    buffer, copied = self.buffers[self.turn], self.copied[self.turn]
    self.turn = 1 - self.turn
    buffer.copy_(loss.float(), non_blocking=True)
    copied.record()
    return lambda: (copied.synchronize(), buffer.item())[1]


def time_pipelined(step, steps: int, device, wait_for_device) -> list[float]:
  """Seconds per step of `PIPELINED_RUNS` runs of `steps` steps timed as `dsjax.bench` times its
  pipelined steps: each step's loss read back (`LossReader`) only after the next step is queued."""
  reader = LossReader(device)
  per_step = []
  for _ in range(PIPELINED_RUNS):
    wait_for_device()  # the last update of the steps before, not counted here
    start, read_previous = time.perf_counter(), None
    for _ in range(steps):
      read = reader.queue(step())
      if read_previous is not None:
        read_previous()
      read_previous = read
    read_previous()
    wait_for_device()  # the last optimizer update too
    per_step.append((time.perf_counter() - start) / steps)
  return per_step


def main():
  args, config, data_info = parse_args()
  step, num_params, positions = make_train_step(config, data_info, args)
  first_step_s, times = time_steps(step, args.steps)
  wait_for_device = torch.cuda.synchronize if args.device == 'cuda' else lambda: None
  pipelined = time_pipelined(step, args.steps, torch.device(args.device), wait_for_device)
  m = config.model
  flops = (6 * num_params + 12 * m.depth * m.width * positions) * positions * config.batch_size
  median_s = statistics.median(times)
  device = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
  peaks = [kind for kind in bench.PEAK_TFLOPS if device.startswith(kind)]
  peak = bench.PEAK_TFLOPS[max(peaks, key=len)]['bfloat16'] if peaks else None
  per_example = positions if m.name == 'gpt' else 1
  unit = 'tokens' if m.name == 'gpt' else 'images'
  per_s = config.batch_size * per_example / median_s
  pipelined_per_s = config.batch_size * per_example / statistics.median(pipelined)
  results = {
    'peer': f'torch.compile, {args.vit} ViT' if m.name == 'vit' else 'torch.compile',
    'compile': args.compile,
    'device': device,
    'torch': torch.__version__,
    'config': args.config,
    'overrides': args.set,
    **bench.commit_fields(),
    'date': time.strftime('%Y-%m-%d'),
    'steps': args.steps,
    'first_step_s': first_step_s,
    **paired.step_ms(times),
    f'{unit}_per_s': per_s,
    **{f'pipelined_{k}': v for k, v in paired.step_ms(pipelined).items()},
    f'pipelined_{unit}_per_s': pipelined_per_s,
    'matmul_params': num_params,
    'model_tflops_per_step': flops / 1e12,
    'peak_tflops': peak,
    'mfu': flops / median_s / 1e12 / peak if peak else None,
    'peak_memory_gib': torch.cuda.max_memory_allocated() / 2**30 if args.device == 'cuda' else None,
  }
  mfu = f', MFU {100 * results["mfu"]:.1f}%' if peak else ''
  print(
    f'PyTorch {torch.__version__} ({"compiled" if args.compile == "on" else "eager"}) on {device}, '
    f'{args.config} {" ".join(args.set)}: first step {first_step_s:.1f} s; '
    f'{paired.step_ms_line(results, args.steps)}, {per_s:,.0f} {unit}/s{mfu}'
  )
  print(
    f'  pipelined ({PIPELINED_RUNS} runs of {args.steps} steps, each loss read after the next step is '
    f'queued): {statistics.median(pipelined) * 1e3:.1f} ms/step median of the runs (min '
    f'{min(pipelined) * 1e3:.1f}, max {max(pipelined) * 1e3:.1f}), {pipelined_per_s:,.0f} {unit}/s'
  )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
