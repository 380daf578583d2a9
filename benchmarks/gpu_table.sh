#!/usr/bin/env bash
# Re-measures the GPU rows of the README's "Performance" section: each `python -m dsjax.bench` command
# behind them, in one go, each writing its JSON into OUTDIR under the name the README cites (with
# PREFIX, default h100, in place of the device). Most of its time on a GPU is compilation.
#
#   benchmarks/gpu_table.sh OUTDIR [PREFIX]
#
# Run it from the repository root on a machine with JAX's CUDA plugin (`pip install '.[cuda]'`).
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: benchmarks/gpu_table.sh OUTDIR [PREFIX]" >&2; exit 2
fi
out=$1 prefix=${2:-h100}
if [[ -e $out && ! -d $out ]]; then
  echo "OUTDIR: $out exists and is not a directory" >&2; exit 2
fi
mkdir -p "$out"

bench() {  # bench NAME ARGS...: one README row (or rows), its JSON as $out/${prefix}_NAME.json
  local name=$1; shift
  echo "=== ${prefix}_$name: python3 -m dsjax.bench $*"
  python3 -m dsjax.bench "$@" --steps=20 --json="$out/${prefix}_$name.json"
}
# The plain math named (model.fused_ops=none), since 'auto' takes the fused kernels at these widths on a GPU.
gpt2=(--config=configs/gpt2_small.py --config.model.fused_ops=none)
vit=(--config=configs/vit_b16.py --config.model.fused_ops=none)
deep=(--config=configs/gpt_preln.py --config.model.width=256 --config.model.num_heads=4
      --config.data.seq_len=256 --config.batch_size=16 --config.model.scan_unroll=1)

bench gpt2_small_b16 "${gpt2[@]}"  # instrumentation off, 'return' and 'callback'
bench gpt2_small_b16_profile "${gpt2[@]}" --instrument=off --profile="$out/profile_gpt2_small"
bench gpt2_small_b16_unroll1 "${gpt2[@]}" --instrument=off --config.model.scan_unroll=1
bench gpt2_small_b32 "${gpt2[@]}" --instrument=off --config.batch_size=32
bench gpt2_small_b64 "${gpt2[@]}" --instrument=off --config.batch_size=64
bench vit_b16_b128_profile "${vit[@]}" --instrument=off --profile="$out/profile_vit_b16"
bench vit_b16_b128_unroll1 "${vit[@]}" --instrument=off --config.model.scan_unroll=1
bench gpt_12x256 "${deep[@]}" --config.model.depth=12 --instrument=off
bench gpt_192x256 "${deep[@]}" --config.model.depth=192  # off, 'return' and 'callback'

# The instrumentation's deliveries timed in turns, the per-site callbacks (several devices) included.
echo "=== ${prefix}_instrument_deliveries_gpt2_small"
python3 benchmarks/instrument_deliveries.py --config=configs/gpt2_small.py --set=model.fused_ops=none --rounds=20 \
  --json="$out/${prefix}_instrument_deliveries_gpt2_small.json"
echo "=== ${prefix}_instrument_deliveries_gpt_192x256"
python3 benchmarks/instrument_deliveries.py --config=configs/gpt_preln.py --set=model.depth=192 \
  --set=model.width=256 --set=model.num_heads=4 --set=data.seq_len=256 --set=batch_size=16 \
  --set=model.scan_unroll=1 --rounds=20 --json="$out/${prefix}_instrument_deliveries_gpt_192x256.json"

# The torch.compile peers of the GPT-2 small and ViT-B/16 rows, on this machine (PyTorch there; timm for
# the ViT-B/16 peer the ViT target is set against, the ViT written plainly beside it).
peer() {  # peer NAME ARGS...: benchmarks/torch_compiled.py ARGS, its JSON as $out/${prefix}_NAME.json
  local name=$1; shift
  echo "=== ${prefix}_$name: python3 benchmarks/torch_compiled.py $*"
  python3 benchmarks/torch_compiled.py "$@" --steps=20 --json="$out/${prefix}_$name.json"
}
peer torch_gpt2_small_b16 --config=configs/gpt2_small.py
peer torch_gpt2_small_b32 --config=configs/gpt2_small.py --set=batch_size=32
peer torch_vit_b16_b128_timm --config=configs/vit_b16.py --vit=timm
peer torch_vit_b16_b128 --config=configs/vit_b16.py

# The fused norm and GELU kernels (model.fused_ops=pallas, what 'auto' takes here) side by side with the
# plain math, profiled, on this machine (the plain rows are gpt2_small_b16_profile and vit_b16_b128_profile).
fused=(--instrument=off --config.model.fused_ops=pallas)
bench gpt2_small_b16_fused_ops_profile --config=configs/gpt2_small.py "${fused[@]}" \
  --profile="$out/profile_gpt2_small_fused_ops"
bench vit_b16_b128_fused_ops_profile --config=configs/vit_b16.py "${fused[@]}" \
  --profile="$out/profile_vit_b16_fused_ops"
