"""The AdamW step with the weight's FP8 copy in one kernel, against torch's fused AdamW followed by
the library's cast of the weight: device time at the seed layer's weight shapes, and agreement.

Per shape (bf16 weight, gradient and moments, as torch's AdamW keeps them for a bf16 parameter):

- ``torch AdamW + cast``: ``torch.optim.AdamW(fused=True, capturable=True)`` with a tensor learning
  rate, then ``fp8ops.quantize_weight`` of the updated weight (delayed scaling, calibrated state);
- ``fused``: ``kernels.optim.adamw_cast_transpose_launch`` (and the step count's increment).

µs per step: CUDA events around 20 steps, median of 5. Agreement after one step from the same
values: whether the fused kernel's FP8 bytes, inverse scale and amax equal the library's cast of
its own updated weight, and the weights' largest difference from torch's AdamW as a fraction of
the learning rate. ``--sweep``: launch configurations of the fused kernel (pointer and TMA stores of the
transposed copy) at 12288 x 4096 and 16384 x 4096, each checked byte for byte against the pointer-store default.

    python scripts/adamw_cast_check.py [--sweep] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import fp8ops
from fp8ops.kernels.optim import adamw_cast_transpose_launch
from fp8ops.testing.states import calibrate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_host_check import device_us  # noqa: E402  (CUDA events around 20 calls, median of 5)

SHAPES = [(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384)]
BETAS, EPS, WD = (0.9, 0.999), 1e-8, 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time launch configs of the fused kernel, pointer and TMA stores")
    args = ap.parse_args()
    recipe = fp8ops.DelayedScaling()
    rows = []
    print(torch.cuda.get_device_name())
    for N, K in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w0 = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).bfloat16()
        g0 = (torch.randn(N, K, device="cuda", generator=gen) * 1e-3).bfloat16()
        m0 = (torch.randn(N, K, device="cuda", generator=gen) * 1e-4).bfloat16()
        v0 = (torch.rand(N, K, device="cuda", generator=gen) * 1e-7).bfloat16()
        st = calibrate(fp8ops.LinearState.init(recipe, device="cuda"), recipe).weight
        lr = torch.tensor(1e-3, device="cuda")

        # torch's fused AdamW, then the library's cast of the new weight
        w_t = w0.clone().requires_grad_()
        w_t.grad = g0.clone()
        opt = torch.optim.AdamW([w_t], lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True, capturable=True)
        opt.step()  # creates the state (zeros), then set it to the test's moments
        s = opt.state[w_t]
        with torch.no_grad():
            w_t.copy_(w0)
            s["exp_avg"].copy_(m0)
            s["exp_avg_sq"].copy_(v0)
            s["step"].zero_()
        opt.step()
        # the fused kernel from the same values
        w_f, m_f, v_f = w0.clone(), m0.clone(), v0.clone()
        step = torch.ones((), device="cuda")
        q = torch.empty(N, K, dtype=torch.float8_e4m3fn, device="cuda")
        qt = torch.empty(K, N, dtype=torch.float8_e4m3fn, device="cuda")
        inv = torch.empty((), device="cuda")
        amax = adamw_cast_transpose_launch(w_f, g0, m_f, v_f, step, lr, st.scale, q, qt, inv, *BETAS, EPS, WD)
        w_diff = (w_f.float() - w_t.detach().float()).abs().max().item() / lr.item()
        cache, st2 = fp8ops.quantize_weight(w_f, st, recipe=recipe)
        same = (torch.equal(cache.value.data.view(torch.uint8), q.view(torch.uint8))
                and torch.equal(cache.value.data_t.view(torch.uint8), qt.view(torch.uint8))
                and torch.equal(cache.value.inv_scale, inv) and torch.equal(st2.pending_amax, amax))
        m_diff = (m_f.float() - s["exp_avg"].float()).abs().max().item()
        v_rel = ((v_f.float() - s["exp_avg_sq"].float()).abs() / s["exp_avg_sq"].float().clamp_min(1e-30)).max().item()

        def torch_step() -> None:
            opt.step()
            fp8ops.quantize_weight(w_t.detach(), st, recipe=recipe)

        def fused_step() -> None:
            step.add_(1.0)
            adamw_cast_transpose_launch(w_f, g0, m_f, v_f, step, lr, st.scale, q, qt, inv, *BETAS, EPS, WD)

        def adamw_only() -> None:
            opt.step()

        with torch.no_grad():
            t_torch, t_adamw, t_fused = device_us(torch_step), device_us(adamw_only), device_us(fused_step)
        nbytes = N * K * (2 * 7 + 2)  # bf16 w, g, m, v read; w, m, v written; two FP8 copies
        row = {"N": N, "K": K, "torch_adamw_plus_cast_us": t_torch, "torch_adamw_us": t_adamw, "fused_us": t_fused,
               "fused_TB_s": nbytes / t_fused / 1e6, "max_w_diff_over_lr": w_diff,
               "fp8_bytes_inv_amax_equal_library_cast": same, "max_abs_diff_m": m_diff, "max_rel_diff_v": v_rel}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.sweep:
        # each config from the same values once (its bytes against the pointer-store default's), then timed
        for N, K in (SHAPES[0], SHAPES[2]):
            gen = torch.Generator(device="cuda").manual_seed(1)
            w0, g0, m0 = ((torch.randn(N, K, device="cuda", generator=gen) * 1e-3).bfloat16() for _ in range(3))
            v0 = (torch.rand(N, K, device="cuda", generator=gen) * 1e-7).bfloat16()
            step, lr, scale = torch.ones((), device="cuda"), torch.full((), 1e-3, device="cuda"), torch.full((), 64.0, device="cuda")

            def run(cfg: dict, ws: tuple) -> tuple:
                q = torch.empty(N, K, dtype=torch.float8_e4m3fn, device="cuda")
                qt = torch.empty(K, N, dtype=torch.float8_e4m3fn, device="cuda")
                inv = torch.empty((), device="cuda")
                amax = adamw_cast_transpose_launch(*ws, step, lr, scale, q, qt, inv, *BETAS, EPS, WD, config=cfg)
                return q, qt, amax, inv

            ref = run({"TMA": False}, tuple(t.clone() for t in (w0, g0, m0, v0)))
            for bm, bk, nw in [(32, 128, 4), (64, 64, 4), (64, 128, 8), (32, 256, 8), (128, 64, 8), (64, 128, 4),
                               (128, 128, 8), (16, 256, 4)]:
                for tma in (False, True):
                    cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": nw, "TMA": tma}
                    got = run(cfg, tuple(t.clone() for t in (w0, g0, m0, v0)))
                    same = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                                           if b.dtype.itemsize == 1 else b) for a, b in zip(ref, got))
                    ws = tuple(t.clone() for t in (w0, g0, m0, v0))
                    q, qt = torch.empty_like(ref[0]), torch.empty_like(ref[1])
                    inv = torch.empty((), device="cuda")
                    us = device_us(lambda: adamw_cast_transpose_launch(*ws, step, lr, scale, q, qt, inv, *BETAS, EPS,
                                                                       WD, config=cfg))
                    row = {"sweep": cfg, "N": N, "K": K, "us": us, "TB_s": N * K * 16 / us / 1e6, "same_bytes": same}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
