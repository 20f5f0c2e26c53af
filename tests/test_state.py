"""ScalingState / OpState: pytree behaviour, immutability, merge, tree update, dict round-trip."""

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops import DelayedScaling, FakeQuantState, Format, ScalingState


def _model_states(r):
    return {
        "blocks": [FakeQuantState.init(r), FakeQuantState.init(r)],
        "head": r.init(role="forward"),
    }


def test_scaling_state_is_a_pytree_with_static_fields():
    s = DelayedScaling(amax_history_len=4).init(role="backward")
    leaves, spec = pytree.tree_flatten(s)
    assert len(leaves) == 3 and all(isinstance(t, torch.Tensor) for t in leaves)
    back = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(back, ScalingState) and back.role == "backward" and back.calibrated is False
    assert torch.equal(back.scale, torch.tensor(2.0))
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(s)[0]]
    assert paths == [".amax_history", ".scale", ".pending_amax"]


def test_states_are_immutable():
    s = DelayedScaling().init()
    with pytest.raises(Exception):
        s.scale = torch.tensor(2.0)  # type: ignore[misc]
    st = FakeQuantState.init(DelayedScaling())
    with pytest.raises(AttributeError, match="immutable"):
        st.input = s  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing"):
        FakeQuantState(input=s)


def test_observe_max_merges_and_propagates_nan():
    s = DelayedScaling().init()
    s = s.observe(torch.tensor(3.0)).observe(torch.tensor(2.0))
    assert s.pending_amax.item() == 3.0
    assert torch.isnan(s.observe(torch.tensor(float("nan"))).pending_amax)


def test_an_op_observation_on_a_state_with_nothing_pending_is_the_amax_itself():
    # observed False promises pending_amax == 0, so max(0, amax) is amax: ops record it as it is.
    r = DelayedScaling()
    fresh = r.init()
    assert fresh.observed is False
    amax = torch.tensor(3.0)
    s = fresh._observe_amax(amax)
    assert s.pending_amax is amax and s.observed is True and fresh.pending_amax.item() == 0.0
    # a second observation max-merges; so does the public observe, whatever was pending
    assert s._observe_amax(torch.tensor(2.0)).pending_amax.item() == 3.0
    assert fresh.observe(torch.tensor(-1.0)).pending_amax.item() == 0.0
    # a pending amax set by hand: no longer "nothing pending", so it is merged, not replaced
    by_hand = fresh.replace(pending_amax=torch.tensor(5.0))
    assert by_hand.observed is None
    assert by_hand._observe_amax(torch.tensor(2.0)).pending_amax.item() == 5.0
    assert fresh.replace(pending_amax=torch.tensor(0.0), observed=False).observed is False
    assert fresh.replace(scale=torch.tensor(2.0)).observed is False
    # through an op: the recorded amax equals the max-merge of the same amax into the state
    st = fp8ops.LinearState.init(r)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    _, new = fp8ops.fp8_linear(x, w, None, st, recipe=r)
    assert new.input.pending_amax.item() == x.abs().max().item()
    assert new.weight.pending_amax.item() == w.abs().max().item()
    _, again = fp8ops.fp8_linear(x / 2, w, None, new, recipe=r)
    assert again.input.pending_amax.item() == x.abs().max().item()


def test_merge_takes_max_of_states_and_tensors():
    r = DelayedScaling()
    a = _model_states(r)
    b = pytree.tree_map(lambda x: x, a, is_leaf=lambda x: isinstance(x, ScalingState))
    a["head"] = a["head"].observe(torch.tensor(5.0))
    b["head"] = b["head"].observe(torch.tensor(7.0))
    m = fp8ops.merge(a, b)
    assert m["head"].pending_amax.item() == 7.0
    g = fp8ops.merge({"p": torch.tensor(1.0)}, {"p": torch.tensor(4.0)}, {"p": torch.tensor(2.0)})
    assert g["p"].item() == 4.0
    with pytest.raises(ValueError, match="different structure"):
        fp8ops.merge(a, {"head": a["head"]})


def test_merge_batched_reduces_vmap_dimension():
    s = DelayedScaling(amax_history_len=2).init()
    batched = s.replace(
        amax_history=s.amax_history.expand(3, 2),
        scale=s.scale.expand(3),
        pending_amax=torch.tensor([1.0, 9.0, 4.0]),
    )
    m = fp8ops.merge_batched({"s": batched, "probe": torch.tensor([2.0, 1.0, 3.0])})
    assert m["s"].pending_amax.item() == 9.0 and m["s"].amax_history.shape == (2,) and m["s"].scale.dim() == 0
    assert m["probe"].item() == 3.0


def test_make_probes_shapes():
    r = DelayedScaling()
    probes = fp8ops.make_probes(_model_states(r))
    assert probes["head"] is None
    assert all(p.shape == () and p.requires_grad and p.item() == 0.0 for p in probes["blocks"])
    p2 = fp8ops.make_probes(_model_states(r), requires_grad=False)
    assert not p2["blocks"][0].requires_grad


def test_tree_update_routes_grad_amax_to_gradient_roles():
    r = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2)
    st = _model_states(r)
    st["blocks"][0] = st["blocks"][0].replace(input=st["blocks"][0].input.observe(torch.tensor(7.0)))
    st["head"] = st["head"].observe(torch.tensor(14.0))
    grads = {"blocks": [torch.tensor(7.0), None], "head": None}
    new = fp8ops.update(st, recipe=r, grad_amax=grads)
    b0, b1 = new["blocks"]
    assert b0.input.scale.item() == 64.0
    assert b0.grad_output.scale.item() == 57344.0 / 7.0
    assert b1.input.scale.item() == 1.0 and b1.grad_output.amax_history.tolist() == [0.0, 0.0]
    assert new["head"].scale.item() == 32.0
    # the states that observed something are calibrated; block 1 observed nothing and stays uncalibrated
    assert b0.input.calibrated and b0.grad_output.calibrated and new["head"].calibrated
    assert not b1.input.calibrated and not b1.grad_output.calibrated
    # the tree-level update equals the per-state recipe update
    assert torch.equal(b0.grad_output.scale, r.update(st["blocks"][0].grad_output, torch.tensor(7.0)).scale)


