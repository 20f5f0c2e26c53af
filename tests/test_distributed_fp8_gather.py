"""fp8ops.all_gather_weight on CPU with gloo, 2 ranks: a weight sharded by rows (FSDP-style) is
all-gathered as FP8 bytes and used by fp8_linear through its weight cache. Two steps (the first
with an uncalibrated state, the second calibrated by ``update(..., group=)``), delayed and current
scaling, float32 and bfloat16, each rank on its own batch: the output equals the single-process
fp8_linear on the full weight bit for bit (the gathered FP8 weight is the one quantize_weight
makes from the full weight), the shard's gradient equals its rows of the single-process gradient
averaged over the ranks, and the states are identical on both ranks and equal the single-process
ones. No high-precision copy of the full weight exists (the stand-in has no storage). The same
checks run on GPUs with NCCL (marker ``gpu``: one rank per GPU, at most 2).

Each configuration is one ``spawn_ranks`` (``mp.spawn``, started again once if a rank dies by a
signal); ranks record mismatches instead of raising, so that no rank is left waiting in a
collective, and the test asserts on the records."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import fp8ops
from fp8ops.testing.distributed import spawn_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

N, K, M = 16, 32, 8
RECIPES = {"delayed": fp8ops.DelayedScaling, "current": fp8ops.CurrentScaling}


def _data(dtype, world, device):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, K, generator=g) * 0.3).to(device, dtype)
    xs = [[torch.randn(M, K, generator=g).to(device, dtype) for _ in range(world)] for _ in range(2)]  # step, rank
    gys = [[torch.randn(M, N, generator=g).to(device, dtype) for _ in range(world)] for _ in range(2)]
    return w, xs, gys


def _reference(recipe, dtype, world, device):
    """Single process, full weight: per step, quantize_weight once, each rank's batch through
    fp8_linear with the cache, the observations merged by max, one update."""
    w, xs, gys = _data(dtype, world, device)
    wf = w.clone().requires_grad_()
    st = fp8ops.LinearState.init(recipe, device=device)
    out = []
    for step in range(2):
        wf.grad = None
        cache, st_w = fp8ops.quantize_weight(wf, st, recipe=recipe)
        ys, states, probes = [], [], []
        for r in range(world):
            p = fp8ops.make_probes(st_w)
            y, s = fp8ops.fp8_linear(xs[step][r], wf, None, st_w, recipe=recipe, grad_probe=p, weight_cache=cache)
            (y.float() * gys[step][r].float()).sum().backward()
            ys.append(y.detach())
            states.append(s)
            probes.append(p)
        merged = fp8ops.merge(*states)
        g_amax = torch.stack([p.grad for p in probes]).amax()
        st = fp8ops.update(merged, recipe=recipe, grad_amax=g_amax)
        out.append({"y": ys, "grad": wf.grad.detach() / world, "state": fp8ops.state_dict(st)})
    return out


def _case(name, dtype, rank, world, device, group, bad):
    recipe = RECIPES[name]()
    tag = f"{name}/{dtype}"
    ref = _reference(recipe, dtype, world, device)
    w, xs, gys = _data(dtype, world, device)
    shard = w.chunk(world, dim=0)[rank].clone().requires_grad_()
    st = fp8ops.LinearState.init(recipe, device=device)
    for step in range(2):
        shard.grad = None
        p = fp8ops.make_probes(st)
        cache, st = fp8ops.all_gather_weight(shard, st, recipe=recipe, group=group)
        if cache.weight.stride() != (0, 0) or cache.value.data.dtype != recipe.dtype("forward"):
            bad.append(f"{tag}: the cache holds a {cache.value.data.dtype} weight and a stand-in with strides "
                       f"{cache.weight.stride()}; expected FP8 and (0, 0)")
        y, st = fp8ops.fp8_linear(xs[step][rank], cache.weight, None, st, recipe=recipe, grad_probe=p,
                                  weight_cache=cache)
        (y.float() * gys[step][rank].float()).sum().backward()
        st = fp8ops.update(st, recipe=recipe, grad_amax=p.grad, group=group)
        want = ref[step]
        if not torch.equal(y.detach(), want["y"][rank]):
            bad.append(f"{tag} step {step}: y differs from the single-process one by "
                       f"{float((y.detach().float() - want['y'][rank].float()).abs().max()):.3g}")
        rows = want["grad"].chunk(world, dim=0)[rank]
        if shard.grad is None or shard.grad.dtype != dtype or not torch.allclose(
                shard.grad.float(), rows.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0):
            bad.append(f"{tag} step {step}: the shard's gradient differs from its rows of the averaged "
                       f"single-process gradient")
        sd = {k: v.cpu() for k, v in fp8ops.state_dict(st).items()}  # compared on the CPU (NCCL: a GPU per rank)
        sds: list = [None] * world
        dist.all_gather_object(sds, sd, group=group)
        for k, v in sd.items():
            if any(not torch.equal(o[k], v) for o in sds):
                bad.append(f"{tag} step {step}: state {k} differs across ranks")
            if not torch.equal(v, want["state"][k].cpu()):
                bad.append(f"{tag} step {step}: state {k} {v.tolist()} differs from the single-process "
                           f"{want['state'][k].tolist()}")


def _worker(rank: int, world: int, backend: str, init_file: str, out_dir: str) -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    bad: list[str] = []
    try:
        for name in RECIPES:
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    _case(name, dtype, rank, world, device, dist.group.WORLD, bad)
                except Exception as e:  # recorded; the test fails on it
                    bad.append(f"{name}/{dtype}: {type(e).__name__}: {e}")
                    raise
    finally:
        torch.save({"bad": bad}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _spawn(world: int, backend: str) -> None:
    res = spawn_ranks(_worker, world, lambda init, d: (world, backend, init, d))
    for r in res:
        assert not r["bad"], "\n".join(r["bad"])


def test_fp8_all_gather_equals_single_process():
    _spawn(2, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_fp8_all_gather_nccl_equals_single_process():
    _spawn(min(2, torch.cuda.device_count()), "nccl")


def test_bad_arguments_are_named():
    st = fp8ops.LinearState.init(fp8ops.DelayedScaling())
    shard = torch.randn(4, 8)
    with pytest.raises(ValueError, match="all_gather_weight: row-wise scaling"):
        fp8ops.all_gather_weight(shard, fp8ops.LinearState.init(fp8ops.CurrentScaling(granularity="row")),
                                 recipe=fp8ops.CurrentScaling(granularity="row"), group=None)
    with pytest.raises(ValueError, match="all_gather_weight: shard must be 2-D"):
        fp8ops.all_gather_weight(torch.randn(8), st, recipe=fp8ops.DelayedScaling(), group=None)
    with pytest.raises(TypeError, match="all_gather_weight: group must be a torch.distributed.ProcessGroup"):
        fp8ops.all_gather_weight(shard, st, recipe=fp8ops.DelayedScaling(), group=None)
    bf16_dgrad = fp8ops.DelayedScaling(dgrad=fp8ops.GemmSpec(precision="high"))
    with pytest.raises(ValueError, match="fprop and dgrad GEMMs, which must then run in FP8"):
        fp8ops.all_gather_weight(shard, fp8ops.LinearState.init(bf16_dgrad), recipe=bf16_dgrad, group=None)
