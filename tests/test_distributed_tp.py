"""Tensor and sequence parallelism on CPU with gloo (and over NCCL on 2 GPUs, marker ``gpu``): a
TP / TP+SP transformer layer on 2 and 4 ranks equals the single-process layer (output, dx, every gathered parameter gradient), for
recipe=None (tightly) and FP8 delayed / current scaling (within the FP8 error budget); the scaling
states are identical on every rank after ``update(group=)``; with sequence parallelism the FP8
all-gathers move FP8 bytes; a 2 x 2 DP x TP mesh training a TP+SP layer under DDP (over "dp")
against single-process training; two TP+SP layers chained through ``residual`` /
``return_residual``; torch.compile(fullgraph=True) of a TP+SP layer;
uneven splits and bad arguments raise clear errors.

Each world size is one ``spawn_ranks`` (``mp.spawn``, started again once if a rank dies by a
signal): every rank runs every case and records mismatches instead of raising (so that no rank is
left waiting in a collective); the test asserts on the records."""

from __future__ import annotations

import datetime
import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.testing.distributed import TPLayer, spawn_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

S, B = 8, 2
CONFIGS = {
    # pre-norm LayerNorm, fused QKV, GQA (8 query heads, 4 key/value heads), causal, biases
    "pre": dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=8, num_gqa_groups=4, hidden_dropout=0.0,
                attention_dropout=0.0, self_attn_mask_type="causal"),
    # post-norm RMSNorm, separate q/k/v weights, gated MLP (swiglu), no biases
    "post": dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                 attention_dropout=0.0, normalization="RMSNorm", activation="swiglu", norm_position="post",
                 fuse_qkv_params=False, bias=False),
}
RECIPES = {"none": None, "delayed": fp8ops.DelayedScaling(), "current": fp8ops.CurrentScaling()}


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run(params, x, gy, cfg, recipe, state, **tp):
    """One forward and backward; returns (y, dx, grads, probe grads, new state)."""
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    x = x.detach().requires_grad_()
    probes = fp8ops.make_probes(state) if recipe is not None else None
    y, new_state = fp8ops.transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=probes, **tp)
    (y * gy).sum().backward()
    pgrads = {k: p.grad for k, p in probes.items()} if probes is not None else None
    return y.detach(), x.grad, {k: p.grad for k, p in params.items()}, pgrads, new_state


def _cpu(tree):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), tree)


