"""kernels/optim.adamw_cast_transpose_launch under TRITON_INTERPRET=1 on CPU, against the FP32
reference (fp8ops.reference.optim): the AdamW step on odd shapes (tile edges in both dimensions,
several tile rows per group), float32 and bfloat16 weights with float32 or matching moments, and the
FP8 copy equal to the library's cast-and-transpose kernel run on the kernel's own updated weight
(the interpreter does not round casts like the GPU, so bytes are compared kernel with kernel here
and with torch's cast on the GPU in tests/test_optim_gpu.py)."""

import os

import pytest
import torch

from fp8ops.kernels.optim import adamw_cast_transpose_launch
from fp8ops.kernels.quantize import cast_transpose_launch
from fp8ops.reference import optim as ref

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("w_dtype,m_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(70, 130), (1, 33), (33, 1)])
def test_step_and_copy_against_the_reference(w_dtype, m_dtype, shape):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(*shape, generator=g) * 0.05).to(w_dtype)
    grad = (torch.randn(*shape, generator=g) * 1e-2).to(w_dtype)
    m = (torch.randn(*shape, generator=g) * 1e-3).to(m_dtype)
    v = (torch.rand(*shape, generator=g) * 1e-5).to(m_dtype)
    step, lr, scale = torch.tensor(4.0), torch.tensor(2e-3), torch.tensor(1024.0)
    wr, mr, vr = w.clone(), m.clone(), v.clone()
    ref.adamw_step(wr, grad, mr, vr, step, lr, 0.9, 0.95, 1e-8, 0.1)
    q = torch.empty(shape, dtype=E4M3)
    qt = torch.empty(shape[::-1], dtype=E4M3)
    inv = torch.empty(())
    amax = adamw_cast_transpose_launch(w, grad, m, v, step, lr, scale, q, qt, inv, 0.9, 0.95, 1e-8, 0.1)
    tol = dict(rtol=1e-5, atol=1e-7) if w_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(w.float(), wr.float(), **tol)
    torch.testing.assert_close(m.float(), mr.float(), **tol)
    torch.testing.assert_close(v.float(), vr.float(), rtol=1e-4 if m_dtype == torch.float32 else 1e-2, atol=1e-12)
    q2, qt2, amax2, inv2 = cast_transpose_launch(w, scale, None, 0, False, E4M3)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), qt2.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
    assert amax.item() == amax2.item() == w.float().abs().max().item()
    assert inv.item() == inv2.item() == 1.0 / 1024.0


def test_weight_decay_and_bias_correction_by_hand():
    # one element, step 1: w = 2 - 0.5 * 0.1 * 2 = 1.9; m = 0.1 * 4 = 0.4; v = 0.001 * 16 = 0.016;
    # w = 1.9 - 0.5 / 0.1 * 0.4 / (sqrt(0.016) / sqrt(0.001) + 0) = 1.9 - 2 / 4 = 1.4
    w, grad, m, v = torch.full((1, 1), 2.0), torch.full((1, 1), 4.0), torch.zeros(1, 1), torch.zeros(1, 1)
    q, qt, inv = torch.empty(1, 1, dtype=E4M3), torch.empty(1, 1, dtype=E4M3), torch.empty(())
    amax = adamw_cast_transpose_launch(w, grad, m, v, torch.tensor(1.0), torch.tensor(0.5), torch.tensor(1.0), q, qt,
                                       inv, 0.9, 0.999, 0.0, 0.1)
    assert w.item() == pytest.approx(1.4, rel=1e-5) and m.item() == pytest.approx(0.4, rel=1e-6)
    assert v.item() == pytest.approx(0.016, rel=1e-4)
    assert amax.item() == pytest.approx(1.4, rel=1e-5)


@pytest.mark.parametrize("config", [None, {"BLOCK": 64, "SLOTS": 3}])
def test_multi_tensor_adamw_against_the_reference(config):
    # kernels/optim.adamw_launch over 11 tensors (an empty one, one element, sizes across the block
    # edge, mixed dtypes), in groups of SLOTS per launch with unused slots in the last group
    from fp8ops.kernels.optim import adamw_launch

    g = torch.Generator().manual_seed(2)
    sizes = [(0,), (1,), (63,), (64, 1), (65,), (7, 19), (130,), (3, 2, 11), (2049,), (5,), (64, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32,
              torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
    ws = [(torch.randn(s, generator=g) * 0.05).to(d) for s, d in zip(sizes, dtypes)]
    gs = [(torch.randn(s, generator=g) * 1e-2).to(d) for s, d in zip(sizes, dtypes)]
    ms = [(torch.randn(s, generator=g) * 1e-3).float() for s in sizes]
    vs = [(torch.rand(s, generator=g) * 1e-5).to(d) for s, d in zip(sizes, dtypes)]
    step, lr = torch.tensor(3.0), torch.tensor(2e-3)
    refs = [[x.clone() for x in xs] for xs in (ws, ms, vs)]
    m0 = [m.clone() for m in ms]
    ref.adamw(refs[0], gs, refs[1], refs[2], step, lr, 0.9, 0.95, 1e-8, 0.1)
    adamw_launch(ws, gs, ms, vs, step, lr, 0.9, 0.95, 1e-8, 0.1, config=config)
    for i, d in enumerate(dtypes):
        tol = dict(rtol=1e-5, atol=1e-7) if d == torch.float32 else dict(rtol=1e-2, atol=1e-5)
        torch.testing.assert_close(ws[i].float(), refs[0][i].float(), **tol, msg=f"w {i}")
        torch.testing.assert_close(ms[i], refs[1][i], rtol=1e-5, atol=1e-9, msg=f"m {i}")
        torch.testing.assert_close(vs[i].float(), refs[2][i].float(), rtol=1e-4 if d == torch.float32 else 1e-2,
                                   atol=1e-12, msg=f"v {i}")
    # every tensor's every element moved (none skipped by the slot search)
    assert all(bool((ms[i] != m0[i]).all()) for i in range(1, len(sizes)))
