"""FP8 weight all-gather inside FSDP2 (``fp8ops.nn.enable_fp8_all_gather`` before ``fully_shard``)
on CPU with gloo, 2 and 4 ranks, each rank on its part of the batch.

A model of fp8ops.nn modules (Linear -> LayerNormLinear -> LayerNormMLP (swiglu, fc1 with 42 rows)
-> Linear with 33 rows -> Linear without bias -> TransformerLayer (fused QKV; its qkv, proj, fc1
and fc2 weights gathered in FP8); the 42 and 33 rows are sharded unevenly over 4 ranks) trains 3 SGD steps under ``fully_shard`` with the weights of every layer gathered in FP8
(the norms and biases in their own dtype), for DelayedScaling and CurrentScaling, next to the same
model under ``fully_shard`` without it and the single-process model on the whole batch. After each
run:

- the parameters equal those of ``fully_shard`` without FP8 all-gather bit for bit: there the layer
  quantizes the full weight with the same scale into the same bytes, so the FP8 all-gather changes
  nothing but the traffic; and they are within the FP8 error budget of the single-process model
  (as in tests/test_distributed_fsdp.py). With a bfloat16 mixed-precision policy ("delayed-bf16":
  the shard is quantized from FP32, not from its bfloat16 cast) they are within twice the error of
  the run without FP8 all-gather, against FP32;
- no unsharded FP8 weight is read in high precision (dequantized) while the model trains: the
  layers read the gathered bytes only;
- the scaling states are identical on every rank and equal to those without FP8 all-gather (the
  weight roles see the full weight's amax through the update's one all_reduce per step; with the
  bfloat16 policy, the weights' amax histories within 1e-2);
- the all-gathers moved FP8 bytes: FSDP2's all-gather hooks were called for each gathered weight
  in the forward and the backward, with uint8 outputs (padded rows included) and an unsharded
  weight of the param dtype, and every all-gather of a layer's parameters moved one byte per
  element of its gathered weights and the param dtype's bytes for its norm and biases (the
  collective is wrapped and its buffers measured against those of the run without FP8 all-gather);
- ``update_scaling`` without ``group=`` (of the model, or of its LayerNormMLP alone) and
  ``enable_fp8_all_gather`` after ``fully_shard`` raise;
- with every layer compiled (``fullgraph=True``, ``aot_eager``), the model trains as the eager one
  bit for bit, with no graph break.

Each distributed test is one ``spawn_ranks`` (``mp.spawn``, started again once if a rank dies by a
signal): every rank also runs the references, records mismatches instead of raising (so that no rank
is left waiting in a collective), and the test asserts on the records. The argument errors and the
subclasses outside FSDP2 are tested in-process."""

from __future__ import annotations

import functools
import inspect
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import fp8ops
from fp8ops.testing.distributed import count_all_reduces, spawn_ranks
from fp8ops import _fsdp

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]

S, B = 8, 4  # (S, B, 16) batches; each of the w ranks takes B/w sequences
STEPS, LR = 3, 0.5
# layer -> its weights gathered in FP8 (the norms' parameters and the biases gather in their own dtype)
GATHERED = {"0": ("weight",), "1": ("weight",), "2": ("fc1_weight", "fc2_weight"), "3": ("weight",),
            "4": ("weight",), "5": ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")}


_DEVICE = ["cpu"]  # this process's device: "cpu" (gloo) or its GPU (NCCL)


def _model(recipe) -> torch.nn.Sequential:
    """The same initial parameters on every rank; fc1 of layer 2 has 42 rows and layer 3 has 33
    (uneven FSDP2 shards)."""
    torch.manual_seed(0)
    return _on_device(torch.nn.Sequential(
        fp8ops.nn.Linear(16, 32, recipe=recipe),
        fp8ops.nn.LayerNormLinear(32, 48, recipe=recipe),
        fp8ops.nn.LayerNormMLP(48, 21, activation="swiglu", recipe=recipe),
        fp8ops.nn.Linear(48, 33, recipe=recipe),
        fp8ops.nn.Linear(33, 16, bias=False, recipe=recipe),
        fp8ops.nn.TransformerLayer(16, 24, 4, recipe=recipe, hidden_dropout=0.0, attention_dropout=0.0,
                                   self_attn_mask_type="causal"),
    ))


def _on_device(model: torch.nn.Module) -> torch.nn.Module:
    return model.to(_DEVICE[0])


def _recipe(name: str):
    return {"delayed": fp8ops.DelayedScaling(), "current": fp8ops.CurrentScaling(), "none": None}[name]


def _data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(S, B, 16, generator=g).to(_DEVICE[0]), torch.randn(S, B, 16, generator=g).to(_DEVICE[0]))
            for _ in range(STEPS)]


