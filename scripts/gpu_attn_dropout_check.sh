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
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_attn_dropout_check.sh "$@" || exit $?

if [ "${TESTS:-1}" != 0 ]; then
    gpu_tests tests/test_attention_hopper_gpu.py tests/test_attention_hopper_bwd_gpu.py tests/test_attention_gpu.py \
        tests/test_transformer_layer_gpu.py
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

gpu_bench_layer
echo "== done (t=$((SECONDS - START))s, failed=$FAILED)"
exit $FAILED
