r"""The bandwidth each kernel of a profiled `dsjax.bench` step ran at: its measured time beside its memory
traffic, read from the same step's HLO.

  python benchmarks/profile_traffic.py --json=BENCH_JSON --hlo=PROFILE_DIR/step.hlo.txt [--mode=off]
                                       [--device=h100|h200] [--top=20] [--out=FILE]

`python -m dsjax.bench ... --profile=DIR --json=BENCH_JSON` times the step's kernels on the device and writes
the compiled step's HLO to DIR/step.hlo.txt (benchmarks/gpu_speed.sh keeps both). This matches the profile's
kernels to the HLO's by name (XLA's fusions and the Pallas kernels; cuBLAS's and cuDNN's kernels have names
of their own, and are compute-bound anyway), reads each one's traffic (`hlo_traffic.py`) and prints, by
measured time, the traffic, the bandwidth it ran at and its fraction of the device's (`--device`), and
whose operations it runs: the step's own, the instrumentation's statistics' or both (`hlo_traffic.PARTS`,
by the statistics' named scope in the HLO's metadata; code before that scope shows every kernel as the
step's). A kernel far below the bandwidth is where a rewrite of the kernel pays; one near it pays only by
fewer bytes.
Nothing runs on a device: this reads files.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hlo_traffic  # noqa: E402 (benchmarks/hlo_traffic.py, beside this script)


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--json', required=True, help='The JSON `dsjax.bench --profile=DIR --json=...` wrote.')
  parser.add_argument('--hlo', required=True, help="The profiled step's HLO: DIR/step.hlo.txt.")
  parser.add_argument('--mode', default='off', help='The --instrument mode whose profile to read.')
  parser.add_argument(
    '--device', default='h100', help=f'Its bandwidth: one of {sorted(hlo_traffic.DEVICES)}.'
  )
  parser.add_argument('--top', type=int, default=20, help='How many kernels to print.')
  parser.add_argument('--out', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  for flag in ('json', 'hlo'):
    if not os.path.isfile(getattr(args, flag)):
      parser.error(f'--{flag}={getattr(args, flag)} is not a file')
  if args.device not in hlo_traffic.DEVICES:
    parser.error(f'--device must be one of {sorted(hlo_traffic.DEVICES)}, got {args.device!r}')
  if args.top < 0:
    parser.error(f'--top must be >= 0, got {args.top}')
  if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
    parser.error(f'--out={args.out}: its directory does not exist')
  with open(args.json) as f:
    profile = json.load(f).get('modes', {}).get(args.mode, {}).get('profile')
  if not profile:
    parser.error(f'--json={args.json} has no profile of mode {args.mode!r} (run dsjax.bench with --profile)')
  args.kernels = profile['kernels']
  return args


def main():
  args = parse_args()
  device = hlo_traffic.DEVICES[args.device]
  found = hlo_traffic.kernels(pathlib.Path(args.hlo).read_text())
  result = hlo_traffic.beside_profile(found, args.kernels, device['memory_bandwidth'])
  print(
    f'{result["matched_kernels"]} memory-bound kernels of the profile found in the HLO: '
    f'{result["ms_per_step"]:.2f} ms per step for {result["gb"]:.2f} GB, '
    f'{result["fraction_of_bandwidth"]:.0%} of the '
    f'{device["memory_bandwidth"] / 1e12:.2f} TB/s of an {device["name"]}'
  )
  print(
    '  by part: '
    + ', '.join(
      f'{part} {row["matched_kernels"]} kernels {row["ms_per_step"]:.2f} ms {row["gb"]:.2f} GB'
      for part, row in result['by_part'].items()
    )
  )
  for row in result['kernels'][: args.top]:
    print(
      f'  {row["ms_per_step"]:7.3f} ms {row["gb"]:7.3f} GB {row["tb_per_s"]:5.2f} TB/s '
      f'{row["fraction_of_bandwidth"]:4.0%}  {row["part"]:10s} {row["kernel"]}'
    )
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(
        {'json': args.json, 'hlo': args.hlo, 'mode': args.mode, 'device': args.device, **result}, f, indent=1
      )


if __name__ == '__main__':
  main()
