#!/usr/bin/env bash
# Check a change to how compiled graphs are built, on the GPU machine, in one call: install
# fp8ops, run the GPU tests of compiled graphs (the library kernels inside Inductor graphs, and the
# model-level compiled modes against eager), time compilation with and without the memo of torch's
# kernel analysis (scripts/compile_time_ab.py), then run `bench gpt` at the given sizes, one
# process per size so that each size's JSON is written when it finishes, until the budget is spent.
#
# Usage: bash scripts/gpu_compile_check.sh OUTDIR
#
#   GPT_HIDDEN="4096 2048"   bench gpt sizes, in order (default "4096 2048")
#   GPT_ARGS="..."           bench gpt arguments, split at spaces (default: the eager builds and the
#                            FP8-head variant left out: --no-eager --impls torch torchao "fp8ops FP8")
#   TESTS=0                  skip the GPU tests
#   AB_HIDDEN=512            the GPT size of the compile-time A/B (0: skip it)
#   BUDGET_S=560             the whole script's time limit
# Wheels in .whl/ (torchao, the gpt suite's peer) are installed to /tmp/site first.

set -u -o pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_compile_check.sh OUTDIR" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-560}
START=$SECONDS
FAILED=0
left() { echo $((BUDGET - (SECONDS - START))); }
export PYTHONUNBUFFERED=1

. scripts/_gpu_install.sh
gpu_install "$OUT/install.log" "$OUT/versions.txt" || exit 1

if [ "${TESTS:-1}" != 0 ]; then
    echo "== GPU tests of compiled graphs (t=$((SECONDS - START))s)"
    workers=$(( $(nproc) > 16 ? 14 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout --kill-after=10 "${TESTS_LIMIT_S:-170}" "$PY" -m pytest -m gpu -v -rf \
        -p no:cacheprovider -n "$workers" --dist worksteal --timeout 160 tests/test_kernels_inline.py \
        tests/test_composition_gpu.py -k "compiled or fp8_head or inline or traced or rule or on_cuda" \
        > "$OUT/gpu_tests.log" 2>&1 || FAILED=1
    tail -3 "$OUT/gpu_tests.log"
fi

if [ "${AB_HIDDEN:-512}" != 0 ]; then
    echo "== compile time, memo off / on (t=$((SECONDS - START))s)"
    timeout --kill-after=10 "$(( $(left) > 240 ? 240 : $(left) ))" "$PY" scripts/compile_time_ab.py \
        --hidden "${AB_HIDDEN:-512}" --json "$OUT/compile_time_ab.json" 2>&1 | tee "$OUT/compile_time_ab.log" || FAILED=1
fi

for h in ${GPT_HIDDEN:-4096 2048}; do
    t=$(( $(left) - 5 ))
    [ "$t" -lt 60 ] && { echo "== bench gpt --hidden $h: skipped, ${t} s left"; continue; }
    echo "== bench gpt --hidden $h (t=$((SECONDS - START))s, limit ${t} s)"
    if [ -n "${GPT_ARGS+set}" ]; then
        read -ra args <<< "$GPT_ARGS"
    else
        args=(--no-eager --impls torch torchao "fp8ops FP8")
    fi
    # the JSON only (the plot stays behind: the files that come back are few)
    timeout --kill-after=10 "$t" "$PY" -m fp8ops.bench gpt --hidden "$h" --out "/tmp/gpt_$h" "${args[@]}" \
        > "$OUT/gpt_$h.log" 2>&1 || FAILED=1
    cp "/tmp/gpt_$h/gpt.json" "$OUT/gpt_$h.json" 2>/dev/null
    grep -E 'target|fastest|x bf16|ms' "$OUT/gpt_$h.log" | tail -25
done
echo "== done in $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
