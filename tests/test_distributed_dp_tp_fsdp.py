"""FSDP2 around the functional ops on CPU with gloo.

1. DP x TP with FSDP2: 4 ranks on a 2 x 2 ("dp", "tp") mesh from ``init_device_mesh``. Each rank
   holds its tensor-parallel shard of a transformer layer in a module whose forward calls the pure
   ``transformer_layer(..., tp_group=mesh["tp"].get_group(), sequence_parallel=True)``, and
   ``fully_shard(module, mesh=mesh["dp"])`` shards those shards over the data-parallel dimension.
   3 SGD steps, each replica on its half of the batch and each TP rank on its sequence slice, one
   ``fp8ops.update(..., group=dist.group.WORLD)`` per step. The parameters (``.full_tensor()`` over
   "dp", then ``gather_transformer_params`` over "tp") equal those of the single-process layer
   trained on the whole batch (recipe=None to 1e-5; DelayedScaling within the FP8 error budget),
   the scaling states are identical on all four ranks, and each weight role's amax history holds,
   step by step, the amax of the full weight.
2. torch.compile under FSDP2: 2 ranks, two ``fp8_linear`` ops in modules under ``fully_shard``
   (each layer and the root), 3 SGD steps compiled with the aot_eager backend equal the eager FSDP2
   steps bit for bit (parameters and states), for recipe=None and DelayedScaling: each sharded
   layer compiled with ``fullgraph=True`` (FSDP2's hooks run outside the compiled forward), and the
   root compiled with ``fullgraph=False`` (the nested layers' hooks are not traceable: a graph
   break each, and ``fullgraph=True`` raises).

Each test is one ``spawn_ranks`` (``mp.spawn``, started again once if a rank dies by a signal):
every rank also runs the references it compares with, records mismatches instead of raising (so that
no rank is left waiting in a collective), and the test asserts on the records."""

from __future__ import annotations

import datetime
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import fp8ops
from fp8ops.testing.distributed import Chain, OpModule, TPLayer, spawn_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

S, B, H = 8, 4, 32  # (S, B, H) batch: each data-parallel replica takes B/2 sequences
STEPS, LR = 3, 0.1
CFG = dict(hidden_size=H, ffn_hidden_size=64, num_attention_heads=4, num_gqa_groups=2, hidden_dropout=0.0,
           attention_dropout=0.0, self_attn_mask_type="causal")
RECIPES = {"none": None, "delayed": fp8ops.DelayedScaling()}
WEIGHT_ROLES = {"qkv.weight": "qkv.weight", "proj.weight": "proj.weight", "fc1.weight": "mlp.fc1_weight",
                "fc2.weight": "mlp.fc2_weight"}  # parameter -> its state role


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _spawn(worker, world: int) -> list[dict]:
    return spawn_ranks(worker, world, lambda init, d: (world, init, d))


