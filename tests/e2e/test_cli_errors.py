"""Every command-line tool turns a user's mistake into one line, before it writes anything.

Each case runs the real program (`python -m dsjax.<tool> ...`) and checks: a non-zero exit, a last
stderr line `dsjax.<tool>: error: ...` naming the flag, key, path or value, no traceback, and the
directory holding the case's outputs and workdirs exactly as it was (same files, sizes and mtimes; no
new file or directory). Every case fails before anything is compiled, so a fresh interpreter would
spend almost all of its ~5 s importing jax, flax, orbax, grain and TFDS. The cases therefore start from a
launcher process that has imported those libraries (not the tools, whose flags must be defined by the
run itself) and forks one child per case; the child runs the tool exactly as `python -m dsjax.<tool>
ARGS` does (`runpy`, `__main__`, its own argv, stderr and exit status). `test_help_exits_zero` starts the
tools as fresh interpreters.
"""

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
TOOLS = ('main', 'moments', 'export', 'bench', 'sensitivity', 'tokenizer', 'sweep')

# Files a case starts from, under its temporary directory ({tmp} in the arguments).
FILES = {
  'file': 'not a directory\n',
  'syntax.py': 'def get_config(:\n',
  'no_get_config.py': 'CONFIG = None\n',
  'raises.py': 'def get_config():\n  raise RuntimeError("config is broken on purpose")\n',
  'returns_none.py': 'def get_config():\n  return None\n',
  'raises_key_error.py': 'def get_config():\n  return {}["model"]\n',
  # A training workdir as dsjax.export sees it before restoring: its config and a finished step.
  'run/config.json': json.dumps(
    {'model': {'name': 'gpt', 'block': 'postln'}, 'optimizer': {'name': 'adamw'}}
  ),
  'run/checkpoints/2/': None,
  'no_ckpt/config.json': json.dumps({'model': {'name': 'gpt'}, 'optimizer': {'name': 'adamw'}}),
  'bad_json/config.json': '{"model": ',
  'bad_json/checkpoints/2/': None,
  'empty_dir/': None,
  'read_only/': None,  # Made read-only below: only a non-root user is kept from writing there.
  'locked/.dsjax.lock': 'pid 1 on elsewhere',  # Held by the test, as a live run would hold it.
  # Another training run's workdir, which no tool may write into.
  'other/config.json': json.dumps({'model': {'name': 'gpt'}, 'optimizer': {'name': 'adamw'}}),
  'other/checkpoints/4/': None,
  # Workdirs of the wrong layout.
  'ckpt_file/checkpoints': 'not a directory\n',
  'metrics_dir/metrics.jsonl/': None,
  # Text: a tokenizer file that does not parse, a file that is not UTF-8, and a tiny corpus whose
  # train split (f0.txt, f1.txt) cannot support a large vocabulary (f12.txt falls into validation).
  'corrupt_tokenizer.json': '{"model": ',
  'latin/a.txt': 'café'.encode('latin-1'),
  'small/f0.txt': 'def f(x):\n  return x\n',
  'small/f1.txt': 'import os\n',
  'small/f12.txt': 'print(1)\n',
}

MAIN = ['--config=configs/gpt_preln.py', '--workdir={tmp}/w']
MOMENTS = ['--config=configs/gpt_preln.py', '--out={tmp}/out']
EXPORT = ['--workdir={tmp}/run', '--out={tmp}/out']
SENSITIVITY = ['--config=configs/gpt_preln.py', '--out={tmp}/out']
TOKENIZER = ['--data=text:{tmp}/small/*.txt', '--out={tmp}/out']
SWEEP = ['--config=configs/gpt_preln.py', '--lrs=1e-3,3e-3', '--out={tmp}/out']

