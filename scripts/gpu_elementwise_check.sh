#!/usr/bin/env bash
# Memory-bound kernels of a GPT step on the GPU: scripts/elementwise_ab.py over the parts in
# AB_PARTS (default "loss norm cast sort"; "" for none), then the GPU tests of the kernels and models
# they touch (TEST_ARGS replaces the list; TESTS_LIMIT_S bounds them), and bench gpt at BENCH_HIDDEN
# (default 4096; " " for none) for the torch and library-loss builds.
#
#   bash scripts/gpu_elementwise_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_elementwise_check.sh "$@" || exit $?
if [ -n "${AB_PARTS-loss norm cast sort}" ]; then
    echo "== elementwise_ab (t=$((SECONDS - START))s)"
    timeout 300 "$PY" scripts/elementwise_ab.py --only ${AB_PARTS-loss norm cast sort} --out "$OUT" \
        > "$OUT/elementwise_ab.log" 2>&1 || FAILED=1
    grep -o '"kernel.*' "$OUT/elementwise_ab.log" | cut -c1-190
fi
TESTS_LIMIT_S=${TESTS_LIMIT_S:-240} gpu_tests tests/test_norm_gpu.py tests/test_linear_cross_entropy_gpu.py \
    tests/test_tied_embedding_gpu.py tests/test_quantize_gpu.py tests/test_composition_gpu.py
grep -E "^FAILED|Error:" "$OUT/gpu_tests.log" | head -20
gpu_bench_gpt 4096
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
