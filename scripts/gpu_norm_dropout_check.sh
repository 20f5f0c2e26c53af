#!/usr/bin/env bash
# Check the norm kernels' dropout on the GPU machine in one call: install fp8ops, run the GPU tests
# of the norm kernels and of the ops built on them (norms, fused_ln_mlp, the layer's hidden
# dropouts), time the kernels with and without dropout at the seed layer's shape
# (scripts/norm_dropout_cost.py, CUDA-graph replays), print the kernels' offline sm_90 registers
# and spills (scripts/norm_sass.py, the machine's Triton), and optionally run `bench layer`.
#
# Usage: bash scripts/gpu_norm_dropout_check.sh OUTDIR
#
#   TESTS=0     skip the tests; TEST_ARGS="...": pytest's files and options instead of the default
#   LAYER=1     also run `python -m fp8ops.bench layer` (its JSON and PNG into OUTDIR)

set -u -o pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_norm_dropout_check.sh "$@" || exit $?

if [ "${TESTS:-1}" != 0 ]; then
    TESTS_LIMIT_S=${TESTS_LIMIT_S:-300} gpu_tests tests/test_norm_gpu.py tests/test_fused_ln_mlp_gpu.py \
        tests/test_layernorm_linear_gpu.py tests/test_transformer_layer_gpu.py
fi

echo "== norm dropout cost (t=$((SECONDS - START))s)"
timeout --kill-after=10 "${CHECK_LIMIT_S:-200}" "$PY" scripts/norm_dropout_cost.py --out "$OUT" \
    > "$OUT/norm_dropout_cost.txt" 2>&1 || FAILED=1
cat "$OUT/norm_dropout_cost.txt"

echo "== offline registers and spills (t=$((SECONDS - START))s)"
timeout --kill-after=10 120 "$PY" scripts/norm_sass.py 2>/dev/null | tee "$OUT/norm_sass.json"

gpu_bench_layer
echo "== done (t=$((SECONDS - START))s, failed=$FAILED)"
exit $FAILED
