r"""The papers' headline claims at ≥ 20 tokens per non-embedding parameter, on one GPU, resumable.

  python experiments/gpu_decisive.py --out=experiments/results/gpu_decisive --budget_s=400

(a) DSLM at constant N·d² (Kedia et al. 2024, arXiv:2403.09635, Table 4 for BERT, Table 8 for GPT): GPTs
of 4×128, 16×64 and 64×32 (N·d² = 65,536; ~0.8M non-embedding parameters), each with four arms —
vanilla and DSLM, Post-LN and Pre-LN — at 5 peak lrs × 3 seeds.
(b) DNT's 2×2 (Qi et al. 2025, arXiv:2507.17501, Table 1): a 4×128 GPT, Pre-Norm (S1) against DNT (S5),
with AdamW and with mSGDW, at 4 peak lrs × 3 seeds.

Every sweep is a `python -m dsjax.sweep` (docs/sweeps.md) with a 4,096-token BPE tokenizer trained first
(OUT/tokenizer); the configs and the papers' settings they follow are in experiments/configs/gpu_stdlib.py.
Order: the depth sweeps first (4×128, 64×32, 16×64), then DNT's. The corpus is `python_stdlib`, or — so
that a machine with another Python trains on the same text — the library of the Python that packed it
(`experiments/gpu_corpus.py`, then `--data='text:DIR/**/*.py'`: the same documents, splits and hash).

Resumable: every finished (arm, lr) is kept under OUT/<sweep>/ (dsjax.sweep's own resumption), so a
command cut off — or stopped by `--budget_s` before an arm that its sweep's measured speed says would not
fit, later sweeps' arms that fit still trained — continues where it stopped when rerun with the same OUT,
here or on another machine with the same corpus (a tokenizer of another corpus is refused). It prints the
plan (members × tokens of every sweep, model FLOPs) first, then for each arm its measured member-tokens/s
and the projected time of what is left. A sweep that fails (e.g. out of memory) is recorded and the next
one runs. Outputs:
  OUT/plan.json                  parameters, tokens per parameter (embeddings included and not), epochs
  OUT/<sweep>/trained_<arm>.json per call that trained the arm: device kind, jax version, date, commit,
                                 attention implementation and dtype, seconds, member-tokens/s
  OUT/<sweep>/{results.json, summary.md, lr_curves.png, arms/}   dsjax.sweep's outputs
  OUT/summary.md, OUT/decisive.json   the claims' contrasts with 95% intervals (Pocock's level after
                                      seeds were added) and verdicts (for the sweeps finished so far)
More seeds where a verdict's `seeds_to_resolve` asks for them: `--seeds=0,1,2,3,4,5` with
`--only=SWEEP/ARM,...` adds seeds 3–5 at every lr those arms have, leaving the others as they are; a claim
is then judged with each arm's seeds, at Pocock's level for the number of looks (docs/sweeps.md).
`experiments/gpu_decisive_device.sh` is the command for a GPU machine (dependencies from wheels, the
packed corpus, a time limit, the outputs packed for the trip back). `--tiny` runs every sweep at a tiny
size on the CPU (tests/test_gpu_decisive.py).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import types

import jax
import numpy as np
from absl import flags
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs'))
import gpu_stdlib as configs  # noqa: E402  (experiments/configs/gpu_stdlib.py)

from dsjax import data as data_lib  # noqa: E402
from dsjax import sweep  # noqa: E402
from dsjax import tokenizer as tokenizer_cli  # noqa: E402
from dsjax.data import corpus as corpus_lib  # noqa: E402
from dsjax.models import config as model_config  # noqa: E402
from dsjax.models.transformer import REMAT_POLICIES  # noqa: E402
from dsjax.train import cli, protocol  # noqa: E402
from dsjax.train import config as config_lib  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402


def _define_flags():
  # Defined only when run as a program, so that importing this file (tests) defines no absl flags.
  flags.DEFINE_string('out', None, 'Output directory; rerunning with the same one resumes.')
  flags.DEFINE_float(
    'budget_s', 0, 'Stop before an arm that would end later than this many seconds after the start (0: none).'
  )
  flags.DEFINE_list(
    'only',
    [],
    'Train only these sweeps (names as in the plan), or only these arms of a sweep (SWEEP/ARM), in the '
    'plan order; the others are left as they are.',
  )
  flags.DEFINE_string(
    'seeds',
    ','.join(map(str, SEEDS)),
    'Seeds that every lr of the sweeps trained in this call has at least (a sweep that holds more keeps '
    "them): more than a sweep holds adds them at each of its arms' lrs (docs/sweeps.md).",
  )
  flags.DEFINE_boolean('tiny', False, 'Every sweep at a tiny size, for checking the script on a CPU.')
  flags.DEFINE_boolean('plan_only', False, 'Print and write the plan (OUT/plan.json), train nothing.')
  flags.DEFINE_boolean(
    'summarize', False, 'Rewrite OUT/summary.md and OUT/decisive.json from what OUT holds, train nothing.'
  )
  flags.DEFINE_string(
    'data',
    'python_stdlib',
    "The corpus (data.name): 'python_stdlib', or 'text:GLOB' (a packed library, or other text).",
  )
  flags.DEFINE_enum(
    'attention',
    'auto',
    ['auto', 'xla', 'plain', 'cudnn'],
    "model.attention of every sweep ('auto': cuDNN's kernel on a GPU; 'xla' where that fails).",
  )
  flags.DEFINE_enum(
    'remat', 'none', list(REMAT_POLICIES), "model.remat of every sweep (e.g. 'full' where memory runs out)."
  )


DEPTH_ARMS = (
  'vanilla_postln:',
  'dslm_postln:model.scheme=dslm',
  'vanilla_preln:model.block=preln',
  'dslm_preln:model.block=preln,model.scheme=dslm',
)
DNT_ARMS = ('preln:', 'dnt:model.dnt_setting=S5')


@dataclasses.dataclass(frozen=True)
class Plan:
  name: str
  config_arg: str  # experiments/configs/gpu_stdlib.py's argument
  arms: tuple[str, ...]
  lrs: tuple[float, ...]
  baseline: str


# Five lrs for the depth study (the DSLM paper searches lrs per model, deeper models wanting larger ones;
# an extension beyond an edge is a population of its own, compiled again); DNT's grids are centred on the
# CPU runs' optima (experiments/README.md §1).
DEPTH_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
PLANS = (
  Plan('depth_4x128', 'depth,4x128', DEPTH_ARMS, DEPTH_LRS, 'vanilla_postln'),
  Plan('depth_64x32', 'depth,64x32', DEPTH_ARMS, DEPTH_LRS, 'vanilla_postln'),
  Plan('depth_16x64', 'depth,16x64', DEPTH_ARMS, DEPTH_LRS, 'vanilla_postln'),
  Plan('dnt_adamw', 'dnt,adamw', DNT_ARMS, (1e-3, 3e-3, 1e-2, 3e-2), 'preln'),
  Plan('dnt_msgdw', 'dnt,msgdw', DNT_ARMS, (0.03, 0.1, 0.3, 1.0), 'preln'),
)
MAX_EXTEND = 2
ESTIMATE_MARGIN = 1.3  # an arm's projected time × this must fit what is left of the budget
SEEDS = (0, 1, 2)
TINY = {'depth': 3, 'width': 32, 'heads': 2, 'steps': 4, 'batch': 4, 'seq_len': 32, 'vocab': 300}


def tiny(config):
  """The config at a tiny size: the same arms and settings, a few steps of a 3×32 model (6×32 for the
  deeper shapes; DSLM needs N > 2 at its k = 2)."""
  c = copy.deepcopy(config)
  deep = c.model.depth > 4  # keep a deeper and a shallower shape apart
  c.model.depth, c.model.width, c.model.num_heads = TINY['depth'] * (2 if deep else 1), TINY['width'], 2
  c.total_steps = c.eval_every = c.checkpoint_every = TINY['steps']
  c.log_every = 2
  c.data.seq_len, c.batch_size, c.eval_batch_size = TINY['seq_len'], TINY['batch'], 64
  c.optimizer.warmup_steps = 1
  return c


def base_config(plan: Plan, data_name: str, tokenizer: str, is_tiny: bool, attention='auto', remat='none'):
  c = configs.get_config(plan.config_arg)
  c.data.name, c.data.tokenizer = data_name, tokenizer
  c.model.attention, c.model.remat = attention, remat
  return tiny(c) if is_tiny else c


# ------------------------------------------------------------------------------------------------
# What was run where: the machine, the code, the date.
# ------------------------------------------------------------------------------------------------


def machine() -> dict:
  device = jax.devices()[0]
  return {
    'device_kind': device.device_kind,
    'platform': device.platform,
    'num_devices': jax.device_count(),
    'jax': jax.__version__,
    'python': platform.python_version(),
    'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    # The caller names the commit it sent in DSJAX_COMMIT (experiments/gpu_decisive_device.sh): a copy
    # of the working tree may lack .git, or carry a .git whose HEAD is another commit than its files.
    'commit': os.environ.get('DSJAX_COMMIT') or source_commit() or 'unknown',
    'checkout_head': source_commit(),
  }


def source_commit() -> str | None:
  """The checkout's commit ('+dirty' with uncommitted changes to tracked files), or None without git."""
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
  try:
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=root, capture_output=True, text=True, check=True)
    dirty = subprocess.run(['git', 'status', '--porcelain', '-uno'], cwd=root, capture_output=True, text=True)
  except (OSError, subprocess.CalledProcessError):
    return None
  return head.stdout.strip() + ('+dirty' if dirty.stdout.strip() else '')


