"""CPU tests of the Hopper attention forward (``kernels/_attention_hopper.py``) and its dispatch.

Gluon kernels have no interpreter, so the kernel's numbers are tested on the GPU
(``tests/test_attention_hopper_gpu.py``). Here: the kernel compiles for sm_90 with the bundled
compiler into the schedule it is written for (warp-specialised partitions with their register
budgets, a scores product left in flight while the previous tile's P V runs, no spills); the 2-D
descriptor views of every dense layout; the refusals; and that the library passes a call's mods to
the launcher, so that the Hopper kernel can never run without them.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

H = importlib.import_module("fp8ops.kernels._attention_hopper")
HB = importlib.import_module("fp8ops.kernels._attention_hopper_bwd")
K = importlib.import_module("fp8ops.kernels.attention")
A = importlib.import_module("fp8ops.attention")
modmath = importlib.import_module("fp8ops").modmath

needs_gluon = pytest.mark.skipif(not H.AVAILABLE, reason="this Triton has no Gluon warp specialisation")


# ------------------------------------------------------------------------------------------------
# Compiled for sm_90 without a GPU

VARIANTS = ["d64_causal", "d128_none", "d256_causal", "d128_alibi", "d128_document_block_mask", "d128_alibi_relative",
            "d128_document_runs", "d128_none_dropout", "d64_causal_dropout"]
BWD_VARIANTS = ["bwd_d64_causal", "bwd_d128_causal", "bwd_d128_alibi", "bwd_d128_alibi_no_grad",
                "bwd_d128_alibi_relative", "bwd_d128_document_block_mask", "bwd_d128_document_runs",
                "bwd_d128_none_dropout", "bwd_d64_causal_dropout", "bwd_d128_causal_mask_mod_band", "bwd_d128_causal_block_mask",
                "bwd_d128_causal_no_cast"]


@pytest.fixture(scope="module")
def compiled():
    """Each variant compiled for sm_90 in a process without the interpreter (which this test session
    turns on when there is no GPU, and which turns every ``@triton.jit`` into an interpreted one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    helper = os.path.join(os.path.dirname(__file__), "_sm90_compile.py")
    run = subprocess.run([sys.executable, helper, *VARIANTS, *BWD_VARIANTS], capture_output=True, text=True, env=env,
                         timeout=600)
    if run.returncode == 3:  # pragma: no cover - a Triton that cannot compile Gluon offline
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("name", VARIANTS)
def test_compiles_for_sm90_into_the_warp_specialised_schedule(name, compiled):
    ptx, res, shared = compiled[name]["ptx"], compiled[name]["resources"], compiled[name]["shared"]
    _assert_register_budgets(ptx, name)
    # scores of tile t awaited while the P V product of tile t-1 stays in flight
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, name
    assert ptx.count("wgmma.mma_async") >= 8, name
    # K/V in through TMA copies signalled on mbarriers, O out through a TMA store
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx), name
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, name
    # a persistent grid: the loader claims each further work item from one counter (the only atomic)
    assert re.findall(r"atom\.[\w.]+", ptx) == ["atom.global.gpu.acq_rel.add.u32"], name
    # no spills in the tile loops: at most a few values kept across the item loop (the item's
    # block-mask list pointers: up to 40 bytes with Triton 3.6, 56 with 3.9)
    assert _stack_bytes(res) <= 64, f"{name}: the kernel spills to local memory: {res}"
    assert shared <= 227 * 1024, name
    _assert_dropout_hash(ptx, name)


def _tile_loops(loops: list[dict], products: int) -> list[dict]:
    """Each consumer's tile loop: the two shortest loops of the kernel's SASS that hold a whole tile
    step's warpgroup products (the two consumer warp groups run code of their own, so each has its
    own loop, compiled apart; the longer loops around them are the item, group and partition loops).
    The two lie apart in the code."""
    first, second = sorted((x for x in loops if x["hgmma"] >= products), key=lambda x: x["instructions"])[:2]
    assert first["end"] < second["start"] or second["end"] < first["start"], (first, second)
    return [first, second]


