"""What every command-line tool shares: flag parsing, and user errors reported as one line.

`run(main)` replaces `absl.app.run(main)`. A mistake of the user's — a flag or config override that does
not parse, a config file that is missing or broken, a value a check rejects (`ValueError`), a path that
cannot be read or written (`OSError`), the device running out of memory — ends the program with one line
on stderr, `<program>: error: <what and where>`, and exit status 2, without a traceback (pass `-v 1` to
see it). Anything else is a bug and keeps its traceback. `--help` prints the flags and exits 0.
"""

from __future__ import annotations

import errno
import logging as std_logging
import os
import re
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Callable, Iterator, NoReturn

from absl import app, flags, logging

from dsjax.train import host_memory

USAGE_ERROR = 2
HELP_FLAGS = ('--help', '-help', '-h', '-?', '--helpshort', '-helpshort', '--helpfull', '-helpfull')


class Exit(Exception):
  """A run that ends early on purpose (a non-finite loss, a signal): `message` is printed as one line
  `<program>: <message>` and the program exits with `status`."""

  def __init__(self, message: str, status: int):
    super().__init__(message)
    self.status = status


def program_name() -> str:
  """`dsjax.main` for `python -m dsjax.main`, else the script's name."""
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  return spec.name if spec is not None and spec.name else os.path.basename(sys.argv[0])


def fail(message: str, status: int = USAGE_ERROR) -> NoReturn:
  """Prints `<program>: error: <message>` (one line) to stderr and exits."""
  one_line = ' '.join(part.strip() for part in str(message).splitlines() if part.strip())
  print(f'{program_name()}: error: {one_line}', file=sys.stderr, flush=True)
  after_last_line()
  sys.exit(status)


def check_output_dir(flag: str, path: str | None):
  """A ValueError naming `flag` unless `path` is a directory, or can be created as one, that we may write."""
  if not path:
    raise ValueError(f'{flag} must name an output directory, got {path!r}')
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f'{flag}={path} exists and is not a directory; name a directory (created if missing)')
  existing = os.path.abspath(path)
  while not os.path.lexists(existing):  # The directory that makedirs would create it in.
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f'{flag}={path} cannot be created: {existing} is not a directory')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f'{flag}={path} cannot be written: {existing} is not writable')


# What `create_output_dir` and `create_output_file` created, newest last: `run` removes it again (a file
# only while still empty, a directory only while empty) when the program fails.
_CREATED: list[str] = []


def _cannot(flag: str, path: str, error: OSError) -> ValueError:
  why = error.strerror or str(error)
  if error.errno == errno.ENAMETOOLONG:
    why += ' (at most 255 bytes a name)'
  return ValueError(f'{flag}={path} cannot be created or written: {why}')


def _make_dirs(flag: str, path: str):
  """os.makedirs(path), recording each directory it creates."""
  missing = []
  existing = os.path.abspath(path)
  while not os.path.lexists(existing):
    missing.append(existing)
    existing = os.path.dirname(existing)
  for directory in reversed(missing):
    try:
      os.mkdir(directory)
    except OSError as e:
      raise _cannot(flag, path, e) from None
    _CREATED.append(directory)


def create_output_dir(flag: str, path: str | None):
  """Checks an output directory up front by creating it (and its parents) and a file in it, before the
  work whose results go there; a ValueError naming `flag` if that fails. What it created is removed
  again if the program fails (`run`)."""
  check_output_dir(flag, path)
  _make_dirs(flag, path)
  try:
    descriptor, probe = tempfile.mkstemp(prefix='.dsjax-write-test-', dir=path)
    os.close(descriptor)
    os.remove(probe)
  except OSError as e:
    raise _cannot(flag, path, e) from None


