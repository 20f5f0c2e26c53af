"""What a score_mod costs the Hopper attention kernels: forward and backward ms of causal attention
with no mod and with ALiBi called three ways: as generated from its Python body (a relative bias:
the kernels add it per key and fold the query part into the LSE, and skip its derivative, 1); the
same with the backward calling the mod per score (its derivative still skipped); and through a
hand-written Triton twin whose derivative the backward calls (the earliest way; one H100/H200, B=8,
H=32, S=8192, d=128, bf16; minimum and median of ten CUDA-event timings, every case timed in two
rounds). Writes ``$OUT/attention_mod_cost.json`` (or ./).

    python scripts/attn_mod_cost.py
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import triton
import triton.language as tl

import fp8ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_hopper_bwd_time import event_times_ms  # noqa: E402  (the sibling script's timing)

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")


@triton.jit
def _slope(h):
    return tl.where(h < 32, tl.exp2(-0.25 * (h + 1)), tl.exp2(-0.125 * (2 * (h - 32) + 1)))


@triton.jit
def alibi_int(score, b, h, q_idx, kv_idx, t0, t1, t2, t3):
    # the mod as written
    return score + _slope(h) * (kv_idx - q_idx)


@triton.jit
def grad_times_one(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3):
    return ds * 1.0


def _times_ms(fn, n=10):
    times = event_times_ms(fn, n)
    return {"min": times[0], "median": times[len(times) // 2]}


def main() -> dict:
    B, H, S, d = 8, 32, 8192, 128
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    left, right = R.normalize_window(None, True)
    py = fp8ops.alibi(H).fn
    K = importlib.import_module("fp8ops.kernels.attention")
    real_mode = K.hopper_bwd_score_mode

    def per_score(kernels, has_score_mod):  # the relative path off: the mod called per score
        mode = real_mode(kernels, has_score_mod)
        return K.SCORE_MODE_NO_GRAD if mode == K.SCORE_MODE_RELATIVE else mode

    mods = {
        "causal": (None, real_mode),
        "alibi (generated, relative bias, derivative skipped)": (fp8ops.alibi(H), real_mode),
        "alibi, called per score in the backward": (fp8ops.alibi(H), per_score),
        "alibi, derivative called": (A.ScoreMod(py, triton=alibi_int, triton_grad=grad_times_one), real_mode),
    }
    res = {}
    ref = None
    for name, (sm, mode_fn) in [*mods.items(), *mods.items()]:
        K.hopper_bwd_score_mode = mode_fn
        kw = dict(score_mod=sm, mask_mod=None, block_mask=None, left=left, right=right, scale=d**-0.5,
                  layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0, seed=None,
                  dq_mode="auto")
        out, _ = A._attention_triton(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        if sm is not None:
            if ref is None:
                ref = (out, grads)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip((out, *grads), (ref[0], *ref[1])))
        else:
            err = None
        row = {"fwd": _times_ms(lambda: A._attention_triton(q, k, v, **kw)),
               "bwd": _times_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)),
               "max_diff_vs_generated": err}
        K.hopper_bwd_score_mode = real_mode
        res.setdefault(name, []).append(row)
        print(name, "fwd min/median %.3f/%.3f bwd %.3f/%.3f" % (row["fwd"]["min"], row["fwd"]["median"],
                                                                  row["bwd"]["min"], row["bwd"]["median"]),
              "max diff", err, flush=True)
    return res


if __name__ == "__main__":
    out = main()
    path = os.path.join(os.environ.get("OUT", "."), "attention_mod_cost.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "runs": out}, f, indent=1)
