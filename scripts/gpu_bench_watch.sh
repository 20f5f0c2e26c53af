#!/usr/bin/env bash
# Run bench suites on the GPU machine in one call, each under its own time limit and under
# scripts/bench_watch.py (every thread's Python stack written every WATCH_S seconds, so that a run
# that stalls shows where), with the GPU's utilisation and memory sampled beside them.
#
# Usage: bash scripts/gpu_bench_watch.sh OUTDIR LIMIT_S "SUITE ARGS" [LIMIT_S "SUITE ARGS" ...]
#
#   Each "SUITE ARGS" is split at spaces, except that ';' stands for a space inside one argument
#   (so --impls "fp8ops FP8, fused loss" is written --impls fp8ops;FP8,;fused;loss).
#   WATCH_S=45               seconds between stack dumps
#   COMPILE_THREADS=1        TORCHINDUCTOR_COMPILE_THREADS for the suites (default: torch's)
# Per run i: OUTDIR/run<i>.log (output), OUTDIR/run<i>_stacks.txt, OUTDIR/run<i>.json (the
# suite's record); OUTDIR/smi.csv (nvidia-smi every 5 s). Wheels in .whl/ go to /tmp/site first.

set -u -o pipefail
[ $# -ge 3 ] || { echo "usage: bash scripts/gpu_bench_watch.sh OUTDIR LIMIT_S \"SUITE ARGS\" ..." >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
[ -n "${COMPILE_THREADS:-}" ] && export TORCHINDUCTOR_COMPILE_THREADS=$COMPILE_THREADS
. scripts/_gpu_install.sh
gpu_install /tmp/install.log "$OUT/run0.log" || exit 1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm --format=csv -l 5 > "$OUT/smi.csv" 2>&1 &
SMI=$!
FAILED=0
i=0
while [ $# -ge 2 ]; do
    i=$((i + 1))
    limit=$1
    read -ra raw <<< "$2"
    shift 2
    args=()
    for a in "${raw[@]}"; do args+=("${a//;/ }"); done
    echo "== run $i: ${args[*]} (limit $limit s, t=${SECONDS}s)"
    timeout --kill-after=10 "$limit" "$PY" scripts/bench_watch.py --stacks "$OUT/run${i}_stacks.txt" \
        --every "${WATCH_S:-45}" -- "${args[@]}" --out "/tmp/bench_run$i" > "$OUT/run$i.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && FAILED=1
    echo "   rc=$rc (t=${SECONDS}s)"
    for j in /tmp/bench_run$i/*.json; do [ -f "$j" ] && cp "$j" "$OUT/run$i.json"; done
    tail -40 "$OUT/run$i.log"
done
kill $SMI 2>/dev/null
exit $FAILED
