#!/usr/bin/env bash
# The GPU measurements of the speed work in one call of at most ~8 minutes, each new form side by side with
# the previous code on the same machine: the plain ops against `model.fused_ops=pallas` (and its GELU
# kernels with fused multiply-adds, `--gelu_fma`, against them as they are), the whole-tensor
# instrumentation against `instrument.sample_rows`, and the per-step callback delivery; and beside dsjax's
# plain rows their `torch.compile` peers (benchmarks/torch_compiled.py, timm's ViT too). Rows run in order
# of importance; a row that would start after BUDGET seconds (default 420) is skipped and named, so the
# call ends in time. Every JSON goes to OUTDIR under the name benchmarks/README.md cites (PREFIX, default
# h100, in place of the device). `benchmarks/gpu_table.sh` re-runs the whole table (longer than 8 minutes).
#
#   benchmarks/gpu_speed.sh OUTDIR [PREFIX] [BUDGET]
#
# Run from the repository root where jax sees the GPU; every row runs `python3`, the interpreter that has
# jax (and torch and timm for the peers); benchmarks/gpu_env.sh makes dsjax importable (from
# the wheels of benchmarks/gpu_wheels.sh where the image lacks some). The output goes to OUTDIR/gpu_speed.log
# too, and with $OUT set, the JSONs, the log and the profiles' kernel tables (not their traces) are packed
# into $OUT/<OUTDIR name>.tgz. Most of the time is compilation: ~46 s per GPT-2-small step (12 layers unrolled).
# GPU_SPEED_TINY=1 runs every row at a tiny size for 2 steps: the whole call checked on a CPU (3-4 minutes
# on 2 cores) before device time is spent on it. Resumable: a row whose JSON is already in OUTDIR is not
# rerun, so a second call with the same OUTDIR (on a machine still warm, OUTDIR inside the git-ignored tmp/)
# runs what the first skipped (and reruns a row whose JSON does not parse). ROW_LIMIT=SECONDS stops any
# one row after that long (default: no limit). A GPU_SPEED_TINY=1 call's JSONs are tiny-size ones: give it
# its own OUTDIR or PREFIX.
set -uo pipefail
if [[ $# -lt 1 || $# -gt 3 ]]; then
  echo "usage: benchmarks/gpu_speed.sh OUTDIR [PREFIX] [BUDGET]" >&2; exit 2
fi
out=$1 prefix=${2:-h100} budget=${3:-420}
if [[ -e $out && ! -d $out ]]; then
  echo "OUTDIR: $out exists and is not a directory" >&2; exit 2
fi
mkdir -p "$out"
exec > >(tee -a "$out/gpu_speed.log") 2>&1
source benchmarks/gpu_env.sh || exit 1
sample_rows=${SAMPLE_ROWS:-1024}
steps=20 rounds=10 deep_depth=192 tiny_gpt=() tiny_vit=() peer_device=cuda tiny_gpt_peer=() tiny_vit_peer=()
tiny_tiles=()
if [[ ${GPU_SPEED_TINY:-0} == 1 ]]; then
  steps=2 rounds=2 deep_depth=2 peer_device=cpu tiny_tiles=(--tiny)
  tiny_gpt=(--config.model.depth=2 --config.model.width=64 --config.model.num_heads=4 --config.data.seq_len=64
            --config.model.scan_unroll=1)
  tiny_vit=(--config.model.depth=2 --config.model.width=64 --config.model.num_heads=4 --config.data.image_size=32
            --config.model.scan_unroll=1)
  # The same sizes in the PyTorch peer's override syntax (--set=KEY=VALUE; it ignores model.scan_unroll).
  tiny_gpt_peer=("${tiny_gpt[@]/#--config./--set=}") tiny_vit_peer=("${tiny_vit[@]/#--config./--set=}")
fi
skipped=() missing=()

whole() {  # whole FILE: FILE is there and parses as JSON (a JSON cut off by a kill does not)
  [[ -s $1 ]] && python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null
}
row() {  # row NAME COMMAND...: one measurement, unless its JSON is there already or the budget is spent
  local name=$1 arg result=; shift
  for arg in "$@"; do  # the row's result: its --out= (profile_traffic.py reads a --json=), else its --json=
    [[ $arg == --json=* && -z $result ]] && result=${arg#--json=}
    [[ $arg == --out=* ]] && result=${arg#--out=}
  done
  # Done already: its result is there and whole (a JSON cut off by a kill is rerun).
  if [[ -n $result ]] && whole "$result"; then echo "=== ${prefix}_$name: done already"; return; fi
  if (( SECONDS > budget )); then skipped+=("$name"); echo "=== ${prefix}_$name: skipped (${SECONDS}s)"; return; fi
  echo "=== ${prefix}_$name (${SECONDS}s): $*"
  local limit=()  # an interrupt first, so that a row keeps what it has; a kill 30 s later if it must
  [[ -n ${ROW_LIMIT:-} ]] && limit=(timeout -k 30 -s INT "$ROW_LIMIT")
  "${limit[@]}" "$@" || echo "=== ${prefix}_$name FAILED (status $?)"
}
bench() {  # bench NAME ARGS...: python -m dsjax.bench ARGS, its JSON as $out/${prefix}_NAME.json
  local name=$1; shift
  row "$name" python3 -m dsjax.bench "$@" --steps=$steps --json="$out/${prefix}_$name.json"
}
peer() {  # peer NAME ARGS...: benchmarks/torch_compiled.py ARGS, its JSON as $out/${prefix}_NAME.json
  local name=$1; shift
  local needs=(torch) library
  [[ " $* " == *" --vit=timm "* ]] && needs+=(timm)
  for library in "${needs[@]}"; do
    if ! python3 -c "import $library" 2>/dev/null; then
      missing+=("$name"); echo "=== ${prefix}_$name: not run, $library is not installed"; return
    fi
  done
  row "$name" python3 benchmarks/torch_compiled.py "$@" --device=$peer_device --steps=$steps \
    --json="$out/${prefix}_$name.json"
}
# The plain math named, since model.fused_ops=auto takes the kernels at these widths on a GPU.
gpt2=(--config=configs/gpt2_small.py "${tiny_gpt[@]}")
vit=(--config=configs/vit_b16.py "${tiny_vit[@]}")
plain=(--config.model.fused_ops=none)
gpt2_peer=(--config=configs/gpt2_small.py "${tiny_gpt_peer[@]}")
vit_peer=(--config=configs/vit_b16.py "${tiny_vit_peer[@]}")
deep=(--config=configs/gpt_preln.py --config.model.width=256 --config.model.num_heads=4 --config.model.depth=$deep_depth
      --config.data.seq_len=256 --config.batch_size=16 --config.model.scan_unroll=1)
fused=(--config.model.fused_ops=pallas)
sampled=(--config.instrument.sample_rows=$sample_rows)  # with --instrument=...,sampled

# First what the last call left open: the instrumented steps' device time beside the plain steps' (their
# kernels told apart by the statistics' scope in the traffic rows below), and the loop's host work at 192
# layers on this machine's own processor.
bench gpt2_small_b16_fused_ops_profile "${gpt2[@]}" "${fused[@]}" --instrument=off \
  --profile="$out/profile_gpt2_small_fused_ops"
# The same step with the GELU kernels' multiply-adds fused (fused_ops.GELU_FMA): compiled for an H200 they
# issue about two thirds of the instructions per element (benchmarks/gpu_kernel_instructions.py), and
# without it more than their bytes take to move. Its profile times each kernel beside the row above's.
bench gpt2_small_b16_fused_ops_fma_profile "${gpt2[@]}" "${fused[@]}" --gelu_fma --instrument=off \
  --profile="$out/profile_gpt2_small_fused_ops_fma"
bench gpt2_small_b16_return_profile "${gpt2[@]}" "${fused[@]}" --instrument=return \
  --profile="$out/profile_gpt2_small_return"
bench gpt_192x256_off_profile "${deep[@]}" --instrument=off --profile="$out/profile_gpt_192x256_off"
bench gpt_192x256_return_profile "${deep[@]}" --instrument=return --profile="$out/profile_gpt_192x256_return"
row instrument_host_cost_192 python3 benchmarks/instrument_host_cost.py --set=model.depth=$deep_depth \
  --set=model.width=32 --set=model.num_heads=4 --set=data.seq_len=16 --set=batch_size=2 \
  --set=model.scan_unroll=1 --rounds=$rounds --json="$out/${prefix}_instrument_host_cost_192.json"
# The GELU kernels alone: as they are, with fused multiply-adds, and with the erf left out (the erf's share
# of their time); `--grid` would time other tilings, none of which took them above 53% on the H200.
row gelu_tiles python3 benchmarks/gpu_gelu_tiles.py "${tiny_tiles[@]}" --json="$out/${prefix}_gelu_tiles.json"
bench gpt2_small_b16 "${gpt2[@]}" "${plain[@]}" "${sampled[@]}" --instrument=off,return,sampled --profile="$out/profile_gpt2_small"
peer torch_gpt2_small_b16 "${gpt2_peer[@]}"
bench vit_b16_b128 "${vit[@]}" "${plain[@]}" --instrument=off
bench vit_b16_b128_fused_ops "${vit[@]}" "${fused[@]}" --instrument=off
bench vit_b16_b128_fused_ops_fma "${vit[@]}" "${fused[@]}" --gelu_fma --instrument=off
peer torch_vit_b16_b128_timm "${vit_peer[@]}" --vit=timm
bench gpt_192x256 "${deep[@]}" "${sampled[@]}" --instrument=off,return,sampled
row instrument_deliveries_gpt_192x256 python3 benchmarks/instrument_deliveries.py --config=configs/gpt_preln.py \
  --set=model.depth=$deep_depth --set=model.width=256 --set=model.num_heads=4 --set=data.seq_len=256 \
  --set=batch_size=16 --set=model.scan_unroll=1 --set=instrument.sample_rows=$sample_rows --rounds=$rounds \
  --json="$out/${prefix}_instrument_deliveries_gpt_192x256.json"
bench gpt2_small_b32 "${gpt2[@]}" "${plain[@]}" --instrument=off --config.batch_size=32
bench gpt2_small_b32_fused_ops "${gpt2[@]}" "${fused[@]}" --instrument=off --config.batch_size=32
peer torch_gpt2_small_b32 "${gpt2_peer[@]}" --set=batch_size=32
bench gpt2_small_b16_fused_ops_sampled "${gpt2[@]}" "${fused[@]}" "${sampled[@]}" --instrument=off,sampled
peer torch_vit_b16_b128 "${vit_peer[@]}"  # the same ViT as dsjax's, written plainly (timm's is the target's)
# GPT-2 small's deliveries in turns, its one-callback-per-step table among them (fused_ops 'auto', as run;
# four steps to compile, ~3 minutes).
row instrument_deliveries_gpt2_small python3 benchmarks/instrument_deliveries.py --config=configs/gpt2_small.py \
  "${tiny_gpt_peer[@]}" --rounds=$rounds \
  --json="$out/${prefix}_instrument_deliveries_gpt2_small.json"

# The profiled steps' kernels beside their memory traffic, read from each step's HLO: the bandwidth each
# kernel ran at (benchmarks/profile_traffic.py; reads files, a second each).
traffic_device=h100; [[ $prefix == h200 ]] && traffic_device=h200
traffic() {  # traffic NAME PROFILE_DIR [MODE]: the profile of mode MODE (default off) of ${prefix}_NAME.json
  # beside PROFILE_DIR/step.hlo.txt
  row "${1}_traffic" python3 benchmarks/profile_traffic.py --json="$out/${prefix}_$1.json" --mode="${3:-off}" \
    --hlo="$out/$2/step.hlo.txt" --device=$traffic_device --out="$out/${prefix}_${1}_traffic.json"
}
traffic gpt2_small_b16_fused_ops_profile profile_gpt2_small_fused_ops
traffic gpt2_small_b16_fused_ops_fma_profile profile_gpt2_small_fused_ops_fma
traffic gpt2_small_b16_return_profile profile_gpt2_small_return return
traffic gpt_192x256_off_profile profile_gpt_192x256_off
traffic gpt_192x256_return_profile profile_gpt_192x256_return return
traffic gpt2_small_b16 profile_gpt2_small
echo "=== done in ${SECONDS}s; skipped: ${skipped[*]:-none}; not installed: ${missing[*]:-none}"
if [[ -n ${OUT:-} ]]; then
  # Named after OUTDIR, so that a second OUTDIR in the same call does not overwrite the first's archive.
  archive="$OUT/$(basename "$out").tgz"
  tar czf "$archive" --exclude='*.xplane.pb' --exclude='*.trace.json.gz' -C "$(dirname "$out")" \
    "$(basename "$out")" && echo "packed $out into $archive"
fi
