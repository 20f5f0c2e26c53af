#!/usr/bin/env bash
# The tied embedding and the loss kernel's ROW_MAX option on the GPU: unless CE=0, scripts/cross_entropy_check.py
# (the kernel's configurations, the head + loss, and the embedding + head + loss with and without
# tied_embedding, at hidden 2048 and 4096); with PICK_ROW_MAX=1 the faster of ROW_MAX off and on at
# BLOCK_V 2048 / 4 warps becomes this copy's default; then the GPU tests of the ops and models it
# touches, and bench gpt at BENCH_HIDDEN (default 4096) for the torch and library-loss builds.
#
#   bash scripts/gpu_tied_embedding_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_tied_embedding_check.sh "$@" || exit $?
if [ "${CE:-1}" = 1 ]; then
    echo "== cross_entropy_check (t=$((SECONDS - START))s)"
    timeout 200 "$PY" scripts/cross_entropy_check.py --hidden 2048 4096 --json "$OUT/cross_entropy.json" \
        > "$OUT/cross_entropy.log" 2>&1 || FAILED=1
    tail -n 14 "$OUT/cross_entropy.log"
fi
if [ "${CE:-1}" = 1 ] && [ "${PICK_ROW_MAX:-0}" = 1 ]; then
    pick=$("$PY" - "$OUT/cross_entropy.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["case"] == "kernel" and r["BLOCK_V"] == 2048
        and r["num_warps"] == 4]
print(min(rows, key=lambda r: r["ms"])["ROW_MAX"])
PY
)
    echo "ROW_MAX picked: $pick"
    sed -i "s/\"num_warps\": 4, \"ROW_MAX\": False}/\"num_warps\": 4, \"ROW_MAX\": $pick}/" kernels/linear_cross_entropy.py
    grep -n '^_CFG' kernels/linear_cross_entropy.py
fi
TESTS_LIMIT_S=${TESTS_LIMIT_S:-240} gpu_tests tests/test_tied_embedding_gpu.py tests/test_linear_cross_entropy_gpu.py \
    tests/test_layernorm_linear_gpu.py tests/test_transformer_layer_gpu.py tests/test_composition_gpu.py \
    tests/test_optim_gpu.py
grep -E "^FAILED|Error:" "$OUT/gpu_tests.log" | head -20
for h in ${BENCH_HIDDEN:-4096}; do
    echo "== bench gpt --hidden $h (t=$((SECONDS - START))s)"
    "$PY" -m fp8ops.bench gpt --hidden "$h" --no-eager --impls torch "fp8ops FP8, fused loss + AdamW" \
        --out "$OUT/gpt_$h" > "$OUT/gpt_$h.log" 2>&1 || FAILED=1
    tail -n 14 "$OUT/gpt_$h.log"
done
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