def _run_worker(body, rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Runs ``body(rank, bad)`` in a gloo process group; saves the records and the seconds taken."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    bad: list[str] = []
    t0 = time.perf_counter()
    try:
        body(rank, bad)
    except Exception as e:  # recorded; the test fails on it
        bad.append(f"{type(e).__name__}: {e}")
        raise
    finally:
        torch.save({"bad": bad, "seconds": time.perf_counter() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# 1. DP x TP with FSDP2 over "dp"


def _train_reference(params, data, cfg, recipe):
    """Single process, full layer, whole batch; the loss halved, as FSDP2 averages the gradients of
    the two replicas (each of which sums over its half). One update per step, SGD."""
    params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.SGD(params.values(), lr=LR)
    state = fp8ops.init_transformer_state(cfg, recipe) if recipe is not None else None
    for x, gy in data:
        probes = fp8ops.make_probes(state) if recipe is not None else None
        y, state = fp8ops.transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=probes)
        ((y * gy).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
        if recipe is not None:
            state = fp8ops.update(state, recipe=recipe, grad_amax=probes)
    return {k: v.detach() for k, v in params.items()}, state


def _dp_tp(rank: int, bad: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    tp_group = mesh["tp"].get_group()
    cfg = fp8ops.TransformerConfig(**CFG)
    params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    init = {k: v.detach().clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)) for _ in range(STEPS)]
    # this replica's half of the batch, this TP rank's sequence slice
    rows, cols = slice(tp_rank * S // 2, (tp_rank + 1) * S // 2), slice(dp_rank * B // 2, (dp_rank + 1) * B // 2)
    fp32, _ = _train_reference(params, data, cfg, None)

    for recipe_name, recipe in RECIPES.items():
        tag = f"dp x tp fsdp2/{recipe_name}"
        layer = TPLayer(fp8ops.shard_transformer_params(params, cfg, rank=tp_rank, world_size=2), cfg, recipe,
                        tp_group)
        fully_shard(layer, mesh=mesh["dp"])
        opt = torch.optim.SGD(layer.parameters(), lr=LR)  # after fully_shard: over the DTensor shards
        state = fp8ops.init_transformer_state(cfg, recipe) if recipe is not None else None
        local_amax = []  # per step: the amax of this rank's part of each weight
        for x, gy in data:
            local_amax.append({n: p.to_local().abs().amax() for n, p in zip(layer.names, layer.p) if n in WEIGHT_ROLES})
            probes = fp8ops.make_probes(state) if recipe is not None else None
            y, new_state = layer(x[rows, cols], state, probes)
            (y * gy[rows, cols]).sum().backward()
            opt.step()
            opt.zero_grad()
            if recipe is not None:
                # every rank of the mesh: the states agree over "dp" and over "tp"
                state = fp8ops.update(new_state, recipe=recipe, grad_amax=probes, group=dist.group.WORLD)

        mine = {}
        for n, p in zip(layer.names, layer.p):
            if not isinstance(p, DTensor) or p.device_mesh != mesh["dp"]:
                bad.append(f"{tag}: parameter {n} is a {type(p).__name__}, not a DTensor shard over 'dp'")
                return
            mine[n] = p.full_tensor().detach()  # this TP rank's shard, gathered over "dp"
        shards: list = [None] * 2
        dist.all_gather_object(shards, mine, group=tp_group)
        got = fp8ops.gather_transformer_params(shards, cfg)
        ref, ref_state = _train_reference(params, data, cfg, recipe)
        for k, v in got.items():
            if recipe is None:
                if not torch.allclose(v, ref[k], rtol=1e-5, atol=1e-5):
                    diff = float((v - ref[k]).abs().max())
                    bad.append(f"{tag}: {k} differs from the single-process one by {diff:.3g}")
            else:
                # the FP8 error budget, on the parameter updates: the error against the FP32
                # single-process update is at most twice (plus 1e-3) the single-process FP8 update's
                d, d_ref, d_fp32 = v - init[k], ref[k] - init[k], fp32[k] - init[k]
                err, budget = _relerr(d, d_fp32), 2 * _relerr(d_ref, d_fp32) + 1e-3
                if err > budget:
                    bad.append(f"{tag}: {k} update error {err:.3g} vs FP32 is over the budget {budget:.3g}")
        if recipe is not None:
            sd = fp8ops.state_dict(state)
            sds: list = [None] * 4
            dist.all_gather_object(sds, sd)
            ref_sd = fp8ops.state_dict(ref_state)
            for k, v in sd.items():
                if any(not torch.equal(o[k], v) for o in sds):
                    bad.append(f"{tag}: state {k} differs across the 4 ranks")
            # each weight role's history holds, per step, the amax of the whole weight: the max
            # over its 4 pieces (a TP shard, all-gathered over "dp" in the forward)
            amaxes: list = [None] * 4
            dist.all_gather_object(amaxes, local_amax)
            for n, role in WEIGHT_ROLES.items():
                want = torch.stack([torch.stack([a[t][n] for a in amaxes]).amax() for t in reversed(range(STEPS))])
                have = sd[f"{role}.amax_history"][:STEPS]
                if not torch.equal(have, want):
                    bad.append(f"{tag}: {role} amax history {have.tolist()}, the weight's amaxes {want.tolist()}")
                # the oldest entry is the initial weight's, as in the single-process run
                if not torch.equal(have[-1], ref_sd[f"{role}.amax_history"][STEPS - 1]):
                    bad.append(f"{tag}: {role} first amax {have[-1]} differs from the single-process one")


def _dp_tp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    _run_worker(_dp_tp, rank, world, init_file, out_dir)


def test_dp_tp_fsdp2_mesh_equals_single_process():
    res = _spawn(_dp_tp_worker, 4)
    assert all(not r["bad"] for r in res), "\n".join(sum((r["bad"] for r in res), []))


# ------------------------------------------------------------------------------------------------
# 2. torch.compile under FSDP2


def _compile_fsdp(rank: int, bad: list[str]) -> None:
    from torch._dynamo.backends.debugging import aot_eager
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    weights = [{"weight": torch.randn(64, H, generator=g) / H**0.5, "bias": torch.randn(64, generator=g)},
               {"weight": torch.randn(H, 64, generator=g) / 8, "bias": torch.randn(H, generator=g)}]
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    data = [(torch.randn(S, B // 2, H, generator=g), torch.randn(S, B // 2, H, generator=g)) for _ in range(STEPS)]

    for recipe_name, recipe in RECIPES.items():
        def linear(p, x, state, probe):
            return fp8ops.fp8_linear(x, p["weight"], p["bias"], state, recipe=recipe, grad_probe=probe)

        results = {}
        for how in ("eager", "layers fullgraph", "root"):
            tag = f"compile under fsdp2/{recipe_name}/{how}"
            model = Chain([OpModule(linear, w) for w in weights])
            for op in model.ops:
                fully_shard(op, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            graphs: list = []

            def backend(gm, example_inputs):
                graphs.append(gm)
                return aot_eager(gm, example_inputs)

            torch._dynamo.reset()
            call = model
            if how == "layers fullgraph":  # each sharded layer's forward; its FSDP2 hooks run around it
                for op in model.ops:
                    op.compile(backend=backend, fullgraph=True)
            elif how == "root":  # the nested layers' FSDP2 hooks break the graph
                call = torch.compile(model, backend=backend, fullgraph=False)
            states = [fp8ops.LinearState.init(recipe) for _ in weights] if recipe is not None else [None] * 2
            for x, gy in data:
                probes = fp8ops.make_probes(states) if recipe is not None else [None] * 2
                y, new = call(x, states, probes)
                (y * gy).sum().backward()
                opt.step()
                opt.zero_grad()
                if recipe is not None:
                    states = fp8ops.update(new, recipe=recipe, grad_amax=probes, group=dist.group.WORLD)
            if how != "eager" and not graphs:
                bad.append(f"{tag}: nothing was compiled")
            out = {f"param {i}": p.full_tensor().detach() for i, p in enumerate(model.parameters())}
            if recipe is not None:
                out.update({f"state {k}": v for k, v in fp8ops.state_dict(states).items()})
            results[how] = out
            if how == "eager":
                continue
            for k, v in out.items():
                if not torch.equal(v, results["eager"][k]):
                    diff = float((v.double() - results["eager"][k].double()).abs().max())
                    bad.append(f"{tag}: {k} differs from the eager FSDP2 run by {diff:.3g}")

        # the root compiled with fullgraph=True meets the nested layers' hooks and raises
        model = Chain([OpModule(linear, w) for w in weights])
        for op in model.ops:
            fully_shard(op, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch._dynamo.reset()
        states = [fp8ops.LinearState.init(recipe) for _ in weights] if recipe is not None else [None] * 2
        try:
            torch.compile(model, backend="aot_eager", fullgraph=True)(data[0][0], states, [None] * 2)
            bad.append(f"compile under fsdp2/{recipe_name}: the root compiled with fullgraph=True did not raise")
        except torch._dynamo.exc.Unsupported:
            pass


def _compile_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    _run_worker(_compile_fsdp, rank, world, init_file, out_dir)


def test_compile_under_fsdp2_equals_eager():
    res = _spawn(_compile_worker, 2)
    assert all(not r["bad"] for r in res), "\n".join(sum((r["bad"] for r in res), []))
