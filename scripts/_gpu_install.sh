# Sourced by the GPU check scripts, from the repository root with PY set: installs the wheels
# carried in .whl/ (torchao, a peer of the gpt and linear suites) to /tmp/site and puts it on
# PYTHONPATH, installs fp8ops in editable mode, and prints the versions and the git revision.
#
#   gpu_install INSTALL_LOG VERSIONS_FILE   (returns 1 when fp8ops does not install)

gpu_install() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -m pip install --no-deps --no-build-isolation -e . > "$1" 2>&1 || { echo "install failed"; tail "$1"; return 1; }
    { "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
      git rev-parse HEAD 2>/dev/null; } | tee "$2"
}

# The start of a GPU check script that takes one argument, OUTDIR (relative to the caller's
# folder): creates it and sets OUT to its absolute path, moves to the repository root, sets PY,
# START and FAILED, exports PYTHONUNBUFFERED and installs fp8ops (versions into OUT/versions.txt).
#
#   gpu_begin SCRIPT_NAME "$@"   (returns 2 on a wrong call, 1 when fp8ops does not install)
gpu_begin() {
    local name=$1
    shift
    [ $# -eq 1 ] || { echo "usage: bash scripts/$name OUTDIR" >&2; return 2; }
    mkdir -p "$1" && OUT=$(cd "$1" && pwd) || return 2
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 2
    PY=${PYTHON:-python3}
    START=$SECONDS
    FAILED=0
    export PYTHONUNBUFFERED=1
    gpu_install /tmp/fp8ops_install.log "$OUT/versions.txt"
}

# The GPU tests of a check script: pytest -m gpu over TEST_ARGS (split as a command line; default:
# the arguments given), spread over worker processes as scripts/gpu_check.sh does (the cores less
# two, at most 14, each compiling with one Inductor thread; work stealing), log OUT/gpu_tests.log
# with a line per test as it ends, so that a run cut by its time limit still names what passed;
# FAILED=1 when they fail. TESTS_LIMIT_S (default 240) bounds the run, each test 200 s. The log's
# tests per file and outcome are printed at the end.
#
#   gpu_tests DEFAULT_PYTEST_ARGS...
gpu_tests() {
    local workers=$(( $(nproc) > 16 ? 14 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))
    [ -n "${TEST_ARGS:-}" ] && eval "set -- $TEST_ARGS"
    echo "== GPU tests (t=$((SECONDS - START))s)"
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout --kill-after=10 "${TESTS_LIMIT_S:-240}" "$PY" -m pytest -m gpu -v -rf \
        -p no:cacheprovider -n "$workers" --dist worksteal --timeout 200 "$@" > "$OUT/gpu_tests.log" 2>&1 || FAILED=1
    # the workers' result lines ("[gw3] [ 12%] PASSED tests/x.py::test"), not -rf's summary of failures
    grep -E '^\[gw[0-9]+\]' "$OUT/gpu_tests.log" | grep -oE '(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) [^ ]+' \
        | sed -E 's/^([A-Z]+) ([^:]+)::.*/\2 \1/' | sort | uniq -c
    tail -2 "$OUT/gpu_tests.log"
}

# `python -m fp8ops.bench layer` into OUT when LAYER is set and not 0 (LAYER_LIMIT_S, default 300,
# bounds it); its last lines printed; FAILED=1 when it fails.
gpu_bench_layer() {
    [ "${LAYER:-0}" != 0 ] || return 0
    echo "== bench layer (t=$((SECONDS - START))s)"
    timeout --kill-after=10 "${LAYER_LIMIT_S:-300}" "$PY" -m fp8ops.bench layer --out "$OUT" \
        > /tmp/layer.txt 2>&1 || FAILED=1
    tail -30 /tmp/layer.txt
}

# bench gpt for the torch build and the library's fused loss + AdamW build (--no-eager) at each
# hidden size of BENCH_HIDDEN (default: the argument; none when both are empty), into OUT/gpt_<h>,
# its log's last lines printed; FAILED=1 when one fails. GPT_TORCHAO=1 adds the torchao build;
# GPT_LIMIT_S (default 600) bounds each size's run.
#
#   gpu_bench_gpt DEFAULT_HIDDEN_SIZES
gpu_bench_gpt() {
    local impls=(torch "fp8ops FP8, fused loss + AdamW")
    [ "${GPT_TORCHAO:-0}" != 0 ] && impls+=(torchao)
    for h in ${BENCH_HIDDEN:-$1}; do
        echo "== bench gpt --hidden $h (t=$((SECONDS - START))s)"
        timeout --kill-after=10 "${GPT_LIMIT_S:-600}" "$PY" -m fp8ops.bench gpt --hidden "$h" --no-eager \
            --impls "${impls[@]}" --out "$OUT/gpt_$h" > "$OUT/gpt_$h.log" 2>&1 || FAILED=1
        tail -n 14 "$OUT/gpt_$h.log"
    done
}
