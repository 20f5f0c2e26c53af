#!/usr/bin/env bash
# The one script run on the GPU machine: install fp8ops, run the GPU tests, run the benchmarks,
# and write every log and result into OUTDIR.
#
# Usage: bash scripts/gpu_check.sh OUTDIR [--sweep]
#
#   SUITES="quantize linear"   benchmark suites to run (python -m fp8ops.bench <suite>), in order
#   GPU_TESTS_LIMIT_S=N           time limit of each test group (default: what the budget leaves)
#   TEST_GROUPS="name:paths;..."  groups of GPU tests run side by side (default: eight groups
#                                covering tests/ and property_tests/)
#   TESTS=0                       run no GPU test (the benchmarks only)
#   BENCH_LIMIT_S=N               time limit of each benchmark suite (default 330; at most what the
#                                budget leaves)
#   XDIST=N                       run the groups' paths as one pytest spread over N worker
#                                processes (pytest-xdist), logged as gpu_tests_all.log (default,
#                                where pytest-xdist is installed: the cores less two, at most 14;
#                                XDIST=0: the groups side by side, a pytest each)
#   PYTEST_ARGS="..."             more pytest arguments for that run (default "-v --dist worksteal
#                                --timeout 170", the last where pytest-timeout is installed: each
#                                result named as it comes, a stuck test cut alone)
#   Wheels in .whl/ (e.g. torchao, a peer in the linear suite) are installed to /tmp/site first.
#
#   OUTDIR     created if missing; receives nvidia-smi.txt, versions.txt, install.log,
#              gpu_tests.log (a line per group), gpu_tests_<group>.log/.xml, bench_quantize.log, quantize.json, quantize.png,
#              summary.txt
#   --sweep    also time launcher configurations of the quantize kernels (python -m fp8ops.bench
#              quantize --sweep) to tune the defaults in kernels/quantize.py
#
# Expects torch (CUDA build) and triton preinstalled for python3 (override with PYTHON=...); needs
# no network. The tests run even if an earlier step failed, the benchmark runs even if tests fail,
# and the exit status is non-zero if any step failed. Every step has a time limit so that the whole
# script stays under GPU_CHECK_BUDGET_S seconds (default 570).

set -u -o pipefail

usage() {
    echo "usage: bash scripts/gpu_check.sh OUTDIR [--sweep]" >&2
    exit 2
}

[ $# -ge 1 ] || usage
OUT_ARG=$1
shift
SWEEP=""
for arg in "$@"; do
    case "$arg" in
        --sweep) SWEEP="--sweep" ;;
        *) usage ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT_ARG" || { echo "gpu_check: cannot create $OUT_ARG" >&2; exit 2; }
OUT=$(cd "$OUT_ARG" && pwd)
cd "$REPO" || exit 2

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
START=$SECONDS
FAILED=()

step() { printf '\n==== %s (t=%ds) ====\n' "$*" "$((SECONDS - START))"; }
fail() {
    echo "gpu_check: FAILED: $*" >&2
    FAILED+=("$*")
}
remaining() { echo $((BUDGET - (SECONDS - START))); }
# limit CAP RESERVE: seconds for the next step: at most CAP, leaving RESERVE for later steps.
limit() {
    local t=$(($(remaining) - $2))
    [ "$t" -gt "$1" ] && t=$1
    [ "$t" -lt 30 ] && t=30
    echo "$t"
}
# check NAME RC: record a failure for a non-zero status (124/137: the time limit).
check() {
    case "$2" in
        0) ;;
        124 | 137) fail "$1 (time limit reached)" ;;
        *) fail "$1 (exit status $2)" ;;
    esac
}

step "GPU and versions"
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
check "nvidia-smi" $?
"$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import platform, sys
print("python", platform.python_version())
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB",
              f"{p.multi_processor_count} SMs")
else:
    print("CUDA is not available to torch")
    sys.exit(1)
EOF
check "versions / CUDA available" $?
(git -C "$REPO" rev-parse --verify -q HEAD 2>/dev/null || echo "git revision: unknown") | tee -a "$OUT/versions.txt"

if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    step "install carried wheels (.whl/) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$REPO"/.whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step "install fp8ops (editable, no dependencies)"
timeout --kill-after=10 "$(limit 180 360)" \
    "$PY" -m pip install --no-deps --no-build-isolation -e . 2>&1 | tee "$OUT/install.log"
check "pip install" $?