def create_output_file(flag: str, path: str | None):
  """Checks an output file up front by creating it (empty; an existing file is opened for appending, so
  nothing in it changes), and its directory; a ValueError naming `flag` if that fails. What it created
  is removed again if the program fails (`run`)."""
  if not path:
    raise ValueError(f'{flag} must name an output file, got {path!r}')
  if os.path.isdir(path):
    raise ValueError(f'{flag}={path} is a directory; name a file')
  check_output_dir(flag, os.path.dirname(os.path.abspath(path)))
  _make_dirs(flag, os.path.dirname(os.path.abspath(path)))
  existed = os.path.lexists(path)
  try:
    with open(path, 'a'):
      pass
  except OSError as e:
    raise _cannot(flag, path, e) from None
  if not existed:
    _CREATED.append(os.path.abspath(path))


def remove_created_outputs():
  """Removes what `create_output_dir` and `create_output_file` created, if still empty (newest first)."""
  while _CREATED:
    path = _CREATED.pop()
    try:
      if os.path.isfile(path) and not os.path.getsize(path):
        os.remove(path)
      elif os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    except OSError:
      pass  # Best effort: the program is failing for another reason, which its message names.


def _config_override_error(error: BaseException, argv: list[str]) -> str:
  """ml_collections reports a mistyped `--config.a.b=v` as a KeyError/AttributeError naming only the
  last key ('b', "Did you mean ..."); name the whole flag instead."""
  text = ' '.join(str(error).replace('\\n', '\n').replace("\\'", "'").strip('\'"').split())
  missing = re.match(r"'?([\w-]+)'?", text)
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  flag = next(
    (a for a in argv if missing and re.match(rf'--\w+(\.\w+)*\.{missing.group(1)}(\.|=|$)', a)), None
  )
  where = flag.split('=')[0] if flag else 'a config override'
  hint = f' (did you mean "{suggestion.group(1)}"?)' if suggestion else ''
  name = missing.group(1) if missing else text
  return f'{where}: the config has no key {name!r}{hint}'


def _config_path(argv: list[str]) -> str:
  paths = [a.split('=', 1)[1] for a in argv if re.match(r'--\w+=.*\.py$', a)]
  return paths[0] if paths else 'the config file'


