#!/usr/bin/env bash
# Train the demo GPT on the GPU machine, in BF16 and in FP8 (python -m fp8ops.demo), and collect the
# results in OUTDIR.
#
# Usage: bash scripts/gpu_train.sh OUTDIR [demo flags...]
#
#   STEPS=2000                 optimizer steps per run (--steps)
#   DEMO_OUT=demo_out          the demo's own output folder (--out), copied into OUTDIR afterwards
#   GPU_TRAIN_BUDGET_S=560     time limit of the training command, in seconds
#   Extra arguments go to the demo (for example --no-compile, --layers 8, --seq 512).
#
#   OUTDIR     created if missing; receives nvidia-smi.txt, versions.txt, install.log, demo.log (the
#              progress lines and the final table), demo.json (both loss curves and the final
#              numbers) and demo_loss.png (the curves), summary.txt
#
# Expects torch (CUDA build) and triton preinstalled for python3 (override with PYTHON=...); needs no
# network. Exit status: the demo's (0: both runs finished with finite losses), 2 on a usage error.

set -u -o pipefail

[ $# -ge 1 ] || { echo "usage: bash scripts/gpu_train.sh OUTDIR [demo flags...]" >&2; exit 2; }
OUT_ARG=$1
shift

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT_ARG" || { echo "gpu_train: cannot create $OUT_ARG" >&2; exit 2; }
OUT=$(cd "$OUT_ARG" && pwd)
cd "$REPO" || exit 2

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${STEPS:-2000}
WORK=${DEMO_OUT:-$REPO/demo_out}
BUDGET=${GPU_TRAIN_BUDGET_S:-560}
START=$SECONDS

echo "==== GPU and versions ===="
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
"$PY" -c "import torch, triton, platform; print('python', platform.python_version()); print('torch', torch.__version__, '| CUDA', torch.version.cuda); print('triton', triton.__version__); print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" \
    2>&1 | tee "$OUT/versions.txt"
(git -C "$REPO" rev-parse --verify -q HEAD 2>/dev/null || echo "git revision: unknown") | tee -a "$OUT/versions.txt"

echo "==== install fp8ops (editable, no dependencies) ===="
"$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "gpu_train: pip install failed (see $OUT/install.log)" >&2; tail -5 "$OUT/install.log" >&2; }

echo "==== python -m fp8ops.demo --device cuda --steps $STEPS --out $WORK $* ===="
timeout --kill-after=10 "$BUDGET" \
    "$PY" -m fp8ops.demo --device cuda --steps "$STEPS" --out "$WORK" "$@" 2>&1 | tee "$OUT/demo.log"
RC=${PIPESTATUS[0]}

for f in demo.json demo_loss.png; do
    if [ -f "$WORK/$f" ]; then
        [ "$WORK/$f" -ef "$OUT/$f" ] || cp "$WORK/$f" "$OUT/"
    else
        echo "gpu_train: $WORK/$f was not written" >&2
    fi
done
{
    echo "gpu_train finished in $((SECONDS - START)) s with exit status $RC; outputs in $OUT"
    [ "$RC" = 124 ] || [ "$RC" = 137 ] && echo "the demo reached the time limit of $BUDGET s (GPU_TRAIN_BUDGET_S)"
} | tee "$OUT/summary.txt"
exit "$RC"