def write_json(path: str, value) -> None:
  sweep.write_atomically(path, json.dumps(value, indent=1, default=float))


def read_json(path: str):
  with open(path) as f:
    return json.load(f)


# ------------------------------------------------------------------------------------------------
# The tokenizer and the plan's sizes.
# ------------------------------------------------------------------------------------------------


def ensure_tokenizer(out: str, data_name: str, vocab_size: int) -> str:
  """OUT/tokenizer/tokenizer.json, trained on this machine's corpus unless there already; one trained on
  another corpus (for python_stdlib: another Python's standard library) is refused."""
  directory = os.path.join(out, 'tokenizer')
  path = os.path.join(directory, tokenizer_cli.TOKENIZER_FILE)
  corpus = corpus_lib.open_corpus(data_name, 'text')
  if os.path.exists(path):
    info = read_json(os.path.join(directory, tokenizer_cli.INFO_FILE))
    if info['corpus_sha256'] != corpus.identity:
      raise ValueError(
        f'--out={out} holds a tokenizer of another {data_name} corpus (trained under Python '
        f'{info.get("python", "?")}, this is {platform.python_version()}); resume where the corpus is the '
        'same, or name another --out'
      )
    return path
  info = tokenizer_cli.train(data_name, vocab_size, directory)
  write_json(os.path.join(directory, tokenizer_cli.INFO_FILE), dict(info, python=platform.python_version()))
  return path


