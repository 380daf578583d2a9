"""`benchmarks/torch_compiled.py`, the `torch.compile` peer of `dsjax.bench`: without PyTorch one line
naming what to install; with it, its usage errors, and that its model has dsjax's matmul parameters and
model FLOPs (so a tokens/s or MFU comparison compares the same work). The compiled GPU step itself is
run by `benchmarks/gpu_speed.sh` (tests/test_gpu_speed.py runs that at a tiny size, compiled on the CPU)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'torch_compiled.py'
HAVE_TORCH = importlib.util.find_spec('torch') is not None
TINY_GPT = ['--set=model.depth=2', '--set=model.width=32', '--set=model.num_heads=2', '--set=data.seq_len=16']


def _run(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(
    [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout
  )


def _one_line_error(proc, expected: str):
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].endswith(expected), proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr


@pytest.mark.skipif(HAVE_TORCH, reason='checks the message of a machine without PyTorch')
def test_without_pytorch_one_line_names_what_to_install():
  proc = _run('--device=cpu')
  assert (
    proc.returncode != 0
    and proc.stderr.strip() == 'torch_compiled.py needs PyTorch beside dsjax: pip install torch'
  )


@pytest.mark.skipif(not HAVE_TORCH, reason='needs PyTorch')
@pytest.mark.parametrize(
  'args, expected',
  [
    (['--vit=other'], "--vit must be one of ['plain', 'timm'], got 'other'"),
    (['--compile=maybe'], "--compile must be one of ['on', 'off'], got 'maybe'"),
    (['--steps=0'], '--steps must be >= 1, got 0'),
    (['--set=model.block=postln'], "model.block must be 'preln' for the PyTorch peer, got 'postln'"),
    (['--set=model.depth=0'], 'model.depth must be a positive integer, got 0'),
  ],
)
def test_usage_errors_are_one_line_and_write_nothing(tmp_path, args, expected):
  out = tmp_path / 'peer.json'
  _one_line_error(_run('--config=configs/gpt_preln.py', '--device=cpu', f'--json={out}', *args), expected)
  assert not out.exists()


@pytest.mark.skipif(not HAVE_TORCH, reason='needs PyTorch')
@pytest.mark.parametrize('config', ['gpt_preln', 'vit_b16'])
def test_the_peer_counts_the_matmul_parameters_and_flops_dsjax_counts(tmp_path, config):
  args = TINY_GPT if config.startswith('gpt') else [*TINY_GPT[:3], '--set=data.image_size=32']
  out = tmp_path / 'peer.json'
  proc = _run(
    f'--config=configs/{config}.py', *args, '--device=cpu', '--compile=off', '--steps=1', f'--json={out}'
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  peer = json.loads(out.read_text())
  # dsjax's own count, from its benchmark's JSON (a process of its own: its absl flags are global).
  ours_json = tmp_path / 'ours.json'
  overrides = [a.replace('--set=', '--config.') for a in args]
  ours_proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'dsjax.bench',
      f'--config=configs/{config}.py',
      *overrides,
      '--instrument=off',
      '--steps=1',
      f'--json={ours_json}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
    timeout=300,
  )
  assert ours_proc.returncode == 0, ours_proc.stderr[-3000:]
  ours = json.loads(ours_json.read_text())
  assert peer['matmul_params'] == ours['matmul_params']
  assert peer['model_tflops_per_step'] * 1e12 == pytest.approx(ours['model_flops_per_step'], rel=1e-12)
  assert peer['step_ms_median'] > 0 and peer['compile'] == 'off'
  assert peer['pipelined_step_ms_min'] <= peer['pipelined_step_ms_median'] <= peer['pipelined_step_ms_max']
  assert peer['pipelined_tokens_per_s' if config.startswith('gpt') else 'pipelined_images_per_s'] > 0
