#!/usr/bin/env bash
# Check the transposed FP8 copies stored through tensor maps, on the GPU machine, in one call:
# install fp8ops, run the GPU tests of the fused AdamW kernel and of the kernels inside compiled
# graphs, sweep the fused AdamW kernel's launch configurations with pointer and TMA stores
# (scripts/adamw_cast_check.py --sweep), and list the kernels of one compiled GPT step at hidden
# 4096 for the two fp8ops builds (scripts/gpt_kernel_diff.py).
#
# Usage: bash scripts/gpu_transposed_store_check.sh OUTDIR
set -u -o pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_transposed_store_check.sh OUTDIR" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "install failed"; exit 1; }
"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"
timeout 200 "$PY" -m pytest -m gpu -v -rf -p no:cacheprovider -n 8 --timeout 150 tests/test_optim_gpu.py \
    tests/test_kernels_inline.py > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
timeout 150 "$PY" scripts/adamw_cast_check.py --sweep --json "$OUT/adamw_cast_check.json" > "$OUT/adamw_cast_check.log" 2>&1
tail -34 "$OUT/adamw_cast_check.log" | cut -c1-230
timeout "${KDIFF_LIMIT_S:-200}" "$PY" scripts/gpt_kernel_diff.py --hidden 4096 --rows 30 \
    --impls "fp8ops FP8" "fp8ops FP8 + fused AdamW" --json "$OUT/gpt_kernel_diff_h4096.json" > "$OUT/kdiff.log" 2>&1
grep -E "====|kernels .* µs$|_act_|_cast_transpose|_adamw|multi_tensor" "$OUT/kdiff.log" | cut -c1-160