def _parse_error_message(error: BaseException, argv: list[str]) -> str:
  if isinstance(error, AttributeError) and 'get_config' in str(error):
    return f'--config: {_config_path(argv)} defines no get_config()'
  if isinstance(error, (KeyError, AttributeError)) and any(re.match(r'--\w+\.\w', a) for a in argv[1:]):
    return _config_override_error(error, argv)
  if (
    isinstance(error, flags.IllegalFlagValueError)
    and 'Flag --config must have a value other than None' in str(error)
    and _config_path(argv) != 'the config file'
  ):
    return (
      f'--config: get_config() of {_config_path(argv)} returned None; it must return the config '
      '(an ml_collections.ConfigDict)'
    )
  if isinstance(error, OSError) and 'Failed loading config file' in str(error):
    reason = str(error).strip().splitlines()[-1].strip()
    return f'--config: cannot load {_config_path(argv)}: {reason}'
  if isinstance(error, SyntaxError):
    return f'--config: {error.filename}, line {error.lineno}: {error.msg}'
  if isinstance(error, (flags.Error, ValueError, TypeError)):
    return str(error)
  return f'--config: get_config() of {_config_path(argv)} raised {type(error).__name__}: {error}'


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with its failures turned into one line (and `--help` exiting 0)."""
  asked = [a.split('=')[0] for a in argv[1:] if a.split('=')[0] in HELP_FLAGS]
  if asked:
    app.usage(shorthelp='helpfull' not in asked[0], writeto_stdout=True)
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    # A flag that does not parse, or an error while loading a config file or applying an override.
    if logging.vlog_is_on(1):
      raise
    fail(_parse_error_message(e, argv))


OUT_OF_MEMORY_ADVICE = (
  'raise microbatches (the same update in smaller pieces), set model.remat, lower '
  'batch_size or data.seq_len, or use more devices (dsjax.bench prints the '
  "compiled step's memory)"
)


def out_of_memory(error: BaseException) -> bool:
  text = str(error)
  return ('RESOURCE_EXHAUSTED' in text or 'Out of memory' in text) and not disk_full(error)


def disk_full(error: BaseException) -> bool:
  """A write that found no space (also as the storage layer's status text, which Orbax passes on)."""
  return any(
    isinstance(e, OSError) and e.errno == errno.ENOSPC or 'No space left on device' in str(e)
    for e in errors_in_chain(error)
  )


def errors_in_chain(error: BaseException | None) -> Iterator[BaseException]:
  """`error` and the exceptions behind it (its cause, or the context it was raised in)."""
  seen = set()
  while error is not None and id(error) not in seen:
    yield error
    seen.add(id(error))
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _os_error_in_chain(error: BaseException) -> OSError | None:
  """An OSError behind `error` (Orbax's background writes re-raise a full disk or a vanished directory
  wrapped in their own exceptions)."""
  return next((e for e in errors_in_chain(error) if isinstance(e, OSError)), None)


def user_error_message(error: BaseException) -> str | None:
  """The one-line message of a user error, or None for a bug (which keeps its traceback)."""
  if disk_full(error) and _os_error_in_chain(error) is None:  # The storage layer's text (TensorStore).
    where = re.search(r'(?:local file|Failed writing:) "([^"]+)"', ' '.join(str(error).split()))
    return (
      f'No space left on device{f" (writing {where.group(1)})" if where else ""}; free space and '
      'rerun the same command: it resumes from the last complete checkpoint'
    )
  if isinstance(error, ValueError) and getattr(error, 'dsjax_user_error', True):
    return str(error)
  error = _os_error_in_chain(error) or error
  if isinstance(error, OSError) and 'Failed loading config file' in str(error):
    return _parse_error_message(error, sys.argv)  # config_flags defers the failure to `.value`.
  if isinstance(error, OSError):
    if error.filename and error.strerror:
      return f'{error.filename}: {error.strerror}'
    return str(error)
  if out_of_memory(error):
    first = str(error).strip().splitlines()[0]
    return f'out of device memory ({first[:300]}); {OUT_OF_MEMORY_ADVICE}'
  return None


# Noise of libraries' background threads when a write fails (a full disk, a damaged checkpoint): Orbax's
# TensorStore callbacks that find their asyncio loop already closed print a traceback each (dozens per
# failure), TensorBoard's writer thread raises OSError once its file is closed. The failure itself
# reaches the main thread and is reported there in one line.
_NOISE = ('Event loop is closed',)


_STORAGE_LAYER = ('/orbax/', '/tensorstore/')


def _is_noise(error: BaseException | None, background: bool = False) -> bool:
  """The asyncio noise above; for a `background` thread or an unraisable exception (e.g. a coroutine of
  a failed restore that nobody awaits any more) also any exception raised in Orbax or TensorStore."""
  if error is None:
    return False
  if any(text in str(error) for text in _NOISE):
    return True
  frames = traceback.extract_tb(error.__traceback__) if background else []
  return any(part in frame.filename for frame in frames for part in _STORAGE_LAYER)


class _BackgroundErrors:
  """Hooks that keep the noise above off stderr (`-v 1` keeps everything): the asyncio noise is
  dropped, a background thread's OSError becomes one warning line, and once the program has printed its
  last line (`after_last_line`) every later background traceback is dropped, so that the last line on
  stderr is dsjax's own."""

  def __init__(self):
    self.last_line_printed = False
    self._reported: set[str] = set()
    self._default_excepthook = sys.excepthook
    self._default_thread_hook = threading.excepthook
    self._default_unraisable = sys.unraisablehook

  def install(self):
    if self._quiet():  # Coroutines of a failed restore that are never awaited, found at garbage collection.
      warnings.filterwarnings('ignore', message=r'coroutine .* was never awaited', category=RuntimeWarning)
    sys.excepthook, threading.excepthook = self._excepthook, self._thread
    sys.unraisablehook = self._unraisable

  def _quiet(self) -> bool:
    return not logging.vlog_is_on(1)

  def _excepthook(self, kind, error, tb):
    # Also what C++ extensions call (PyErr_Print) for an exception in a callback of theirs.
    if not (self._quiet() and (self.last_line_printed or _is_noise(error))):
      self._default_excepthook(kind, error, tb)

  def _thread(self, args):
    if self._quiet() and (self.last_line_printed or _is_noise(args.exc_value, background=True)):
      return
    if self._quiet() and isinstance(args.exc_value, OSError):
      name = args.thread.name if args.thread is not None else 'a background thread'
      if name not in self._reported:
        self._reported.add(name)
        logging.warning('%s stopped: %s', name, user_error_message(args.exc_value))
      return
    self._default_thread_hook(args)

  def _unraisable(self, unraisable):
    if not (self._quiet() and (self.last_line_printed or _is_noise(unraisable.exc_value, background=True))):
      self._default_unraisable(unraisable)


_BACKGROUND = _BackgroundErrors()


def after_last_line():
  """Called once the program's last line is printed: later background tracebacks are dropped."""
  _BACKGROUND.last_line_printed = True


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` with one-line user errors (see the module docstring) and dsjax's progress
  lines (`_progress_logging`), in a process that keeps freed host memory for reuse (`host_memory`:
  before any JAX runtime thread exists)."""
  host_memory.keep_freed_memory()
  _BACKGROUND.install()

  def guarded_main(argv):
    try:
      _progress_logging()
      main(argv)
      _CREATED.clear()
    except BaseException:
      remove_created_outputs()
      raise

  def reporting_main(argv):
    try:
      guarded_main(argv)
    except Exit as e:
      print(f'{program_name()}: {e}', file=sys.stderr, flush=True)
      after_last_line()
      sys.exit(e.status)
    except KeyboardInterrupt:
      fail('interrupted', status=130)
    except Exception as e:  # pylint: disable=broad-except
      message = user_error_message(e)
      if message is None or logging.vlog_is_on(1):
        raise
      fail(message)

  app.run(reporting_main, flags_parser=_quiet_backend_probe(parse_flags))


def _progress_logging() -> None:
  """dsjax's INFO lines on (a higher `-v` is kept: at 1, user errors also keep their traceback), Orbax's
  off: it logs every file it renames or reads at INFO, which would bury the progress lines and precede a
  one-line error."""
  logging.set_verbosity(max(logging.get_verbosity(), logging.INFO))
  logging.get_absl_handler().addFilter(_not_from_orbax)  # the same function is added once
  logging.get_absl_handler().addFilter(_not_storage_noise)


def _not_from_orbax(record: std_logging.LogRecord) -> bool:
  return '/orbax/' not in record.pathname


def _not_storage_noise(record: std_logging.LogRecord) -> bool:
  """Drops asyncio's 'exception was never retrieved' records of Orbax's reads that a failed restore
  left behind (one traceback per array; the failure itself is reported once), unless `-v 1`."""
  error = record.exc_info[1] if record.exc_info else None  # asyncio logs the exception with the record
  return record.name != 'asyncio' or logging.vlog_is_on(1) or not _is_noise(error, background=True)


def _quiet_backend_probe(parse: Callable[[list[str]], list[str]]) -> Callable[[list[str]], list[str]]:
  """`parse` that also silences JAX's INFO lines about the backends it probes and does not find
  ('Unable to initialize backend tpu' on every machine without one), which would otherwise precede a
  one-line error on stderr; `-v 1` keeps them."""

  def parse_and_quiet(argv):
    remaining = parse(argv)
    if not logging.vlog_is_on(1):
      std_logging.getLogger('jax._src.xla_bridge').setLevel(std_logging.WARNING)
    return remaining

  return parse_and_quiet
