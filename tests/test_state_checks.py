"""Misuse of states, recipes and updates gives the right result or an error that names the function,
the argument, what was expected and what was received; never a silently wrong scale.

One section per rule: a state used with a recipe it was not built for (1), an update that observed
nothing (2), probes passed as grad_amax (3), a missing recipe (4), load_state_dict of bad dicts
(5), recipe hooks that mix states (6), merge of mismatched shapes (7), hand-made states (8) and
margins that flush everything to zero (9).
"""

import math

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops as F
from fp8ops import CurrentScaling, DelayedScaling, FakeQuantState, Format, ScalingState

D = DelayedScaling()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _dq(x, state, recipe):
    q, new = F.quantize(x, state, recipe=recipe)
    return F.dequantize(q), new


# ------------------------------------------------------------------------------------------------
# 1. a state remembers the FP8 dtype and the recipe mode it was built for


def test_init_records_fp8_dtype_and_mode():
    h = DelayedScaling(fp8_format=Format.HYBRID)
    assert (h.init(role="forward").fp8_dtype, h.init(role="forward").mode) == (E4M3, "delayed")
    assert h.init(role="backward").fp8_dtype == E5M2
    assert DelayedScaling(fp8_format=Format.E5M2).init(role="forward").fp8_dtype == E5M2
    assert CurrentScaling().init().mode == "current"
    assert CurrentScaling(granularity="row").init().mode == "rowwise"
    # hand-made states: unknown, not checked
    s = ScalingState(torch.zeros(16), torch.ones(()), torch.zeros(()))
    assert s.fp8_dtype is None and s.mode is None


def test_e5m2_state_with_e4m3_recipe_is_refused():
    e5 = DelayedScaling(fp8_format=Format.E5M2)
    s = e5.update(e5.init(role="forward").observe(torch.tensor(1000.0)))  # scale 57344 / 1000
    e4 = DelayedScaling(fp8_format=Format.E4M3)
    x = torch.full((1, 4), 1000.0)
    with pytest.raises(ValueError, match=r"quantize: state scales forward tensors for torch.float8_e5m2 .*float8_e4m3fn"):
        F.quantize(x, s, recipe=e4)
    with pytest.raises(ValueError, match=r"DelayedScaling.update: state scales forward tensors for torch.float8_e5m2"):
        e4.update(s)
    with pytest.raises(ValueError, match=r"update: states\['a'\]: state scales forward tensors for torch.float8_e5m2"):
        F.update({"a": s}, recipe=e4)
    # the recipe it was built with still works, and HYBRID shares E4M3 for the forward role
    assert torch.allclose(_dq(x, s, e5)[0], x)
    F.quantize(x, D.init(role="forward").replace(calibrated=True), recipe=e4)


def test_current_scaling_state_with_delayed_recipe_is_refused():
    st = FakeQuantState.init(CurrentScaling())
    x = torch.full((2, 3), 1000.0)
    with pytest.raises(ValueError, match=r"fake_quantize: state.input: state was built for a 'current' recipe but "
                                         r"recipe is DelayedScaling \(mode 'delayed'\)"):
        F.fake_quantize(x, st, recipe=D)
    with pytest.raises(ValueError, match="state was built for a 'current' recipe"):
        F.quantize(x, st.input, recipe=D)
    with pytest.raises(ValueError, match="'current' recipe but recipe is DelayedScaling"):
        DelayedScaling(amax_history_len=1).update(st.input.observe(torch.tensor(3.0)))
    with pytest.raises(ValueError, match="'current' recipe but recipe is CurrentScaling \\(mode 'rowwise'\\)"):
        F.quantize(x, st.input, recipe=CurrentScaling(granularity="row"))


def test_static_fields_survive_every_transformation():
    r = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=3)
    s = r.init(role="backward").observe(torch.tensor(2.0))
    want = ("backward", E5M2, "delayed")

    def static(x):
        return (x.role, x.fp8_dtype, x.mode)

    leaves, spec = pytree.tree_flatten(s)
    assert len(leaves) == 3 and static(pytree.tree_unflatten(leaves, spec)) == want
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec  # the context stays serializable
    assert static(s.replace(scale=torch.tensor(2.0))) == want
    assert static(F.merge(s, s)) == want
    batched = s.replace(amax_history=s.amax_history.expand(2, 3), scale=s.scale.expand(2),
                        pending_amax=torch.tensor([1.0, 2.0]))
    assert static(F.merge_batched(batched)) == want
    assert static(r.update(s)) == want and static(F.update({"s": s}, recipe=r)["s"]) == want
    back = F.load_state_dict({"s": r.init(role="backward")}, F.state_dict({"s": s}))["s"]
    assert static(back) == want and torch.equal(back.pending_amax, torch.tensor(2.0))
    assert "fp8_dtype=torch.float8_e5m2" in repr(s) and "mode='delayed'" in repr(s)