# (id, tool, arguments, a substring the error line must contain).
CASES = [
  # dsjax.main: config file, overrides, flags and workdir, all rejected before training.
  ('main-config-missing', 'main', ['--config={tmp}/missing.py', '--workdir={tmp}/w'], 'missing.py'),
  ('main-config-syntax', 'main', ['--config={tmp}/syntax.py', '--workdir={tmp}/w'], 'syntax.py, line 1'),
  (
    'main-config-no-get-config',
    'main',
    ['--config={tmp}/no_get_config.py', '--workdir={tmp}/w'],
    'no_get_config.py defines no get_config()',
  ),
  ('main-config-raises', 'main', ['--config={tmp}/raises.py', '--workdir={tmp}/w'], 'broken on purpose'),
  (
    'main-config-returns-none',
    'main',
    ['--config={tmp}/returns_none.py', '--workdir={tmp}/w'],
    '--config: get_config() of {tmp}/returns_none.py returned None',
  ),
  (
    'main-config-raises-key-error',
    'main',
    ['--config={tmp}/raises_key_error.py', '--workdir={tmp}/w'],
    "--config: get_config() of {tmp}/raises_key_error.py raised KeyError: 'model'",
  ),
  ('main-mistyped-key', 'main', MAIN + ['--config.totl_steps=5'], '--config.totl_steps'),
  ('main-mistyped-nested-key', 'main', MAIN + ['--config.model.detph=4'], '--config.model.detph'),
  ('main-mistyped-section', 'main', MAIN + ['--config.modle.depth=4'], '--config.modle.depth'),
  ('main-not-an-int', 'main', MAIN + ['--config.total_steps=abc'], 'abc'),
  ('main-unknown-flag', 'main', MAIN + ['--no_such_flag=1'], 'no_such_flag'),
  ('main-missing-config', 'main', ['--workdir={tmp}/w'], '--config'),
  ('main-mesh-shape', 'main', MAIN + ['--config.mesh.shape=abc'], 'mesh.shape'),
  ('main-negative-lr', 'main', MAIN + ['--config.optimizer.lr=-1'], 'lr'),
  ('main-unknown-scheme', 'main', MAIN + ['--config.model.scheme=nope'], "'nope'"),
  ('main-empty-workdir', 'main', ['--config=configs/gpt_preln.py', '--workdir='], '--workdir'),
  ('main-workdir-is-file', 'main', ['--config=configs/gpt_preln.py', '--workdir={tmp}/file'], '{tmp}/file'),
  (
    'main-workdir-in-use',
    'main',
    ['--config=configs/gpt_preln.py', '--workdir={tmp}/locked'],
    'is in use by a running dsjax run',
  ),
  (
    'main-checkpoints-is-a-file',
    'main',
    ['--config=configs/gpt_preln.py', '--workdir={tmp}/ckpt_file'],
    '{tmp}/ckpt_file/checkpoints is not a directory',
  ),
  (
    'main-metrics-is-a-directory',
    'main',
    ['--config=configs/gpt_preln.py', '--workdir={tmp}/metrics_dir'],
    '{tmp}/metrics_dir/metrics.jsonl is not a file',
  ),
  ('main-unknown-dataset', 'main', MAIN + ['--config.data.name=not_a_dataset'], 'not_a_dataset'),
  (
    'main-tokenizer-missing',
    'main',
    MAIN + ['--config.data.name=python_stdlib', '--config.data.tokenizer={tmp}/missing.json'],
    'data.tokenizer={tmp}/missing.json: no such file',
  ),
  (
    'main-tokenizer-corrupt',
    'main',
    MAIN + ['--config.data.name=python_stdlib', '--config.data.tokenizer={tmp}/corrupt_tokenizer.json'],
    'corrupt_tokenizer.json: not a readable tokenizers JSON file',
  ),
  (
    'main-text-glob-matches-nothing',
    'main',
    MAIN + ['--config.data.name=text:{tmp}/nothing/*.txt'],
    'matches no file',
  ),
  (
    'main-text-not-utf8',
    'main',
    MAIN + ['--config.data.name=text:{tmp}/latin/*.txt'],
    '{tmp}/latin/a.txt is not UTF-8',
  ),
  # dsjax.moments
  ('moments-zero-batches', 'moments', MOMENTS + ['--batches=0'], '--batches=0'),
  ('moments-negative-batches', 'moments', MOMENTS + ['--batches=-2'], '--batches=-2'),
  (
    'moments-out-is-file',
    'moments',
    ['--config=configs/gpt_preln.py', '--out={tmp}/file'],
    '--out={tmp}/file',
  ),
  (
    'moments-out-under-file',
    'moments',
    ['--config=configs/gpt_preln.py', '--out={tmp}/file/sub'],
    '{tmp}/file is not a directory',
  ),
  ('moments-unknown-theory-form', 'moments', MOMENTS + ['--theory_form=nope'], '--theory_form'),
  ('moments-missing-out', 'moments', ['--config=configs/gpt_preln.py'], '--out'),
  ('moments-checkpoint-missing', 'moments', MOMENTS + ['--checkpoint={tmp}/nowhere'], '{tmp}/nowhere'),
  (
    'moments-checkpoint-without-checkpoints',
    'moments',
    MOMENTS + ['--checkpoint={tmp}/empty_dir'],
    'holds no checkpoint',
  ),
  ('moments-unknown-scheme', 'moments', MOMENTS + ['--config.model.scheme=nope'], 'model.scheme'),
  ('moments-unknown-dataset', 'moments', MOMENTS + ['--config.data.name=not_a_dataset'], 'not_a_dataset'),
  # dsjax.export
  ('export-workdir-missing', 'export', ['--workdir={tmp}/nowhere', '--out={tmp}/out'], '{tmp}/nowhere'),
  ('export-workdir-is-file', 'export', ['--workdir={tmp}/file', '--out={tmp}/out'], '--workdir={tmp}/file'),
  (
    'export-workdir-without-config',
    'export',
    ['--workdir={tmp}/empty_dir', '--out={tmp}/out'],
    'no config.json',
  ),
  (
    'export-workdir-bad-config',
    'export',
    ['--workdir={tmp}/bad_json', '--out={tmp}/out'],
    '{tmp}/bad_json/config.json',
  ),
  (
    'export-workdir-without-checkpoints',
    'export',
    ['--workdir={tmp}/no_ckpt', '--out={tmp}/out'],
    'holds no checkpoint',
  ),
  ('export-out-is-workdir', 'export', ['--workdir={tmp}/run', '--out={tmp}/run'], '--out={tmp}/run'),
  (
    'export-out-in-checkpoints',
    'export',
    ['--workdir={tmp}/run', '--out={tmp}/run/checkpoints/x'],
    'would overwrite the run',
  ),
  (
    'export-out-is-another-run',
    'export',
    ['--workdir={tmp}/run', '--out={tmp}/other'],
    '--out={tmp}/other holds a training run (config.json, checkpoints)',
  ),
  (
    'export-out-is-a-live-workdir',
    'export',
    ['--workdir={tmp}/run', '--out={tmp}/locked'],
    '--out={tmp}/locked is the workdir of a running dsjax run (pid 1 on elsewhere)',
  ),
  ('export-out-is-file', 'export', ['--workdir={tmp}/run', '--out={tmp}/file'], '--out={tmp}/file'),
  ('export-zero-rtol', 'export', EXPORT + ['--rtol=0'], '--rtol'),
  ('export-missing-out', 'export', ['--workdir={tmp}/run'], '--out'),
  ('export-missing-workdir', 'export', ['--out={tmp}/out'], '--workdir'),
  # dsjax.bench (writes only to a temporary directory of its own)
  ('bench-zero-steps', 'bench', ['--steps=0'], '--steps=0'),
  ('bench-unknown-instrument-mode', 'bench', ['--instrument=off,sometimes'], '--instrument'),
  ('bench-unknown-inputs', 'bench', ['--inputs=zeros'], '--inputs'),
  ('bench-zero-peak', 'bench', ['--peak_tflops=0'], '--peak_tflops=0'),
  ('bench-nan-peak', 'bench', ['--peak_tflops=nan'], '--peak_tflops must be a finite'),
  ('bench-json-is-directory', 'bench', ['--json={tmp}'], '--json={tmp} is a directory'),
  ('bench-profile-is-file', 'bench', ['--profile={tmp}/file'], '--profile={tmp}/file exists'),
  (
    'bench-cudnn-on-cpu',
    'bench',
    ['--config.model.attention=cudnn', '--config.model.dtype=bfloat16'],
    'model.attention=cudnn',
  ),
  ('bench-unknown-scheme', 'bench', ['--config.model.scheme=nope'], 'model.scheme'),
  ('bench-heads-do-not-divide-width', 'bench', ['--config.model.num_heads=5'], 'model.num_heads'),
  # dsjax.sensitivity
  ('sensitivity-zero-draws', 'sensitivity', SENSITIVITY + ['--draws=0'], '--draws=0'),
  (
    'sensitivity-out-is-file',
    'sensitivity',
    ['--config=configs/gpt_preln.py', '--out={tmp}/file'],
    '--out={tmp}/file',
  ),
  ('sensitivity-missing-config', 'sensitivity', ['--out={tmp}/out'], '--config'),
  ('sensitivity-unknown-block', 'sensitivity', SENSITIVITY + ['--config.model.block=bogus'], 'model.block'),
  # Output paths are checked up front, by creating them (a name over 255 bytes), naming the flag.
  ('bench-json-name-too-long', 'bench', ['--json={tmp}/' + 'x' * 300 + '.json'], '--json={tmp}/xxx'),
  (
    'sensitivity-out-name-too-long',
    'sensitivity',
    ['--config=configs/gpt_preln.py', '--out={tmp}/new/' + 'x' * 300],
    '--out={tmp}/new/xxx',
  ),
  (
    'moments-out-name-too-long',
    'moments',
    ['--config=configs/gpt_preln.py', '--out={tmp}/new/' + 'x' * 300],
    '--out={tmp}/new/xxx',
  ),
  (
    'export-out-name-too-long',
    'export',
    ['--workdir={tmp}/run', '--out={tmp}/new/' + 'x' * 300],
    '--out={tmp}/new/xxx',
  ),
  # Created up front, removed again when a later check fails (the snapshot below is unchanged).
  (
    'bench-json-created-then-removed',
    'bench',
    ['--json={tmp}/new/bench.json', '--config.model.num_heads=5'],
    'model.num_heads',
  ),
  (
    'sensitivity-out-is-a-run',
    'sensitivity',
    ['--config=configs/gpt_preln.py', '--out={tmp}/other'],
    '--out={tmp}/other holds a training run',
  ),
  (
    'bench-json-replaces-a-run-config',
    'bench',
    ['--json={tmp}/other/config.json'],
    '--json={tmp}/other holds a training run',
  ),
  (
    'sensitivity-out-not-writable',
    'sensitivity',
    ['--config=configs/gpt_preln.py', '--out={tmp}/read_only/out'],
    '{tmp}/read_only is not writable',
  ),
  # dsjax.sweep: the grid, the arms (named with the key) and the output directory.
  ('sweep-bad-lrs', 'sweep', ['--config=configs/gpt_preln.py', '--lrs=1e-3,abc', '--out={tmp}/out'], '--lrs'),
  ('sweep-negative-lr', 'sweep', ['--config=configs/gpt_preln.py', '--lrs=-1', '--out={tmp}/out'], '--lrs'),
  ('sweep-bad-seeds', 'sweep', SWEEP + ['--seeds=0,0'], '--seeds'),
  (
    'sweep-unknown-arm-key',
    'sweep',
    SWEEP + ['--arm=deep:model.detph=4'],
    '--arm=deep: the config has no key',
  ),
  ('sweep-bad-arm-value', 'sweep', SWEEP + ['--arm=deep:model.depth=four'], '--arm=deep: model.depth=four'),
  ('sweep-arm-fails-a-check', 'sweep', SWEEP + ['--arm=wide:model.width=33'], '--arm=wide: model.width'),
  ('sweep-arm-sets-the-lr', 'sweep', SWEEP + ['--arm=a:optimizer.lr=1'], '--arm=a: optimizer.lr'),
  ('sweep-arm-names-repeat', 'sweep', SWEEP + ['--arm=a:', '--arm=a:model.depth=2'], '--arm names'),
  ('sweep-baseline-not-an-arm', 'sweep', SWEEP + ['--arm=a:', '--baseline=b'], '--baseline=b'),
  ('sweep-unknown-split', 'sweep', SWEEP + ['--report_split=nope'], "split 'nope'"),
  (
    'sweep-out-is-file',
    'sweep',
    ['--config=configs/gpt_preln.py', '--lrs=1e-3', '--out={tmp}/file'],
    '--out={tmp}/file',
  ),
  (
    'sweep-out-is-a-run',
    'sweep',
    ['--config=configs/gpt_preln.py', '--lrs=1e-3', '--out={tmp}/other'],
    'holds a training run',
  ),
  ('sweep-missing-lrs', 'sweep', ['--config=configs/gpt_preln.py', '--out={tmp}/out'], '--lrs'),
  # dsjax.tokenizer
  ('tokenizer-vocab-too-small', 'tokenizer', TOKENIZER + ['--vocab_size=100'], '--vocab_size=100'),
  (
    'tokenizer-vocab-larger-than-the-corpus',
    'tokenizer',
    TOKENIZER + ['--vocab_size=5000'],
    '--vocab_size=5000 is larger than the train split',
  ),
  (
    'tokenizer-glob-matches-nothing',
    'tokenizer',
    ['--data=text:{tmp}/nothing/*.txt', '--vocab_size=300', '--out={tmp}/out'],
    'matches no file',
  ),
  (
    'tokenizer-not-utf8',
    'tokenizer',
    ['--data=text:{tmp}/latin/*.txt', '--vocab_size=300', '--out={tmp}/out'],
    '{tmp}/latin/a.txt is not UTF-8',
  ),
  (
    'tokenizer-out-is-file',
    'tokenizer',
    ['--data=text:{tmp}/small/*.txt', '--vocab_size=300', '--out={tmp}/file'],
    '--out={tmp}/file',
  ),
  ('tokenizer-missing-data', 'tokenizer', ['--vocab_size=300', '--out={tmp}/out'], '--data'),
]
IS_ROOT = hasattr(os, 'geteuid') and os.geteuid() == 0
MARKS = {
  'sensitivity-out-not-writable': pytest.mark.skipif(IS_ROOT, reason='permissions do not stop root'),
}
PARAMS = [pytest.param(*case[1:], id=case[0], marks=MARKS.get(case[0], ())) for case in CASES]
assert len(CASES) >= 30


