#!/usr/bin/env bash
# Check the attention kernels' dropout on the GPU machine in one call: install fp8ops, run the GPU
# tests of the attention kernels (Hopper forward and backward, portable kernels, the layer's
# attention), then time attention with and without dropout at the seed layer's shape against SDPA
# (scripts/attn_dropout_check.py, CUDA-graph replays), and optionally the Hopper kernels' registers
# and spills compiled offline (tests/_sm90_compile.py) and `bench layer`.
#
# Usage: bash scripts/gpu_attn_dropout_check.sh OUTDIR
#
#   TESTS=0          skip the tests; TEST_ARGS="...": pytest's files and options instead of the default
#   LAYER=1          also run `python -m fp8ops.bench layer` (its JSON and PNG into OUTDIR)
#   SPILLS="a b"     variants of tests/_sm90_compile.py to report registers and spills of
#   CHECKS="a;b"     argument sets of attn_dropout_check.py, one run each (default: one run, its defaults)

set -u -o pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_attn_dropout_check.sh OUTDIR" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
START=$SECONDS
FAILED=0
export PYTHONUNBUFFERED=1

. scripts/_gpu_install.sh
gpu_install /tmp/fp8ops_install.log "$OUT/versions.txt" || exit 1

if [ "${TESTS:-1}" != 0 ]; then
    echo "== attention GPU tests (t=$((SECONDS - START))s)"
    workers=$(( $(nproc) > 16 ? 8 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))
    # TEST_ARGS is split as the shell splits a command line (quotes group words)
    eval "set -- ${TEST_ARGS:-tests/test_attention_hopper_gpu.py tests/test_attention_hopper_bwd_gpu.py \
        tests/test_attention_gpu.py tests/test_transformer_layer_gpu.py}"
    timeout --kill-after=10 "${TESTS_LIMIT_S:-240}" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider \
        -n "$workers" --timeout 200 "$@" > "$OUT/gpu_tests.log" 2>&1 || FAILED=1
    tail -4 "$OUT/gpu_tests.log"
fi

# one timing run per ';'-separated argument set of CHECKS (default: the seed layer's shape only),
# each run's JSON in OUTDIR/check<i>/ (CHECK_JSON=0: none)
IFS=';' read -r -a checks <<< "${CHECKS:- }"
i=0
for check in "${checks[@]}"; do
    echo "== attention dropout timing: ${check:-(defaults)} (t=$((SECONDS - START))s)"
    # shellcheck disable=SC2086
    out_args=(--out "$OUT/check$i")
    [ "${CHECK_JSON:-1}" = 0 ] && out_args=()
    eval "set -- $check"
    timeout --kill-after=10 "${CHECK_LIMIT_S:-200}" "$PY" scripts/attn_dropout_check.py --graph \
        "${out_args[@]}" "$@" >> "$OUT/attn_dropout.txt" 2>&1 || FAILED=1
    i=$((i + 1))
done
grep '"impl"' "$OUT/attn_dropout.txt"

if [ -n "${SPILLS:-}" ]; then  # the Hopper kernels' registers and spill stack, compiled offline for sm_90
    echo "== spills (t=$((SECONDS - START))s)"
    eval "set -- $SPILLS"
    timeout --kill-after=10 120 "$PY" tests/_sm90_compile.py --resources "$@" 2>/dev/null | tee "$OUT/spills.txt"
fi

if [ "${LAYER:-0}" != 0 ]; then
    echo "== bench layer (t=$((SECONDS - START))s)"
    timeout --kill-after=10 "${LAYER_LIMIT_S:-300}" "$PY" -m fp8ops.bench layer --out "$OUT" \
        > /tmp/layer.txt 2>&1 || FAILED=1
    tail -30 /tmp/layer.txt
fi
echo "== done (t=$((SECONDS - START))s, failed=$FAILED)"
exit $FAILED