def test_merge_refuses_states_of_different_static_fields():
    a = DelayedScaling(fp8_format=Format.E4M3).init()
    b = DelayedScaling(fp8_format=Format.E5M2).init()
    with pytest.raises(ValueError, match=r"merge: the state at \['x'\] of tree 1 has \(role, calibrated, fp8_dtype, "
                                         r"mode\) = \('forward', False, torch.float8_e5m2, 'delayed'\)"):
        F.merge({"x": a}, {"x": b})
    with pytest.raises(ValueError, match="merge: the state at <root> of tree 1"):
        F.merge(a, a.replace(calibrated=True))


def test_static_fields_under_compile_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def build(h, s, p):
        a = ScalingState(h, s, p, role="backward", calibrated=True, fp8_dtype=E5M2, mode="delayed")
        return a.replace(scale=s * 2)

    out = build(torch.zeros(16), torch.ones(()), torch.zeros(()))
    assert (out.fp8_dtype, out.mode, out.scale.item()) == (E5M2, "delayed", 2.0)
    F.quantize(torch.ones(1, 2), out, recipe=D, role="backward")  # accepted by the recipe it matches


# ------------------------------------------------------------------------------------------------
# 2. an update that observed nothing does not calibrate


def test_first_update_calibrates_with_the_observed_amax():
    # hand-computed: HYBRID forward is E4M3, 448 / 3.5 = 128 exactly
    s = D.update(D.init().observe(torch.tensor(3.5)))
    assert s.calibrated and s.scale.item() == 128.0
    assert s.amax_history.tolist() == [3.5] + [0.0] * 15 and s.pending_amax.item() == 0.0
    g = D.update(D.init(role="backward"), grad_amax=torch.tensor(3.5))  # E5M2: 57344 / 3.5 = 16384
    assert g.calibrated and g.scale.item() == 16384.0


@pytest.mark.parametrize("observed", [None, 0.0, math.nan, math.inf, -math.inf])
def test_update_that_observed_nothing_keeps_the_state_uncalibrated(observed):
    s = D.init()
    if observed is not None:
        s = s.observe(torch.tensor(observed))
    new = D.update(s)
    assert not new.calibrated and new.scale.item() == 1.0
    assert new.amax_history.tolist() == [0.0] * 16  # no 0 entry rolled in either
    assert new.pending_amax.item() == 0.0  # the (empty or non-finite) observation is consumed
    assert torch.equal(s.scale, torch.ones(()))  # the input is untouched
    # so the next step still quantizes with current scaling: 1000 does not saturate at 448 (as
    # with scale 1) and 1e-3 does not flush to 0 (below E4M3's smallest subnormal 2**-9)
    assert _dq(torch.tensor([[1000.0]]), new, D)[0].item() == pytest.approx(1000.0, rel=1e-6)
    assert _dq(torch.tensor([[1e-3]]), new, D)[0].item() == pytest.approx(1e-3, rel=1e-6)
    # and the first real observation calibrates it
    cal = D.update(new.observe(torch.tensor(3.5)))
    assert cal.calibrated and cal.scale.item() == 128.0 and cal.amax_history[0].item() == 3.5


def test_tree_update_without_grad_amax_leaves_gradient_roles_uncalibrated():
    st = FakeQuantState.init(D)
    st = st.replace(input=st.input.observe(torch.tensor(7.0)))
    new = F.update(st, recipe=D)  # grad_amax omitted: the backward role observed nothing
    assert new.input.calibrated and new.input.scale.item() == 64.0
    assert not new.grad_output.calibrated and new.grad_output.scale.item() == 1.0
    # a NaN gradient amax on the first step: the same
    new = F.update(st, recipe=D, grad_amax=torch.tensor(math.nan))
    assert not new.grad_output.calibrated and torch.equal(new.grad_output.amax_history, torch.zeros(16))


