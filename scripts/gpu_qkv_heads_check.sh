#!/usr/bin/env bash
# The QKV head views on the GPU: their tests and the GPU tests they touch (layernorm_linear, the
# transformer layer, the GPT compiled and graphed against eager), then, with BENCH_HIDDEN set
# (e.g. "2048 4096"), bench gpt's bf16 torch build beside the fp8ops build with the library's loss
# and AdamW, and the kernel lists of one step of each.
#
#   bash scripts/gpu_qkv_heads_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_qkv_heads_check.sh "$@" || exit $?
if [ "${TESTS:-1}" = 1 ]; then
    TESTS_LIMIT_S=${TESTS_LIMIT_S:-420} gpu_tests tests/test_layernorm_linear_gpu.py \
        tests/test_transformer_layer_gpu.py tests/test_composition_gpu.py tests/test_optim_gpu.py
fi
gpu_bench_gpt ""
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