EMBEDDING_TABLES = ('token_embed', 'pos_embedding')


def non_embedding_params(model) -> int:
  """Parameters outside the embedding tables (the token table, tied, is also the output layer)."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  return sum(
    math.prod(leaf.shape)
    for path, leaf in flat
    if not any(getattr(k, 'key', None) in EMBEDDING_TABLES for k in path)
  )


def param_counts(config) -> dict[str, int]:
  """Parameters of the model `config` builds: all, those outside the embedding tables, and the vocabulary."""
  if not config.model.tie_embeddings:
    raise ValueError('the GPU experiments count parameters of tied embeddings (model.tie_embeddings=True)')
  info = data_lib.dataset_info(config_lib.validate_config(config, num_devices=1).data)
  model = state_lib.make_setup(config, info).abstract_model
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {'params': total, 'non_embedding_params': non_embedding_params(model), 'vocab_size': info.vocab_size}


def train_tokens(config) -> int:
  return len(split_tokens(config, 'train'))


def split_tokens(config, split: str):
  data = config_lib.validate_config(config, num_devices=1).data
  pipeline = data_lib.make_pipeline(
    data, split=split, global_batch_size=1, process_index=0, process_count=1, train=split == 'train'
  )
  return pipeline.stream


def train_log_frequencies(config, vocab: int) -> np.ndarray:
  """The train split's token log-frequencies, add-one smoothed."""
  counts = np.bincount(np.asarray(split_tokens(config, 'train')), minlength=vocab) + 1.0
  return np.log(counts / counts.sum())


def unigram_losses(config, vocab: int) -> dict[str, float]:
  """The loss of predicting every token from the train split's token frequencies (add-one smoothed), on
  the validation and test splits: a model at this loss has learnt nothing beyond the frequencies."""
  log_p = train_log_frequencies(config, vocab)
  return {
    split: float(-log_p[np.asarray(split_tokens(config, split))].mean()) for split in ('validation', 'test')
  }


def flops_per_token(config, counts) -> float:
  """Training FLOPs per token: 6 per matmul parameter (norm gains and biases counted too, a rounding
  error), the tied output layer included, and the attention's 12·N·d·L (PaLM's count, arXiv:2204.02311
  App. B, as `dsjax.bench` counts)."""
  m = config.model
  head = m.width * counts['vocab_size']
  return 6 * (counts['non_embedding_params'] + head) + 12 * m.depth * m.width * config.data.seq_len


def sizes(
  plan: Plan, config, corpus_tokens: int, seeds: list[int], seeds_of_arm: dict[str, list[int]]
) -> dict:
  """The sweep's sizes; `seeds`: the sweep's, `seeds_of_arm`: the seeds each arm holds once this call is
  done, or will be trained with if it has not started (an arm that --only leaves alone keeps its seeds)."""
  counts = param_counts(config)
  tokens = config.total_steps * config.batch_size * config.data.seq_len
  members_of_arm = {arm: len(plan.lrs) * len(s) for arm, s in seeds_of_arm.items()}
  per_token = flops_per_token(config, counts)
  return {
    'sweep': plan.name,
    'depth': config.model.depth,
    'width': config.model.width,
    'heads': config.model.num_heads,
    'steps': config.total_steps,
    'tokens_per_member': tokens,
    **counts,
    'tokens_per_param': tokens / counts['params'],
    'tokens_per_non_embedding_param': tokens / counts['non_embedding_params'],
    'epochs': tokens / corpus_tokens,
    'arms': len(plan.arms),
    'seeds': list(seeds),
    'members_per_arm': members_of_arm,
    'flops_per_token': per_token,
    'flops': per_token * tokens * sum(members_of_arm.values()),
  }


def seeds_of_arms(
  out: str, plan: Plan, seeds: list[int], trained_now: set[str] | None
) -> dict[str, list[int]]:
  """The seeds each arm holds once this call is done: the sweep's `seeds` for an arm trained now
  (`trained_now`; None: all) or not yet started, the seeds it has trained for any other."""
  held = {}
  for arm in [a.split(':')[0] for a in plan.arms]:
    trained = sorted({seed for _, seed in trained_members(os.path.join(out, plan.name), arm)})
    now = trained_now is None or arm in trained_now
    held[arm] = list(seeds) if now or not trained else trained
  return held


def members_text(members_of_arm: dict[str, int]) -> str:
  """ "4 × 15" when every arm has as many members, "(15 + 15 + 30 + 30)" when --only grew some."""
  counts = list(members_of_arm.values())
  if len(set(counts)) == 1:
    return f'{len(counts)} × {counts[0]}'
  return '(' + ' + '.join(str(c) for c in counts) + ')'


