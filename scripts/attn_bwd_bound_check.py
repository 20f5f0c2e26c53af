"""What bounds the Hopper attention backward: the kernel timed against copies of itself without the
float32 dQ reductions, and without the dQ products as well (timing only: their dQ is wrong), on one
GPU; the cases, inputs and timing of ``scripts/attn_hopper_kernel_ab.py`` (B = 8, H = 4096 / d,
S = 8192, backward ms with the passes, minimum of ten CUDA-event timings, two rounds).

    python scripts/attn_bwd_bound_check.py [window128 causal128 document128 ...]

If the copy without reductions is much faster, the reductions (every tile step of every program
adds 64 x d float32 values to the dQ buffer in L2) bound the kernel; if only the copy without dQ
products is, its tensor work does; if neither, the consumers' and the loader's barriers do. Writes
``$OUT/attn_bwd_bound.json`` (or ./).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join(ROOT, "kernels", "_attention_hopper_bwd.py")
# a consumer's dQ columns added to the float32 buffer (in the tile loop and in a skipped half's step)
_REDUCTION = "_tma_add(dq_desc, [(b * n_heads + h) * seq_q + m0, c * DQ_COLS], dq_smem.index(c))"
_DQ_PRODUCTS = '''                dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)),
                                   k_smem.index(0).slice(c * DQ_COLS, DQ_COLS, dim=1), q_zero,
                                   use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                                   k_smem.index(1).slice(c * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
                dq, dv, dk = warpgroup_mma_wait(0, deps=[dq, dv, dk])
'''
_NO_DQ_PRODUCTS = '''                dq = q_zero
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
'''


def diagnostic_sources(source: str) -> dict[str, str]:
    """The kernel file's source without its dQ reductions, and without its dQ products as well; a
    ValueError if the kernel no longer has the code these edits take out."""
    lines = source.split("\n")
    kept = [ln for ln in lines if ln.strip() != _REDUCTION]
    if len(lines) - len(kept) != 2:
        raise ValueError(f"attn_bwd_bound_check: expected the dQ reduction twice in {KERNEL}, "
                         f"found it {len(lines) - len(kept)} times")
    no_reduction = "\n".join(kept)
    if no_reduction.count(_DQ_PRODUCTS) != 1:
        raise ValueError(f"attn_bwd_bound_check: the tile loop's dQ products are not where expected in {KERNEL}")
    return {"no dQ reductions": no_reduction,
            "no dQ reductions or products": no_reduction.replace(_DQ_PRODUCTS, _NO_DQ_PRODUCTS)}


def main(cases: list[str]) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attn_hopper_kernel_ab as ab

    with open(KERNEL) as f:
        variants = diagnostic_sources(f.read())
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, text in variants.items():
            path = os.path.join(tmp, "_".join(label.split()) + ".py")
            with open(path, "w") as f:
                f.write(text)
            print(f"-- {label}", flush=True)
            res[label] = ab.main("bwd", KERNEL, cases or ["window128", "causal128", "document128"], new_path=path)
    return res


if __name__ == "__main__":
    import torch
    import triton

    result = main(sys.argv[1:])
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "what": "backward ms, 'new' the copy, 'old' the kernel as it is"}
    with open(os.path.join(os.environ.get("OUT", "."), "attn_bwd_bound.json"), "w") as f:
        json.dump({"environment": meta, "variants": result}, f, indent=1)