@needs_gluon
@pytest.mark.parametrize("name", VARIANTS + ["bwd_d64_causal", "bwd_d64_causal_dropout"])
def test_tile_loops_keep_their_values_in_registers(name, compiled):
    # both consumers' tile loops of every forward variant and of the d = 64 backward store nothing
    # to local memory and load at most two values back from it (loop-invariant reloads: with Triton
    # 3.9 the block-mask variants' forward and the d = 64 backward with dropout; none with 3.6). Per
    # consumer and tile the forward's products are Q K^T (K = d) and P V (K = block_n), the
    # backward's S^T and dP^T (K = d), dV, dK (K = 64) and dQ (K = 128), each in wgmma steps of
    # k = 16. The d = 128 backward spills around its products (its stack is bounded above)
    d = int(re.search(r"(?:^|_)d(\d+)_", name).group(1))
    products = 2 * d // 16 + 16 if name.startswith("bwd") else d // 16 + H.hopper_config(d).block_n // 16
    for loop in _tile_loops(compiled[name]["loops"], products):
        assert loop["stl"] == 0 and loop["ldl"] <= 2, f"{name}: {loop}"


def _assert_dropout_hash(ptx: str, name: str) -> None:
    # the dropout variants hash every weight (kernels/_dropout.py's per-element multiplier 0x21F0AAAD);
    # the others carry no trace of it
    assert ("569420461" in ptx) == ("dropout" in name), name


def _assert_register_budgets(ptx: str, name: str) -> None:
    # the loader gives registers back (24), a consumer takes them (240)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx), name
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx), name


def _stack_bytes(res: str) -> int:
    """The spill stack of cuobjdump's resource line (LOCAL counts only static local arrays)."""
    return int(re.search(r"STACK:(\d+)", res).group(1))