def _env():
  return {**os.environ, 'JAX_PLATFORMS': 'cpu'}


# Reads one case per line (JSON: tool, args, stderr path), forks, and runs the tool as __main__ in the
# child; answers each case with its exit status. It imports the libraries the tools use, never a tool.
LAUNCHER = r"""
import json, os, runpy, sys
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot
import dsjax.train.loop, dsjax.train.cli, dsjax.theory.verify
for line in sys.stdin:
  case = json.loads(line)
  pid = os.fork()
  if pid == 0:
    os.dup2(os.open(case['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.argv = [f"dsjax/{case['tool']}.py", *case['args']]
    status = 0
    try:
      runpy.run_module(f"dsjax.{case['tool']}", run_name='__main__', alter_sys=True)
    except SystemExit as e:
      status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      import traceback
      traceback.print_exc()
      status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  _, wait_status = os.waitpid(pid, 0)
  print(os.waitstatus_to_exitcode(wait_status), flush=True)
"""


@pytest.fixture(scope='module')
def launch():
  launcher = subprocess.Popen(
    [sys.executable, '-c', LAUNCHER],
    cwd=ROOT,
    env=_env(),
    text=True,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
  )

  def run(tool: str, args: list[str], stderr_path: pathlib.Path) -> subprocess.CompletedProcess:
    launcher.stdin.write(json.dumps({'tool': tool, 'args': args, 'stderr': str(stderr_path)}) + '\n')
    launcher.stdin.flush()
    status = int(launcher.stdout.readline())
    return subprocess.CompletedProcess(args, status, '', stderr_path.read_text())

  yield run
  launcher.stdin.close()
  launcher.wait(timeout=60)