def plan_table(rows: list[dict]) -> list[str]:
  """The sizes of every sweep as a Markdown table (printed first, and the summary's first table)."""
  lines = [
    '| sweep | N×d | steps | params (non-emb.) | tokens/param (non-emb.) | epochs | members | PFLOP |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
      f'| {r["sweep"]} | {r["depth"]}×{r["width"]} | {r["steps"]} | {r["params"] / 1e6:.2f}M '
      f'({r["non_embedding_params"] / 1e6:.2f}M) | {r["tokens_per_param"]:.1f} '
      f'({r["tokens_per_non_embedding_param"]:.1f}) | {r["epochs"]:.2f} | '
      f'{members_text(r["members_per_arm"])} × {r["tokens_per_member"] / 1e6:.1f}M tokens | '
      f'{r["flops"] / 1e15:.1f} |'
    )
  return lines


# ------------------------------------------------------------------------------------------------
# Running the sweeps within the budget.
# ------------------------------------------------------------------------------------------------


class Clock:
  """The budget, and the measured speed of the arms trained on this kind of device (model FLOP/s,
  compilation and evaluation included), by sweep — in this call, and in earlier calls as their
  `trained_<arm>.json` recorded it. An arm's time is projected from its own sweep's slowest arm, else
  from the slowest arm of a sweep of the same model shape, else from the slowest arm of any sweep, times
  `ESTIMATE_MARGIN`; with no arm measured yet, it is unknown. Once an arm did not fit (`stopped`), the
  later sweeps' arms that do fit still run, so that the end of a window is not left idle."""

  def __init__(self, budget_s: float, device_kind: str, shapes: dict[str, tuple[int, int]]):
    self.start, self.budget_s, self.device_kind = time.time(), budget_s, device_kind
    self.shapes = shapes  # sweep -> (depth, width): sweeps of one shape train at about one speed
    self.stopped = False
    self.rates: dict[str, list[float]] = {}
    self.remaining: dict[tuple[str, str], float] = {}  # (sweep, arm) -> model FLOPs still to train

  def load(self, out: str) -> None:
    for plan in PLANS:
      for record in trained_records(os.path.join(out, plan.name)):
        if record['device_kind'] == self.device_kind:
          self.add(plan.name, record['model_tflops_per_s'] * 1e12)

  def add(self, sweep_name: str, rate: float) -> None:
    self.rates.setdefault(sweep_name, []).append(rate)

  def left(self) -> float:
    return self.budget_s - (time.time() - self.start) if self.budget_s else math.inf

  def estimate(self, sweep_name: str, flops: float) -> float | None:
    same_shape = [
      r for name, rs in self.rates.items() if self.shapes[name] == self.shapes[sweep_name] for r in rs
    ]
    rates = same_shape or [r for rs in self.rates.values() for r in rs]
    return ESTIMATE_MARGIN * flops / min(rates) if rates else None

  def projection(self) -> str:
    times = [self.estimate(name, flops) for (name, _), flops in self.remaining.items()]
    if not times:
      return 'nothing left to train'
    known = sum(t for t in times if t is not None)
    unknown = sum(t is None for t in times)
    left = f'{self.left():.0f}s of the budget' if self.budget_s else 'no budget'
    return (
      f'left: {len(times)} arms, ~{known:.0f}s at the measured speeds'
      + (f' (+{unknown} of unknown speed)' if unknown else '')
      + f'; {left}'
    )


def last_window(out: str) -> dict | None:
  """The machine record of the latest call that trained an arm (None before any)."""
  records = [r for p in PLANS for r in trained_records(os.path.join(out, p.name))]
  return max(records, key=lambda r: r['date']) if records else None


def trained_records(sweep_dir: str) -> list[dict]:
  records = []
  for name in sorted(os.listdir(sweep_dir)) if os.path.isdir(sweep_dir) else []:
    if name.startswith('trained_') and name.endswith('.json'):
      records += read_json(os.path.join(sweep_dir, name))
  return records


def recorded_seeds(out: str, plan: Plan) -> list[int]:
  """The seeds of the sweep in OUT/<sweep>/sweep.json ([] before it started)."""
  return (sweep.recorded_sweep(os.path.join(out, plan.name)) or {}).get('seeds', [])


def parse_only(only: list[str]) -> dict[str, set[str] | None]:
  """--only as {sweep: the arms to train (None: all)}; every sweep with None when it is empty."""
  arms_of = {p.name: [a.split(':')[0] for a in p.arms] for p in PLANS}
  chosen: dict[str, set[str] | None] = {} if only else dict.fromkeys(arms_of)
  unknown = []
  for entry in only:
    name, _, arm = entry.partition('/')
    if name not in arms_of or (arm and arm not in arms_of[name]):
      unknown.append(entry)
    elif not arm:
      chosen[name] = None
    elif chosen.get(name, set()) is not None:
      chosen[name] = chosen.get(name, set()) | {arm}
  if unknown:
    choices = ', '.join(f'{n} ({"/".join(a)})' for n, a in arms_of.items())
    raise ValueError(f'--only: {unknown} are not sweeps (or SWEEP/ARM) of the plan; choose from {choices}')
  return chosen