def test_calibrated_state_that_observed_nothing_rolls_a_zero_and_keeps_its_scale():
    s = D.update(D.init().observe(torch.tensor(7.0)))
    new = D.update(s)
    assert new.calibrated and new.scale.item() == 64.0 and new.amax_history[:2].tolist() == [0.0, 7.0]


def test_calibrated_update_has_no_host_read():
    # Meta tensors have no values: any host read (.item(), .tolist(), bool()) raises. The update of
    # calibrated states, the ops' state plumbing and the internal constructors never read.
    st = {"a": FakeQuantState.init(D, device="meta"), "b": D.init(device="meta")}
    st = pytree.tree_map(lambda s: s.replace(calibrated=True), st, is_leaf=lambda x: isinstance(x, ScalingState))
    st = F.merge(st, st)
    new = F.update(st, recipe=D, grad_amax={"a": torch.zeros((), device="meta"), "b": None})
    assert new["a"].grad_output.scale.device.type == "meta" and new["b"].calibrated
    # An uncalibrated state that no op observed (a gradient role without a probe, an unused role)
    # stays uncalibrated without a read: `observed` is static.
    fresh = F.update(D.init(device="meta"), recipe=D)
    assert not fresh.calibrated and not fresh.observed
    with pytest.raises(NotImplementedError):  # an observed uncalibrated state reads (documented)
        F.update(D.init(device="meta").observe(torch.zeros((), device="meta")), recipe=D)


def test_calibrated_tree_update_traces_with_fullgraph():
    st = FakeQuantState.init(D)
    st = F.update(st.replace(input=st.input.observe(torch.tensor(7.0))), recipe=D, grad_amax=torch.tensor(2.0))
    step = torch.compile(lambda s, g: F.update(s, recipe=D, grad_amax=g), fullgraph=True, backend="aot_eager")
    out = step(st.replace(input=st.input.observe(torch.tensor(3.5))), torch.tensor(7.0))
    assert out.input.scale.item() == 64.0 and out.grad_output.scale.item() == 57344.0 / 7.0


# ------------------------------------------------------------------------------------------------
# 3. probes passed as grad_amax


def _probe_step():
    st = FakeQuantState.init(D)
    probe = torch.zeros((), requires_grad=True)
    y, new = F.fake_quantize(torch.ones(2, 3), st, recipe=D, grad_probe=probe)
    (y * -4.0).sum().backward()
    return new, probe


def test_update_accepts_the_probes_themselves():
    new, probe = _probe_step()
    by_grad = F.update({"l": new}, recipe=D, grad_amax={"l": probe.grad})
    by_probe = F.update({"l": new}, recipe=D, grad_amax={"l": probe})
    assert by_probe["l"].grad_output.calibrated
    assert by_probe["l"].grad_output.scale.item() == by_grad["l"].grad_output.scale.item() == 57344.0 / 4.0
    assert D.update(new.grad_output, grad_amax=probe).scale.item() == 57344.0 / 4.0


def test_probe_without_gradient_and_non_tensor_leaves_are_refused():
    st = {"l": FakeQuantState.init(D)}
    probes = F.make_probes(st)
    with pytest.raises(ValueError, match=r"update: grad_amax\['l'\] is a probe that has no gradient: run backward "
                                         r"first, or pass None"):
        F.update(st, recipe=D, grad_amax=probes)
    with pytest.raises(TypeError, match=r"update: grad_amax\['l'\] must be a Tensor \(a probe gradient, or the probe "
                                        r"itself\) or None, got float"):
        F.update(st, recipe=D, grad_amax={"l": 3.0})
    with pytest.raises(TypeError, match="DelayedScaling.update: grad_amax must be a Tensor .* got int"):
        D.update(D.init(), grad_amax=3)


# ------------------------------------------------------------------------------------------------
# 4. update without a recipe


@pytest.mark.parametrize("recipe,got", [(None, "got None"), ("delayed", "got str 'delayed'"),
                                        (Format.E4M3, "got Format")])
def test_update_needs_a_recipe(recipe, got):
    with pytest.raises(TypeError, match=f"update: recipe must be a fp8ops recipe .*{got}"):
        F.update({"a": D.init()}, recipe=recipe)


# ------------------------------------------------------------------------------------------------
# 5. load_state_dict of bad dicts


