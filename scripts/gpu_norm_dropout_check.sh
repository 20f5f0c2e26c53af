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
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_norm_dropout_check.sh OUTDIR" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
START=$SECONDS
FAILED=0
export PYTHONUNBUFFERED=1

. scripts/_gpu_install.sh
gpu_install /tmp/fp8ops_install.log "$OUT/versions.txt" || exit 1

if [ "${TESTS:-1}" != 0 ]; then
    echo "== norm GPU tests (t=$((SECONDS - START))s)"
    workers=$(( $(nproc) > 16 ? 8 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))
    eval "set -- ${TEST_ARGS:-tests/test_norm_gpu.py tests/test_fused_ln_mlp_gpu.py tests/test_layernorm_linear_gpu.py \
        tests/test_transformer_layer_gpu.py}"
    timeout --kill-after=10 "${TESTS_LIMIT_S:-300}" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider \
        -n "$workers" --timeout 250 "$@" > "$OUT/gpu_tests.log" 2>&1 || FAILED=1
    tail -4 "$OUT/gpu_tests.log"
fi

echo "== norm dropout cost (t=$((SECONDS - START))s)"
timeout --kill-after=10 "${CHECK_LIMIT_S:-200}" "$PY" scripts/norm_dropout_cost.py --out "$OUT" \
    > "$OUT/norm_dropout_cost.txt" 2>&1 || FAILED=1
cat "$OUT/norm_dropout_cost.txt"

echo "== offline registers and spills (t=$((SECONDS - START))s)"
timeout --kill-after=10 120 "$PY" scripts/norm_sass.py 2>/dev/null | tee "$OUT/norm_sass.json"

if [ "${LAYER:-0}" != 0 ]; then
    echo "== bench layer (t=$((SECONDS - START))s)"
    timeout --kill-after=10 "${LAYER_LIMIT_S:-300}" "$PY" -m fp8ops.bench layer --out "$OUT" \
        > /tmp/layer.txt 2>&1 || FAILED=1
    tail -30 /tmp/layer.txt
fi
echo "== done (t=$((SECONDS - START))s, failed=$FAILED)"
exit $FAILED
