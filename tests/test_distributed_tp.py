"""Tensor and sequence parallelism on CPU with gloo: a TP / TP+SP transformer layer on 2 and 4
ranks equals the single-process layer (output, dx, every gathered parameter gradient), for
recipe=None (tightly) and FP8 delayed / current scaling (within the FP8 error budget); the scaling
states are identical on every rank after ``update(group=)``; with sequence parallelism the FP8
all-gathers move FP8 bytes; a 2 x 2 DP x TP mesh; torch.compile(fullgraph=True) of a TP+SP layer;
uneven splits and bad arguments raise clear errors.

Each world size is one ``mp.spawn``: every rank runs every case and records mismatches instead of
raising (so that no rank is left waiting in a collective); the test asserts on the records."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8ops

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


def _case(name, cfg_kw, recipe_name, sp, rank, world, group, bad):
    cfg = fp8ops.TransformerConfig(**cfg_kw)
    recipe = RECIPES[recipe_name]
    g = torch.Generator().manual_seed(0)
    params = fp8ops.init_transformer_params(cfg, generator=g)
    x = torch.randn(S, B, cfg.hidden_size, generator=g)
    gy = torch.randn(S, B, cfg.hidden_size, generator=g)
    shard = fp8ops.shard_transformer_params(params, cfg, rank=rank, world_size=world)
    sl = slice(rank * S // world, (rank + 1) * S // world) if sp else slice(None)
    tp = {"tp_group": group, "sequence_parallel": sp}
    tag = f"{name}/{recipe_name}/sp={sp}/w={world}"

    st1 = st_tp = fp8ops.init_transformer_state(cfg, recipe) if recipe is not None else None
    steps = 2 if recipe_name == "delayed" else 1  # delayed: compare the second, scaled step
    for step in range(steps):
        ref = _run(params, x, gy, cfg, recipe, st1)
        out = _run(shard, x[sl], gy[sl], cfg, recipe, st_tp, **tp)
        if recipe is not None:
            st1 = fp8ops.update(ref[4], recipe=recipe, grad_amax=ref[3])
            st_tp = fp8ops.update(out[4], recipe=recipe, grad_amax=out[3], group=group)
    y, dx, grads = out[0], out[1], out[2]
    ry, rdx, rgrads = ref[0][sl], ref[1][sl], ref[2]
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
        hp = _run(params, x, gy, cfg, None, None)
        hp_pairs = [hp[0][sl], hp[1][sl]] + [hp[2][k] for k in rgrads]
        for (what, a, b), h in zip(pairs, hp_pairs):
            budget = 2 * _relerr(b, h) + 1e-3
            if _relerr(a, h) > budget:
                bad.append(f"{tag}: {what} error {_relerr(a, h):.3g} vs FP32 is over the budget {budget:.3g}")
        # the states after update(group=) are identical on every rank, and (max over the shards'
        # amaxes = the amax of the whole tensor) equal to the single-process state
        sd = fp8ops.state_dict(st_tp)
        sds: list = [None] * world
        dist.all_gather_object(sds, sd, group=group)
        ref_sd = fp8ops.state_dict(st1)
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

    g = torch.Generator().manual_seed(3)
    M, K, N = 8, 32, 16
    x, w, b = torch.randn(M, B, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    gy = torch.randn(M, B, N, generator=g)
    sl = slice(rank * M // world, (rank + 1) * M // world)  # this rank's sequence rows
    gathered = []
    orig = fc.all_gather_single

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
            fc.all_gather_single = spy
            try:
                if mode == "column":  # x: rows of the sequence; y: every row, the rank's columns
                    out = run(x[sl], w[n], b[n], gy[..., n], **tp)
                    want = [ref[0][..., n], ref[1][sl], ref[2][n], ref[3][n]]
                else:  # x: every row, the rank's K columns; y: the rank's rows
                    out = run(x[..., k], w[:, k], b, gy[sl], **tp)
                    want = [ref[0][sl], ref[1][..., k], ref[2][:, k], ref[3]]
            finally:
                fc.all_gather_single = orig
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


def _mesh(rank, bad):
    """A 2 x 2 DP x TP mesh: each data-parallel replica runs its own batch through a TP+SP layer;
    update over every rank leaves one state on all four."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    cfg = fp8ops.TransformerConfig(**CONFIGS["pre"])
    recipe = RECIPES["delayed"]
    params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + dp_rank)  # this replica's batch
    x, gy = torch.randn(S, B, cfg.hidden_size, generator=g), torch.randn(S, B, cfg.hidden_size, generator=g)
    shard = fp8ops.shard_transformer_params(params, cfg, rank=tp_rank, world_size=2)
    sl = slice(tp_rank * S // 2, (tp_rank + 1) * S // 2)
    state = fp8ops.init_transformer_state(cfg, recipe)
    y, _, _, pgrads, st = _run(shard, x[sl], gy[sl], cfg, recipe, state, tp_group=mesh.get_group("tp"),
                               sequence_parallel=True)
    st = fp8ops.update(st, recipe=recipe, grad_amax=pgrads, group=dist.group.WORLD)
    ref, hp = _run(params, x, gy, cfg, recipe, state), _run(params, x, gy, cfg, None, None)
    if _relerr(y, hp[0][sl]) > 2 * _relerr(ref[0][sl], hp[0][sl]) + 1e-3:
        bad.append(f"mesh: y error {_relerr(y, hp[0][sl]):.3g} over the FP8 budget")
    sds: list = [None] * 4
    dist.all_gather_object(sds, fp8ops.state_dict(st))
    for k, v in sds[0].items():
        if any(not torch.equal(o[k], v) for o in sds):
            bad.append(f"mesh: state {k} differs across the 4 ranks")


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
        if world == 4:
            _mesh(rank, bad)
    finally:
        torch.save(bad, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _spawn(world, cases):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, cases), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def test_tp_layer_two_ranks_equals_single_process():
    cases = [(n, r, sp) for n in CONFIGS for r in RECIPES for sp in (False, True)]
    bad = _spawn(2, cases)
    assert bad == [[], []], "\n".join(sum(bad, []))


def test_tp_layer_four_ranks_equals_single_process():
    cases = [("pre", r, True) for r in RECIPES] + [("pre", "none", False), ("post", "current", True)]
    bad = _spawn(4, cases)
    assert all(b == [] for b in bad), "\n".join(sum(bad, []))


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
                bad.append(f"compiled result {i} differs from eager by {diff:.3g}")
    finally:
        torch.save(bad, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def test_tp_sp_layer_compiles_fullgraph():
    """torch.compile(fullgraph=True) captures an FP8 TP+SP layer with its collectives (the FP8
    all-gathers with the group's amax all-reduce, the reduce-scatters), forward and backward, and
    computes what eager computes."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_compile_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
        bad = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]
    assert bad == [[], []], "\n".join(sum(bad, []))
