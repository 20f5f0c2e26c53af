#!/usr/bin/env bash
# Profile one launch of the Hopper attention backward with Nsight Compute (clocks left alone): the
# details page (throughput, warp stalls, occupancy, memory) and the per-instruction SASS stall
# counts of the source page, written under $OUT (or ./).
#
#   bash scripts/attn_hopper_bwd_profile.sh [causal|none] [head dim] [batch]
set -euo pipefail
variant=${1:-causal}
d=${2:-128}
batch=${3:-2}
out=${OUT:-.}
rep=/tmp/attn_hopper_bwd_${variant}${d}
cat > /tmp/attn_hopper_bwd_once.py <<PY
import importlib
import torch
A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
d, B, S = $d, $batch, 8192
H = 4096 // d
q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
do = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
left, right = R.normalize_window(None, "$variant" == "causal")
out, _ = A._attention_triton(q, k, v, score_mod=None, mask_mod=None, block_mask=None, left=left, right=right,
                             scale=d**-0.5, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                             dropout_p=0.0, seed=None, dq_mode="auto", bwd_config={"HOPPER": 2})
for _ in range(2):
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
torch.cuda.synchronize()
PY
ncu --clock-control none -k regex:_hopper_bwd_kernel -s 1 -c 1 --set full --import-source yes -f -o "$rep" \
    python3 /tmp/attn_hopper_bwd_once.py > /dev/null
ncu -i "$rep.ncu-rep" --page details > "$out/bwd_${variant}${d}_details.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/bwd_${variant}${d}_sass.csv"
