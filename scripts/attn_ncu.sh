#!/usr/bin/env bash
# Nsight Compute over the Hopper attention kernels of one forward+backward per case (scripts/attn_ncu.py;
# B = 8, H = 32, S = 8192, d = 128, bf16, the bench's masks), clocks left alone: throughput, warp
# states, scheduler, occupancy, memory and instruction statistics, and the stall samples per SASS
# instruction. Writes OUT/ncu_details.txt (every kernel's details page) and OUT/ncu_source.csv.gz (the
# source page of every kernel: per-instruction samples).
#
#   OUT=DIR bash scripts/attn_ncu.sh [sliding_window document causal ...]
set -euo pipefail
out=${OUT:-.}
rep=/tmp/attn_ncu
ncu --clock-control none --profile-from-start off -k regex:_hopper_ --import-source yes -f -o "$rep" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section InstructionStats --section SourceCounters \
    python3 "$(dirname "${BASH_SOURCE[0]}")/attn_ncu.py" "$@"
ncu -i "$rep.ncu-rep" --page details > "$out/ncu_details.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$out/ncu_source.csv.gz"
