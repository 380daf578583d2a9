#!/usr/bin/env bash
# experiments/gpu_decisive.py on a GPU machine in one call of at most LIMIT seconds (default 470): the
# dependencies from .whl/ where the image lacks them (benchmarks/gpu_env.sh), the corpus packed by
# experiments/gpu_corpus.py (.gpu/python_stdlib.tar.gz) unpacked where every call finds it, the run
# stopped in time by its own budget (LIMIT − 90 s) and by `timeout` (an interrupt keeps what finished),
# and OUT (experiments/results/gpu_decisive) with this call's log packed into $OUT/gpu_decisive.tgz (or
# /tmp/gpu_decisive_back/) for the trip back. Further flags go to gpu_decisive.py (e.g. --attention=xla).
#
#   experiments/gpu_decisive_device.sh COMMIT [LIMIT] [FLAGS...]
set -uo pipefail
if [[ $# -lt 1 ]]; then echo "usage: experiments/gpu_decisive_device.sh COMMIT [LIMIT] [FLAGS...]" >&2; exit 2; fi
commit=$1 limit=${2:-470}
shift $(( $# < 2 ? $# : 2 ))
source benchmarks/gpu_env.sh || exit 1
data=()
if [[ -f .gpu/python_stdlib.tar.gz ]]; then
  mkdir -p /tmp/dsjax_corpus && tar xzf .gpu/python_stdlib.tar.gz -C /tmp/dsjax_corpus || exit 1
  data=(--data='text:/tmp/dsjax_corpus/python_stdlib/**/*.py')
fi
results=${GPU_DECISIVE_OUT:-experiments/results/gpu_decisive}  # another folder for a check on a CPU
back=${OUT:-/tmp/gpu_decisive_back}
mkdir -p "$back" "$results"
log="$results/call_$(date -u +%Y%m%dT%H%M%SZ).log"
DSJAX_COMMIT=$commit timeout -s INT $((limit - 20)) python3 experiments/gpu_decisive.py --out="$results" \
  --budget_s=$((limit - 90)) "${data[@]}" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
tar czf "$back/gpu_decisive.tgz" "$results" && echo "packed $results into $back/gpu_decisive.tgz"
exit "$status"
