"""Time the Hopper attention backward (``kernels/_attention_hopper_bwd.py``, forced wherever it applies
with launch config HOPPER=2) against the portable backward kernels and cuDNN SDPA on one GPU: B=8,
H=4096/d, S=8192 (or $SEQ, with B = 65536 / S), bf16, ms as the median of five CUDA-event timings. Writes
``$OUT/attention_hopper_bwd[_S<seq>].json`` (or ./).

    python scripts/attn_hopper_bwd_time.py [causal128 none128 causal64 alibi128 document128 window128 alibi64
                                            document64 window64]
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
CASES = [(128, "causal"), (128, "none"), (64, "causal"), (128, "alibi"), (128, "document"), (128, "window"),
         (64, "alibi"), (64, "document"), (64, "window")]


def event_times_ms(fn, n=5):
    """``n`` CUDA-event timings of ``fn`` after one warm-up call, sorted (ms)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def _median_ms(fn, n=5):
    times = event_times_ms(fn, n)
    return times[len(times) // 2]


def main(pick: list[str]) -> dict:
    res = {}
    for d, variant in [c for c in CASES if not pick or f"{c[1]}{c[0]}" in pick]:
        S = int(os.environ.get("SEQ", 8192))
        H, B = 4096 // d, 65536 // S
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
        left, right = R.normalize_window((1024, 0) if variant == "window" else None, variant in ("causal", "alibi"))
        kw = dict(score_mod=A.alibi(H) if variant == "alibi" else None, mask_mod=None, block_mask=None,
                  left=left, right=right, scale=d**-0.5, layout="bhsd", cu_q=None, cu_kv=None, max_q=None,
                  max_kv=None, dropout_p=0.0, seed=None)
        if variant == "document":
            docs = (torch.arange(S, device="cuda") * 8) // S
            mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
            kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, S, S, block_size=128))
        row = {}
        for name, extra in (("hopper", dict(dq_mode="auto", bwd_config={"HOPPER": 2})),
                            ("portable", dict(dq_mode="separate"))):
            out, _ = A._attention_triton(q, k, v, **kw, **extra)
            row[name] = _median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))

            def step(extra=extra):
                o, _ = A._attention_triton(q, k, v, **kw, **extra)
                torch.autograd.grad(o, (q, k, v), do)

            row[name + "_fb"] = _median_ms(step)
        if variant in ("causal", "none"):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                def cudnn():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal")
                    torch.autograd.grad(o, (q, k, v), do)

                row["cudnn_fb"] = _median_ms(cudnn)
        res[f"d{d}_{variant}"] = row
        print(d, variant, {key: round(val, 3) for key, val in row.items()}, flush=True)
    return res


if __name__ == "__main__":
    out = main(sys.argv[1:])
    seq = os.environ.get("SEQ")
    path = os.path.join(os.environ.get("OUT", "."), f"attention_hopper_bwd{'_S' + seq if seq else ''}.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": out}, f, indent=1)
