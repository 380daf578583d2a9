"""Every command-line tool turns a user's mistake into one line, before it writes anything.

Each case runs the real program (`python -m dsjax.<tool> ...`) and checks: a non-zero exit, a last
stderr line `dsjax.<tool>: error: ...` naming the flag, key, path or value, no traceback, and the
directory holding the case's outputs and workdirs exactly as it was (same files, sizes and mtimes; no
new file or directory). Every case fails before anything is compiled, so each costs about the
program's import time.
"""

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ('main', 'moments', 'export', 'bench', 'sensitivity')

# Files a case starts from, under its temporary directory ({tmp} in the arguments).
FILES = {
    'file': 'not a directory\n',
    'syntax.py': 'def get_config(:\n',
    'no_get_config.py': 'CONFIG = None\n',
    'raises.py': 'def get_config():\n  raise RuntimeError("config is broken on purpose")\n',
    # A training workdir as dsjax.export sees it before restoring: its config and a finished step.
    'run/config.json': json.dumps({'model': {'name': 'gpt', 'block': 'postln'},
                                   'optimizer': {'name': 'adamw'}}),
    'run/checkpoints/2/': None,
    'no_ckpt/config.json': json.dumps({'model': {'name': 'gpt'}, 'optimizer': {'name': 'adamw'}}),
    'bad_json/config.json': '{"model": ',
    'bad_json/checkpoints/2/': None,
    'empty_dir/': None,
    'read_only/': None,  # Made read-only below: only a non-root user is kept from writing there.
    'locked/.dsjax.lock': 'pid 1 on elsewhere',  # Held by the test, as a live run would hold it.
}

MAIN = ['--config=configs/gpt_preln.py', '--workdir={tmp}/w']
MOMENTS = ['--config=configs/gpt_preln.py', '--out={tmp}/out']
EXPORT = ['--workdir={tmp}/run', '--out={tmp}/out']
SENSITIVITY = ['--config=configs/gpt_preln.py', '--out={tmp}/out']