def test_tree_update_rejects_mismatched_grad_amax():
    r = DelayedScaling()
    st = _model_states(r)
    with pytest.raises(ValueError, match="structure of the states' probes"):
        fp8ops.update(st, recipe=r, grad_amax={"blocks": [torch.tensor(1.0)], "head": None})
    with pytest.raises(ValueError, match="must have shape"):
        fp8ops.update(st, recipe=r, grad_amax={"blocks": [torch.ones(2), None], "head": None})


def test_state_dict_round_trip():
    r = DelayedScaling(amax_history_len=3)
    st = fp8ops.update(_model_states(r), recipe=r, grad_amax={"blocks": [torch.tensor(3.0), torch.tensor(5.0)], "head": None})
    st["head"] = st["head"].observe(torch.tensor(2.0))
    flat = fp8ops.state_dict(st)
    assert flat["fp8ops.schema_version"].item() == fp8ops.SCHEMA_VERSION
    assert "blocks.0.grad_output.amax_history" in flat and "head.pending_amax" in flat
    assert all(isinstance(v, torch.Tensor) for v in flat.values())
    back = fp8ops.load_state_dict(_model_states(r), flat)
    for a, b in zip(
        pytree.tree_leaves(st, is_leaf=lambda x: isinstance(x, ScalingState)),
        pytree.tree_leaves(back, is_leaf=lambda x: isinstance(x, ScalingState)),
    ):
        assert (a.role, a.calibrated) == (b.role, b.calibrated)
        for f in ("amax_history", "scale", "pending_amax"):
            assert torch.equal(getattr(a, f), getattr(b, f))


def test_load_state_dict_of_schema_version_1_keeps_new_roles():
    # Version 1 had no fc1_output role in LayerNormMLPState: such a dict loads, that role fresh.
    r = DelayedScaling(amax_history_len=3)
    st = fp8ops.LayerNormMLPState.init(r)
    st = st.replace(fc1_input=st.fc1_input.observe(torch.tensor(3.0)))
    # (nor the fp8_dtype and mode entries of version 3)
    flat = {k: v for k, v in fp8ops.state_dict({"mlp": st}).items() if ".fc1_output." not in k}
    v1 = {k: v for k, v in flat.items() if not k.endswith((".fp8_dtype", ".mode"))}
    v1["fp8ops.schema_version"] = torch.tensor(1)
    like = {"mlp": fp8ops.LayerNormMLPState.init(r)}
    back = fp8ops.load_state_dict(like, v1)
    assert torch.equal(back["mlp"].fc1_input.pending_amax, torch.tensor(3.0))
    assert back["mlp"].fc1_output is like["mlp"].fc1_output
    flat["fp8ops.schema_version"] = torch.tensor(fp8ops.SCHEMA_VERSION)  # current version: required
    with pytest.raises(ValueError, match="missing key mlp.fc1_output.amax_history"):
        fp8ops.load_state_dict(like, flat)


def test_load_state_dict_errors():
    r = DelayedScaling(amax_history_len=3)
    flat = fp8ops.state_dict({"a": r.init()})
    with pytest.raises(ValueError, match="missing key b.amax_history"):
        fp8ops.load_state_dict({"b": r.init()}, flat)
    with pytest.raises(ValueError, match="shape"):
        fp8ops.load_state_dict({"a": DelayedScaling(amax_history_len=4).init()}, flat)
    bad = dict(flat)
    bad["fp8ops.schema_version"] = torch.tensor(99)
    with pytest.raises(ValueError, match="schema version 99"):
        fp8ops.load_state_dict({"a": r.init()}, bad)
    del bad["fp8ops.schema_version"]
    with pytest.raises(ValueError, match="not written by fp8ops.state_dict"):
        fp8ops.load_state_dict({"a": r.init()}, bad)


def test_state_construction_under_compile_fullgraph():
    r = DelayedScaling(amax_history_len=2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def build(h, s, p):
        a = ScalingState(h, s, p, role="backward", calibrated=False)
        b = a.replace(pending_amax=p * 2).observe(torch.tensor(3.0))
        st = FakeQuantState(input=a, grad_output=b)
        return st.replace(input=st.input.replace(scale=s + 1))

    out = build(torch.zeros(2), torch.ones(()), torch.tensor(1.0))
    assert isinstance(out, FakeQuantState)
    assert out.grad_output.pending_amax.item() == 3.0 and out.input.scale.item() == 2.0
    assert out.grad_output.role == "backward" and out.input.calibrated is False
    # A calibrated state's update (the steady state) has no host read: it traces with fullgraph.
    upd = torch.compile(lambda s: r.update(s.observe(torch.tensor(7.0))), fullgraph=True, backend="aot_eager")
    assert upd(r.init().replace(calibrated=True)).scale.item() == 448.0 / 7.0
    # An uncalibrated one reads whether it observed anything (a graph break): compiles without fullgraph.
    upd = torch.compile(lambda s: r.update(s.observe(torch.tensor(7.0))), backend="aot_eager")
    out = upd(r.init())
    assert out.scale.item() == 448.0 / 7.0 and out.calibrated
