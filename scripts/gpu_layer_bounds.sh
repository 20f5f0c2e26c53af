#!/usr/bin/env bash
# What bounds the seed layer's training step, in one call on the GPU machine: install fp8ops, then
#   1. GPU clocks, power and energy per step of fp8ops delayed, torchao and the basic fp16 layer
#      (scripts/clock_check.py --layer), back to back and in bursts from idle;
#   2. which operation launches each kernel of an fp8ops delayed step (scripts/layer_kernel_ops.py);
#   3. the host time of the ops' forward+backward with cProfile (scripts/host_profile.py --profile).
# Every result goes into OUTDIR (at most five files).
#
# Usage: bash scripts/gpu_layer_bounds.sh OUTDIR
#   CLOCK=0 / OPS=0 / HOST=0   skip a part; SECONDS_PER_PHASE=N   seconds per clock phase (default 4)
#   TESTS="pytest args"        also run these GPU tests first (log: OUTDIR/gpu_tests.log)
#   DQ=1                       also time the dQ accumulator's cast into the layer's gradient view
#                              (scripts/dq_cast_check.py)
#   AB="args"                  also run scripts/layer_ab_check.py with these arguments (JSON: OUTDIR/layer_ab.json)
#   LAYER=1                    also run `python -m fp8ops.bench layer` (its JSON into OUTDIR)

set -u -o pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_layer_bounds.sh "$@" || exit $?

if [ -n "${TESTS:-}" ]; then
    echo "== GPU tests (t=$((SECONDS - START))s)"
    eval "set -- $TESTS"
    timeout --kill-after=10 "${TESTS_LIMIT_S:-240}" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider \
        --timeout 200 "$@" > "$OUT/gpu_tests.log" 2>&1 || FAILED=1
    tail -4 "$OUT/gpu_tests.log"
fi
if [ "${CLOCK:-1}" != 0 ]; then
    echo "== clocks and power (t=$((SECONDS - START))s)"
    timeout --kill-after=10 "${CLOCK_LIMIT_S:-240}" "$PY" scripts/clock_check.py "$OUT" --layer \
        --seconds "${SECONDS_PER_PHASE:-4}" 2>&1 | grep -v Warning || FAILED=1
fi
if [ "${OPS:-1}" != 0 ]; then
    echo "== kernels by operation (t=$((SECONDS - START))s)"
    timeout --kill-after=10 120 "$PY" scripts/layer_kernel_ops.py --dropout 0.1 --json "$OUT/layer_kernel_ops.json" \
        > /tmp/layer_kernel_ops.txt 2>&1 || FAILED=1
    head -3 /tmp/layer_kernel_ops.txt
fi
if [ "${HOST:-1}" != 0 ]; then
    echo "== host profile (t=$((SECONDS - START))s)"
    timeout --kill-after=10 180 "$PY" scripts/host_profile.py --device cuda --cpu-time --profile \
        --only "torch F.linear" "fp8_linear delayed" "transformer_layer delayed" > "$OUT/host_profile.txt" 2>&1 || FAILED=1
    grep "us/call" "$OUT/host_profile.txt"
fi
if [ "${DQ:-0}" != 0 ]; then
    echo "== dQ cast (t=$((SECONDS - START))s)"
    timeout --kill-after=10 60 "$PY" scripts/dq_cast_check.py --out "$OUT" || FAILED=1
fi
if [ -n "${AB:-}" ]; then
    echo "== A/B of a switch: $AB (t=$((SECONDS - START))s)"
    eval "set -- $AB"
    timeout --kill-after=10 "${AB_LIMIT_S:-240}" "$PY" scripts/layer_ab_check.py --json "$OUT/layer_ab.json" "$@" \
        2>&1 | grep -v Warning || FAILED=1
fi
gpu_bench_layer
cat "$OUT/versions.txt"
echo "== done (t=$((SECONDS - START))s, failed=$FAILED)"
exit $FAILED