step "GPU tests: pytest -m gpu, over worker processes or in concurrent groups"
# Compilation is CPU-bound and the machine has many cores: the tests run in xdist workers (XDIST)
# or, without pytest-xdist, in groups side by side, each with its own log and JUnit file.
# TEST_GROUPS="name:paths;name:paths" overrides the default groups.
TEST_GROUPS=${TEST_GROUPS:-"composition:tests/test_composition_gpu.py;ops:tests/test_composition_ops.py property_tests;attention:tests/test_attention_gpu.py tests/test_attention_hopper_gpu.py;attention_bwd:tests/test_attention_hopper_bwd_gpu.py;linear:tests/test_fp8_linear_gpu.py tests/test_layernorm_linear_gpu.py tests/test_fused_ln_mlp_gpu.py tests/test_gemm_gpu.py;norm:tests/test_norm_gpu.py tests/test_transformer_layer_gpu.py;quantize:tests/test_quantize_gpu.py tests/test_activation_gpu.py tests/test_kernels_launch_gpu.py tests/test_kernels_inline.py tests/test_optim_gpu.py tests/test_linear_cross_entropy_gpu.py tests/test_tied_embedding_gpu.py;graph:tests/test_graph_step_gpu.py tests/test_nn_compile.py tests/test_distributed_fp8_gather.py tests/test_distributed_tp.py tests/test_distributed_fsdp_fp8.py"}
TEST_LIMIT=${GPU_TESTS_LIMIT_S:-$(limit 420 60)}
IFS=';' read -ra groups <<< "$TEST_GROUPS"
pids=()
if [ "${TESTS:-1}" = 0 ]; then
    groups=() XDIST=0  # no GPU test: straight to the benchmarks
fi
if [ -z "${XDIST+set}" ] && "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=$(( $(nproc) > 16 ? 14 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))
fi
if [ -z "${PYTEST_ARGS+set}" ]; then
    PYTEST_ARGS="-v --dist worksteal"
    "$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS="$PYTEST_ARGS --timeout 170"
fi
if [ "${XDIST:-0}" != 0 ]; then
    # One pytest over every group's paths, its tests spread over XDIST worker processes
    # (pytest-xdist), each compiling with one Inductor thread so that the workers share the cores.
    paths=()
    for g in "${groups[@]}"; do
        # shellcheck disable=SC2206  # the paths are words
        paths+=(${g#*:})
    done
    groups=()
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout --kill-after=10 "$TEST_LIMIT" "$PY" -m pytest -m gpu -rf \
        -p no:cacheprovider -n "$XDIST" ${PYTEST_ARGS:-} --junitxml="$OUT/gpu_tests_all.xml" "${paths[@]}" \
        > "$OUT/gpu_tests_all.log" 2>&1 &
    pids+=("all:$!")
fi
for g in "${groups[@]}"; do
    name=${g%%:*}
    # shellcheck disable=SC2086  # the paths are words
    timeout --kill-after=10 "$TEST_LIMIT" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider \
        --junitxml="$OUT/gpu_tests_$name.xml" ${g#*:} > "$OUT/gpu_tests_$name.log" 2>&1 &
    pids+=("$name:$!")
done
for p in "${pids[@]}"; do
    wait "${p#*:}"
    rc=$?
    printf '%-12s %s\n' "${p%%:*}" "$(tail -1 "$OUT/gpu_tests_${p%%:*}.log")" | tee -a "$OUT/gpu_tests.log"
    check "GPU tests ${p%%:*}" $rc
done

for suite in ${SUITES:-quantize linear}; do
    step "benchmark: python -m fp8ops.bench $suite"
    extra=""
    [ "$suite" = quantize ] && extra=$SWEEP
    # shellcheck disable=SC2086  # extra is empty or one word
    timeout --kill-after=10 "$(limit "${BENCH_LIMIT_S:-330}" 10)" \
        "$PY" -m fp8ops.bench "$suite" --out "$OUT" $extra 2>&1 | tee "$OUT/bench_$suite.log"
    check "benchmark $suite" $?
done

step "summary"
{
    echo "gpu_check finished in $((SECONDS - START)) s; outputs in $OUT"
    if [ ${#FAILED[@]} -eq 0 ]; then
        echo "all steps passed"
    else
        echo "${#FAILED[@]} step(s) failed:"
        printf '  - %s\n' "${FAILED[@]}"
    fi
} | tee "$OUT/summary.txt"
[ ${#FAILED[@]} -eq 0 ]