def _train(model, data, recipe, group=None, calls=None, per_step=None):
    """STEPS SGD steps on ``data`` with one update (over ``group``) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, gy in data:
        (model(x) * gy).mean().backward()
        opt.step()
        opt.zero_grad()
        if recipe is not None:
            n = len(calls) if calls is not None else 0
            fp8ops.nn.update_scaling(model, group=group)
            if per_step is not None:
                per_step.append(len(calls) - n)


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _states(model) -> dict[str, torch.Tensor]:
    """The scaling states of every layer, on the CPU (compared across ranks, whose GPUs differ)."""
    return {f"{i}.{k}": v.cpu() for i, m in enumerate(model) for k, v in m.scaling_state_dict().items()}


class _Spy:
    """Records FSDP2's all-gathers (output dtype and bytes) and the calls
    of the FP8 all-gather hooks (dtype and shape of their outputs; for the post-all-gather hook,
    the dtype of the unsharded parameter)."""

    def __init__(self) -> None:
        self.gathers: list[tuple[torch.dtype, int]] = []
        self.hooks: list[tuple[str, torch.dtype, tuple[int, ...], torch.dtype | None]] = []
        self.pre_in_backward: list[bool] = []  # per pre-all-gather hook call: inside the backward pass
        self.casts = 0  # shards quantized by the hooks
        self.dequantized = 0  # unsharded FP8 weights read in high precision (an op other than the layer's)
        self._saved: list = []

    def __enter__(self) -> _Spy:
        # FSDP2's all-gather: dist.all_gather_single (torch >= 2.13) or dist.all_gather_into_tensor
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        orig_ag = getattr(dist, name)
        pre, post = _fsdp.FP8AllGatherWeight.fsdp_pre_all_gather, _fsdp.FP8AllGatherWeight.fsdp_post_all_gather
        quantize, dequantize = _fsdp.fp8_group_quantize, _fsdp.GatheredFP8Weight.dequantize

        def fp8_group_quantize(*args, **kwargs):
            self.casts += 1
            return quantize(*args, **kwargs)

        def count_dequantize(w):
            self.dequantized += 1
            return dequantize(w)

        def all_gather_single(output_tensor, input_tensor, *args, **kwargs):
            self.gathers.append((output_tensor.dtype, output_tensor.numel() * output_tensor.element_size()))
            return orig_ag(output_tensor, input_tensor, *args, **kwargs)

        @functools.wraps(pre)
        def fsdp_pre_all_gather(w, mesh, outer_size, outer_stride, module, mp_policy):
            inputs, meta = pre(w, mesh, outer_size, outer_stride, module, mp_policy)
            self.hooks += [("pre", t.dtype, tuple(outer_size), None) for t in inputs]
            self.pre_in_backward.append(torch._C._current_graph_task_id() != -1)
            return inputs, meta

        @functools.wraps(post)
        def fsdp_post_all_gather(w, outputs, metadata, param_dtype, *, out=None):
            res = post(w, outputs, metadata, param_dtype, out=out)
            unsharded = out if res is None else res[0]
            self.hooks += [("post", t.dtype, tuple(t.shape), unsharded.dtype) for t in outputs]
            return res

        self._saved = [name, orig_ag, pre, post, quantize, dequantize]
        setattr(dist, name, all_gather_single)
        _fsdp.GatheredFP8Weight.dequantize = count_dequantize
        _fsdp.fp8_group_quantize = fp8_group_quantize
        _fsdp.FP8AllGatherWeight.fsdp_pre_all_gather = fsdp_pre_all_gather
        _fsdp.FP8AllGatherWeight.fsdp_post_all_gather = fsdp_post_all_gather
        return self

    def __exit__(self, *exc) -> None:
        name, orig_ag, pre, post, quantize, dequantize = self._saved
        setattr(dist, name, orig_ag)
        _fsdp.GatheredFP8Weight.dequantize = dequantize
        _fsdp.fp8_group_quantize = quantize
        _fsdp.FP8AllGatherWeight.fsdp_pre_all_gather = pre
        _fsdp.FP8AllGatherWeight.fsdp_post_all_gather = post


def _fsdp_run(recipe, local, world, group, fp8_gather: bool, tag: str, bad: list[str], param_dtype=None,
              compile_backend=None):
    """The model under fully_shard (each layer, then the root; ``param_dtype``: a mixed-precision
    policy with FP32 reduction; ``compile_backend``: each layer compiled with fullgraph=True), trained
    on this rank's data. Returns (model, spy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(recipe)
    if fp8_gather:
        names = fp8ops.nn.enable_fp8_all_gather(model)
        if names != list(GATHERED):
            bad.append(f"{tag}: enable_fp8_all_gather selected {names}, expected {list(GATHERED)}")
    mesh = init_device_mesh(torch.device(_DEVICE[0]).type, (world,))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        if compile_backend is not None:
            layer.compile(backend=compile_backend, fullgraph=True)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    per_step: list[int] = []
    with count_all_reduces() as calls, _Spy() as spy:
        _train(model, local, recipe, group, calls, per_step)
    if per_step != [1] * STEPS:
        bad.append(f"{tag}: the update made {per_step} all_reduce calls per step, expected one each")
    return model, spy