def sweep_plan(plan: Plan, config, out: str, max_extend: int, seeds) -> sweep.Plan:
  args = types.SimpleNamespace(
    config=config,
    lrs=','.join(map(str, plan.lrs)),
    seeds=','.join(map(str, seeds)),
    arm=list(plan.arms),
    baseline=plan.baseline,
    out=os.path.join(out, plan.name),
    max_extend=max_extend,
    max_members=0,
    refine_ratio=0.0,  # The plan's grids as run on the first windows; no refinement.
    train_split=None,
    select_split=None,
    report_split=None,
  )
  checked = sweep.check(args)
  command = f'python experiments/gpu_decisive.py --out={out}  (sweep {plan.name})'
  return dataclasses.replace(checked, command=command)


def arm_flops_left(checked: sweep.Plan, arm: str, size: dict) -> float:
  """The model FLOPs of the arm's members not yet trained: its grid's lrs not trained, with every seed,
  and the seeds added since its trained lrs were (extensions not counted until the protocol asks)."""
  records = sweep.finished_lrs(checked.out, arm)
  members = len(checked.seeds) * sum(lr not in records for lr in checked.lrs)
  members += sum(len(sweep.missing_seeds(r, checked.seeds)) for r in records.values())
  return members * size['tokens_per_member'] * size['flops_per_token']


def trained_members(out: str, arm: str) -> set[tuple[float, int]]:
  return {(lr, m['seed']) for lr, r in sweep.finished_lrs(out, arm).items() for m in r['members']}


def run_sweep(
  checked: sweep.Plan, size: dict, clock: Clock, where: dict, train_arms: set[str] | None
) -> bool:
  """Runs the sweep's unfinished arms (those of `train_arms`; None: all) while they fit the budget; True
  when every arm has finished."""
  name_of_sweep = size['sweep']
  started: dict[str, tuple[float, set]] = {}  # arm -> (start time, (lr, seed) trained before)

  def stop_before(arm) -> bool:
    for name in [n for n in started if n != arm.name]:  # the arm before this one has just finished
      finish_arm(name)
    if sweep.arm_finished(checked.out, arm.name, checked.lrs, checked.seeds, checked.max_extend):
      return False  # finished in an earlier call: nothing to train
    need, left = clock.estimate(name_of_sweep, arm_flops_left(checked, arm.name, size)), clock.left()
    if (need is None and clock.stopped) or (need is not None and need > left):
      need_s = 'speed not measured' if need is None else f'needs ~{need:.0f}s'
      print(f'{name_of_sweep}/{arm.name}: {need_s}, {left:.0f}s left: stopping here', flush=True)
      clock.stopped = True
      return True
    started[arm.name] = (time.time(), trained_members(checked.out, arm.name))
    guess = f'~{need:.0f}s' if need is not None else 'speed not measured yet'
    print(f'{name_of_sweep}/{arm.name}: training ({guess})', flush=True)
    return False

  def finish_arm(name: str) -> None:
    start, before = started.pop(name)
    seconds = time.time() - start
    new = trained_members(checked.out, name) - before  # added seeds and extensions too
    member_tokens = size['tokens_per_member'] * len(new)
    flops = size['flops_per_token'] * member_tokens
    clock.add(name_of_sweep, flops / seconds)
    clock.remaining.pop((name_of_sweep, name), None)
    record = dict(
      where,
      sweep=name_of_sweep,
      arm=name,
      lrs_trained=sorted({lr for lr, _ in new}),
      seeds_trained=sorted({seed for _, seed in new}),
      seconds=seconds,
      member_tokens=member_tokens,
      tokens_per_s=member_tokens / seconds,
      model_tflops_per_s=flops / seconds / 1e12,
    )
    path = os.path.join(checked.out, f'trained_{name}.json')
    write_json(path, (read_json(path) if os.path.exists(path) else []) + [record])  # one per call
    print(
      f'{name_of_sweep}/{name}: {seconds:.0f}s, {member_tokens / seconds:,.0f} member-tokens/s '
      f'({flops / seconds / 1e12:.3g} model TFLOP/s, compilation and evaluation included); '
      + clock.projection(),
      flush=True,
    )

  sweep.run(checked, stop_before=stop_before, train_arms=train_arms)
  for name in list(started):
    finish_arm(name)
  return all(
    sweep.arm_finished(checked.out, a.name, checked.lrs, checked.seeds, checked.max_extend)
    for a in checked.arms
    if train_arms is None or a.name in train_arms
  )


# ------------------------------------------------------------------------------------------------
# The claims: contrasts across arms and sweeps, with the verdict rule of experiments/README.md.
# ------------------------------------------------------------------------------------------------


def verdict(interval: dict, paper_sign: int) -> str:
  """'reproduced' when the interval excludes zero in the paper's direction (paper_sign: the sign
  of the paper's difference), 'not reproduced' when it excludes zero the other way, else 'not resolved'."""
  low, high = interval['low'], interval['high']
  if not (math.isfinite(low) and math.isfinite(high)):
    return 'not resolved'
  if (paper_sign < 0 and high < 0) or (paper_sign > 0 and low > 0):
    return 'reproduced'
  if (paper_sign < 0 and low > 0) or (paper_sign > 0 and high < 0):
    return 'not reproduced'
  return 'not resolved'


