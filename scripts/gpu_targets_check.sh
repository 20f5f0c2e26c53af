#!/usr/bin/env bash
# The step-time targets of the GPT and layer suites on one GPU, nothing else: bench gpt at
# BENCH_HIDDEN (default "4096 2048") for the torch build, the library's fused loss + AdamW build and
# torchao (GPT_TORCHAO=0 leaves torchao out; GPT_LIMIT_S bounds each size), then bench layer
# (LAYER=0 skips it; LAYER_LIMIT_S bounds it).
#
#   bash scripts/gpu_targets_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_targets_check.sh "$@" || exit $?
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/nvidia_smi.txt"
GPT_TORCHAO=${GPT_TORCHAO:-1} gpu_bench_gpt "4096 2048"
LAYER=${LAYER:-1} gpu_bench_layer
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