def _full_params(model, tag: str, bad: list[str], fp8_gather: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.named_parameters():
        if type(v).__name__ != "DTensor":
            bad.append(f"{tag}: parameter {k} is a {type(v).__name__}, not a DTensor shard")
            continue
        layer, name = k.split(".", 1)
        gathered = fp8_gather and name in GATHERED[layer]
        if gathered != isinstance(v._local_tensor, _fsdp.FP8AllGatherWeight):
            bad.append(f"{tag}: the shard of {k} is a {type(v._local_tensor).__name__}")
        out[k] = v.full_tensor().detach()
        if type(out[k]) is not torch.Tensor:
            bad.append(f"{tag}: {k}.full_tensor() is a {type(out[k]).__name__}, expected a plain tensor")
    return out


def _check_traffic(tag: str, spy: _Spy, plain: _Spy, world: int, param_dtype: torch.dtype, bad: list[str]) -> None:
    """Every all-gather of a layer moved one byte per element of its FP8 weights, and the unsharded
    weights have the param dtype."""
    itemsize = param_dtype.itemsize
    # bytes one all-gather of each layer moves without and with FP8 weights (FSDP2 pads each
    # parameter's shard to ceil(rows / w) rows; with several dtypes the buffer is bytes)
    plain_to_fp8: dict[int, int] = {}
    for i, layer in enumerate(_model(None)):
        size = fp8 = 0
        for name, p in layer.named_parameters():
            padded = -(-p.shape[0] // world) * world * p[0].numel()
            size += padded * itemsize
            fp8 += padded * (1 if name in GATHERED[str(i)] else itemsize)
        plain_to_fp8[size] = fp8
    if len(set(plain_to_fp8.values())) != len(plain_to_fp8):
        bad.append(f"{tag}: test setup: layers with equal all-gather sizes {plain_to_fp8}")
    hooks = {(kind, dt, unsharded) for kind, dt, _, unsharded in spy.hooks}
    if hooks != {("pre", torch.uint8, None), ("post", torch.uint8, param_dtype)}:
        bad.append(f"{tag}: the FP8 all-gather hooks produced {sorted(map(str, hooks))}, expected uint8 in and out "
                   f"and a {param_dtype} unsharded weight")
    # each gathered weight: forward and backward all-gathers (the root's layers reshard after the
    # forward), every step
    n_pre, n_weights = sum(h[0] == "pre" for h in spy.hooks), sum(map(len, GATHERED.values()))
    if n_pre != 2 * n_weights * STEPS or n_pre != sum(h[0] == "post" for h in spy.hooks):
        bad.append(f"{tag}: {n_pre} pre-all-gather hook calls, expected {2 * n_weights * STEPS}, as many "
                   f"post-all-gather calls")
    posts = {h[2] for h in spy.hooks if h[0] == "post"}
    expected = {(-(-n // world) * world, k) for n, k in ((32, 16), (48, 32), (42, 48), (48, 21), (33, 48), (16, 33),
                                                         (48, 16), (16, 16), (24, 16), (16, 24))}
    if posts != expected:
        bad.append(f"{tag}: the all-gather outputs were {sorted(posts)}, expected {sorted(expected)} (padded rows)")
    got = sorted(n for _, n in spy.gathers)
    want = sorted(plain_to_fp8.get(n, n) for _, n in plain.gathers)
    if got != want:
        bad.append(f"{tag}: all-gathers of {got} bytes, expected {want} (the run without FP8 all-gather moved "
                   f"{sorted(n for _, n in plain.gathers)})")


def _compiled_case(case: str, rank: int, world: int, group, bad: list[str]) -> None:
    """``case`` "delayed-compile": every layer compiled with ``fullgraph=True`` (``aot_eager``: the
    eager kernels, so that the comparison is exact) over the FP8-gathered weights trains as the eager
    model, parameters and states bit for bit, with no graph break."""
    from torch._dynamo.utils import counters

    recipe, tag = _recipe(case.partition("-")[0]), f"w{world}/{case}"
    local = [(x.chunk(world, dim=1)[rank], gy.chunk(world, dim=1)[rank]) for x, gy in _data()]
    eager, _ = _fsdp_run(recipe, local, world, group, True, f"{tag}/eager", bad)
    torch._dynamo.reset()
    counters.clear()
    model, spy = _fsdp_run(recipe, local, world, group, True, tag, bad, compile_backend="aot_eager")
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    if breaks or graphs < len(model):
        bad.append(f"{tag}: {breaks} graph breaks and {graphs} graphs for {len(model)} compiled layers")
    if spy.casts == 0 or spy.dequantized:
        bad.append(f"{tag}: {spy.casts} shards quantized for FP8 all-gathers, {spy.dequantized} unsharded weights "
                   f"dequantized (expected some and none)")
    params, eager_params = _full_params(model, tag, bad, True), _full_params(eager, f"{tag}/eager", bad, True)
    for k, p in params.items():
        if not torch.equal(p, eager_params[k]):
            bad.append(f"{tag}: {k} differs from the eager run by {float((p - eager_params[k]).abs().max()):.3g}")
    sd, eager_sd = _states(model), _states(eager)
    for k, v in sd.items():
        if not torch.equal(v, eager_sd[k]):
            bad.append(f"{tag}: state {k} {v.tolist()} differs from the eager run's {eager_sd[k].tolist()}")


def _inductor_case(case: str, rank: int, world: int, group, bad: list[str]) -> None:
    """``case`` "delayed-bf16-inductor" (GPUs): every layer compiled with Inductor (``fullgraph=True``)
    over FP8-gathered weights, with a bfloat16 mixed-precision policy, trains with no graph break and
    each parameter's update within twice the eager FP8 all-gather run's error against FP32 (+1e-3)."""
    from torch._dynamo.utils import counters

    recipe, tag = _recipe(case.partition("-")[0]), f"w{world}/{case}"
    data = _data()
    local = [(x.chunk(world, dim=1)[rank], gy.chunk(world, dim=1)[rank]) for x, gy in data]
    init = {k: v.detach().clone() for k, v in _model(None).named_parameters()}
    fp32 = _model(None)
    _train(fp32, data, None)
    eager, _ = _fsdp_run(recipe, local, world, group, True, f"{tag}/eager", bad, torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    model, spy = _fsdp_run(recipe, local, world, group, True, tag, bad, torch.bfloat16, compile_backend="inductor")
    breaks = sum(counters["graph_break"].values())
    if breaks or spy.casts == 0 or spy.dequantized:
        bad.append(f"{tag}: {breaks} graph breaks, {spy.casts} shards quantized, {spy.dequantized} unsharded weights "
                   f"dequantized (expected none, some, none)")
    params, eager_params = _full_params(model, tag, bad, True), _full_params(eager, f"{tag}/eager", bad, True)
    fp32_params = dict(fp32.named_parameters())
    for k, p in params.items():
        d_fp32 = fp32_params[k].detach() - init[k]
        err, budget = _relerr(p - init[k], d_fp32), 2 * _relerr(eager_params[k] - init[k], d_fp32) + 1e-3
        if err > budget:
            bad.append(f"{tag}: {k} update error {err:.3g} vs FP32 is over the budget {budget:.3g}")


def _case(case: str, rank: int, world: int, group, bad: list[str]) -> None:
    """``case``: "delayed" or "current" (FP32 parameters), or "delayed-bf16" (a bfloat16
    mixed-precision policy: the unsharded weights and the compute in bfloat16); "delayed-compile":
    :func:`_compiled_case`; "delayed-bf16-inductor": :func:`_inductor_case`."""
    if case.endswith("-compile"):
        return _compiled_case(case, rank, world, group, bad)
    if case.endswith("-inductor"):
        return _inductor_case(case, rank, world, group, bad)
    recipe_name, _, low = case.partition("-")
    recipe = _recipe(recipe_name)
    param_dtype = torch.bfloat16 if low == "bf16" else None
    tag = f"w{world}/{case}"
    data = _data()
    local = [(x.chunk(world, dim=1)[rank], gy.chunk(world, dim=1)[rank]) for x, gy in data]

    init = {k: v.detach().clone() for k, v in _model(None).named_parameters()}
    fp32 = _model(None)
    _train(fp32, data, None)
    plain, plain_spy = _fsdp_run(recipe, local, world, group, False, f"{tag}/plain", bad, param_dtype)
    model, spy = _fsdp_run(recipe, local, world, group, True, tag, bad, param_dtype)
    params = _full_params(model, tag, bad, True)
    plain_params = _full_params(plain, f"{tag}/plain", bad, False)
    fp32_params = {k: v.detach() for k, v in fp32.named_parameters()}
    if param_dtype is None:
        ref = _model(recipe)
        _train(ref, data, recipe)
        ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    else:
        ref_params = plain_params  # the budget: that of fully_shard without FP8 all-gather
    if sorted(params) != sorted(ref_params):
        bad.append(f"{tag}: parameters {sorted(params)}, expected {sorted(ref_params)}")
        return
    for k, p in params.items():
        # FP32 parameters: the same FP8 weights as without FP8 all-gather (there the layer
        # quantizes the gathered FP32 weight with the same scale), the same GEMMs, the same
        # result. With a bfloat16 policy the shard is quantized from FP32, not from its bfloat16
        # cast: FP8 rounding may differ, within the budget below.
        if param_dtype is None and not torch.equal(p, plain_params[k]):
            bad.append(f"{tag}: {k} differs from fully_shard without FP8 all-gather by "
                       f"{float((p - plain_params[k]).abs().max()):.3g}")
        d, d_ref, d_fp32 = p - init[k], ref_params[k] - init[k], fp32_params[k] - init[k]
        err, budget = _relerr(d, d_fp32), 2 * _relerr(d_ref, d_fp32) + 1e-3
        if err > budget:
            bad.append(f"{tag}: {k} update error {err:.3g} vs FP32 is over the budget {budget:.3g}")

    sd, plain_sd = _states(model), _states(plain)
    sds: list = [None] * world
    dist.all_gather_object(sds, sd, group=group)
    if sorted(sd) != sorted(plain_sd):
        bad.append(f"{tag}: state keys {sorted(sd)}, expected {sorted(plain_sd)}")
        return
    for k, v in sd.items():
        if any(not torch.equal(o[k], v) for o in sds):
            bad.append(f"{tag}: state {k} differs across ranks")
        if param_dtype is None:
            same = torch.equal(v, plain_sd[k])
        elif any(k.startswith(f"{i}.{w}") for i, ws in GATHERED.items() for w in ws) and "amax_history" in k:
            # the FP32 weight's amax, not its bfloat16 cast's
            same = torch.allclose(v, plain_sd[k], rtol=1e-2, atol=0)
        else:
            same = not k.endswith("calibrated") or torch.equal(v, plain_sd[k])
        if not same:
            bad.append(f"{tag}: state {k} {v.tolist()} differs from the one without FP8 all-gather "
                       f"{plain_sd[k].tolist()}")
    _check_traffic(tag, spy, plain_spy, world, param_dtype or torch.float32, bad)
    if spy.dequantized:  # the layers read the gathered bytes only
        bad.append(f"{tag}: {spy.dequantized} unsharded FP8 weights were read in high precision while training")
    # the backward pass's gathers send the bytes their forward cast: one cast per forward gather
    forward_gathers = spy.pre_in_backward.count(False)
    if spy.casts != forward_gathers or forward_gathers == len(spy.pre_in_backward):
        bad.append(f"{tag}: {spy.casts} shards quantized for {forward_gathers} forward and "
                   f"{len(spy.pre_in_backward) - forward_gathers} backward all-gathers; expected one per forward "
                   f"all-gather and some backward all-gathers")

    # the errors, identical on every rank (raised before any collective)
    for part in (model, model[2]):  # the model, and a LayerNormMLP alone (no attribute "weight")
        try:
            fp8ops.nn.update_scaling(part)
            bad.append(f"{tag}: update_scaling({type(part).__name__}) without group= did not raise")
        except ValueError as e:
            if "group" not in str(e):
                bad.append(f"{tag}: update_scaling without group=: {e}")
    try:
        fp8ops.nn.enable_fp8_all_gather(plain)
        bad.append(f"{tag}: enable_fp8_all_gather after fully_shard did not raise")
    except ValueError as e:
        if "before fully_shard" not in str(e):
            bad.append(f"{tag}: enable_fp8_all_gather after fully_shard: {e}")


def _worker(rank: int, world: int, init_file: str, out_dir: str, cases: tuple[str, ...], backend: str = "gloo"
            ) -> None:
    # fp8ops.nn.Linear returns a reshaped (view) output, which FSDP2 warns about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        _DEVICE[0] = f"cuda:{rank}"
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
    bad: list[str] = []
    t0 = time.perf_counter()
    try:
        for case in cases:
            try:
                _case(case, rank, world, dist.group.WORLD, bad)
            except Exception as e:  # recorded; the test fails on it
                bad.append(f"w{world}/{case}: {type(e).__name__}: {e}")
                raise
    finally:
        torch.save({"bad": bad, "seconds": time.perf_counter() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _spawn(world: int, *cases: str, backend: str = "gloo") -> list[dict]:
    return spawn_ranks(_worker, world, lambda init, d: (world, init, d, cases, backend))


def test_fsdp2_fp8_all_gather_2_ranks_delayed_current_and_bf16_policy():
    for r in _spawn(2, "delayed", "current", "delayed-bf16"):
        assert not r["bad"], "\n".join(r["bad"])


def test_fsdp2_fp8_all_gather_compiled_layers_train_as_eager():
    for r in _spawn(2, "delayed-compile"):
        assert not r["bad"], "\n".join(r["bad"])


def test_fsdp2_fp8_all_gather_4_ranks_delayed_and_current():
    for r in _spawn(4, "delayed", "current"):
        assert not r["bad"], "\n".join(r["bad"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 GPUs and NCCL")
def test_fsdp2_fp8_all_gather_nccl_two_gpus():
    """The same checks over NCCL, one rank per GPU: the GPU kernels, FSDP2's streams, and the
    backward's transposed copy of the bytes FSDP2 gathered again into the forward's storage; and
    the layers compiled with Inductor over FP8-gathered weights in bfloat16, within the FP8 budget."""
    cases = ("delayed", "current", "delayed-bf16", "delayed-compile", "delayed-bf16-inductor")
    for r in _spawn(2, *cases, backend="nccl"):
        assert not r["bad"], "\n".join(r["bad"])


# ------------------------------------------------------------------------------------------------
# In-process: the arguments, and the subclasses outside fully_shard


@pytest.mark.parametrize("recipe, match", [
    (fp8ops.CurrentScaling(granularity="row"), "row-wise"),
    (fp8ops.DelayedScaling(fprop=fp8ops.GemmSpec(precision="high")), "fprop='high'"),
    (fp8ops.DelayedScaling(dgrad=fp8ops.GemmSpec(precision="high")), "dgrad='high'"),
])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_enable_fp8_all_gather_rejects_recipes_without_a_per_tensor_fp8_weight(recipe, match, kind):
    model = torch.nn.Sequential(fp8ops.nn.Linear(16, 32, recipe=fp8ops.DelayedScaling()),
                                getattr(fp8ops.nn, kind)(32, 16, recipe=recipe))
    with pytest.raises(ValueError, match=rf"enable_fp8_all_gather: layer '1' has a .*{match}"):
        fp8ops.nn.enable_fp8_all_gather(model)
    # the filter leaves the layer out
    assert fp8ops.nn.enable_fp8_all_gather(model, filter=lambda fqn, m: fqn != "1") == ["0"]
    assert {k for k, p in model.named_parameters() if isinstance(p, _fsdp.FP8AllGatherWeight)} == {"0.weight"}


def test_enable_fp8_all_gather_argument_errors():
    r = fp8ops.DelayedScaling()
    with pytest.raises(TypeError, match="enable_fp8_all_gather: model must be a torch.nn.Module, got dict"):
        fp8ops.nn.enable_fp8_all_gather({"w": torch.zeros(2, 2)})
    with pytest.raises(TypeError, match="enable_fp8_all_gather: filter must be a callable"):
        fp8ops.nn.enable_fp8_all_gather(fp8ops.nn.Linear(16, 16, recipe=r), filter="0")
    none = "found no fp8ops.nn.Linear, LayerNormLinear, LayerNormMLP or TransformerLayer with a recipe"
    with pytest.raises(ValueError, match=none):
        fp8ops.nn.enable_fp8_all_gather(torch.nn.Sequential(  # no recipe: nothing of theirs is FP8
            fp8ops.nn.Linear(16, 16), fp8ops.nn.LayerNormLinear(16, 16), fp8ops.nn.LayerNormMLP(16, 16),
            fp8ops.nn.TransformerLayer(32, 64, 4), torch.nn.Linear(16, 16)))
    # a TransformerLayer's GEMM weights; separate q, k, v weights (quantized together) are not gathered in FP8
    for fuse, names in ((True, {"qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"}),
                        (False, {"proj.weight", "fc1.weight", "fc2.weight"})):
        layer = fp8ops.nn.TransformerLayer(32, 64, 4, recipe=r, fuse_qkv_params=fuse)
        assert fp8ops.nn.enable_fp8_all_gather(layer) == [""]
        assert {k for k, p in layer.named_parameters() if isinstance(p, _fsdp.FP8AllGatherWeight)} == names
    with pytest.raises(ValueError, match=none):
        fp8ops.nn.enable_fp8_all_gather(fp8ops.nn.Linear(16, 16, recipe=r), filter=lambda fqn, m: False)


def test_enable_fp8_all_gather_outside_fully_shard_changes_nothing():
    """Without fully_shard the wrapped weight computes as the plain one; tied weights stay tied."""
    r = fp8ops.DelayedScaling()
    x, gy = torch.randn(3, 5, 16), torch.randn(3, 5, 16)

    def run(enable: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(fp8ops.nn.Linear(16, 16, recipe=r), fp8ops.nn.Linear(16, 16, recipe=r),
                                    fp8ops.nn.Linear(16, 16), fp8ops.nn.LayerNormLinear(16, 16, recipe=r),
                                    fp8ops.nn.LayerNormMLP(16, 8, activation="swiglu", recipe=r))
        model[1].weight = model[0].weight  # tied
        if enable:
            assert fp8ops.nn.enable_fp8_all_gather(model) == ["0", "1", "3", "4"]
            assert fp8ops.nn.enable_fp8_all_gather(model) == ["0", "1", "3", "4"]  # again: nothing changes
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            (model(x) * gy).sum().backward()
            opt.step()
            opt.zero_grad()
            fp8ops.nn.update_scaling(model)
        return model

    plain, model = run(False), run(True)
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, _fsdp.FP8AllGatherWeight)
    assert type(model[2].weight) is torch.nn.Parameter
    wrapped = {k for k, p in model.named_parameters() if isinstance(p, _fsdp.FP8AllGatherWeight)}
    assert wrapped == {"0.weight", "3.weight", "4.fc1_weight", "4.fc2_weight"}  # not the norms and biases
    assert [model[4].fc1_weight._role, model[4].fc2_weight._role] == ["fc1_weight", "fc2_weight"]
    assert sorted(model.state_dict()) == sorted(plain.state_dict())
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k
    assert _states(model).keys() == _states(plain).keys()
    for k, v in _states(model).items():
        assert torch.equal(v, _states(plain)[k]), k


def test_sharded_weight_ops_on_flat_and_nested_arguments():
    """Ops on the wrapped shard run on the tensor inside, whether it comes alone, in the flat lists of
    the optimizers' foreach ops (unwrapped without pytree) or nested (pytree); the ops FSDP2 shards
    with keep the subclass and the owner and role of the first wrapped argument."""
    m = fp8ops.nn.Linear(4, 6, recipe=fp8ops.DelayedScaling())
    other = fp8ops.nn.Linear(4, 6, recipe=fp8ops.DelayedScaling())
    fp8ops.nn.enable_fp8_all_gather(m)
    fp8ops.nn.enable_fp8_all_gather(other)
    w, w2 = m.weight.detach(), other.weight.detach()
    a, b = w._tensor.clone(), w2._tensor.clone()
    plain = torch.randn(6)
    out = torch._foreach_mul([w, w2, plain], 2.0)  # flat list, mixed with a plain tensor
    assert [type(t) for t in out] == [torch.Tensor] * 3
    assert torch.equal(out[0], a * 2) and torch.equal(out[1], b * 2) and torch.equal(out[2], plain * 2)
    t1, t2 = torch.randn(6, 4), torch.randn(6, 4)
    torch._foreach_addcdiv_([w, w2], [t1, t2], [torch.ones(6, 4)] * 2, [0.5, 0.25])  # in place, scalar list
    assert torch.equal(w._tensor, a + 0.5 * t1) and torch.equal(w2._tensor, b + 0.25 * t2)
    assert torch.equal(m.weight._tensor, w._tensor)  # the parameter's own storage
    assert isinstance(w, _fsdp.FP8AllGatherWeight)
    pieces = torch.split(w2, 3)  # kept as the subclass, with the first wrapped argument's owner and role
    assert all(type(p) is _fsdp.FP8AllGatherWeight and p._owner() is other and p._role == "weight" for p in pieces)
    c = torch.cat([w, w2])  # a list inside the arguments
    assert type(c) is torch.Tensor and torch.equal(c, torch.cat([w._tensor, w2._tensor]))
    s = torch.stack([w, w2], dim=0)
    assert torch.equal(s, torch.stack([w._tensor, w2._tensor]))
    n = torch.add(w, w2, alpha=2.0)  # a keyword argument: the general path
    assert torch.equal(n, w._tensor + 2.0 * w2._tensor)
    assert _fsdp._unwrap_flat(_fsdp.FP8AllGatherWeight, ([[w]],)) is None  # nested lists: pytree
    assert _fsdp._unwrap_flat(_fsdp.FP8AllGatherWeight, ([plain], 1.0)) is None  # nothing wrapped


def test_pre_all_gather_hook_signature_is_stored():
    """FSDP2 reads inspect.signature of the shard's hook at every all-gather: the five-parameter
    signature it expects, one stored object (no new Signature per read); through the class the hook
    takes the shard first, as the function would."""
    m = fp8ops.nn.Linear(4, 6, recipe=fp8ops.DelayedScaling())
    fp8ops.nn.enable_fp8_all_gather(m)
    w = m.weight
    sig = inspect.signature(w.fsdp_pre_all_gather)
    assert list(sig.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
    assert inspect.signature(w.fsdp_pre_all_gather) is sig
    cls_sig = inspect.signature(_fsdp.FP8AllGatherWeight.fsdp_pre_all_gather)
    assert list(cls_sig.parameters) == ["self", "mesh", "outer_size", "outer_stride", "module", "mp_policy"]
    with pytest.raises(ValueError, match="needs row shards"):  # the hook's own check, reached both ways
        w.fsdp_pre_all_gather(None, torch.Size([6, 8]), (8, 1), m, None)
    with pytest.raises(ValueError, match="needs row shards"):
        _fsdp.FP8AllGatherWeight.fsdp_pre_all_gather(w, None, torch.Size([6, 8]), (8, 1), m, None)


def test_gathered_weight_reads_as_its_dequantized_value_and_refuses_in_place_ops():
    w = torch.randn(8, 4)
    q, _ = fp8ops.quantize(w, None, recipe=fp8ops.CurrentScaling())
    g = _fsdp.GatheredFP8Weight(q.data.view(torch.uint8), q.inv_scale,
                                w.abs().amax(), q.data.dtype, torch.bfloat16)
    assert g.shape == (8, 4) and g.dtype == torch.bfloat16
    deq = (q.data.float() * q.inv_scale).to(torch.bfloat16)
    assert type(g + 0) is torch.Tensor and torch.equal(g + 0, deq)
    assert torch.equal(g.detach().dequantize(), deq)
    with pytest.raises(RuntimeError, match="GatheredFP8Weight: .*modify the sharded parameter"):
        g.add_(1)


class _TiedLM(torch.nn.Module):
    """Embedding -> Linear -> Linear head whose weight is the embedding's."""

    def __init__(self, recipe) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.mid = fp8ops.nn.Linear(32, 32, recipe=recipe)
        self.head = fp8ops.nn.Linear(32, 64, bias=False, recipe=recipe)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.mid(self.emb(tokens)))


def test_enable_fp8_all_gather_refuses_a_weight_tied_to_another_module():
    """An embedding would read the tied weight as its FP8 value under fully_shard: refused."""
    model = _TiedLM(fp8ops.DelayedScaling())
    with pytest.raises(ValueError, match="weight of layer 'head' is also a parameter of 'emb' .Embedding.*filter="):
        fp8ops.nn.enable_fp8_all_gather(model)
    assert type(model.head.weight) is torch.nn.Parameter  # nothing swapped
    assert fp8ops.nn.enable_fp8_all_gather(model, filter=lambda fqn, m: fqn != "head") == ["mid"]
    assert model.head.weight is model.emb.weight and type(model.emb.weight) is torch.nn.Parameter
    # a weight that is also another (not gathered) parameter of a selected layer: refused as well
    mlp = fp8ops.nn.LayerNormMLP(16, 16, activation="gelu", recipe=fp8ops.DelayedScaling())
    mlp.register_parameter("extra", mlp.fc2_weight)
    with pytest.raises(ValueError, match="fc2_weight of model is also a parameter of '' .LayerNormMLP, as 'extra'"):
        fp8ops.nn.enable_fp8_all_gather(mlp)