def arm_at_most_seeds(c: sweep.Plan, arm) -> dict | None:
  """The arm's result at the largest set of seeds at which it has finished (None: at none), so that an
  arm whose added seeds are still being trained is judged at the seeds it had — and an arm holding more
  seeds than another is compared with all of them (Welch's interval takes unequal n). With it, `looks`:
  how many times its comparisons have been looked at (1 + the earlier seed sets it has grown from)."""
  records = sweep.finished_lrs(c.out, arm.name)
  earlier = (sweep.recorded_sweep(c.out) or {}).get('earlier_seeds', [])
  # The seed sets its records hold, and the sweep's earlier ones (an arm whose added seeds reached every
  # lr, then sent the best lr to an edge whose extension was cut off, is finished at the earlier seeds).
  candidates = {tuple(sorted(m['seed'] for m in r['members'])) for r in records.values()}
  candidates |= {tuple(sorted(e)) for e in earlier}
  for seeds in sorted(candidates, key=len, reverse=True):
    if sweep.arm_finished(c.out, arm.name, c.lrs, seeds, c.max_extend):
      looks = 1 + sum(set(e) < set(seeds) for e in earlier)
      return dict(sweep.arm_result(arm, sweep.at_seeds(records, seeds)), looks=looks)
  return None


def load_results(out: str, checked: dict[str, sweep.Plan]) -> dict[str, dict]:
  """Every finished arm's result by sweep, from its records (also in a sweep cut off, so that a claim
  whose arms are all in is judged before its sweep ends)."""
  found = {}
  for plan in PLANS:
    c = checked[plan.name]
    arms = {a.name: arm_at_most_seeds(c, a) for a in c.arms}
    if any(arms.values()):
      found[plan.name] = {name: arm for name, arm in arms.items() if arm is not None}
  return found


# (label, [(weight, sweep, arm)], paper's sign of the loss difference, source in the paper)
DEPTHS = ('4x128', '16x64', '64x32')
CLAIMS = [
  *[
    (
      f'DSLM − vanilla, {ln}, {shape}',
      [(1, f'depth_{shape}', f'dslm_{ln}'), (-1, f'depth_{shape}', f'vanilla_{ln}')],
      -1,
      'DSLM Tables 4, 5, 8',
    )
    for ln in ('postln', 'preln')
    for shape in DEPTHS
  ],
  *[
    (
      f'deeper DSLM − 4×128 vanilla, {ln}, {shape}',
      [(1, f'depth_{shape}', f'dslm_{ln}'), (-1, 'depth_4x128', f'vanilla_{ln}')],
      -1,
      'DSLM Tables 4, 8 (deeper-narrower at constant N·d²)',
    )
    for ln in ('postln', 'preln')
    for shape in DEPTHS[1:]
  ],
  ('DNT − Pre-LN, AdamW', [(1, 'dnt_adamw', 'dnt'), (-1, 'dnt_adamw', 'preln')], -1, 'DNT Table 1'),
  ('DNT − Pre-LN, mSGDW', [(1, 'dnt_msgdw', 'dnt'), (-1, 'dnt_msgdw', 'preln')], -1, 'DNT Table 1'),
  (
    'mSGDW penalty (mSGDW − AdamW), Pre-LN',
    [(1, 'dnt_msgdw', 'preln'), (-1, 'dnt_adamw', 'preln')],
    1,
    'DNT Table 1 (the standard transformer loses with mSGDW)',
  ),
  (
    'mSGDW penalty (mSGDW − AdamW), DNT',
    [(1, 'dnt_msgdw', 'dnt'), (-1, 'dnt_adamw', 'dnt')],
    0,
    'DNT Table 1',
  ),
  (
    "DNT's penalty − Pre-LN's penalty",
    [
      (1, 'dnt_msgdw', 'dnt'),
      (-1, 'dnt_adamw', 'dnt'),
      (-1, 'dnt_msgdw', 'preln'),
      (1, 'dnt_adamw', 'preln'),
    ],
    -1,
    'DNT Table 1 (DNT trains with mSGDW as with AdamW)',
  ),
]


def diverged_at_selected_lr(arm: dict) -> int:
  return sum(m['diverged'] for m in arm['members'] if m['lr'] == arm['selected_lr'])


def claim_rows(results: dict[str, dict]) -> list[dict]:
  """Each claim whose arms have all finished: the contrast with its 95% interval (Pocock's level where
  seeds were added after a look) and the verdict. An arm whose lr is UNSETTLED, or with diverged seeds
  at its selected lr (reported from their last finite state), is named beside the verdict."""
  rows = []
  for label, terms, sign, source in CLAIMS:
    arms = [results.get(s, {}).get(a) for _, s, a in terms]
    if any(a is None for a in arms):
      continue
    groups = [a['report']['eval/loss']['values'] for a in arms]
    weights = [w for w, _, _ in terms]
    looks = max(a.get('looks', 1) for a in arms)  # seeds added after a look: Pocock's level
    level = protocol.interval_level(looks)
    interval = protocol.contrast_interval(groups, weights, level)
    if interval is None:  # fewer than two seeds
      continue
    # The seeds that would resolve a difference; for a claim that the difference is about 0, none.
    interval['seeds_to_resolve'] = protocol.seeds_to_resolve(groups, weights, level) if sign else None
    if sign == 0:  # a difference the paper says is about 0 (DNT's mSGDW penalty)
      finite = math.isfinite(interval['low']) and math.isfinite(interval['high'])
      judged = (
        'not resolved'
        if not finite
        else 'consistent with 0'
        if interval['low'] <= 0 <= interval['high']
        else 'not 0'
      )
    else:
      judged = verdict(interval, sign)
    names = [f'{s}/{a}' for _, s, a in terms]
    seeds = {n: len(g) for n, g in zip(names, groups)}
    unsettled = [n for n, arm in zip(names, arms) if not arm['settled']]
    diverged = {
      n: diverged_at_selected_lr(arm) for n, arm in zip(names, arms) if diverged_at_selected_lr(arm)
    }
    rows.append(
      dict(
        label=label,
        source=source,
        seeds_per_arm=seeds,
        looks=looks,
        level=level,
        unsettled=unsettled,
        diverged=diverged,
        verdict=judged,
        **interval,
      )
    )
  return rows


