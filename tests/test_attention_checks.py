"""attention's input checks: inputs that used to corrupt results silently or crash with unclear
errors now give the right result or a TypeError/ValueError naming the function, the argument, what
was expected and what was received.

1. packed-sequence offsets (``cu_seqlens_q/kv``) and ``max_seqlen_q/kv``;
2. ``score_mod``/``mask_mod`` results that broadcast to the wrong shape;
3. ``mask_mod`` results that are not bool;
4. mods that read a captured tensor (``modmath.load``) built for a smaller problem — in the
   reference math, in ``create_block_mask`` and, before the kernels run, on the fused path;
5. scalar arguments: ``scale``, ``dropout_p``, ``dropout_seed``, ``return_lse``.

CPU, tiny shapes: the public op runs the reference math here; the fused-path checks run with
``_use_kernels`` patched to True and raise before any kernel is launched.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from fp8ops import modmath
from fp8ops._transformer_checks import _padding_mask_mod

A = importlib.import_module("fp8ops.attention")
A_op = importlib.import_module("fp8ops.attention.op")  # where attention() looks up _use_kernels
R = importlib.import_module("fp8ops.reference.attention")

attention = A.attention


def _packed(T=6, Tkv=None, Hq=2, Hkv=1, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tkv = T if Tkv is None else Tkv
    return (torch.randn(T, Hq, D, generator=g), torch.randn(Tkv, Hkv, D, generator=g),
            torch.randn(Tkv, Hkv, D, generator=g))


def _cu(*vals, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


def _dense(B=2, H=3, Sq=5, Skv=5, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Sq, D, generator=g), torch.randn(B, H, Skv, D, generator=g),
            torch.randn(B, H, Skv, D, generator=g))


@pytest.fixture
def kernel_path(monkeypatch):
    """Route the public op to the fused path, as on CUDA (the checks below raise before a launch)."""
    monkeypatch.setattr(A_op, "_use_kernels", lambda t: True)


# ------------------------------------------------------------------------------------------------
# 1. Packed-sequence offsets


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_kv"])
@pytest.mark.parametrize("vals,msg", [
    ((0, 4, 10), r"ends at 10, past the 6 packed tokens"),
    ((0, 4, 2, 6), r"must be non-decreasing .*\[1\] = 4 > .*\[2\] = 2"),
    ((1, 4, 6), r"must start at 0"),
])
def test_offset_values_are_checked(arg, vals, msg):
    q, k, v = _packed(6)
    good = _cu(*((0, 3, 6) if len(vals) == 3 else (0, 3, 4, 6)))
    kw = {"cu_seqlens_q": good, "cu_seqlens_kv": good, arg: _cu(*vals)}
    with pytest.raises(ValueError, match=rf"attention: {arg} {msg}"):
        attention(q, k, v, **kw)


def test_default_kv_offsets_are_checked_against_k():
    q, k, v = _packed(6, Tkv=4)
    with pytest.raises(ValueError, match=r"attention: cu_seqlens_q \(used for k and v too: cu_seqlens_kv is None\) "
                                         r"ends at 6, past the 4 packed tokens of k and v"):
        attention(q, k, v, cu_seqlens_q=_cu(0, 3, 6))


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_kv"])
@pytest.mark.parametrize("bad,exc,msg", [
    (_cu(0, 3, 6, dtype=torch.int64), ValueError, r"int32 tensor .*got dtype torch.int64; convert it once with "
                                                  r"\w+\.to\(torch.int32\)"),
    (_cu(0, 3, 6, dtype=torch.float32), ValueError, r"got dtype torch.float32"),
    (_cu(0, 3, 6).view(1, 3), ValueError, r"got shape \(1, 3\)"),
    (_cu(0), ValueError, r"at least 2 entries .*got 1 entry"),
    ([0, 3, 6], TypeError, r"got list"),
    (_cu(0, 3, 6).to("meta"), ValueError, r"on q's device cpu, got meta; move it once with "
                                          r"\w+\.to\(q.device\)"),
])
def test_offset_form_is_checked(arg, bad, exc, msg):
    q, k, v = _packed(6)
    kw = {"cu_seqlens_q": _cu(0, 3, 6), arg: bad}
    with pytest.raises(exc, match=rf"attention: {arg} must be .*?{msg}"):
        attention(q, k, v, **kw)


def test_max_seqlen_below_the_longest_sequence_raises():
    q, k, v = _packed(6)
    cu_q, cu_kv = _cu(0, 4, 6), _cu(0, 1, 6)
    with pytest.raises(ValueError, match=r"attention: max_seqlen_q = 3 is less than the longest sequence in "
                                         r"cu_seqlens_q \(4\).*Pass max_seqlen_q >= 4"):
        attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=3)
    with pytest.raises(ValueError, match=r"attention: max_seqlen_kv = 4 is less than the longest sequence in "
                                         r"cu_seqlens_kv \(5\)"):
        attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=4, max_seqlen_kv=4)
    with pytest.raises(TypeError, match=r"attention: max_seqlen_kv must be None or an int >= 0 .*got 2.5"):
        attention(q, k, v, cu_seqlens_q=cu_q, max_seqlen_kv=2.5)
    # Upper bounds are fine, and do not change the result.
    a, _ = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=9, max_seqlen_kv=5)
    b, _ = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_valid_offsets_still_run_empty_sequences_and_trailing_rows_refused():
    # What stays accepted: empty sequences; what is refused: rows after cu[-1] (in no sequence).
    q, k, v = _packed(6)
    cu = _cu(0, 0, 3, 6)
    (out, lse), _ = attention(q, k, v, cu_seqlens_q=cu, causal=True, return_lse=True)
    ref = attention(q[3:6].transpose(0, 1)[None], k[3:6].transpose(0, 1)[None], v[3:6].transpose(0, 1)[None],
                    causal=True)[0][0].transpose(0, 1)
    torch.testing.assert_close(out[3:6], ref, rtol=1e-5, atol=1e-6)
    q7, k7, v7 = _packed(7)
    with pytest.raises(ValueError, match=r"ends at 6, before the end of the 7 packed tokens"):
        attention(q7, k7, v7, cu_seqlens_q=cu, causal=True)


def test_offsets_are_read_once_per_call_and_not_while_tracing(monkeypatch):
    q, k, v = _packed(6)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("attention read a value with .item()"))
    attention(q, k, v, cu_seqlens_q=_cu(0, 4, 6), cu_seqlens_kv=_cu(0, 2, 6), max_seqlen_q=4, max_seqlen_kv=4)
    assert reads == [torch.Size([6])]  # both offset tensors, in one read
    reads.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attention(q, k, v, cu_seqlens_q=_cu(0, 4, 6), max_seqlen_q=4, max_seqlen_kv=4)
    assert reads == []


# ------------------------------------------------------------------------------------------------
# 2. Mod results of the wrong shape


@pytest.mark.parametrize("fn,got", [
    (lambda s, b, h, i, j: s * 0 + torch.ones(3, 1, 1), r"\(2, 3, 5, 5\)"),  # broadcasts to the right shape...
    (lambda s, b, h, i, j: torch.ones(3, 1, 1), r"\(3, 1, 1\)"),              # ...this does not have 4 dims
    (lambda s, b, h, i, j: (i - j).float()[0, 0], r"\(5, 5\)"),
    (lambda s, b, h, i, j: s[None], r"\(1, 2, 3, 5, 5\)"),
    (lambda s, b, h, i, j: torch.ones(2, 3, 5, 1).expand(2, 3, 5, 2), r"\(2, 3, 5, 2\)"),
])
def test_score_mod_result_shape_is_checked(fn, got):
    q, k, v = _dense()
    if got == r"\(2, 3, 5, 5\)":
        attention(q, k, v, score_mod=fn)  # the right shape: accepted
        return
    with pytest.raises(ValueError, match=rf"attention: score_mod .* returned shape {got}; expected the shape of "
                                         r"the scores \(B, H, Sq, Skv\) = \(2, 3, 5, 5\)"):
        attention(q, k, v, score_mod=fn)


def test_broadcastable_mod_results_are_still_accepted():
    q, k, v = _dense()
    bias = torch.randn(3)
    a, _ = attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h])          # (1, 3, 1, 1) added
    b, _ = attention(q, k, v, score_mod=lambda s, b, h, i, j: (s * 0 + 1) * s + bias[h].expand(2, 3, 5, 5))
    torch.testing.assert_close(a, b)
    attention(q, k, v, score_mod=lambda s, b, h, i, j: (i - j).float())             # (1, 1, Sq, Skv)
    attention(q, k, v, mask_mod=lambda b, h, i, j: True)                             # a constant mask


def _no_twin(*args):
    raise AssertionError("not run on the CPU")


def test_mask_mod_result_shape_is_checked():
    q, k, v = _dense()
    with pytest.raises(ValueError, match=r"attention: mask_mod .* returned shape \(5,\); expected .*"
                                         r"= \(2, 3, 5, 5\).*\(b, h, q_idx, kv_idx\)"):
        attention(q, k, v, mask_mod=lambda b, h, i, j: torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"create_block_mask: mask_mod .* returned shape \(1, 16\); expected .*"
                                         r"\(B, H, Sq, Skv\) = \(1, 1, 16, 16\)"):
        # (explicit twins: the eager function is free to do anything)
        A.create_block_mask(A.MaskMod(lambda b, h, i, j: torch.ones(1, 16, dtype=torch.bool), triton=_no_twin),
                            None, None, 16, 16, block_size=16)


def test_packed_mod_result_shape_is_checked():
    q, k, v = _packed(6)
    with pytest.raises(ValueError, match=r"attention: score_mod .* returned shape \(6, 6\); expected the shape of "
                                         r"the scores \(1, H, Tq, Tkv\) \(packed sequences\) = \(1, 2, 6, 6\)"):
        attention(q, k, v, cu_seqlens_q=_cu(0, 2, 6), score_mod=lambda s, b, h, i, j: s[0, 0])


# ------------------------------------------------------------------------------------------------
# 3. Masks that are not bool


def _int_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) * 1


def test_integer_mask_raises_in_the_reference_math_and_in_create_block_mask():
    q, k, v = _dense()
    with pytest.raises(TypeError, match=r"attention: mask_mod .* must return a bool tensor \(True: visible\), got "
                                        r"dtype torch.int64; return a comparison, e.g. \(x != 0\)"):
        attention(q, k, v, mask_mod=_int_mask)
    with pytest.raises(TypeError, match=r"create_block_mask: mask_mod _int_mask must return a bool tensor"):
        A.create_block_mask(_int_mask, None, None, 16, 16, block_size=16)


def test_integer_mask_raises_before_the_kernels(kernel_path):
    q, k, v = _dense()
    with pytest.raises(TypeError, match=r"attention: mask_mod _int_mask must return a bool tensor .* returns an "
                                        r"integer expression"):
        attention(q, k, v, mask_mod=_int_mask)


# ------------------------------------------------------------------------------------------------
# 4. Mods built for a smaller problem


def test_captured_tensor_too_small_in_the_reference_math():
    q, k, v = _dense(Sq=8, Skv=8)
    with pytest.raises(ValueError, match=r"attention: mask_mod document_mask reads a captured "
                                         r"tensor of shape \(5,\) \(5 elements\) at flat indices \[0, 7\].*"
                                         r"\(B, H, Sq, Skv\) = \(2, 3, 8, 8\).*rebuild it"):
        attention(q, k, v, mask_mod=A.document_mask(torch.zeros(5, dtype=torch.int64)))
    # A relative-position table of 2 heads called with 3: the flat index reaches 2 * 11 + 10 = 32.
    with pytest.raises(ValueError, match=r"attention: score_mod relative_position_bias.<locals>.rel_bias reads a "
                                         r"captured tensor of shape \(2, 11\) \(22 elements\) at flat indices "
                                         r"\[\d+, 32\]"):
        attention(q, k, v, score_mod=A.relative_position_bias(torch.randn(2, 11)))
    # The transformer's padding mask, built for a batch of 1, called on a batch of 2.
    with pytest.raises(ValueError, match=r"attention: mask_mod _padding_mask_mod.<locals>.padding reads a captured "
                                         r"tensor of shape \(1, 8\) \(8 elements\) at flat indices \[0, 15\]"):
        attention(q, k, v, mask_mod=_padding_mask_mod(torch.ones(1, 8, dtype=torch.bool)))


def test_captured_tensor_too_small_with_packed_sequences():
    q, k, v = _packed(6)
    with pytest.raises(ValueError, match=r"attention: mask_mod prefix_lm_mask.<locals>.prefix_lm reads a captured "
                                         r"tensor of shape \(2,\) .* \[0, 2\].*\(sequences, H, longest Sq, longest "
                                         r"Skv\) = \(3, 2, 3, 3\)"):
        attention(q, k, v, cu_seqlens_q=_cu(0, 2, 3, 6), mask_mod=A.prefix_lm_mask(torch.tensor([1, 1])))


def test_captured_tensor_too_small_in_create_block_mask():
    with pytest.raises(ValueError, match=r"create_block_mask: mask_mod document_mask reads a "
                                         r"captured tensor of shape \(5,\) .*\[0, 15\].*\(B, H, Sq, Skv\) = "
                                         r"\(1, 1, 16, 16\)"):
        A.create_block_mask(A.document_mask(torch.zeros(5, dtype=torch.int64)), None, None, 16, 16, block_size=16)


def test_captured_tensor_too_small_is_found_before_the_kernels(kernel_path):
    q, k, v = _dense(B=1, H=8, Sq=4, Skv=4)
    with pytest.raises(ValueError, match=r"attention: score_mod alibi.<locals>.alibi_slopes reads a captured tensor "
                                         r"of shape \(4,\) \(4 elements\) with modmath.load at flat indices up to "
                                         r"\[0, 7\] for this call's \(B, H, Sq, Skv\) = \(1, 8, 4, 4\)"):
        attention(q, k, v, score_mod=A.alibi(torch.ones(4)))
    qp, kp, vp = _packed(6)
    with pytest.raises(ValueError, match=r"attention: mask_mod prefix_lm_mask.<locals>.prefix_lm .*\[0, 2\] for this "
                                         r"call's \(sequences, H, longest Sq, longest Skv\) = \(3, 2, 3, 3\)"):
        attention(qp, kp, vp, cu_seqlens_q=_cu(0, 2, 3, 6), mask_mod=A.prefix_lm_mask(torch.tensor([1, 1])))


_T8 = torch.arange(8)
_F8 = torch.arange(8.0)


def _guarded(b, h, q_idx, kv_idx):
    return modmath.load(_T8, modmath.where(kv_idx < 8, kv_idx, 0)) >= 0


def _guarded_off_by_one(b, h, q_idx, kv_idx):
    return modmath.load(_T8, modmath.where(kv_idx <= 8, kv_idx, 0)) >= 0


def _wrapped(b, h, q_idx, kv_idx):
    return modmath.load(_T8, (kv_idx + 3) % 8) >= 0


def _clamped(score, b, h, q_idx, kv_idx):
    return score + modmath.load(_F8, modmath.clamp(kv_idx - q_idx, -3, 3) + 3)


def _data_dependent(b, h, q_idx, kv_idx):
    return modmath.load(_T8, modmath.load(_T8, q_idx)) >= 0  # not bounded statically: not checked there


def test_static_index_check_accepts_mods_that_fit():
    dims = (2, 4, 8, 8)
    for kind, mod in [
        ("score_mod", A.relative_position_bias(torch.randn(4, 15))), ("score_mod", A.alibi(torch.ones(4))),
        ("score_mod", A.alibi(4)), ("score_mod", A.ScoreMod(_clamped)),
        ("mask_mod", A.document_mask(torch.zeros(2, 8, dtype=torch.int64))),
        ("mask_mod", A.and_masks(A.causal_mask(), A.prefix_lm_mask(torch.tensor([1, 2])))),
        ("mask_mod", _padding_mask_mod(torch.ones(2, 8, dtype=torch.bool))),
        ("mask_mod", A.MaskMod(_guarded)), ("mask_mod", A.MaskMod(_wrapped)), ("mask_mod", A.MaskMod(_data_dependent)),
    ]:
        A._check_mod_statically(mod, kind, "attention", "(B, H, Sq, Skv)", dims)
        A._check_mod_statically(mod, kind, "attention", "(B, H, Sq, Skv)", (1, 1, 1, 1))
    A._check_mod_statically(A.MaskMod(_guarded), "mask_mod", "attention", "(B, H, Sq, Skv)", (1, 1, 1, 20))
    with pytest.raises(ValueError, match=r"_guarded_off_by_one reads .* up to \[0, 8\]"):  # one past the table
        A._check_mod_statically(A.MaskMod(_guarded_off_by_one), "mask_mod", "attention", "(B, H, Sq, Skv)",
                                (1, 1, 1, 20))


def test_static_index_check_of_the_document_masks_twins():
    # non-decreasing ids: explicit kernel twins that read the runs by the same rows as the ids, checked
    # as the comparison of ids would be (a batch beyond the (B, S) ids, a sequence beyond S)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    for mod in (A.document_mask(ids), A.and_masks(A.causal_mask(), A.document_mask(ids))):
        assert mod.spec.children or mod.spec.prepare is not None
        A._check_mod_statically(mod, "mask_mod", "attention", "(B, H, Sq, Skv)", (2, 4, 8, 8))
        for dims in ((3, 4, 8, 8), (2, 4, 9, 9)):
            with pytest.raises(ValueError, match=r"reads a captured tensor of shape \(2, 8\) \(16 elements\)"):
                A._check_mod_statically(mod, "mask_mod", "attention", "(B, H, Sq, Skv)", dims)


def test_modmath_load_refuses_indices_outside_the_table():
    t = torch.arange(5.0)
    with pytest.raises(IndexError, match=r"modmath.load: index out of range for a table of shape \(5,\) .*"
                                         r"got indices in \[-1, 2\]"):
        modmath.load(t, torch.tensor([-1, 2]))  # would wrap in PyTorch, read before the table in a kernel
    with pytest.raises(IndexError, match=r"got indices in \[5, 5\]"):
        modmath.load(t, 5)
    with pytest.raises(TypeError, match=r"modmath.load: index must be an integer tensor .*got torch.bool"):
        modmath.load(t, torch.tensor([True, False, True, False, True]))
    assert modmath.load(t, torch.tensor([[4, 0]])).tolist() == [[4.0, 0.0]]


# ------------------------------------------------------------------------------------------------
# 5. Scalar arguments


@pytest.mark.parametrize("kw,exc,msg", [
    ({"scale": 0.0}, ValueError, r"scale must be a finite number > 0 .*got 0.0"),
    ({"scale": -0.5}, ValueError, r"scale must be a finite number > 0 .*got -0.5"),
    ({"scale": float("inf")}, ValueError, r"scale must be a finite number > 0 .*got inf"),
    ({"scale": float("nan")}, ValueError, r"scale must be a finite number > 0 .*got nan"),
    ({"dropout_p": "0.1"}, TypeError, r"dropout_p must be a number in \[0, 1\), got '0.1'"),
    ({"dropout_p": 0.1, "dropout_seed": torch.tensor(True)}, TypeError, r"dropout_seed must be an int or a "
                                                                          r"1-element integer tensor, got a tensor "
                                                                          r"of dtype torch.bool"),
    ({"dropout_p": 0.1, "dropout_seed": 2**64}, ValueError, r"dropout_seed must fit in int64"),
    ({"dropout_seed": 1.5}, TypeError, r"dropout_seed must be an int, a 1-element integer tensor or None, got 1.5"),
    ({"return_lse": "yes"}, TypeError, r"return_lse must be True or False, got 'yes'"),
])
def test_scalar_arguments_are_checked(kw, exc, msg):
    q, k, v = _dense()
    with pytest.raises(exc, match=rf"attention: {msg}"):
        attention(q, k, v, **kw)


def test_existing_checks_still_hold():
    # Guards (these raised before): mixed devices / dtypes, negative windows, dropout_p out of range.
    q, k, v = _dense()
    with pytest.raises(ValueError, match=r"attention: q, k, v must be on one device"):
        attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"attention: q, k, v must have one dtype"):
        attention(q, k.half(), v)
    with pytest.raises(ValueError, match=r"attention: window must be >= 1"):
        attention(q, k, v, window=-1)
    with pytest.raises(ValueError, match=r"attention: window left bound must be a non-negative int"):
        attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match=r"attention: dropout_p must be a number in \[0, 1\)"):
        attention(q, k, v, dropout_p=-0.1)


def test_create_block_mask_sizes_must_be_ints():
    with pytest.raises(ValueError, match=r"create_block_mask: B must be an int >= 1, or None .*got 1.5"):
        A.create_block_mask(A.causal_mask(), 1.5, None, 16, 16, block_size=16)  # was truncated to 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under TRITON_INTERPRET=1")
def test_packed_kernel_path_uses_the_offsets_it_read(kernel_path):
    # The fused path takes max_seqlen from the validated offsets, and a fitting mod passes the check.
    q, k, v = _packed(6, Hq=2, Hkv=1, D=16)
    cu = _cu(0, 2, 6)
    mm = A.prefix_lm_mask(torch.tensor([1, 2]))
    out, _ = attention(q, k, v, cu_seqlens_q=cu, mask_mod=mm, causal=True)
    ref, _ = R.attention(q, k, v, cu_seqlens_q=cu, mask_mod=mm, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
