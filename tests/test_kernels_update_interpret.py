"""kernels/_update.scale_update_launch (the fused delayed-scaling update) under TRITON_INTERPRET=1,
on CPU: hand-computed cases (a history roll, a NaN or inf observation recorded as 0, an amax of 0
keeping the old scale, margins, power-of-two scales, most_recent, E4M3 and E5M2 maxima), and
random states with special values against the torch operations of DelayedScaling.update_many."""

import math
import os

import pytest
import torch

import fp8ops
from fp8ops.kernels._update import scale_update_launch

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

NAN, INF = float("nan"), float("inf")


def _hand_inputs():
    # three states, history length 4: (pending amax, gradient amax, history, old scale, fp8 max)
    pending = [3.5, NAN, 0.0]
    grads = [1.0, 2.0, INF]
    hist = torch.tensor([[0.0, 0.0, 0.0, 0.0], [7.0, 1.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    scale = torch.tensor([1.0, 2.0, 3.0])
    fmax = torch.tensor([448.0, 57344.0, 448.0])
    return torch.tensor(pending + grads), hist, scale, fmax


@pytest.mark.parametrize("margin, power_2, most_recent, want_scale", [
    (0, False, False, [128.0, 8192.0, 3.0]),  # 448 / 3.5; 57344 / max(0, 7, 1, 0); amax 0 keeps 3
    (1, False, False, [64.0, 4096.0, 3.0]),
    (0, False, True, [128.0, 2.0, 3.0]),  # most_recent: state 1's newest entry is the dropped NaN, 0
])
def test_hand_computed(margin, power_2, most_recent, want_scale):
    obs, hist, scale, fmax = _hand_inputs()
    new_hist, new_scale, seen, zeros = scale_update_launch(obs, hist, scale, fmax, margin=margin, power_2=power_2,
                                                           most_recent=most_recent)
    assert new_hist.tolist() == [[3.5, 0.0, 0.0, 0.0], [0.0, 7.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert new_scale.tolist() == want_scale
    assert seen.tolist() == [True, False, False]
    assert zeros.tolist() == [0.0, 0.0, 0.0]


def test_power_of_two_and_clamping():
    # 448 / 3 = 149.33 -> 128; a tiny amax overflows the quotient -> the largest float32 (rounded
    # down to 2**127 with power_2); 448 / the largest float32 = 1.3166e-36 -> 2**-120
    obs = torch.tensor([3.0, 1e-44, 3.4028234663852886e38, 0.0, 0.0, 0.0])
    hist, scale, fmax = torch.zeros(3, 1), torch.ones(3), torch.full((3,), 448.0)
    _, s, _, _ = scale_update_launch(obs, hist, scale, fmax, margin=0, power_2=True, most_recent=False)
    assert s.tolist() == [128.0, 2.0**127, 2.0**-120]
    _, s, _, _ = scale_update_launch(obs, hist, scale, fmax, margin=0, power_2=False, most_recent=False)
    assert s[0].item() == (torch.tensor(448.0) / torch.tensor(3.0)).item()
    assert s[1].item() == torch.finfo(torch.float32).max
    # a margin so large that the quotient underflows the normal range: the smallest normal float32
    _, s, _, _ = scale_update_launch(obs, hist, scale, fmax, margin=140, power_2=False, most_recent=False)
    assert s[0].item() == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("L", [1, 5, 16])
@pytest.mark.parametrize("kw", [dict(), dict(margin=2), dict(power_2_scale=True), dict(amax_compute_algo="most_recent"),
                                dict(fp8_format=fp8ops.Format.E5M2)])
def test_random_states_equal_the_torch_update(L, kw):
    g = torch.Generator().manual_seed(L)
    recipe = fp8ops.DelayedScaling(amax_history_len=L, **kw)
    S = 37
    roles = ["forward" if j % 3 else "backward" for j in range(S)]
    states = [recipe.init(role=r) for r in roles]
    hist = torch.rand(S, L, generator=g) * 10 ** torch.randint(-3, 4, (S, 1), generator=g)
    hist[::5] = 0.0
    obs = torch.rand(2, S, generator=g) * 100
    obs[0, ::4], obs[1, 1::6], obs[0, 2::7], obs[1, 3::9] = NAN, INF, 0.0, -INF
    scale = torch.rand(S, generator=g) + 0.5
    states = [s.replace(amax_history=hist[j].clone(), scale=scale[j].clone(), calibrated=True)
              for j, s in enumerate(states)]
    ref = recipe.update_many(states, obs)  # CPU: the torch operations
    fmax = torch.tensor([recipe.fp8_max(r) for r in roles])
    # strided inputs: every other row of a larger buffer, every other scale
    hbuf = torch.full((2 * S, L + 3), -1.0)
    hbuf[::2, :L] = hist
    sbuf = torch.full((2 * S,), -1.0)
    sbuf[::2] = scale
    new_hist, new_scale, seen, zeros = scale_update_launch(
        obs.reshape(-1), hbuf[::2, :L], sbuf[::2], fmax, margin=recipe.margin, power_2=recipe.power_2_scale,
        most_recent=recipe.amax_compute_algo == "most_recent")
    assert torch.equal(new_hist, torch.stack([s.amax_history for s in ref]))
    assert torch.equal(new_scale, torch.stack([s.scale for s in ref]))
    # one merged observation per state, (S,): the same outputs
    merged = scale_update_launch(obs.amax(0), hbuf[::2, :L], sbuf[::2], fmax, margin=recipe.margin,
                                 power_2=recipe.power_2_scale, most_recent=recipe.amax_compute_algo == "most_recent")
    assert torch.equal(merged[0], new_hist) and torch.equal(merged[1], new_scale) and torch.equal(merged[2], seen)
    o = obs.amax(0)
    assert seen.tolist() == [bool(math.isfinite(v) and v > 0) for v in o.tolist()]
    assert not zeros.any()