def _snapshot(root: pathlib.Path) -> dict[str, tuple[int, int] | None]:
  """Every file (size, mtime) and directory (None) under `root`."""
  out = {}
  for path in sorted(root.rglob('*')):
    stat = path.lstat()
    out[str(path.relative_to(root))] = None if path.is_dir() else (stat.st_size, stat.st_mtime_ns)
  return out


def _make_files(tmp: pathlib.Path):
  for name, text in FILES.items():
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is None:
      path.mkdir(parents=True, exist_ok=True)
    elif isinstance(text, bytes):
      path.write_bytes(text)
    else:
      path.write_text(text)
  (tmp / 'read_only').chmod(0o555)


@pytest.mark.parametrize('tool,args,expected', PARAMS)
def test_user_error_is_one_line_and_writes_nothing(launch, tool, args, expected, tmp_path, tmp_path_factory):
  _make_files(tmp_path)
  before = _snapshot(tmp_path)
  argv = [a.format(tmp=tmp_path) for a in args]
  lock = open(tmp_path / 'locked' / '.dsjax.lock')
  fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    proc = launch(tool, argv, tmp_path_factory.mktemp('stderr') / 'stderr.txt')
  finally:
    (tmp_path / 'read_only').chmod(0o755)  # So that pytest can clean up.
    lock.close()
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode != 0, proc.stderr
  assert 'Traceback' not in proc.stderr, proc.stderr
  assert lines and lines[-1].startswith(f'dsjax.{tool}: error: '), proc.stderr
  assert expected.format(tmp=tmp_path) in lines[-1], lines[-1]
  assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
  'tool', [pytest.param(t, marks=pytest.mark.slow if t in ('moments', 'bench') else ()) for t in TOOLS]
)  # Fresh interpreters: ~5 s each.
def test_help_exits_zero(tool):
  proc = subprocess.run(
    [sys.executable, '-m', f'dsjax.{tool}', '--help'],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert '--' in proc.stdout and 'Traceback' not in proc.stderr