UNIGRAM_MARGIN = 0.02  # a member not this far below the unigram loss on validation learnt no more


def not_below_unigram(member: dict, unigram_validation: float) -> bool:
  return not member['diverged'] and member['select']['eval/loss'] > unigram_validation - UNIGRAM_MARGIN


def arm_rows(
  results: dict[str, dict], sizes_by_sweep: dict[str, dict], unigram: dict[str, float]
) -> list[dict]:
  rows = []
  for name, arms in results.items():
    for arm in arms.values():
      chosen = [m for m in arm['members'] if m['lr'] == arm['selected_lr']]
      steps = sizes_by_sweep[name]['steps']
      by_lr = {f'{lr:.3g}': [m for m in arm['members'] if m['lr'] == lr] for lr in arm['lrs']}
      diverged = {lr: sum(m['diverged'] for m in ms) for lr, ms in by_lr.items()}
      not_below = {
        lr: sum(not_below_unigram(m, unigram['validation']) for m in ms) for lr, ms in by_lr.items()
      }
      rows.append(
        {
          'sweep': name,
          'arm': arm['name'],
          'selected_lr': arm['selected_lr'],
          'settled': arm['settled'],
          'report': arm['report']['eval/loss'],
          'diverged_by_lr': diverged,
          'not_below_unigram_by_lr': not_below,
          'clipped_fraction': [m.get('clipped_steps', 0) / steps for m in chosen],
        }
      )
  return rows