def _flat(**kw):
    r = DelayedScaling(amax_history_len=3)
    s = r.update(r.init().observe(torch.tensor(7.0))).observe(torch.tensor(2.0))
    flat = F.state_dict({"a": s})
    flat.update(kw)
    return r, flat


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("a.role", torch.tensor(2, dtype=torch.int8), r"a.role must be one of the codes \[0, 1\], got 2"),
        ("a.role", torch.tensor(1, dtype=torch.int8), r"a.role is 'backward' but like's state at a is 'forward'"),
        ("a.scale", torch.tensor(math.nan), r"a.scale must be finite and > 0 .*got nan"),
        ("a.scale", torch.tensor(math.inf), r"a.scale must be finite and > 0 .*got inf"),
        ("a.scale", torch.tensor(0.0), r"a.scale must be finite and > 0 .*got 0.0"),
        ("a.scale", torch.tensor(-64.0), r"a.scale must be finite and > 0 .*got -64.0"),
        ("a.amax_history", torch.tensor([7.0, math.nan, 0.0]), r"a.amax_history must hold finite amaxes >= 0"),
        ("a.amax_history", torch.tensor([7.0, -1.0, 0.0]), r"a.amax_history must hold finite amaxes >= 0"),
        ("a.pending_amax", torch.tensor(-2.0), r"a.pending_amax must be an amax >= 0 .*got -2.0"),
        ("a.fp8_dtype", torch.tensor(9, dtype=torch.int8), r"a.fp8_dtype must be one of the codes \[0, 1, 2\], got 9"),
        ("fp8ops.schema_version", torch.tensor(2.5), r"'fp8ops.schema_version' must be an integer, got tensor\(2.5"),
        ("fp8ops.schema_version", torch.tensor(True), r"'fp8ops.schema_version' must be an integer, got a bool"),
        ("fp8ops.schema_version", torch.tensor([3, 3]), r"'fp8ops.schema_version' must be a one-element tensor"),
    ],
)
def test_load_state_dict_rejects_bad_values(key, value, match):
    r, flat = _flat(**{key: value})
    with pytest.raises(ValueError, match=f"load_state_dict: {match}"):
        F.load_state_dict({"a": r.init()}, flat)


def test_load_state_dict_rejects_keys_like_does_not_have():
    r = DelayedScaling(amax_history_len=3)
    flat = F.state_dict({"a": r.init(), "b": FakeQuantState.init(r)})
    with pytest.raises(ValueError, match=r"load_state_dict: flat has 14 keys that like does not have: "
                                         r"'b.grad_output.amax_history', .* and 9 more"):
        F.load_state_dict({"a": r.init()}, flat)


def test_load_state_dict_refuses_a_checkpoint_of_another_recipe():
    e5 = DelayedScaling(fp8_format=Format.E5M2, amax_history_len=1)
    flat = F.state_dict({"a": e5.update(e5.init().observe(torch.tensor(1000.0)))})
    e4 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1)
    with pytest.raises(ValueError, match=r"load_state_dict: a was saved with fp8_dtype=torch.float8_e5m2 but like's "
                                         r"state has fp8_dtype=torch.float8_e4m3fn"):
        F.load_state_dict({"a": e4.init()}, flat)
    flat = F.state_dict({"a": CurrentScaling(fp8_format=Format.E5M2).init()})
    with pytest.raises(ValueError, match="a was saved with mode=current but like's state has mode=delayed"):
        F.load_state_dict({"a": DelayedScaling(fp8_format=Format.E5M2, amax_history_len=1).init()}, flat)


def test_load_state_dict_of_version_2_takes_the_new_fields_from_like():
    r, flat = _flat()
    assert F.SCHEMA_VERSION == 3 and flat["a.fp8_dtype"].item() == 1 and flat["a.mode"].item() == 1
    v2 = {k: v for k, v in flat.items() if k not in ("a.fp8_dtype", "a.mode")}
    v2["fp8ops.schema_version"] = torch.tensor(2)
    back = F.load_state_dict({"a": r.init()}, v2)["a"]
    assert (back.fp8_dtype, back.mode, back.calibrated, back.scale.item()) == (E4M3, "delayed", True, 64.0)
    v2["fp8ops.schema_version"] = torch.tensor(2.0)  # an integral float is an integer
    F.load_state_dict({"a": r.init()}, v2)
    with pytest.raises(ValueError, match="flat has 2 keys that like does not have: 'a.fp8_dtype', 'a.mode'"):
        F.load_state_dict({"a": r.init()}, {**flat, "fp8ops.schema_version": torch.tensor(2)})
    # a hand-made state (fields unknown) takes the dict's
    hand = ScalingState(torch.zeros(3), torch.ones(()), torch.zeros(()), calibrated=False)
    back = F.load_state_dict({"a": hand}, flat)["a"]
    assert (back.fp8_dtype, back.mode) == (E4M3, "delayed")


