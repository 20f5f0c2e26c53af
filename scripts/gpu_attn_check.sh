#!/usr/bin/env bash
# The Hopper attention kernels on the GPU. PASS (bwd, the default, or fwd) picks the kernel: its GPU
# tests (TEST_ARGS replaces the list; TESTS_LIMIT_S bounds them), then scripts/attn_hopper_kernel_ab.py
# PASS against that kernel's file at git revision OLD_REV (default HEAD; OLD_FILE: a copy of that file
# instead) over AB_CASES (default "window128 document128 causal128"; "" for none), once per entry of
# AB_SETS (";"-separated; each entry "--set NAME=INT ..." for the new kernel's module, "-" none; an entry
# "SETTINGS @ CASES" runs those cases instead of AB_CASES), then, when NCU=1,
# Nsight Compute over one forward+backward of each of NCU_CASES (default: scripts/attn_ncu.py's,
# the sliding window and the document mask; OUT/ncu.csv and its summary OUT/ncu.txt), then `bench attention` at S = 8192,
# d = 128 when BENCH=1 (BENCH_VARIANTS, default the four of the Flex targets).
#
#   bash scripts/gpu_attn_check.sh OUTDIR
. "$(dirname "${BASH_SOURCE[0]}")/_gpu_install.sh"
gpu_begin gpu_attn_check.sh "$@" || exit $?
PASS=${PASS:-bwd}
case $PASS in
    bwd) KFILE=_attention_hopper_bwd.py; TESTS=tests/test_attention_hopper_bwd_gpu.py ;;
    fwd) KFILE=_attention_hopper.py; TESTS=tests/test_attention_hopper_gpu.py ;;
    *) echo "gpu_attn_check.sh: PASS must be fwd or bwd, not '$PASS'" >&2; exit 2 ;;
esac
TESTS_LIMIT_S=${TESTS_LIMIT_S:-240} gpu_tests $TESTS
grep -E "^FAILED|Error" "$OUT/gpu_tests.log" | head -20
if [ -n "${AB_CASES-window128 document128 causal128}" ]; then
    echo "== $PASS kernel A/B against ${OLD_FILE:-${OLD_REV:-HEAD}} (t=$((SECONDS - START))s)"
    mkdir -p /tmp/attn_old
    if [ -n "${OLD_FILE:-}" ]; then
        cp "$OLD_FILE" "/tmp/attn_old/$KFILE" || FAILED=1
    else
        git show "${OLD_REV:-HEAD}:kernels/$KFILE" > "/tmp/attn_old/$KFILE" || FAILED=1
    fi
    IFS=';' read -r -a sets <<< "${AB_SETS:--}"
    for entry in "${sets[@]}"; do
        opts=${entry%%@*}
        cases=${AB_CASES-window128 document128 causal128}
        [ "$opts" != "$entry" ] && cases=${entry#*@}
        read -r -a words <<< "$opts" && opts="${words[*]}"  # trimmed
        [ "$opts" = "-" ] && opts=""
        echo "-- settings: ${opts:-none}; cases: $cases"
        # shellcheck disable=SC2086  # the settings and cases are lists of words
        OUT=$OUT timeout 300 "$PY" scripts/attn_hopper_kernel_ab.py "$PASS" "/tmp/attn_old/$KFILE" $opts \
            $cases >> "$OUT/hopper_${PASS}_ab.log" 2>&1 || FAILED=1
    done
    tail -20 "$OUT/hopper_${PASS}_ab.log"
fi
if [ "${NCU:-0}" = 1 ]; then
    echo "== Nsight Compute (t=$((SECONDS - START))s)"
    # the clocks left alone, as in the timed runs; sections for the bound, stall reasons per issue
    timeout 400 ncu --profile-from-start off --clock-control none --csv --page details \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor_op.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
        "$PY" scripts/attn_ncu.py ${NCU_CASES:-} > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || FAILED=1
    "$PY" scripts/attn_ncu.py --summarize "$OUT/ncu.csv" > "$OUT/ncu.txt" 2>&1 || FAILED=1
    cat "$OUT/ncu.txt"; tail -5 "$OUT/ncu.err"
fi
if [ "${BENCH:-0}" = 1 ]; then
    echo "== bench attention (t=$((SECONDS - START))s)"
    timeout 400 "$PY" -m fp8ops.bench attention --seqlens 8192 --head-dims 128 --no-portable --no-deterministic \
        --variants ${BENCH_VARIANTS:-causal alibi sliding_window document} --out "$OUT/bench" > "$OUT/bench_attention.log" 2>&1 || FAILED=1
    tail -30 "$OUT/bench_attention.log"
fi
echo "elapsed $((SECONDS - START)) s, failed=$FAILED"
exit $FAILED