def _case(name, cfg_kw, recipe_name, sp, rank, world, group, bad, device="cpu", seq=S):
    cfg = fp8ops.TransformerConfig(**cfg_kw)
    recipe = RECIPES[recipe_name]
    g = torch.Generator().manual_seed(0)
    params = fp8ops.init_transformer_params(cfg, generator=g)
    x = torch.randn(seq, B, cfg.hidden_size, generator=g)
    gy = torch.randn(seq, B, cfg.hidden_size, generator=g)
    params, x, gy = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (params, x, gy))
    shard = fp8ops.shard_transformer_params(params, cfg, rank=rank, world_size=world)
    sl = slice(rank * seq // world, (rank + 1) * seq // world) if sp else slice(None)
    tp = {"tp_group": group, "sequence_parallel": sp}
    tag = f"{name}/{recipe_name}/sp={sp}/w={world}"

    st1 = st_tp = fp8ops.init_transformer_state(cfg, recipe, device=device) if recipe is not None else None
    steps = 2 if recipe_name == "delayed" else 1  # delayed: compare the second, scaled step
    for step in range(steps):
        ref = _run(params, x, gy, cfg, recipe, st1)
        out = _run(shard, x[sl], gy[sl], cfg, recipe, st_tp, **tp)
        if recipe is not None:
            st1 = fp8ops.update(ref[4], recipe=recipe, grad_amax=ref[3])
            st_tp = fp8ops.update(out[4], recipe=recipe, grad_amax=out[3], group=group)
    # compared on the CPU (the NCCL variant runs each rank on its own GPU)
    y, dx, grads = _cpu(out[:3])
    ry, rdx, rgrads = _cpu((ref[0][sl], ref[1][sl], ref[2]))
    # every rank's gradient shards, gathered to full gradients
    shards: list = [None] * world
    dist.all_gather_object(shards, grads, group=group)
    full = fp8ops.gather_transformer_params(shards, cfg)
    pairs = [("y", y, ry), ("dx", dx, rdx)] + [(f"grad[{k}]", full[k], rgrads[k]) for k in rgrads]
    if recipe is None:
        for what, a, b in pairs:
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                bad.append(f"{tag}: {what} differs by {float((a - b).abs().max()):.3g}")
    else:
        # the FP8 error budget: this comparison's error against the FP32 layer is at most twice
        # (plus 1e-3) the error of the single-process FP8 layer against it
        hp = _cpu(_run(params, x, gy, cfg, None, None)[:3])
        hp_pairs = [hp[0][sl], hp[1][sl]] + [hp[2][k] for k in rgrads]
        for (what, a, b), h in zip(pairs, hp_pairs):
            budget = 2 * _relerr(b, h) + 1e-3
            if _relerr(a, h) > budget:
                bad.append(f"{tag}: {what} error {_relerr(a, h):.3g} vs FP32 is over the budget {budget:.3g}")
        # the states after update(group=) are identical on every rank, and (max over the shards'
        # amaxes = the amax of the whole tensor) equal to the single-process state
        sd = _cpu(fp8ops.state_dict(st_tp))
        sds: list = [None] * world
        dist.all_gather_object(sds, sd, group=group)
        ref_sd = _cpu(fp8ops.state_dict(st1))
        for k, v in sd.items():
            if any(not torch.equal(o[k], v) for o in sds):
                bad.append(f"{tag}: state {k} differs across ranks")
            # a weight's amax is exact; the other tensors differ from the single-process ones
            # by the FP8 rounding upstream (a shard is quantized with its own current scale)
            rtol = 1e-6 if "weight." in k else 0.1
            if v.is_floating_point() and not torch.allclose(v, ref_sd[k], rtol=rtol, atol=0):
                bad.append(f"{tag}: state {k} {v.tolist()} differs from the single-process {ref_sd[k].tolist()}")
    # replicated gradients are identical on every rank
    for k in rgrads:
        if fp8ops.parallel._layout(cfg)[k] is None and any(not torch.equal(s[k], grads[k]) for s in shards):
            bad.append(f"{tag}: the replicated gradient {k} differs across ranks")


def _fp8_comm(rank, world, group, bad):
    """A column-parallel SP fp8_linear all-gathers x, and a row-parallel one all-gathers dy in its
    backward, as FP8 bytes with the group's scale: with a delayed-scaling state each computes
    what the single-process call computes on its shard, and its state after update(group=) is
    the single-process one; with current scaling they stay within the FP8 budget."""
    import torch.distributed._functional_collectives as fc

    from fp8ops import _parallel

    g = torch.Generator().manual_seed(3)
    M, K, N = 8, 32, 16
    x, w, b = torch.randn(M, B, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    gy = torch.randn(M, B, N, generator=g)
    sl = slice(rank * M // world, (rank + 1) * M // world)  # this rank's sequence rows
    gathered = []
    gname = _parallel.GATHER_NAME if hasattr(fc, _parallel.GATHER_NAME) else "all_gather_tensor"
    orig = getattr(fc, gname)

    def spy(t, *args, **kwargs):
        gathered.append(t.dtype)
        return orig(t, *args, **kwargs)

    for name in ("delayed", "current"):
        recipe = RECIPES[name]
        state = fp8ops.LinearState.init(recipe)
        if name == "delayed":  # a calibrated state (the same on every rank)
            _, st = fp8ops.fp8_linear(x, w, b, state, recipe=recipe)
            state = fp8ops.update(st, recipe=recipe, grad_amax=torch.tensor(4.0))

        def run(x, w, b, gy, **tp):
            x, w, b = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
            probe = torch.zeros((), requires_grad=True)
            y, st = fp8ops.fp8_linear(x, w, b, state, recipe=recipe, grad_probe=probe, **tp)
            (y * gy).sum().backward()
            st = fp8ops.update(st, recipe=recipe, grad_amax=probe, **({"group": group} if tp else {}))
            return y.detach(), x.grad, w.grad, b.grad, st

        ref = run(x, w, b, gy)
        hp = fp8ops.fp8_linear(x, w, b, None, recipe=None)[0]
        n, k = slice(rank * N // world, (rank + 1) * N // world), slice(rank * K // world, (rank + 1) * K // world)
        for mode in ("column", "row"):
            tp = {"tp_group": group, "parallel_mode": mode, "sequence_parallel": True}
            setattr(fc, gname, spy)
            try:
                if mode == "column":  # x: rows of the sequence; y: every row, the rank's columns
                    out = run(x[sl], w[n], b[n], gy[..., n], **tp)
                    want = [ref[0][..., n], ref[1][sl], ref[2][n], ref[3][n]]
                else:  # x: every row, the rank's K columns; y: the rank's rows
                    out = run(x[..., k], w[:, k], b, gy[sl], **tp)
                    want = [ref[0][sl], ref[1][..., k], ref[2][:, k], ref[3]]
            finally:
                setattr(fc, gname, orig)
            tag = f"fp8 comm/{name}/{mode}"
            if name == "delayed":
                for what, a, r in zip(("y", "dx", "dw", "db"), out[:4], want):
                    if not torch.allclose(a, r, rtol=1e-5, atol=1e-5):
                        bad.append(f"{tag}: {what} differs by {float((a - r).abs().max()):.3g}")
                for role in ("input", "weight", "grad_output"):
                    a, r = getattr(out[4], role).amax_history, getattr(ref[4], role).amax_history
                    if not torch.allclose(a, r, rtol=1e-6):
                        bad.append(f"{tag}: {role} history {a[:2].tolist()} != {r[:2].tolist()}")
            else:
                h = hp[..., n] if mode == "column" else hp[sl]
                if _relerr(out[0], h) > 2 * _relerr(want[0], h) + 1e-3:
                    bad.append(f"{tag}: y over the FP8 budget")
            if gathered != [torch.uint8]:
                bad.append(f"{tag}: the all-gathers moved {gathered}, expected one of FP8 bytes (uint8)")
            gathered.clear()


def _row_chunks(rank, world, group, bad):
    """The row-parallel forward GEMMs of a TP+SP layer (proj, fc2) in column chunks, each chunk
    reduce-scattered on its own (_parallel.ROW_FPROP_CHUNKS): the same outputs, gradients and
    states as one GEMM and one reduce-scatter, with one more reduce-scatter per row-parallel linear
    and chunk; a setting that does not split the columns into multiples of 16 runs one GEMM."""
    import torch.distributed._functional_collectives as fc

    from fp8ops import _parallel

    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])  # hidden 32: proj and fc2 have N = 32
    recipe = RECIPES["delayed"]
    g = torch.Generator().manual_seed(5)
    params = fp8ops.init_transformer_params(cfg, generator=g)
    x, gy = torch.randn(S, B, cfg.hidden_size, generator=g), torch.randn(S, B, cfg.hidden_size, generator=g)
    shard = fp8ops.shard_transformer_params(params, cfg, rank=rank, world_size=world)
    sl = slice(rank * S // world, (rank + 1) * S // world)
    tp = {"tp_group": group, "sequence_parallel": True}
    calls = []
    sname = _parallel.SCATTER_NAME if hasattr(fc, _parallel.SCATTER_NAME) else "reduce_scatter_tensor"
    orig = getattr(fc, sname)

    def spy(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        return orig(t, *args, **kwargs)

    def two_steps(chunks):
        _parallel.ROW_FPROP_CHUNKS[0] = chunks
        setattr(fc, sname, spy)
        try:
            st, outs = fp8ops.init_transformer_state(cfg, recipe), []
            for _ in range(2):  # the second step runs with calibrated scales
                out = _run(shard, x[sl], gy[sl], cfg, recipe, st, **tp)
                st = fp8ops.update(out[4], recipe=recipe, grad_amax=out[3], group=group)
                outs.append((out[:3], st))
            n = len(calls)
            calls.clear()
            return outs, n
        finally:
            setattr(fc, sname, orig)
            _parallel.ROW_FPROP_CHUNKS[0] = 1

    ref, n_ref = two_steps(1)
    for chunks, extra in ((2, 2), (4, 0)):  # 4 chunks of 8 columns: not a multiple of 16, one GEMM
        got, n = two_steps(chunks)
        tag = f"row chunks {chunks}"
        if n - n_ref != 2 * extra:  # two steps, proj and fc2, (chunks - 1) more each
            bad.append(f"{tag}: {n} reduce-scatters in two steps, expected {n_ref + 2 * extra}")
        for (a, sa), (r, sr) in zip(got, ref):
            for (ka, va), (_, vr) in zip(pytree.tree_flatten_with_path(a)[0], pytree.tree_flatten_with_path(r)[0]):
                if not torch.allclose(va, vr, rtol=1e-5, atol=1e-6):
                    bad.append(f"{tag}: {pytree.keystr(ka)} differs by {float((va - vr).abs().max()):.3g}")
            for (ka, va), (_, vr) in zip(pytree.tree_flatten_with_path(sa)[0], pytree.tree_flatten_with_path(sr)[0]):
                if not torch.equal(va, vr):
                    bad.append(f"{tag}: state {pytree.keystr(ka)} differs")
    if [_parallel.row_fprop_chunks(n) for n in (32, 48, 64)] != [1, 1, 1]:
        bad.append("row_fprop_chunks: a setting of 1 must give 1 chunk")
    _parallel.ROW_FPROP_CHUNKS[0] = 2
    try:
        got = [_parallel.row_fprop_chunks(n) for n in (32, 48, 64, 30)]
    finally:
        _parallel.ROW_FPROP_CHUNKS[0] = 1
    if got != [2, 1, 2, 1]:
        bad.append(f"row_fprop_chunks with 2: {got} for N = 32, 48, 64, 30, expected [2, 1, 2, 1]")


def _errors(rank, world, group, bad):
    """Bad arguments raise before any collective (every rank raises the same)."""
    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
    params = fp8ops.init_transformer_params(cfg)
    x = torch.randn(S // world, B, 32)
    checks = [
        # 8 query heads and 4 key/value heads do not split 3 ways
        (ValueError, "divisible", lambda: fp8ops.shard_transformer_params(params, cfg, rank=0, world_size=3)),
        (ValueError, "rank must be",
         lambda: fp8ops.shard_transformer_params(params, cfg, rank=world, world_size=world)),
        (TypeError, "tp_group", lambda: fp8ops.fp8_linear(x, torch.randn(4, 32), None, None, recipe=None,
                                                          tp_group="world", parallel_mode="column")),
        (ValueError, "parallel_mode", lambda: fp8ops.fp8_linear(x, torch.randn(4, 32), None, None, recipe=None,
                                                               tp_group=group)),
        (ValueError, "parallel_mode", lambda: fp8ops.fp8_linear(x, torch.randn(4, 32), None, None, recipe=None,
                                                               tp_group=group, parallel_mode="rows")),
        (ValueError, "need tp_group", lambda: fp8ops.fp8_linear(x, torch.randn(4, 32), None, None, recipe=None,
                                                               sequence_parallel=True)),
        (ValueError, "parallel_mode", lambda: fp8ops.layernorm_linear(
            x, torch.ones(32), None, torch.randn(4, 32), None, None, recipe=None, tp_group=group, parallel_mode="row")),
        (ValueError, "return_layernorm_output", lambda: fp8ops.layernorm_linear(
            x, torch.ones(32), None, torch.randn(4, 32), None, None, recipe=None, tp_group=group,
            parallel_mode="column", return_layernorm_output=True)),
        (ValueError, "recompute", lambda: fp8ops.fused_ln_mlp(
            x, torch.ones(32), None, torch.randn(8, 32), None, torch.randn(32, 8), None, None, recipe=None,
            tp_group=group, sequence_parallel=True, recompute="activation")),
        # a row-parallel output of 5 rows does not reduce-scatter over the group
        (ValueError, "sequence length", lambda: fp8ops.fp8_linear(
            torch.randn(5, 8), torch.randn(4, 8), None, None, recipe=None, tp_group=group, parallel_mode="row",
            sequence_parallel=True)),
    ]
    if world == 4:  # 4 key/value heads of a 2-group GQA config do not split 4 ways
        gqa2 = fp8ops.TransformerConfig(**{**CONFIGS["pre"], "num_gqa_groups": 2})
        checks.append((ValueError, "num_gqa_groups", lambda: fp8ops.transformer_layer(
            params, x, None, config=gqa2, recipe=None, tp_group=group)))
    for i, (exc, text, fn) in enumerate(checks):
        try:
            fn()
            bad.append(f"error check {i}: no {exc.__name__}")
        except exc as e:
            if text not in str(e):
                bad.append(f"error check {i}: {exc.__name__} without {text!r}: {e}")


MESH_STEPS, MESH_LR = 3, 0.1


def _mesh_train_reference(params, batches, cfg, recipe):
    """Single process, full layer: each step the two replicas' batches, the loss averaged over
    them (as DDP averages the replicas' gradients), one update, SGD."""
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.SGD(params.values(), lr=MESH_LR)
    state = fp8ops.init_transformer_state(cfg, recipe) if recipe is not None else None
    for step in batches:
        states, probes = [], []
        for x, gy in step:
            pr = fp8ops.make_probes(state) if recipe is not None else None
            y, ns = fp8ops.transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=pr)
            ((y * gy).sum() / len(step)).backward()
            states.append(ns)
            probes.append(pr)
        opt.step()
        opt.zero_grad()
        if recipe is not None:
            g_amax = {k: torch.stack([p[k].grad for p in probes]).amax(0) for k in probes[0]}
            state = fp8ops.update(fp8ops.merge(*states), recipe=recipe, grad_amax=g_amax)
    return {k: v.detach() for k, v in params.items()}


def _mesh(rank, bad):
    """A 2 x 2 DP x TP mesh: each data-parallel replica runs its own batches through a TP+SP layer
    wrapped in DistributedDataParallel over the "dp" group (eagerly, and under torch.compile for
    delayed scaling), 3 SGD steps with one update over all four ranks per step. The states are identical on all four ranks; the trained parameters,
    gathered over "tp", equal the single-process layer trained on both replicas' batches (no FP8:
    to 1e-5; delayed scaling: the FP8 error budget of the single-process FP8 training)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
    params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(S, B, cfg.hidden_size, generator=g), torch.randn(S, B, cfg.hidden_size, generator=g))
                for _ in range(2)] for _ in range(MESH_STEPS)]  # step, replica
    sl = slice(tp_rank * S // 2, (tp_rank + 1) * S // 2)
    init = {k: v.detach().clone() for k, v in params.items()}
    fp32 = _mesh_train_reference(params, batches, cfg, None)
    for recipe_name, compiled in (("none", False), ("delayed", False), ("delayed", True)):
        recipe = RECIPES[recipe_name]
        tag = f"mesh/{recipe_name}" + (" compiled" if compiled else "")
        layer = TPLayer(fp8ops.shard_transformer_params(params, cfg, rank=tp_rank, world_size=2), cfg, recipe,
                        tp_group)
        ddp = torch.nn.parallel.DistributedDataParallel(layer, process_group=dp_group)
        opt = torch.optim.SGD(ddp.parameters(), lr=MESH_LR)
        if compiled:  # torch.compile of the DDP-wrapped TP layer (aot_eager: no C++ compiler needed)
            torch._dynamo.reset()
            ddp = torch.compile(ddp, backend="aot_eager")
        state = fp8ops.init_transformer_state(cfg, recipe) if recipe is not None else None
        for step in batches:
            x, gy = step[dp_rank]
            probes = fp8ops.make_probes(state) if recipe is not None else None
            y, ns = ddp(x[sl], state, probes)
            (y * gy[sl]).sum().backward()
            opt.step()
            opt.zero_grad()
            if recipe is not None:
                state = fp8ops.update(ns, recipe=recipe, grad_amax={k: p.grad for k, p in probes.items()},
                                      group=dist.group.WORLD)
        mine = {n: p.detach() for n, p in zip(layer.names, layer.p)}
        shards: list = [None] * 2
        dist.all_gather_object(shards, mine, group=tp_group)
        got = fp8ops.gather_transformer_params(shards, cfg)
        ref = _mesh_train_reference(params, batches, cfg, recipe)
        for k, v in got.items():
            if recipe is None:
                if not torch.allclose(v, ref[k], rtol=1e-5, atol=1e-6):
                    bad.append(f"{tag}: {k} differs from the single-process one by {float((v - ref[k]).abs().max()):.3g}")
            else:
                d, d_ref, d_fp32 = v - init[k], ref[k] - init[k], fp32[k] - init[k]
                err, budget = _relerr(d, d_fp32), 2 * _relerr(d_ref, d_fp32) + 1e-3
                if err > budget:
                    bad.append(f"{tag}: {k} update error {err:.3g} vs FP32 is over the budget {budget:.3g}")
        if recipe is not None:
            sds: list = [None] * 4
            dist.all_gather_object(sds, fp8ops.state_dict(state))
            for k, v in sds[0].items():
                if any(not torch.equal(o[k], v) for o in sds):
                    bad.append(f"{tag}: state {k} differs across the 4 ranks")


def _replicated(rank, world, group, bad):
    """The replicated parameters of a sequence-parallel transformer_layer (norms, row-parallel
    biases: six in the "pre" config) have their gradients summed in one all-reduce per backward;
    copy_to_tp_many sums over the group, keeps each gradient's dtype and counts an unused output
    as zeros."""
    import torch.distributed._functional_collectives as fc

    from fp8ops._parallel import copy_to_tp_many

    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
    params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    shard = {k: v.requires_grad_() for k, v in fp8ops.shard_transformer_params(params, cfg, rank=rank,
                                                                               world_size=world).items()}
    x = torch.randn(S // world, B, cfg.hidden_size, generator=torch.Generator().manual_seed(1 + rank))
    calls = []
    orig = fc.all_reduce

    def spy(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        return orig(t, *args, **kwargs)

    fc.all_reduce = spy
    try:
        y, _ = fp8ops.transformer_layer(shard, x, None, config=cfg, recipe=None, tp_group=group,
                                        sequence_parallel=True)
        y.sum().backward()
    finally:
        fc.all_reduce = orig
    n = sum(shard[k].numel() for k in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias", "fc2.bias"))
    if calls != [(n,)]:
        bad.append(f"replicated: the backward all-reduced {calls}, expected one all-reduce of {n} elements")
    a = torch.full((3,), float(rank + 1), requires_grad=True)
    b = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    c = torch.ones(4, requires_grad=True)
    out = copy_to_tp_many({"a": a, "b": b, "c": c}, group)
    (out["a"] * out["a"]).sum().add((out["b"] * 3).sum()).backward()  # c unused
    total = sum(2.0 * (r + 1) for r in range(world))
    if not (torch.equal(a.grad, torch.full((3,), total)) and b.grad.dtype == torch.bfloat16
            and torch.equal(b.grad, torch.full((2,), 3.0 * world, dtype=torch.bfloat16)) and c.grad is not None
            and torch.equal(c.grad, torch.zeros(4))):
        bad.append(f"replicated: copy_to_tp_many gave {a.grad}, {b.grad}, {c.grad}")


def _residual_chain(rank, world, group, bad):
    """Two pre-norm layers chained through ``residual`` / ``return_residual`` under TP+SP equal the
    single-process chain (m, s, dx, d residual, every gathered parameter gradient), recipe=None
    tightly; the residual sums come from the norm kernels (no separate add in the graph)."""
    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
    g = torch.Generator().manual_seed(5)
    params = [fp8ops.init_transformer_params(cfg, generator=g) for _ in range(2)]
    x, r, gm, gs = (torch.randn(S, B, cfg.hidden_size, generator=g) for _ in range(4))
    sl = slice(rank * S // world, (rank + 1) * S // world)

    def chain(ps, x, r, **tp):
        ps = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in ps]
        x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
        (h, s), _ = fp8ops.transformer_layer(ps[0], x, None, config=cfg, recipe=None, residual=r,
                                             return_residual=True, **tp)
        (m, s2), _ = fp8ops.transformer_layer(ps[1], h, None, config=cfg, recipe=None, residual=s,
                                              return_residual=True, **tp)
        adds = [t.grad_fn.name() for t in (s, s2) if "Add" in t.grad_fn.name()]
        ((m * gm[sl if tp else slice(None)]).sum() + (s2 * gs[sl if tp else slice(None)]).sum()).backward()
        return m.detach(), s2.detach(), x.grad, r.grad, [{k: v.grad for k, v in p.items()} for p in ps], adds

    ref = chain(params, x, r)
    shards = [fp8ops.shard_transformer_params(p, cfg, rank=rank, world_size=world) for p in params]
    out = chain(shards, x[sl], r[sl], tp_group=group, sequence_parallel=True)
    if out[5]:
        bad.append(f"residual chain: the residual sums came from separate adds: {out[5]}")
    pairs = [("m", out[0], ref[0][sl]), ("s", out[1], ref[1][sl]), ("dx", out[2], ref[2][sl]),
             ("d residual", out[3], ref[3][sl])]
    for i in range(2):
        every: list = [None] * world
        dist.all_gather_object(every, out[4][i], group=group)
        full = fp8ops.gather_transformer_params(every, cfg)
        pairs += [(f"layer {i} grad[{k}]", full[k], v) for k, v in ref[4][i].items()]
    for what, a, b in pairs:
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
            bad.append(f"residual chain w={world}: {what} differs by {float((a - b).abs().max()):.3g}")


def _symm_check(rank, world, group, bad):
    """Whether a group can take the pipelined GEMMs is decided alike on every rank, once per group:
    ranks on different hosts never (even where some of them share a host); ranks of one host whose
    GPUs are the same device or reach each other's memory, yes. (On gloo, with each rank's host
    name and device stood in.)"""
    import socket

    from fp8ops import _parallel

    orig, name = socket.gethostname, group.group_name
    try:
        for hosts, peer_ok, want in (
            (["a"] * world, [True] * world, True),
            (["a"] * (world - 1) + ["b"], [True] * world, False),
            (["a"] * world, [False] * world, False),
            (["a"] * world, [False] + [True] * (world - 1), False),  # only rank 0 lacks peer access
        ):
            _parallel._SYMM_GROUPS.pop(name, None)
            socket.gethostname = lambda h=hosts[rank]: h
            access = torch.cuda.can_device_access_peer
            torch.cuda.can_device_access_peer = lambda a, b, ok=peer_ok[rank]: ok
            try:
                got = _parallel._symm_check(group, torch.device("cuda", rank))
            finally:
                torch.cuda.can_device_access_peer = access
            if got != want or _parallel._SYMM_GROUPS.get(name) != want:
                bad.append(f"symm check: hosts {hosts}, peer access {peer_ok}: {got} "
                           f"(cached {_parallel._SYMM_GROUPS.get(name)}), expected {want}")
    finally:
        socket.gethostname = orig
        _parallel._SYMM_GROUPS.pop(name, None)


def _worker(rank, world, init_file, out_dir, cases):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    bad: list[str] = []
    try:
        group = dist.group.WORLD
        for name, recipe_name, sp in cases:
            _case(name, CONFIGS[name], recipe_name, sp, rank, world, group, bad)
        _errors(rank, world, group, bad)
        _fp8_comm(rank, world, group, bad)
        _replicated(rank, world, group, bad)
        _residual_chain(rank, world, group, bad)
        _symm_check(rank, world, group, bad)
        if world == 2:
            _row_chunks(rank, world, group, bad)
        if world == 4:
            _mesh(rank, bad)
    finally:
        torch.save(bad, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _spawn(world, cases):
    return spawn_ranks(_worker, world, lambda init, d: (world, init, d, cases))


def test_tp_layer_two_ranks_equals_single_process():
    cases = [(n, r, sp) for n in CONFIGS for r in RECIPES for sp in (False, True)]
    bad = _spawn(2, cases)
    assert bad == [[], []], "\n".join(sum(bad, []))


def test_tp_layer_four_ranks_equals_single_process():
    cases = [("pre", r, True) for r in RECIPES] + [("pre", "none", False), ("post", "current", True)]
    bad = _spawn(4, cases)
    assert all(b == [] for b in bad), "\n".join(sum(bad, []))


def _nccl_worker(rank, world, init_file, out_dir, cases):
    torch.manual_seed(0)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    bad: list[str] = []
    try:
        for name, recipe_name, sp in cases:
            _case(name, CONFIGS[name], recipe_name, sp, rank, world, dist.group.WORLD, bad, device=f"cuda:{rank}")
        # the overlap settings: row-parallel forward GEMMs in 2 chunks, the GEMMs that overlap a
        # collective leaving 16 SMs free (set around them, then restored); the same layer
        from fp8ops import _parallel
        lin = importlib.import_module("fp8ops.fp8_linear")  # the module (fp8ops.fp8_linear is the function)

        sets, orig = [], torch._C._set_sm_carveout_experimental
        _parallel.ROW_FPROP_CHUNKS[0], _parallel.OVERLAP_SM_CARVEOUT[0] = 2, 16
        torch._C._set_sm_carveout_experimental = lambda v: (sets.append(v), orig(v))[1]
        try:
            for name, recipe_name, sp in cases:
                if sp:
                    _case(name, CONFIGS[name], recipe_name, sp, rank, world, dist.group.WORLD, bad,
                          device=f"cuda:{rank}")
        finally:
            torch._C._set_sm_carveout_experimental = orig
            _parallel.ROW_FPROP_CHUNKS[0], _parallel.OVERLAP_SM_CARVEOUT[0] = 1, 0
        if 16 not in sets or torch._C._get_sm_carveout_experimental() is not None:
            bad.append(f"overlap carveout: set {sorted(set(sets), key=str)}, left "
                       f"{torch._C._get_sm_carveout_experimental()}; expected 16 set and None left")
        # the fused, pipelined GEMMs and collectives (symmetric memory; the default, taken when every
        # GEMM dimension is a multiple of 16: 64 rows per rank): the same layer; each fused op runs
        calls = {"all_gather_scaled_mm": 0, "scaled_mm_reduce_scatter": 0}
        origs = {k: getattr(lin, k) for k in calls}

        def counted(k):
            def fn(*args, **kwargs):
                calls[k] += 1
                return origs[k](*args, **kwargs)
            return fn

        assert _parallel.FUSED_SP_GEMMS[0]  # the default
        for k in calls:
            setattr(lin, k, counted(k))
        try:
            for name, recipe_name, sp in cases:
                if sp and recipe_name != "none":
                    _case(name, CONFIGS[name], recipe_name, sp, rank, world, dist.group.WORLD, bad,
                          device=f"cuda:{rank}", seq=64)
        finally:
            for k, v in origs.items():
                setattr(lin, k, v)
        if not all(calls.values()) or _parallel._SYMM_GROUPS != {dist.group.WORLD.group_name: True}:
            bad.append(f"fused SP GEMMs: calls {calls}, groups {_parallel._SYMM_GROUPS}; expected each fused op "
                       f"to run, on the world group found fit")
    finally:
        torch.save(bad, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA GPUs and NCCL")
def test_tp_layer_nccl_two_gpus_equals_single_process():
    """The 2-rank cases over NCCL, one rank per GPU, float32 on the GPU (Triton kernels, FP8 all-gathers
    of the sequence-parallel inputs and output gradients as bytes)."""
    cases = [(n, r, sp) for n in CONFIGS for r in RECIPES for sp in (False, True)]
    bad = spawn_ranks(_nccl_worker, 2, lambda init, d: (2, init, d, cases))
    assert bad == [[], []], "\n".join(sum(bad, []))


def _compile_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    bad: list[str] = []
    try:
        cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
        recipe = RECIPES["delayed"]
        params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
        shard = fp8ops.shard_transformer_params(params, cfg, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(1)
        x, gy = torch.randn(S // world, B, cfg.hidden_size, generator=g), torch.randn(S // world, B, 32, generator=g)
        state = fp8ops.init_transformer_state(cfg, recipe)

        def layer(shard, x, state, probes):
            return fp8ops.transformer_layer(shard, x, state, config=cfg, recipe=recipe, probes=probes,
                                            tp_group=dist.group.WORLD, sequence_parallel=True)

        from fp8ops import _parallel

        for chunks in (1, 2):  # 2: the row-parallel forward GEMMs in two column chunks
            _parallel.ROW_FPROP_CHUNKS[0] = chunks
            results = []
            for fn in (layer, torch.compile(layer, fullgraph=True)):
                p = {k: v.detach().requires_grad_() for k, v in shard.items()}
                xx = x.clone().requires_grad_()
                probes = fp8ops.make_probes(state)
                y, st = fn(p, xx, state, probes)
                (y * gy).sum().backward()
                results.append([y, xx.grad, *(v.grad for v in p.values()), *(q.grad for q in probes.values()),
                                *fp8ops.state_dict(st).values()])
            for i, (a, b) in enumerate(zip(*results)):
                if not torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5):
                    diff = float((a.float() - b.float()).abs().max())
                    bad.append(f"row chunks {chunks}: compiled result {i} differs from eager by {diff:.3g}")
    finally:
        torch.save(bad, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def test_tp_sp_layer_compiles_fullgraph():
    """torch.compile(fullgraph=True) captures an FP8 TP+SP layer with its collectives (the FP8
    all-gathers with the group's amax all-reduce, the reduce-scatters), forward and backward, and
    computes what eager computes."""
    bad = spawn_ranks(_compile_worker, 2, lambda init, d: (2, init, d))
    assert bad == [[], []], "\n".join(sum(bad, []))


def test_overlap_carveout_sets_and_restores_the_cublas_setting():
    """_parallel.OVERLAP_SM_CARVEOUT: read for CUDA ops in eager mode only (0 on the CPU and under
    torch.compile); the context sets cuBLAS's SM carveout for its block and restores what was set
    before, also when the block raises; 0 leaves the setting alone; a bad setting raises."""
    from fp8ops import _parallel

    get = torch._C._get_sm_carveout_experimental
    assert get() is None
    _parallel.OVERLAP_SM_CARVEOUT[0] = 16
    try:
        assert _parallel.overlap_sm_carveout(torch.device("cuda", 0)) == 16
        assert _parallel.overlap_sm_carveout(torch.device("cpu")) == 0

        def f(x):
            return x + _parallel.overlap_sm_carveout(torch.device("cuda", 0))

        assert float(torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(()))) == 0.0
        with _parallel.overlap_carveout(16):
            assert get() == 16
            with _parallel.overlap_carveout(0):
                assert get() == 16
            with _parallel.overlap_carveout(8):
                assert get() == 8
            assert get() == 16
        assert get() is None
        with pytest.raises(RuntimeError, match="inside"), _parallel.overlap_carveout(24):
            raise RuntimeError("inside")
        assert get() is None
        _parallel.OVERLAP_SM_CARVEOUT[0] = -1
        with pytest.raises(ValueError, match=r"OVERLAP_SM_CARVEOUT: expected a number of SMs >= 0, got -1"):
            _parallel.overlap_sm_carveout(torch.device("cuda", 0))
    finally:
        _parallel.OVERLAP_SM_CARVEOUT[0] = 0
        torch._C._set_sm_carveout_experimental(None)


def test_fused_sp_gemms_only_where_the_symmetric_memory_ops_apply():
    """_parallel.fused_sp_gemms: on by default, and only for CUDA, per-tensor scales, cuBLAS and
    every GEMM dimension a multiple of 16 (each refusal before any look at the group); under
    torch.compile never."""
    from fp8ops import _parallel

    cuda, ok = torch.device("cuda", 0), ("auto", "cublas")
    assert _parallel.FUSED_SP_GEMMS == [True]
    refused = [
        (torch.device("cpu"), "delayed", ok, (64, 32, 32)),
        (cuda, "rowwise", ok, (64, 32, 32)),
        (cuda, "delayed", ("auto", "triton"), (64, 32, 32)),
        (cuda, "current", ok, (64, 32, 40)),
        (cuda, "delayed", ok, (8, 32, 32)),
    ]
    for device, mode, backends, dims in refused:
        assert not _parallel.fused_sp_gemms(device, None, mode, backends, *dims), (device, mode, backends, dims)
    _parallel.FUSED_SP_GEMMS[0] = False
    try:
        assert not _parallel.fused_sp_gemms(cuda, None, "delayed", ok, 64, 32, 32)
    finally:
        _parallel.FUSED_SP_GEMMS[0] = True
    with pytest.raises(ValueError, match="Invalid process group|not a valid|group"):
        _parallel.fused_sp_gemms(cuda, None, "delayed", ok, 64, 32, 32)  # reaches the group's backend

    def f(x):
        return x + _parallel.fused_sp_gemms(cuda, None, "delayed", ok, 64, 32, 32)

    assert float(torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(()))) == 0.0


def test_comm_options_set_restore_and_reject_bad_values():
    """fp8ops.parallel.set_comm_options writes the settings the ops read (and returns the old
    ones); comm_options restores them on exit, also when its block raises; bad values raise naming
    the function and the argument, and change nothing."""
    from fp8ops import _parallel

    P = fp8ops.parallel
    default = P.CommOptions(pipelined_gemms=True, sm_carveout=0, row_chunks=1)
    assert P.set_comm_options() == default
    old = P.set_comm_options(pipelined_gemms=False, sm_carveout=16, row_chunks=2)
    try:
        assert old == default
        assert (_parallel.FUSED_SP_GEMMS, _parallel.OVERLAP_SM_CARVEOUT, _parallel.ROW_FPROP_CHUNKS) == ([False], [16], [2])
        assert _parallel.row_fprop_chunks(64) == 2 and _parallel.overlap_sm_carveout(torch.device("cuda", 0)) == 16
    finally:
        assert P.set_comm_options(**old._asdict()) == P.CommOptions(False, 16, 2)
    assert P.set_comm_options() == default
    with pytest.raises(RuntimeError, match="inside"), P.comm_options(row_chunks=4) as opts:
        assert opts == P.CommOptions(True, 0, 4) and _parallel.ROW_FPROP_CHUNKS == [4]
        raise RuntimeError("inside")
    assert P.set_comm_options() == default
    for kw, match in [({"pipelined_gemms": 1}, r"set_comm_options: pipelined_gemms must be a bool, got 1"),
                      ({"sm_carveout": -1}, r"set_comm_options: sm_carveout must be an int >= 0, got -1"),
                      ({"row_chunks": 0}, r"set_comm_options: row_chunks must be an int >= 1, got 0"),
                      ({"row_chunks": 2.0}, r"row_chunks must be an int >= 1, got 2.0"),
                      ({"sm_carveout": True, "row_chunks": 2}, r"sm_carveout must be an int >= 0, got True")]:
        with pytest.raises((TypeError, ValueError), match=match):
            P.set_comm_options(**kw)
        assert P.set_comm_options() == default
