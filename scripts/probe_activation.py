"""Isolate what bounds the activation kernels: launch configs of the same kernels on one GPU."""
import torch
from fp8ops.kernels import activation as K
from fp8ops.kernels import quantize as Q

from fp8ops.bench.common import copy_bandwidth, time_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
g = torch.Generator(device="cuda").manual_seed(0)
M, F = 8192, 16384
h = (torch.randn(M, F, generator=g, device="cuda") * 2).bfloat16()
hg = (torch.randn(M, 2 * F, generator=g, device="cuda") * 2).bfloat16()
da = torch.randn(M, F, generator=g, device="cuda").bfloat16()
s = torch.tensor(16.0, device="cuda")
print("copy", copy_bandwidth(2**30)["tbps"])


def t(name, fn, *args, nbytes):
    r = time_cuda(fn, [args], samples=5, max_calls=4)
    print(f"{name:70s} {r.median_us:8.1f} us  {nbytes / r.median_us / 1e6:6.2f} TB/s", flush=True)


def fwd(act, x, cfg, q=True, qt=True):
    return lambda x: K.act_fwd_launch(x, act, False, s, None, 0, False, E4M3, q, qt, config=cfg)


def bwd(act, cfg, qt=True, db=True):
    return lambda d, x: K.act_bwd_launch(d, x, act, False, s, None, 0, False, E5M2, qt, db, config=cfg)


# Saturation of the conversion alone equals the explicit clamp (both formats, NaN kept).
v = torch.tensor([1e30, -1e30, float("inf"), -float("inf"), float("nan"), 470.0, 500.0, 6e4, 7e4, 1.0], device="cuda")
hv = v.repeat(8, 13)[:, :128].bfloat16().contiguous()
for dt, fmax in ((E4M3, 448.0), (E5M2, 57344.0)):
    q = K.act_fwd_launch(hv, "relu", False, None, None, 0, False, dt, True, False)[1]
    a = torch.relu(hv.float())
    want = torch.where(a.isnan(), a, a.clamp(-fmax, fmax)).to(dt)
    print("saturation", dt, torch.equal(q.view(torch.uint8), want.view(torch.uint8)))
t("quantize cast_transpose 8192x16384", lambda x: Q.cast_transpose_launch(x, s, None, 0, False, E4M3), h,
  nbytes=M * F * 4)
for act, x, nb in (("relu", h, 4), ("silu", h, 4), ("gelu_tanh", h, 4), ("swiglu", hg, 6)):
    t(f"act_fwd {act} q+qt", fwd(act, x, None), x, nbytes=M * F * nb)
t("act_fwd relu q only", fwd("relu", h, None, qt=False), h, nbytes=M * F * 3)
t("act_fwd relu qt only", fwd("relu", h, None, q=False), h, nbytes=M * F * 3)
t("act_fwd relu amax only", lambda x: K.act_amax_launch(x, "relu"), h, nbytes=M * F * 2)
t("act_bwd gelu_tanh q+qt", bwd("gelu_tanh", None, db=False), da, h, nbytes=M * F * 6)
t("act_bwd gelu_tanh q+qt+dbias", bwd("gelu_tanh", None), da, h, nbytes=M * F * 6)
t("act_bwd relu q+qt", bwd("relu", None, db=False), da, h, nbytes=M * F * 6)
t("act_bwd swiglu q+qt+dbias", bwd("swiglu", None), da, hg, nbytes=M * F * 10)
t("act_bwd swiglu q only", bwd("swiglu", None, qt=False, db=False), da, hg, nbytes=M * F * 8)
