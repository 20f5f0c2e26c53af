#!/usr/bin/env bash
# The Hopper attention backward on the GPU: its GPU tests (TEST_ARGS replaces the list; TESTS_LIMIT_S
# bounds them), then scripts/attn_hopper_kernel_ab.py bwd against kernels/_attention_hopper_bwd.py at
# git revision OLD_REV (default HEAD; OLD_FILE: a copy of that file instead) over AB_CASES (default
# "window128 document128 causal128"; "" for none), then `bench attention` at S = 8192, d = 128 when
# BENCH=1 (BENCH_VARIANTS, default the four of the Flex targets).
#
#   bash scripts/gpu_attn_bwd_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_attn_bwd_check.sh "$@" || exit $?
TESTS_LIMIT_S=${TESTS_LIMIT_S:-240} gpu_tests tests/test_attention_hopper_bwd_gpu.py
grep -E "^FAILED|Error" "$OUT/gpu_tests.log" | head -20
if [ -n "${AB_CASES-window128 document128 causal128}" ]; then
    echo "== kernel A/B against ${OLD_FILE:-${OLD_REV:-HEAD}} (t=$((SECONDS - START))s)"
    mkdir -p /tmp/attn_old
    if [ -n "${OLD_FILE:-}" ]; then
        cp "$OLD_FILE" /tmp/attn_old/_attention_hopper_bwd.py || FAILED=1
    else
        git show "${OLD_REV:-HEAD}:kernels/_attention_hopper_bwd.py" > /tmp/attn_old/_attention_hopper_bwd.py || FAILED=1
    fi
    OUT=$OUT timeout 300 "$PY" scripts/attn_hopper_kernel_ab.py bwd /tmp/attn_old/_attention_hopper_bwd.py \
        ${AB_CASES-window128 document128 causal128} > "$OUT/hopper_bwd_ab.log" 2>&1 || FAILED=1
    tail -20 "$OUT/hopper_bwd_ab.log"
fi
if [ "${BENCH:-0}" = 1 ]; then
    echo "== bench attention (t=$((SECONDS - START))s)"
    timeout 400 "$PY" -m fp8ops.bench attention --seqlens 8192 --head-dims 128 --no-portable --no-deterministic \
        --variants ${BENCH_VARIANTS:-causal alibi sliding_window document} --out "$OUT/bench" > "$OUT/bench_attention.log" 2>&1 || FAILED=1
    tail -30 "$OUT/bench_attention.log"
fi
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