# ------------------------------------------------------------------------------------------------
# 6. recipe hooks that mix the states


def _two_states(r):
    return {"a": r.init().observe(torch.tensor(448.0)), "b": r.init().observe(torch.tensor(4.48))}


def test_amax_compute_algo_must_keep_one_amax_per_state():
    r = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.max())  # reduces across states
    with pytest.raises(ValueError, match=r"DelayedScaling.update: amax_compute_algo must map a history of shape "
                                         r"\(2, 2\) to shape \(2,\), one value per state, got shape \(\)"):
        F.update(_two_states(r), recipe=r)
    ok = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(-1))
    new = F.update(_two_states(ok), recipe=ok)
    assert new["a"].scale.item() == 1.0 and new["b"].scale.item() == pytest.approx(100.0)


def test_scaling_factor_compute_algo_must_keep_one_scale_per_state():
    r = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=lambda a, s, m, rec: (m / a).mean())
    with pytest.raises(ValueError, match=r"scaling_factor_compute_algo must map amaxes of shape \(2,\) to shape "
                                         r"\(2,\), one value per state, got shape \(\)"):
        F.update(_two_states(r), recipe=r)
    r = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=lambda a, s, m, rec: 2.0)
    with pytest.raises(TypeError, match="scaling_factor_compute_algo must return a Tensor, got float"):
        r.update(r.init().observe(torch.tensor(1.0)))


# ------------------------------------------------------------------------------------------------
# 7. merge never broadcasts


def test_merge_refuses_different_history_lengths_and_shapes():
    a = DelayedScaling(amax_history_len=2).init().observe(torch.tensor(1.0))
    b = DelayedScaling(amax_history_len=3).init().observe(torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"merge: tree 1 has shape \(3,\) torch.float32 at \['s'\].amax_history but "
                                         r"tree 0 has \(2,\) torch.float32"):
        F.merge({"s": a}, {"s": b})
    with pytest.raises(ValueError, match=r"merge: tree 2 has shape \(2,\) torch.float32 at \['g'\] but tree 0 has "
                                         r"\(\) torch.float32"):
        F.merge({"g": torch.tensor(1.0)}, {"g": torch.tensor(2.0)}, {"g": torch.tensor([3.0, 4.0])})
    with pytest.raises(ValueError, match=r"merge: tree 1 has shape \(\) torch.float64 at <root>"):
        F.merge(torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"merge: tree 1 holds a Tensor at \['s'\] but tree 0 a ScalingState"):
        F.merge({"s": a}, {"s": torch.tensor(1.0)})


# ------------------------------------------------------------------------------------------------
# 8. hand-made states


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"scale": torch.tensor(0.0)}, ValueError, "scale must be finite and > 0 .*got 0.0"),
        ({"scale": torch.tensor(-1.0)}, ValueError, "scale must be finite and > 0 .*got -1.0"),
        ({"scale": torch.tensor(math.nan)}, ValueError, "scale must be finite and > 0 .*got nan"),
        ({"scale": torch.tensor(math.inf)}, ValueError, "scale must be finite and > 0 .*got inf"),
        ({"amax_history": torch.tensor([1.0, -2.0])}, ValueError, "amax_history must hold finite amaxes >= 0"),
        ({"amax_history": torch.tensor([1.0, math.inf])}, ValueError, "amax_history must hold finite amaxes >= 0"),
        ({"pending_amax": torch.tensor(-1.0)}, ValueError, "pending_amax must be an amax >= 0 or NaN"),
        ({"amax_history": torch.zeros(2, dtype=torch.float64)}, ValueError,
         r"amax_history must be a 1-d float32 tensor, got shape \(2,\) torch.float64"),
        ({"amax_history": torch.zeros(())}, ValueError, r"amax_history must be a 1-d float32 tensor, got shape \(\)"),
        ({"amax_history": torch.zeros(0)}, ValueError, "amax_history must have at least one entry"),
        ({"scale": torch.ones(1)}, ValueError, r"scale must be a 0-d float32 tensor, got shape \(1,\)"),
        ({"pending_amax": 0.0}, ValueError, "pending_amax must be a 0-d float32 tensor, got float"),
        ({"pending_amax": torch.zeros((), device="meta")}, ValueError,
         "amax_history, scale and pending_amax must be on one device, got cpu, cpu and meta"),
        ({"role": "grad"}, ValueError, "role must be 'forward' or 'backward', got 'grad'"),
        ({"calibrated": 1}, TypeError, "calibrated must be a bool, got 1"),
        ({"fp8_dtype": "e4m3"}, TypeError, "fp8_dtype must be a torch.dtype"),
        ({"mode": 3}, TypeError, "mode must be a recipe mode"),
    ],
)
def test_hand_made_state_is_checked(kwargs, err, match):
    args = {"amax_history": torch.zeros(2), "scale": torch.ones(()), "pending_amax": torch.zeros(())}
    static = {k: kwargs.pop(k) for k in ("role", "calibrated", "fp8_dtype", "mode") if k in kwargs}
    args.update(kwargs)
    with pytest.raises(err, match=f"ScalingState: {match}"):
        ScalingState(args["amax_history"], args["scale"], args["pending_amax"], **static)


