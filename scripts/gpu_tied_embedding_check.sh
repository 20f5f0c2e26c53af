#!/usr/bin/env bash
# The tied embedding on the GPU: unless CE=0, scripts/cross_entropy_check.py (the loss kernel's
# configurations; at each hidden size of CE_HIDDEN, default "2048 4096", the tied embedding's
# backward kernel alone, the head + loss, and the embedding + head + loss with and without
# tied_embedding); then the GPU tests of the ops and models it touches (TEST_ARGS replaces the
# list), and bench gpt at BENCH_HIDDEN (default 4096; " " for none) for the torch and library-loss
# builds.
#
#   bash scripts/gpu_tied_embedding_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_tied_embedding_check.sh "$@" || exit $?
if [ "${CE:-1}" = 1 ]; then
    echo "== cross_entropy_check (t=$((SECONDS - START))s)"
    timeout 200 "$PY" scripts/cross_entropy_check.py --hidden ${CE_HIDDEN:-2048 4096} --json "$OUT/cross_entropy.json" \
        > "$OUT/cross_entropy.log" 2>&1 || FAILED=1
    tail -n 14 "$OUT/cross_entropy.log"
fi
TESTS_LIMIT_S=${TESTS_LIMIT_S:-240} gpu_tests tests/test_tied_embedding_gpu.py tests/test_linear_cross_entropy_gpu.py \
    tests/test_layernorm_linear_gpu.py tests/test_transformer_layer_gpu.py tests/test_composition_gpu.py \
    tests/test_optim_gpu.py
grep -E "^FAILED|Error:" "$OUT/gpu_tests.log" | head -20
gpu_bench_gpt 4096
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
