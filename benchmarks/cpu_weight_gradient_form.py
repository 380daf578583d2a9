r"""The train step with one of dsjax's CPU gradient forms on and off, timed in turns in one process on
the CPU.

  python benchmarks/cpu_weight_gradient_form.py [--form=narrowing|attention|attention_key|attention_value]
      [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...] [--rounds=40] [--pause=0.05] [--json=FILE]

Two compiled train steps of one config on one device (instrumentation off, random inputs, built as
`python -m dsjax.bench` builds them) that differ in one thing, the form of some backward matmuls:
  * `--form=narrowing` (default): the weight gradient of the dense layers with more inputs than
    outputs (the FFN's second), 'plain' as XLA writes xᵀ·dy and 'transposed' as dsjax computes it on
    the CPU, (dyᵀ·x)ᵀ (`dsjax.models.fast_matmul.TRANSPOSED_NARROW_WEIGHT_GRADIENT`);
  * `--form=attention`: the key and value gradients of the XLA attention (`model.attention='xla'`),
    'plain' dSᵀ·Q and Pᵀ·dO as JAX transposes the plain derivative, and 'transposed' as dsjax computes
    them on the CPU, dSᵀ written out before its product and (dOᵀ·P)ᵀ
    (`dsjax.models.attention_xla.TRANSPOSED_ATTENTION_KEY_GRADIENT`, `..._VALUE_GRADIENT`);
    `--form=attention_key` / `attention_value`: one of the two, the other transposed in both steps.
The steps take turns, one each per round, in alternating order, with `--pause` seconds of idle before
each; the ratio of the two in the same round cancels the machine's drift. Reported: each step's median
and min–max time, and per round the ratio transposed/plain (median and quartiles).
"""

from __future__ import annotations

import pathlib
import sys

from dsjax.train import host_memory

host_memory.keep_freed_memory()  # as every dsjax command does; before JAX starts its threads

import jax  # noqa: E402

from dsjax import bench  # noqa: E402
from dsjax.models import attention_xla, fast_matmul  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

WARMUP_ROUNDS = 3


# --form: the switches (module, name) that turn the CPU's forms on (True, the default) or off.
_KEY = (attention_xla, 'TRANSPOSED_ATTENTION_KEY_GRADIENT')
_VALUE = (attention_xla, 'TRANSPOSED_ATTENTION_VALUE_GRADIENT')
FORMS = {
  'narrowing': ((fast_matmul, 'TRANSPOSED_NARROW_WEIGHT_GRADIENT'),),
  'attention': (_KEY, _VALUE),
  'attention_key': (_KEY,),
  'attention_value': (_VALUE,),
}


def step_with(config, switches: tuple[tuple[object, str], ...], transposed: bool):
  """One step of the config's train step, compiled with the forms `switches` name on or off (the
  others on)."""
  for module, switch in switches:
    setattr(module, switch, transposed)  # read when the step is traced
  try:
    return bench.step_runner(bench.prepare(config, ['off'], 'random'))
  finally:
    for module, switch in switches:
      setattr(module, switch, True)


def _add_form_arg(parser) -> None:
  parser.add_argument(
    '--form', choices=sorted(FORMS), default='narrowing', help='Which gradient form the two steps differ in.'
  )


def main():
  args, config = paired.parse_config_timing_args(__doc__, _add_form_arg)
  switches = FORMS[args.form]
  steps = {'plain': step_with(config, switches, False), 'transposed': step_with(config, switches, True)}
  seconds = paired.alternate(steps, args.rounds, WARMUP_ROUNDS, args.pause)
  results = paired.report(
    args, seconds, 'plain', jax.devices()[0].device_kind, bench.source_commit(), jax.__version__
  )
  results['form'] = args.form
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