def test_hand_made_state_builds_where_values_cannot_be_read():
    s = ScalingState(torch.zeros(2, device="meta"), torch.ones((), device="meta"), torch.zeros((), device="meta"))
    assert s.scale.device.type == "meta"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s = ScalingState(torch.zeros(2), torch.ones(()), torch.zeros(()))
    # inside torch.func transforms: per-sample shapes, no value read
    scales = torch.tensor([1.0, 2.0, 4.0])
    out = torch.func.vmap(lambda sc: ScalingState(torch.zeros(2), sc, torch.zeros(())).scale * 2)(scales)
    assert out.tolist() == [2.0, 4.0, 8.0]
    g = torch.func.grad(lambda sc: ScalingState(torch.zeros(2), sc, torch.zeros(())).scale * 3)(torch.tensor(1.0))
    assert g.item() == 3.0
    with pytest.raises(TypeError, match=r"ScalingState.replace: unknown fields \['scal'\]"):
        s.replace(scal=torch.ones(()))
    with pytest.raises(ValueError, match="ScalingState.replace: role must be 'forward' or 'backward'"):
        s.replace(role="input")


# ------------------------------------------------------------------------------------------------
# 9. margins that would flush every value to zero


@pytest.mark.parametrize(
    "fmt,hi", [(Format.E4M3, 14), (Format.E5M2, 29), (Format.HYBRID, 14)],
)
@pytest.mark.parametrize("cls", [DelayedScaling, CurrentScaling])
def test_margin_is_capped_per_format(cls, fmt, hi):
    assert fmt.max_margin() == hi
    cls(fp8_format=fmt, margin=hi)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: margin must be an int in \[0, {hi}\] for "
                                         rf"fp8_format=Format.{fmt.name} .*got {hi + 1}"):
        cls(fp8_format=fmt, margin=hi + 1)


def test_largest_margin_still_represents_the_tensor():
    # the tensor's max lands on fp8_max / 2**margin: 448 / 2**14 = 1.75 * 2**-6, a normal E4M3 value
    r = CurrentScaling(fp8_format=Format.E4M3, margin=14)
    y, _ = _dq(torch.tensor([[1.0, 0.5]]), None, r)
    assert y.tolist() == [[1.0, 0.5]]
    with pytest.raises(ValueError, match=r"CurrentScaling: margin must be an int in \[0, 14\] .*got 64"):
        CurrentScaling(margin=64)


def test_a_nan_observation_round_trips_through_a_checkpoint():
    """A NaN observation is legitimate (a NaN in the data; the next update drops it): a state
    holding one saves and loads, and its update then keeps the state as it was."""
    st = {"a": D.init().observe(torch.tensor(math.nan))}
    back = F.load_state_dict(st, F.state_dict(st))
    assert math.isnan(back["a"].pending_amax.item()) and back["a"].observed
    new = F.update(back, recipe=D)
    assert not new["a"].calibrated and new["a"].scale.item() == 1.0
    assert F.ScalingState(torch.zeros(2), torch.ones(()), torch.tensor(math.nan)).pending_amax.isnan()