def summary_markdown(plan_rows, arms, claims, where, unigram) -> str:
  lines = [
    '# GPU experiments: DSLM at constant N·d², DNT 2×2',
    '',
    f'Machine of the last window: {where["device_kind"]}, jax {where["jax"]}, Python {where["python"]}, '
    f"{where['date']}, commit {where['commit']} (each arm's own: `<sweep>/trained_<arm>.json`).",
    '',
    *plan_table(plan_rows),
  ]
  lines += [
    '',
    '## Arms: test-split eval loss at the lr selected on validation',
    '',
    f"The unigram loss (every token predicted from the train split's token frequencies) is "
    f'{unigram["validation"]:.4f} on validation and {unigram["test"]:.4f} on test; a seed not '
    f'{UNIGRAM_MARGIN} below it on validation has learnt no more than the frequencies.',
    '',
    '| sweep | arm | lr | mean ± sd (min–max), n | diverged seeds by lr | seeds not below unigram, by lr | '
    'clipped steps (fraction) |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in arms:
    s = r['report']
    lr = f'{r["selected_lr"]:.3g}' + ('' if r['settled'] else ' UNSETTLED')
    div = ', '.join(f'{k}: {v}' for k, v in r['diverged_by_lr'].items())
    not_below = ', '.join(f'{k}: {v}' for k, v in r['not_below_unigram_by_lr'].items())
    clip = ', '.join(f'{x:.2f}' for x in r['clipped_fraction'])
    spread = f'{s["mean"]:.4f} ± {s["sd"]:.4f} ({s["min"]:.4f}–{s["max"]:.4f}), {s["n"]}'
    lines.append(f'| {r["sweep"]} | {r["arm"]} | {lr} | {spread} | {div} | {not_below} | {clip} |')
  lines += [
    '',
    '## Claims: differences of mean test loss with 95% Welch–Satterthwaite intervals',
    '',
  ]
  if any(c.get('looks', 1) > 1 for c in claims):
    lines += [
      "A claim whose seeds were added after an earlier look is judged at Pocock's level for its number "
      'of looks, named beside its verdict (`dsjax.train.protocol.interval_level`).',
      '',
    ]
  lines += [
    '| contrast | paper | difference [95% CI] | verdict | seeds per arm to resolve |',
    '|---|---|---|---|---|',
  ]
  for c in claims:
    notes = [f'UNSETTLED: {", ".join(c["unsettled"])}'] if c['unsettled'] else []
    notes += [f'diverged seeds at the selected lr: {n} of {k}' for k, n in c['diverged'].items()]
    if c.get('looks', 1) > 1:
      notes.append(f'{c["looks"]} looks: a {100 * c["level"]:.4g}% interval')
    if len(set(c['seeds_per_arm'].values())) > 1:
      notes.append('seeds: ' + ', '.join(f'{n} in {k}' for k, n in c['seeds_per_arm'].items()))
    note = f' ({"; ".join(notes)})' if notes else ''
    lines.append(
      f'| {c["label"]} | {c["source"]} | {c["difference"]:+.4f} [{c["low"]:+.4f}, {c["high"]:+.4f}] | '
      f'{c["verdict"]}{note} | {c.get("seeds_to_resolve") or "–"} |'
    )
  return '\n'.join(lines) + '\n'


# ------------------------------------------------------------------------------------------------


def main(argv):
  del argv
  args = flags.FLAGS
  out = args.out
  if not out:
    raise ValueError('--out: the output directory is required')
  only = parse_only(args.only)
  seeds = sweep.parse_seeds(args.seeds)
  if args.budget_s < 0:
    raise ValueError(f'--budget_s must be >= 0, got {args.budget_s}')
  cli.check_output_dir('--out', out)
  to_train = [p for p in PLANS if p.name in only]
  # A sweep trained now has the seeds it holds and --seeds; one left as it is, the seeds it holds.
  seeds_of = {
    p.name: sorted(set(recorded_seeds(out, p)) | set(seeds)) if p in to_train else recorded_seeds(out, p)
    for p in PLANS
  }
  seeds_of = {name: s or list(SEEDS) for name, s in seeds_of.items()}
  where = machine()
  print(
    f'{where["device_kind"]} ({where["platform"]}), jax {where["jax"]}, commit {where["commit"]}', flush=True
  )

  cli.create_output_dir('--out', out)
  vocab = TINY['vocab'] if args.tiny else configs.VOCAB_SIZE
  tokenizer = ensure_tokenizer(out, args.data, vocab)
  config_of = {
    p.name: base_config(p, args.data, tokenizer, args.tiny, args.attention, args.remat) for p in PLANS
  }
  corpus_tokens = train_tokens(config_of[PLANS[0].name])
  plan_rows = [
    sizes(
      p,
      config_of[p.name],
      corpus_tokens,
      seeds_of[p.name],
      seeds_of_arms(out, p, seeds_of[p.name], only[p.name] if p in to_train else set()),
    )
    for p in PLANS
  ]
  print(f'train split: {corpus_tokens:,} tokens', flush=True)
  print('\n'.join(plan_table(plan_rows)), flush=True)
  unigram = unigram_losses(config_of[PLANS[0].name], plan_rows[0]['vocab_size'])
  print(f'unigram loss: validation {unigram["validation"]:.4f}, test {unigram["test"]:.4f}', flush=True)
  plan_json = {'train_tokens': corpus_tokens, 'unigram_loss': unigram, 'sweeps': plan_rows}
  write_json(os.path.join(out, 'plan.json'), plan_json)
  sizes_by_sweep = {r['sweep']: r for r in plan_rows}
  if args.plan_only:
    return

  max_extend = 0 if args.tiny else MAX_EXTEND
  checked = {  # all, first
    p.name: sweep_plan(p, config_of[p.name], out, max_extend, seeds_of[p.name]) for p in PLANS
  }
  for p in [] if args.summarize else to_train:
    sweep.check_resumable(checked[p.name])
  shapes = {r['sweep']: (r['depth'], r['width']) for r in plan_rows}
  clock = Clock(args.budget_s, where['device_kind'], shapes)
  clock.load(out)
  for p in to_train:
    c = checked[p.name]
    for arm in c.arms:
      wanted = only[p.name] is None or arm.name in only[p.name]
      if wanted and not sweep.arm_finished(c.out, arm.name, c.lrs, c.seeds, max_extend):
        clock.remaining[(p.name, arm.name)] = arm_flops_left(c, arm.name, sizes_by_sweep[p.name])
  print(clock.projection(), flush=True)

  stopped, failures = False, []
  for p in [] if args.summarize else to_train:
    try:
      machine_here = sweep_machine(where, config_of[p.name])
      finished = run_sweep(checked[p.name], sizes_by_sweep[p.name], clock, machine_here, only[p.name])
    except Exception as e:  # noqa: BLE001  (one sweep's failure, e.g. out of memory, must not cost the others)
      failures.append(dict(where, sweep=p.name, error=f'{type(e).__name__}: {e}'[:4000]))
      print(f'{p.name}: FAILED, going on with the next sweep: {failures[-1]["error"][:500]}', flush=True)
      continue
    stopped = stopped or not finished  # a later sweep's arms may still fit the budget
  if failures:
    path = os.path.join(out, 'failures.json')
    write_json(path, (read_json(path) if os.path.exists(path) else []) + failures)
  results = load_results(out, checked)
  arms, claims = arm_rows(results, sizes_by_sweep, unigram), claim_rows(results)
  last = last_window(out) or where
  write_json(
    os.path.join(out, 'decisive.json'),
    {'machine': last, 'plan': plan_rows, 'unigram_loss': unigram, 'arms': arms, 'claims': claims},
  )
  summary = summary_markdown(plan_rows, arms, claims, last, unigram)
  sweep.write_atomically(os.path.join(out, 'summary.md'), summary)
  print(summary, flush=True)
  if args.summarize:
    print('Summarized what OUT holds; nothing trained.', flush=True)
  elif stopped:
    print('Stopped within the budget; rerun the command to resume.', flush=True)
  elif failures:
    print(f'Failed: {", ".join(f["sweep"] for f in failures)} (OUT/failures.json); the others finished.')
  else:
    print('All sweeps finished.', flush=True)


def sweep_machine(where: dict, config) -> dict:
  """The machine's record with how this sweep's model is computed on it."""
  try:
    attention = model_config.attention_implementation(config.model)
  except ValueError as e:
    attention = f'error: {e}'
  return dict(
    where, attention=attention, dtype=model_config.compute_dtype(config.model), remat=config.model.remat
  )


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
