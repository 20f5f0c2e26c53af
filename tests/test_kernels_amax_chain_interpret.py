"""kernels/_library.AmaxChain under TRITON_INTERPRET=1, on CPU: every amax-producing kernel zeroes
the amax word of the next such launch, so that launches in a row need no fill kernel.

The chain's new words are poisoned (a huge value instead of uninitialised memory): a kernel that
failed to zero the next word would hand that value to the next launch as its amax."""

import os

import pytest
import torch

from fp8ops.kernels import _library as L
from fp8ops.kernels import activation as KA
from fp8ops.kernels import norm as KN
from fp8ops.kernels import quantize as KQ

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

E4M3 = torch.float8_e4m3fn
POISON = 3.0e38


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(L.AMAX_CHAIN, "_word", lambda device: torch.full((), POISON, device=device))
    monkeypatch.setattr(L.AMAX_CHAIN, "eager", True)  # plain launches chained (the default)
    L.AMAX_CHAIN.reset()
    yield L.AMAX_CHAIN
    L.AMAX_CHAIN.reset()


def _amax(t: torch.Tensor) -> float:
    return float(t.float().abs().max())


def test_each_launcher_zeroes_the_next_launchs_amax(poisoned):
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor(4.0)

    def data(*shape: int, mag: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=g) * 2 - 1) * mag

    xs = [data(5, 24, mag=m) for m in (9.0, 1.5, 0.25)]
    h, da = data(6, 16, mag=3.0), data(6, 16, mag=0.5)
    w, b = torch.ones(24), torch.zeros(24)
    chained = poisoned.chained
    got, want = [], []
    # each launch's amax is the word the launch before zeroed (the first one: a torch.zeros)
    _, amax, _ = KQ.cast_launch(xs[0].reshape(-1), scale, None, 0, False, E4M3)
    got.append(amax), want.append(_amax(xs[0]))
    _, _, amax, _ = KQ.cast_transpose_launch(xs[1], scale, None, 0, False, E4M3)
    got.append(amax), want.append(_amax(xs[1]))
    got.append(KQ.amax_launch(xs[2])), want.append(_amax(xs[2]))
    _, _, amax = KQ.cast_rowwise_launch(xs[1], 0, False, E4M3)
    got.append(amax), want.append(_amax(xs[1]))
    y = KN.norm_fwd_launch(xs[2], None, w, b, 1e-5, False, False, True, scale, None, 0, False, E4M3, True)
    got.append(y[4]), want.append(_amax(torch.nn.functional.layer_norm(xs[2], (24,), w, b, 1e-5)))
    _, _, _, amax, _ = KA.act_fwd_launch(h, "relu", False, scale, None, 0, False, E4M3, True, True)
    got.append(amax), want.append(_amax(h.clamp_min(0)))
    _, _, _, amax, _, _ = KA.act_bwd_launch(da, h, "relu", False, scale, None, 0, False, E4M3, True, False)
    got.append(amax), want.append(_amax(da * (h > 0)))
    # the last launch zeroed a word that waits for the next launch
    _, amax, _ = KQ.cast_launch(xs[0].reshape(-1), scale, None, 0, False, E4M3)
    got.append(amax), want.append(_amax(xs[0]))
    assert poisoned.chained - chained == len(want) - 1
    for i, (a, e) in enumerate(zip(got, want)):
        assert a.dtype == torch.float32 and a.shape == ()
        assert float(a) == pytest.approx(e, rel=1e-6), f"launch {i}: amax {float(a)} != {e}"
    assert len({id(a) for a in got}) == len(got)  # a new tensor for every launch


def test_a_launch_that_fails_hands_no_word_on(poisoned):
    x = torch.randn(4, 8)
    KQ.cast_transpose_launch(x, torch.tensor(1.0), None, 0, False, E4M3)  # leaves a zeroed word
    with pytest.raises(RuntimeError, match="boom"):
        with poisoned.output(torch.device("cpu")):
            raise RuntimeError("boom")  # the word was taken, never handed to a kernel
    chained = poisoned.chained
    _, _, amax, _ = KQ.cast_transpose_launch(x, torch.tensor(1.0), None, 0, False, E4M3)
    assert poisoned.chained == chained  # a fresh torch.zeros, not the taken word
    assert float(amax) == _amax(x)


@pytest.mark.parametrize("how", ["default", "eager off"])
def test_plain_launches_chain_by_default_only(how, monkeypatch):
    """Plain launches are chained by default, not with eager off (on a GPU, only those on the
    default stream: tests/test_kernels_launch_gpu.py). An unchained launch gets no word to zero:
    its kernel is compiled for None."""
    words = []
    monkeypatch.setattr(L.AMAX_CHAIN, "_word", lambda device: words.append(1) or torch.full((), POISON, device=device))
    if how == "eager off":
        monkeypatch.setattr(L.AMAX_CHAIN, "eager", False)
    L.AMAX_CHAIN.reset()
    chained = L.AMAX_CHAIN.chained
    xs = [torch.randn(4, 8) * m for m in (2.0, 0.5, 1.0)]
    got = [KQ.cast_transpose_launch(x, torch.tensor(1.0), None, 0, False, E4M3)[2] for x in xs]
    with L.AMAX_CHAIN.output(torch.device("cpu")) as (amax, amax_next):
        pass
    if how == "default":
        assert L.AMAX_CHAIN.chained - chained == len(xs) and len(words) == len(xs) + 1
        assert amax_next is not None
    else:
        assert L.AMAX_CHAIN.chained == chained and not words and amax_next is None
    assert float(amax) == 0.0
    assert [float(a) for a in got] == [_amax(x) for x in xs]
    L.AMAX_CHAIN.reset()
