"""The cached launch path of the Triton kernels (kernels/_library.FastKernel) on the GPU: once a
specialization is compiled, launches skip Triton's binding, and an argument that changes the
specialization (an unaligned pointer, a size of 1 or not a multiple of 16) still gets its own
compiled kernel: every output equal to the FP8 cast computed with torch."""

from __future__ import annotations

import pytest
import torch
from fp8ops.kernels import _library as L
from fp8ops.kernels import quantize as kq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3 = torch.float8_e4m3fn


def _expected(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def test_the_kernels_launch_through_the_cached_path():
    assert isinstance(kq._cast_transpose_fwd_kernel, L.FastKernel)
    x = torch.randn(64, 128, device="cuda").bfloat16()
    scale = torch.tensor(4.0, device="cuda")
    before = kq._cast_transpose_fwd_kernel.direct_launches
    for _ in range(3):
        q, qt, amax, inv = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    assert kq._cast_transpose_fwd_kernel.direct_launches >= before + 2
    torch.testing.assert_close(q.view(torch.uint8), _expected(x, 4.0).view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8), rtol=0, atol=0)
    assert float(amax) == float(x.float().abs().max()) and float(inv) == 0.25


@pytest.mark.parametrize("M,K,offset", [(64, 128, 0), (64, 128, 1), (1, 128, 0), (1, 128, 3), (17, 33, 0),
                                        (17, 33, 1), (64, 128, 0), (16, 16, 0), (16, 16, 5)])
def test_every_specialization_gets_its_own_kernel(M, K, offset):
    # run in this order on one process: aligned and unaligned inputs, sizes of 1, odd sizes, and
    # back to an earlier specialization, each checked against torch's cast
    buf = torch.randn(M * K + 8, device="cuda").bfloat16()
    x = buf[offset:offset + M * K].view(M, K)
    scale = torch.tensor(2.0, device="cuda")
    for _ in range(2):  # the second call takes the cached path
        q, qt, amax, _ = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
        torch.testing.assert_close(q.view(torch.uint8), _expected(x, 2.0).view(torch.uint8), rtol=0, atol=0)
        torch.testing.assert_close(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8), rtol=0, atol=0)
        assert float(amax) == float(x.float().abs().max())
        q1, _, _ = kq.cast_launch(x.reshape(-1), scale, None, 0, False, E4M3)
        torch.testing.assert_close(q1.view(torch.uint8), _expected(x.reshape(-1), 2.0).view(torch.uint8),
                                   rtol=0, atol=0)


def test_cuda_graph_capture_of_cached_launches():
    x = torch.randn(256, 512, device="cuda").bfloat16()
    scale = torch.tensor(8.0, device="cuda")
    kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)  # compiled and cached before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, _, amax, _ = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(q.view(torch.uint8), _expected(x, 8.0).view(torch.uint8), rtol=0, atol=0)
    assert float(amax) == float(x.float().abs().max())