@needs_gluon
@pytest.mark.parametrize("name", BWD_VARIANTS)
def test_backward_compiles_for_sm90_into_five_products_per_tile_pair(name, compiled):
    ptx, res, shared = compiled[name]["ptx"], compiled[name]["resources"], compiled[name]["shared"]
    _assert_register_budgets(ptx, name)
    d = int(name.split("_d")[1].split("_")[0])
    # per consumer and query tile: S^T and dP^T (64 x 64, K = d), dV and dK (64 x d, K = 64) and its
    # d / 2 columns of dQ over both halves' keys (K = 2 x 64): d/16 + d/16 + 4 + 4 + 8 of k = 16
    n = ptx.count("wgmma.mma_async")
    # with a band (a window, causal, or a mask known to lie in one) and no block mask, each consumer
    # also has the steps of the walk's leading and trailing tiles in which its half sees no row: one
    # dQ product over the other half's keys (K = 64: 4 of k = 16), and a reduction
    banded = ("causal" in name or "alibi" in name or name.endswith("_band")) and "block_mask" not in name
    assert n == 2 * (2 * (d // 16) + 16) + (2 * 2 * 4 if banded else 0), f"{name}: {n} wgmma instructions"
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{d // 2}k16") >= 2 * 8, name  # dQ
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{d}k16") >= 2 * 8, name  # dV and dK
    # S^T awaited while dP^T runs, dP^T while dV runs; with dropout dP^T is awaited before dV is
    # issued, so that the mask's draws are compared where they are made (kernels/_attention_hopper_bwd.py)
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") >= (2 if "dropout" in name else 4), name
    # dQ leaves through shared memory by one TMA reduction per consumer and tile (the copy engine
    # adds it to the float32 buffer), awaited only before the buffer is written again; nothing is
    # atomic in the threads
    reductions = 2 * (3 if banded else 1)  # per consumer: in the loop (and the two loops of skipped halves)
    assert ptx.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add") == reductions, name
    cast = not name.endswith("_no_cast")
    # those, and one at the end: with the caster (CAST), a wait for every reduction to land, and one
    # release count-off per consumer; the caster polls its head's counter and takes it once with acquire
    assert ptx.count("cp.async.bulk.wait_group.read") == reductions + (0 if cast else 2), name
    # one wait for every reduction to land and one release count-off per consumer; the caster polls
    # its head's counter and takes it once with acquire; nothing is stored by TMA
    assert ptx.count("cp.async.bulk.wait_group 0") == (2 if cast else 0), name
    assert ptx.count("red.global.gpu.release.add") == (2 if cast else 0), name
    assert ptx.count("red.global") == ptx.count("red.global.gpu.release.add") and "atom.global" not in ptx, name
    assert ptx.count("ld.global.gpu.acquire") == (1 if cast else 0) and ("nanosleep" in ptx) == cast, name
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" not in ptx, name
    # Q and dO in through TMA copies on mbarriers; no TMA store
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx), name
    assert shared <= 227 * 1024, name
    # spills: none in the loops at d = 64 (a few values kept across the partitions' start); at d = 128
    # the consumers spill a few values around the dV product (152 to 304 bytes with Triton 3.6 and
    # 3.9, the most with the document mask's twin; 320 when the consumers added dQ with vector atomics;
    # 360 with the caster, whose partition the register allocation of the whole kernel sees)
    assert _stack_bytes(res) <= (40 if d == 64 else 360), f"{name}: spill stack {res}"
    _assert_dropout_hash(ptx, name)
    _assert_copies_before_rows(ptx, name)


def _assert_copies_before_rows(ptx: str, name: str) -> None:
    """The backward's loader issues a query tile's Q and dO copies (the last two arrive.expect_tx of
    the kernel) before it loads the tile's lse and delta rows, and publishes the rows by a second,
    plain arrival on the Q barrier after them."""
    d = int(name.split("_d")[1].split("_")[0])
    cast_bytes = HB.CAST_ROWS * d * 4  # the caster's copies of float32 rows are not the loader's
    expects = [(m.start(), m.group(1)) for m in
               re.finditer(r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[(%r\d+)\], (\d+);", ptx)
               if int(m.group(2)) != cast_bytes]
    assert len(expects) >= 4, f"{name}: {len(expects)} expect_tx arrivals"  # K/V halves, Q, dO
    (_, q_bar), (do_at, _) = expects[-2:]
    plain = r"mbarrier\.arrive\.shared::cta\.b64 _, \[" + re.escape(q_bar) + r"\]"
    arrivals = [m.start() for m in re.finditer(plain, ptx)]
    assert arrivals and arrivals[-1] > do_at, f"{name}: no second arrival on the Q barrier after the copies"
    assert "ld.global" in ptx[do_at:arrivals[-1]], f"{name}: the rows do not load between the copies and the arrival"


# ------------------------------------------------------------------------------------------------
# Descriptor views and refusals


@needs_gluon
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sbhd", "fused_sbhd", "gqa_bshd"])
def test_every_dense_layout_has_a_2d_view_whose_rows_address_each_head(layout):
    B, Hh, S, D = 2, 3, 256, 64
    if layout == "fused_sbhd":
        x = torch.randn(S, B, 3, Hh, D, dtype=torch.bfloat16)[:, :, 1]
        t = x.permute(1, 2, 0, 3)
    elif layout == "gqa_bshd":
        t = torch.randn(B, S, 1, D, dtype=torch.bfloat16).transpose(1, 2)
        Hh = 1
    else:
        shape = {"bhsd": (B, Hh, S, D), "bshd": (B, S, Hh, D), "sbhd": (S, B, Hh, D)}[layout]
        base = torch.randn(shape, dtype=torch.bfloat16)
        t = {"bhsd": base, "bshd": base.transpose(1, 2), "sbhd": base.permute(1, 2, 0, 3)}[layout]
    view = H._view2d(t, 64)
    assert view is not None, layout
    row_stride, width = view.desc.strides[0], view.desc.shape[1]
    flat = torch.as_strided(t, (view.desc.shape[0], width), (row_stride, 1))
    for b in range(B):
        for h in range(Hh):
            r0 = (b * view.rb + h * view.rh) * S
            c0 = b * view.cb + h * view.ch
            assert torch.equal(flat[r0:r0 + S, c0:c0 + D], t[b, h]), (layout, b, h)


@needs_gluon
def test_views_the_descriptor_cannot_address_are_refused():
    t = torch.randn(2, 4, 256, 64, dtype=torch.bfloat16)
    assert H._view2d(t, 64) is not None
    assert H._view2d(t[..., ::2], 64) is None  # a strided head dim
    assert H._view2d(t[:, :, :200], 64) is None  # 200 rows: not whole 64-row tiles
    assert H._view2d(torch.randn(2, 4, 256, 72, dtype=torch.bfloat16)[..., :64], 64) is not None  # padded rows
    assert H._view2d(torch.randn(2, 256, 4, 64, dtype=torch.bfloat16).transpose(1, 2)[:, :, :, :48], 64) is None
    padded = torch.randn(2, 4, 320, 64, dtype=torch.bfloat16)[:, :, :256]  # heads 320 rows apart
    assert H._view2d(padded, 64) is None


def test_hopper_is_never_chosen_on_the_cpu():
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not H.hopper_supported(q, q, q, varlen=False, descale=False, sparse_q=None, sparse_kv=None)


def test_config_hopper_key_and_portable_keys():
    # HOPPER is a launch-config key; an unknown key still raises, naming the expected ones
    q = torch.randn(1, 2, 32, 16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 32)
    with pytest.raises(ValueError, match="HOPPER"):
        K.attention_fwd_launch(q, q, q, out, lse, sm_scale=1.0, config={"HOPER": 0})
    K.attention_fwd_launch(q, q, q, out, lse, sm_scale=0.25, config={"HOPPER": 0})
    ref = torch.softmax(q @ q.transpose(-1, -2) * 0.25, -1) @ q
    assert torch.allclose(out, ref, atol=1e-4)


@pytest.fixture
def launched_kernels(monkeypatch):
    """The ``kernels`` argument of every forward launch of the test, in order."""
    seen = []
    real = K.attention_fwd_launch

    def spy(*args, **kwargs):
        seen.append(kwargs["kernels"])
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "attention_fwd_launch", spy)
    return seen


def test_the_library_passes_the_mods_to_the_launcher(launched_kernels):
    """The Hopper kernel takes a call's mods as arguments: the forward op must hand them over (a
    launcher without them keeps the portable kernel, never an unmodified Hopper run)."""
    seen = launched_kernels
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    mm = A.and_masks(A.causal_mask(), A.sliding_window_mask(8))
    A._attention_triton(q, q, q, score_mod=A.alibi(2), mask_mod=mm, block_mask=None, scale=0.25, left=None,
                        right=None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0,
                        seed=None)
    assert seen and seen[-1].score_mod is not None and seen[-1].mask_mod is not None
    assert seen[-1].score_mod is not K._identity_score_mod and seen[-1].mask_mod is not K._all_visible


def test_score_mods_with_per_score_transcendental_math_stay_portable(launched_kernels):
    from fp8ops.attention.codegen import tile_math

    def low(m):
        return m.spec.lowered

    assert tile_math(low(A.softcap(5.0)))
    assert not tile_math(low(A.alibi(8)))  # exp2 of the head index only: one value per program
    assert not tile_math(low(A.alibi(torch.rand(8))))
    assert not tile_math(low(A.relative_position_bias(torch.randn(2, 31))))
    assert tile_math(low(A.ScoreMod(lambda score, b, h, q_idx, kv_idx: score / (1 + q_idx))))
    assert not tile_math(low(A.ScoreMod(lambda score, b, h, q_idx, kv_idx: score + h / 2)))
    # the forward op then hands no score mod to the Hopper launcher (the portable kernel runs)
    seen = launched_kernels
    q = torch.randn(1, 2, 32, 16)
    for mod, passed in ((A.softcap(5.0), False), (A.alibi(2), True)):
        A._attention_triton(q, q, q, score_mod=mod, mask_mod=None, block_mask=None, scale=0.25, left=None,
                            right=None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                            dropout_p=0.0, seed=None)
        assert (seen[-1].score_mod is not None) == passed


# ------------------------------------------------------------------------------------------------
# How the Hopper backward calls a score_mod


def _named_bias(score, b, h, q_idx, kv_idx):
    shifted = score - 0.25 * (q_idx - kv_idx) * h
    return shifted + 1.0


def _scaled_in_steps(score, b, h, q_idx, kv_idx):
    doubled = score * 2.0
    return doubled - score + 0.5 * kv_idx  # derivative 2 - 1 = 1, but not recognised: stays called


def test_the_derivative_of_an_additive_mod_is_the_identity_unless_a_table_learns():
    from fp8ops.attention.codegen import score_grad_identity
    from fp8ops.testing import attention_inputs as inputs

    def identity(mod, needs=None):
        needs = tuple(t.requires_grad for t in mod.buffers) if needs is None else needs
        return score_grad_identity(mod.spec.fn, mod.spec.lowered, needs)

    for mod in (A.alibi(8), A.alibi(torch.rand(8)), A.relative_position_bias(torch.randn(8, 31)),
                A.score_mod(_named_bias), A.score_mod(inputs.additive_named)):
        assert identity(mod), mod.name
    assert not identity(A.alibi(torch.rand(8, requires_grad=True)))
    assert not identity(A.relative_position_bias(torch.randn(8, 31)), needs=(True,))
    for mod in (A.softcap(5.0), A.score_mod(inputs.scaled_score), A.score_mod(_scaled_in_steps)):
        assert not identity(mod), mod.name
    # the derivative the kernels get: the kernels' identity, or the generated one
    assert A.alibi(8).spec.grad_jit(()) is K._identity_score_grad
    assert A.alibi(torch.rand(8)).spec.grad_jit((True,)) is not K._identity_score_grad


def test_backward_score_mode_per_mod():
    from fp8ops.attention.autograd import _kernels
    from fp8ops.testing import attention_inputs as inputs

    cases = [(A.alibi(4), HB.SCORE_MODE_RELATIVE), (A.alibi(torch.rand(4)), HB.SCORE_MODE_RELATIVE),
             (A.alibi(torch.rand(4, requires_grad=True)), HB.SCORE_MODE_NATURAL),  # the slopes learn
             (A.score_mod(inputs.additive_named), HB.SCORE_MODE_RELATIVE),
             (A.score_mod(_absolute_bias), HB.SCORE_MODE_NO_GRAD),  # additive, not a relative bias
             (A.relative_position_bias(torch.randn(4, 9)), HB.SCORE_MODE_NO_GRAD),  # a table per distance
             (A.score_mod(inputs.scaled_score), HB.SCORE_MODE_NATURAL)]
    for mod, mode in cases:
        ks = _kernels(mod.key, None, tuple(t.requires_grad for t in mod.buffers))
        assert K.hopper_bwd_score_mode(ks, True) == mode, mod.name
        assert K.hopper_bwd_score_mode(ks, False) == HB.SCORE_MODE_NONE


@needs_gluon
def test_skipping_the_derivative_drops_its_mask(compiled):
    """SCORE_MODE_NO_GRAD compiles the same ALiBi without the derivative call and the visibility
    select around it (per consumer thread, a backward tile holds 32 scores)."""
    def selects(name):
        return len(re.findall(r"\bselp\.f32", compiled[name]["ptx"]))

    assert selects("bwd_d128_alibi_no_grad") <= selects("bwd_d128_alibi") - 32


@needs_gluon
def test_relative_bias_in_the_backward_converts_no_position_per_score(compiled):
    """SCORE_MODE_RELATIVE adds ALiBi per key row and folds its query part into the LSE row: no
    position converted to float per score (a consumer thread holds 32 scores of a tile), against
    one per score when the mod is called."""
    def conversions(name):
        return compiled[name]["ptx"].count("cvt.rn.f32.s32")

    assert conversions("bwd_d128_alibi_no_grad") >= 2 * 32
    assert conversions("bwd_d128_alibi_relative") <= 4


# ------------------------------------------------------------------------------------------------
# Relative biases in the Hopper forward


def _offset_bias(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) * (h + 1) * 0.125 - 2.0


def _divided_bias(score, b, h, q_idx, kv_idx):
    return score - (q_idx - kv_idx) * (h + 1) / 8


def _absolute_bias(score, b, h, q_idx, kv_idx):
    return score + 0.5 * kv_idx


def _summed_positions(score, b, h, q_idx, kv_idx):
    return score + 0.5 * kv_idx + 0.5 * q_idx


def _squared_distance(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) * (kv_idx - q_idx)


def _halved_distance(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) // 2


def _stepped_bias(score, b, h, q_idx, kv_idx):
    return score + 0.25 * (kv_idx - q_idx) + modmath.where(kv_idx > q_idx + 4, 1.0, 0.0)


def test_relative_biases_are_recognised_and_nothing_else(launched_kernels):
    """``codegen.relative_bias``: ``score + slope * (kv - q) + c`` with slope and c per (b, h), which
    the Hopper forward adds per key column (the row part into the LSE); any other dependence on a
    position, or a score that is not added once, keeps the mod's own call per score."""
    from fp8ops.attention.autograd import _kernels
    from fp8ops.attention.codegen import relative_bias
    from fp8ops.testing import attention_inputs as inputs

    def rel(mod):
        return relative_bias(mod.spec.lowered)

    for mod in (A.alibi(8), A.alibi(12), A.alibi(torch.rand(8)), A.alibi(torch.rand(8, requires_grad=True)),
                A.score_mod(_named_bias), A.score_mod(inputs.additive_named), A.score_mod(_offset_bias),
                A.score_mod(_divided_bias)):
        assert rel(mod), mod.name
    for mod in (A.softcap(5.0), A.relative_position_bias(torch.randn(8, 31)), A.score_mod(inputs.scaled_score),
                A.score_mod(_scaled_in_steps), A.score_mod(_absolute_bias), A.score_mod(_summed_positions),
                A.score_mod(_squared_distance), A.score_mod(_halved_distance), A.score_mod(_stepped_bias)):
        assert not rel(mod), mod.name
    # the kernels the forward op hands the launcher say so
    for mod, expected in ((A.alibi(4), True), (A.score_mod(_offset_bias), True), (A.softcap(5.0), False),
                          (A.score_mod(inputs.scaled_score), False)):
        assert _kernels(mod.key, None, tuple(t.requires_grad for t in mod.buffers)).score_rel == expected, mod.name
        # ... and the forward op passes it on to the launcher
        q = torch.randn(1, 2, 32, 16)
        A._attention_triton(q, q, q, score_mod=mod, mask_mod=None, block_mask=None, scale=0.25, left=None,
                            right=None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                            dropout_p=0.0, seed=None)
        assert launched_kernels[-1].score_rel == expected, mod.name