# (id, tool, arguments, a substring the error line must contain).
CASES = [
    # dsjax.main: config file, overrides, flags and workdir, all rejected before training.
    ('main-config-missing', 'main', ['--config={tmp}/missing.py', '--workdir={tmp}/w'], 'missing.py'),
    ('main-config-syntax', 'main', ['--config={tmp}/syntax.py', '--workdir={tmp}/w'], 'syntax.py, line 1'),
    ('main-config-no-get-config', 'main', ['--config={tmp}/no_get_config.py', '--workdir={tmp}/w'],
     'no_get_config.py defines no get_config()'),
    ('main-config-raises', 'main', ['--config={tmp}/raises.py', '--workdir={tmp}/w'], 'broken on purpose'),
    ('main-mistyped-key', 'main', MAIN + ['--config.totl_steps=5'], '--config.totl_steps'),
    ('main-mistyped-nested-key', 'main', MAIN + ['--config.model.detph=4'], '--config.model.detph'),
    ('main-not-an-int', 'main', MAIN + ['--config.total_steps=abc'], 'abc'),
    ('main-unknown-flag', 'main', MAIN + ['--no_such_flag=1'], 'no_such_flag'),
    ('main-missing-config', 'main', ['--workdir={tmp}/w'], '--config'),
    ('main-mesh-shape', 'main', MAIN + ['--config.mesh.shape=abc'], 'mesh.shape'),
    ('main-negative-lr', 'main', MAIN + ['--config.optimizer.lr=-1'], 'lr'),
    ('main-unknown-scheme', 'main', MAIN + ['--config.model.scheme=nope'], "'nope'"),
    ('main-empty-workdir', 'main', ['--config=configs/gpt_preln.py', '--workdir='], '--workdir'),
    ('main-workdir-is-file', 'main', ['--config=configs/gpt_preln.py', '--workdir={tmp}/file'], '{tmp}/file'),
    ('main-workdir-in-use', 'main', ['--config=configs/gpt_preln.py', '--workdir={tmp}/locked'],
     'is in use by a running dsjax run'),
    ('main-unknown-dataset', 'main', MAIN + ['--config.data.name=not_a_dataset'], 'not_a_dataset'),
    # dsjax.moments
    ('moments-zero-batches', 'moments', MOMENTS + ['--batches=0'], '--batches=0'),
    ('moments-negative-batches', 'moments', MOMENTS + ['--batches=-2'], '--batches=-2'),
    ('moments-out-is-file', 'moments', ['--config=configs/gpt_preln.py', '--out={tmp}/file'], '--out={tmp}/file'),
    ('moments-out-under-file', 'moments', ['--config=configs/gpt_preln.py', '--out={tmp}/file/sub'],
     '{tmp}/file is not a directory'),
    ('moments-unknown-theory-form', 'moments', MOMENTS + ['--theory_form=nope'], '--theory_form'),
    ('moments-missing-out', 'moments', ['--config=configs/gpt_preln.py'], '--out'),
    ('moments-checkpoint-missing', 'moments', MOMENTS + ['--checkpoint={tmp}/nowhere'], '{tmp}/nowhere'),
    ('moments-checkpoint-without-checkpoints', 'moments', MOMENTS + ['--checkpoint={tmp}/empty_dir'],
     'holds no checkpoint'),
    ('moments-unknown-scheme', 'moments', MOMENTS + ['--config.model.scheme=nope'], 'model.scheme'),
    ('moments-unknown-dataset', 'moments', MOMENTS + ['--config.data.name=not_a_dataset'], 'not_a_dataset'),
    # dsjax.export
    ('export-workdir-missing', 'export', ['--workdir={tmp}/nowhere', '--out={tmp}/out'], '{tmp}/nowhere'),
    ('export-workdir-is-file', 'export', ['--workdir={tmp}/file', '--out={tmp}/out'], '--workdir={tmp}/file'),
    ('export-workdir-without-config', 'export', ['--workdir={tmp}/empty_dir', '--out={tmp}/out'],
     'no config.json'),
    ('export-workdir-bad-config', 'export', ['--workdir={tmp}/bad_json', '--out={tmp}/out'],
     '{tmp}/bad_json/config.json'),
    ('export-workdir-without-checkpoints', 'export', ['--workdir={tmp}/no_ckpt', '--out={tmp}/out'],
     'holds no checkpoint'),
    ('export-out-is-workdir', 'export', ['--workdir={tmp}/run', '--out={tmp}/run'], '--out={tmp}/run'),
    ('export-out-in-checkpoints', 'export', ['--workdir={tmp}/run', '--out={tmp}/run/checkpoints/x'],
     'would overwrite the run'),
    ('export-out-is-file', 'export', ['--workdir={tmp}/run', '--out={tmp}/file'], '--out={tmp}/file'),
    ('export-zero-rtol', 'export', EXPORT + ['--rtol=0'], '--rtol'),
    ('export-missing-out', 'export', ['--workdir={tmp}/run'], '--out'),
    ('export-missing-workdir', 'export', ['--out={tmp}/out'], '--workdir'),
    # dsjax.bench (writes only to a temporary directory of its own)
    ('bench-zero-steps', 'bench', ['--steps=0'], '--steps=0'),
    ('bench-unknown-scheme', 'bench', ['--config.model.scheme=nope'], 'model.scheme'),
    ('bench-heads-do-not-divide-width', 'bench', ['--config.model.num_heads=5'], 'model.num_heads'),
    # dsjax.sensitivity
    ('sensitivity-zero-draws', 'sensitivity', SENSITIVITY + ['--draws=0'], '--draws=0'),
    ('sensitivity-out-is-file', 'sensitivity', ['--config=configs/gpt_preln.py', '--out={tmp}/file'],
     '--out={tmp}/file'),
    ('sensitivity-missing-config', 'sensitivity', ['--out={tmp}/out'], '--config'),
    ('sensitivity-unknown-block', 'sensitivity', SENSITIVITY + ['--config.model.block=bogus'], 'model.block'),
    ('sensitivity-out-not-writable', 'sensitivity',
     ['--config=configs/gpt_preln.py', '--out={tmp}/read_only/out'], '{tmp}/read_only is not writable'),
]
IS_ROOT = hasattr(os, 'geteuid') and os.geteuid() == 0
# Each case costs a process start (about 3 s of imports on 2 cores); the default suite runs the 33
# that differ most, `-m slow` also runs these variants of them.
SLOW_VARIANTS = ('main-not-an-int', 'moments-negative-batches', 'moments-missing-out',
                 'moments-unknown-scheme', 'moments-unknown-dataset', 'export-out-is-file',
                 'export-missing-out', 'export-missing-workdir', 'bench-unknown-scheme',
                 'sensitivity-out-is-file', 'sensitivity-missing-config', 'sensitivity-unknown-block')
MARKS = {
    'sensitivity-out-not-writable': pytest.mark.skipif(IS_ROOT, reason='permissions do not stop root'),
    **{case: pytest.mark.slow for case in SLOW_VARIANTS},
}
PARAMS = [pytest.param(*case[1:], id=case[0], marks=MARKS.get(case[0], ())) for case in CASES]
assert sum(case[0] not in SLOW_VARIANTS for case in CASES) >= 33


def _env():
  return {**os.environ, 'JAX_PLATFORMS': 'cpu'}


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
    else:
      path.write_text(text)
  (tmp / 'read_only').chmod(0o555)


@pytest.mark.parametrize('tool,args,expected', PARAMS)
def test_user_error_is_one_line_and_writes_nothing(tool, args, expected, tmp_path):
  _make_files(tmp_path)
  before = _snapshot(tmp_path)
  argv = [a.format(tmp=tmp_path) for a in args]
  lock = open(tmp_path / 'locked' / '.dsjax.lock')
  fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    proc = subprocess.run([sys.executable, '-m', f'dsjax.{tool}', *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
  finally:
    (tmp_path / 'read_only').chmod(0o755)  # So that pytest can clean up.
    lock.close()
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode != 0, proc.stderr
  assert 'Traceback' not in proc.stderr, proc.stderr
  assert lines and lines[-1].startswith(f'dsjax.{tool}: error: '), proc.stderr
  assert expected.format(tmp=tmp_path) in lines[-1], lines[-1]
  assert _snapshot(tmp_path) == before


@pytest.mark.parametrize('tool', [pytest.param(t, marks=pytest.mark.slow if t in ('moments', 'bench') else ())
                                  for t in TOOLS])
def test_help_exits_zero(tool):
  proc = subprocess.run([sys.executable, '-m', f'dsjax.{tool}', '--help'], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert '--' in proc.stdout and 'Traceback' not in proc.stderr
