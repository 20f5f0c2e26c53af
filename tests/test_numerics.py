"""Hand-computed numerics of FP8 quantization: saturation, round-to-nearest-even, scale rules.

On CPU the kernels *are* the FP32 reference functions, so "kernel == reference" tests cannot catch
a wrong rule in the reference itself. Every expected value here is a literal computed by hand (the
comment next to it gives the derivation), independent of ``fp8ops.reference`` and, for the FP8
encodings, of torch's float8 casts: quantized data is compared as raw bytes (``view(torch.uint8)``)
with hand-encoded bit patterns. DESIGN.md section 4 (scaling state) and section 5 (numerics).

Encodings used below (sign | exponent | mantissa):

- E4M3 (``float8_e4m3fn``): 1 | 4 (bias 7) | 3. Normal: (1 + m/8) * 2**(e-7); subnormal (e = 0):
  m * 2**-9. Largest finite 0 1111 110 = 0x7E = 1.75 * 2**8 = 448; 0x7F / 0xFF are NaN; no inf.
- E5M2 (``float8_e5m2``): 1 | 5 (bias 15) | 2. Normal: (1 + m/4) * 2**(e-15); subnormal:
  m * 2**-16. Largest finite 0 11110 11 = 0x7B = 1.75 * 2**15 = 57344; 0x7C is inf, 0x7D-0x7F NaN.

Scale-1 states are built through the public protocol only (``recipe.init`` + ``update`` with an
observed amax equal to ``fp8_max``: scale = fp8_max / fp8_max = 1), never with the constructor.
"""

import math

import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, FakeQuantState, Format, LinearState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INF, NAN = math.inf, math.nan


# ------------------------------------------------------------------------------------------------
# helpers (no fp8ops numerics in here: only the public state protocol)


def _bits(q):
    """The raw FP8 bytes of a Float8Value, as a list of ints."""
    return q.data.view(torch.uint8).flatten().tolist()


def _calibrated(recipe, role, amax):
    """A state of ``role`` after one update that observed ``amax``: scale fp8_max / amax."""
    s = recipe.init(role=role).observe(torch.tensor(amax))
    return fp8ops.update(s, recipe=recipe)


def _scale_one(recipe, role):
    s = _calibrated(recipe, role, recipe.fp8_max(role))  # fp8_max / fp8_max = 1 exactly
    assert s.calibrated and s.scale.item() == 1.0
    return s


def _linear_state_scale_one(recipe):
    """A LinearState with every role calibrated to scale 1 (E4M3 x and W, E5M2 dy under HYBRID)."""
    st = LinearState.init(recipe)
    st = st.replace(input=st.input.observe(torch.tensor(448.0)), weight=st.weight.observe(torch.tensor(448.0)))
    st = fp8ops.update(st, recipe=recipe, grad_amax=torch.tensor(57344.0))
    for role in ("input", "weight", "grad_output"):
        assert getattr(st, role).calibrated and getattr(st, role).scale.item() == 1.0
    return st


def _fake_quant_state_scale_one(recipe):
    st = FakeQuantState.init(recipe)
    st = st.replace(input=st.input.observe(torch.tensor(448.0)))
    st = fp8ops.update(st, recipe=recipe, grad_amax=torch.tensor(57344.0))
    assert st.input.scale.item() == 1.0 and st.grad_output.scale.item() == 1.0
    return st


def _is_nan_bits(b, fmt):
    if fmt == "e4m3":
        return b & 0x7F == 0x7F  # S 1111 111
    return b & 0x7C == 0x7C and b & 0x03 != 0  # S 11111 mm, mm != 0


# ------------------------------------------------------------------------------------------------
# 1. Saturation: q = clamp(x * s, -fp8_max, fp8_max) -> FP8; never inf, NaN stays NaN

# (x, expected byte, expected dequantized value) at scale 1.
E4M3_SATURATION = [
    (448.0, 0x7E, 448.0),  # the largest finite value itself: 0 1111 110
    (449.0, 0x7E, 448.0),  # just above: clamps to 448
    (464.0, 0x7E, 448.0),  # midpoint of 448 and 480 (480 is not finite in e4m3fn): 448
    (480.0, 0x7E, 448.0),  # would be 0 1111 111 = NaN in e4m3fn without the clamp
    (1000.0, 0x7E, 448.0),
    (3.0e38, 0x7E, 448.0),
    (INF, 0x7E, 448.0),  # inf saturates: e4m3fn has no inf (an unclamped cast gives NaN)
    (-449.0, 0xFE, -448.0),  # sign bit set: 1 1111 110
    (-480.0, 0xFE, -448.0),
    (-INF, 0xFE, -448.0),
]

E5M2_SATURATION = [
    (57344.0, 0x7B, 57344.0),  # largest finite: 0 11110 11 = 1.75 * 2**15
    (57344.0 * 1.1, 0x7B, 57344.0),  # 63078.4, above the midpoint 61440 to 2**16 (= inf): clamps
    (61440.0, 0x7B, 57344.0),  # midpoint of 57344 and 65536: an unclamped RNE cast gives inf
    (65536.0, 0x7B, 57344.0),
    (1.0e6, 0x7B, 57344.0),
    (INF, 0x7B, 57344.0),  # inf saturates to max, never 0x7C
    (-57344.0 * 1.1, 0xFB, -57344.0),  # 1 11110 11
    (-INF, 0xFB, -57344.0),
]


@pytest.mark.parametrize("x, byte, value", E4M3_SATURATION)
def test_e4m3_saturates_to_448(x, byte, value):
    r = DelayedScaling()  # HYBRID: forward role is E4M3
    q, _ = fp8ops.quantize(torch.tensor([x]), _scale_one(r, "forward"), recipe=r)
    assert q.data.dtype == E4M3
    assert _bits(q) == [byte]
    assert fp8ops.dequantize(q).tolist() == [value]


@pytest.mark.parametrize("x, byte, value", E5M2_SATURATION)
def test_e5m2_saturates_to_57344(x, byte, value):
    r = DelayedScaling()  # HYBRID: backward (gradient) role is E5M2
    q, _ = fp8ops.quantize(torch.tensor([x]), _scale_one(r, "backward"), recipe=r)
    assert q.data.dtype == E5M2
    assert _bits(q) == [byte]
    assert fp8ops.dequantize(q).tolist() == [value]


@pytest.mark.parametrize("role, fmt", [("forward", "e4m3"), ("backward", "e5m2")])
def test_nan_stays_nan(role, fmt):
    r = DelayedScaling()
    x = torch.tensor([NAN, 1.0, -NAN])
    q, s = fp8ops.quantize(x, _scale_one(r, role), recipe=r)
    b = _bits(q)
    assert _is_nan_bits(b[0], fmt) and _is_nan_bits(b[2], fmt)
    assert b[1] == (0x38 if fmt == "e4m3" else 0x3C)  # 1.0: 0 0111 000 / 0 01111 00
    y = fp8ops.dequantize(q)
    assert math.isnan(y[0].item()) and math.isnan(y[2].item()) and y[1].item() == 1.0
    assert math.isnan(s.pending_amax.item())  # the observation is NaN (dropped later by update)


def test_saturation_with_scale_two_and_dequantize():
    # amax 224 observed -> scale 448 / 224 = 2 exactly, inverse scale 0.5.
    r = DelayedScaling()
    s = _calibrated(r, "forward", 224.0)
    assert s.scale.item() == 2.0
    x = torch.tensor([96.0, 224.0, 225.0, 300.0, -1000.0, 3.0e38, -INF])
    q, _ = fp8ops.quantize(x, s, recipe=r)
    assert q.inv_scale.item() == 0.5
    # x * 2 = [192, 448, 450, 600, -2000, inf (float32 overflow), -inf]
    # 192 = 1.5 * 2**7: 0 1110 100 = 0x74; 448 = 0x7E; 450, 600, inf clamp to 448; negatives 0xFE.
    assert _bits(q) == [0x74, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE]
    # dequantize multiplies by 0.5: 448 -> 224
    assert fp8ops.dequantize(q).tolist() == [96.0, 224.0, 224.0, 224.0, -224.0, 224.0, -224.0]
    assert fp8ops.dequantize(q, dtype=torch.bfloat16).tolist() == [96.0, 224.0, 224.0, 224.0, -224.0, 224.0, -224.0]


def test_saturation_with_scale_one_half():
    # amax 896 -> scale 448 / 896 = 0.5, inverse scale 2.
    r = DelayedScaling()
    s = _calibrated(r, "forward", 896.0)
    assert s.scale.item() == 0.5
    q, _ = fp8ops.quantize(torch.tensor([896.0, 900.0, 2000.0, -1.0]), s, recipe=r)
    # x * 0.5 = [448, 450, 1000, -0.5]: 448 and the two above clamp; -0.5 = 1 0110 000 = 0xB0
    assert _bits(q) == [0x7E, 0x7E, 0x7E, 0xB0]
    assert fp8ops.dequantize(q).tolist() == [896.0, 896.0, 896.0, -1.0]


def test_current_scaling_with_inf_in_input_saturates():
    # amax(x) = inf is not a usable amax: the scale falls back to 1 (no state), and inf -> 448.
    q, _ = fp8ops.quantize(torch.tensor([1.0, INF, -2.0]), None, recipe=CurrentScaling())
    assert q.inv_scale.item() == 1.0
    assert _bits(q) == [0x38, 0x7E, 0xC0]  # 1.0; 448; -2.0 = 1 1000 000
    assert fp8ops.dequantize(q).tolist() == [1.0, 448.0, -2.0]


def test_fake_quantize_saturates_and_rounds_forward_and_backward():
    r = DelayedScaling()
    st = _fake_quant_state_scale_one(r)
    x = torch.tensor([1.0625, 449.0, INF, -INF, -1000.0, 1.07, NAN], requires_grad=True)
    probe = torch.zeros((), requires_grad=True)
    y, st2 = fp8ops.fake_quantize(x, st, recipe=r, grad_probe=probe)
    # forward, E4M3 at scale 1: 1.0625 is the tie of 1.0 and 1.125 -> even 1.0; 449, inf, -inf,
    # -1000 saturate; 1.07 -> 1.125 (0.055 away vs 0.07); NaN stays NaN.
    yl = y.tolist()
    assert yl[:6] == [1.0, 448.0, 448.0, -448.0, -448.0, 1.125] and math.isnan(yl[6])
    assert math.isnan(st2.input.pending_amax.item())  # amax(x) includes the NaN
    # backward, E5M2 at scale 1: dy = c.
    c = torch.tensor([1.125, 1.375, 57344.0 * 1.1, -1.0e6, 2.0**-17, 3 * 2.0**-17, 0.0])
    (torch.nan_to_num(y, nan=0.0) * c).sum().backward()
    # 1.125: tie of 1.0 (m 00) and 1.25 (m 01) -> 1.0; 1.375: tie of 1.25 and 1.5 (m 10) -> 1.5;
    # 63078.4 and -1e6 saturate to +-57344; 2**-17 is half the smallest subnormal 2**-16 -> tie -> 0;
    # 3 * 2**-17 = 1.5 * 2**-16: tie of 1 and 2 subnormal units -> 2 * 2**-16 = 2**-15.
    # nan_to_num passes the gradient only where y was not NaN; the last entry's dy is 0 anyway.
    assert x.grad.tolist() == [1.0, 1.5, 57344.0, -57344.0, 0.0, 2.0**-15, 0.0]
    assert probe.grad.item() == 1.0e6  # amax(dy), before saturation


# fp8_linear forward, scale-1 states: x and W exactly representable in E4M3 -> y exact.
#   x = [[1, 2, -0.5], [3, 0.25, 4]]      W = [[1, -1, 2], [0.5, 3, -2]]      b = [0.5, -1]
#   y[0] = [1 - 2 - 1 + 0.5, 0.5 + 6 + 1 - 1] = [-1.5, 6.5]
#   y[1] = [3 - 0.25 + 8 + 0.5, 1.5 + 0.75 - 8 - 1] = [11.25, -6.75]
X_EXACT = [[1.0, 2.0, -0.5], [3.0, 0.25, 4.0]]
W_EXACT = [[1.0, -1.0, 2.0], [0.5, 3.0, -2.0]]
B_EXACT = [0.5, -1.0]


def test_fp8_linear_forward_exact():
    r = DelayedScaling()
    st = _linear_state_scale_one(r)
    y, st2 = fp8ops.fp8_linear(torch.tensor(X_EXACT), torch.tensor(W_EXACT), torch.tensor(B_EXACT), st, recipe=r)
    assert y.tolist() == [[-1.5, 6.5], [11.25, -6.75]]
    assert st2.input.pending_amax.item() == 4.0 and st2.weight.pending_amax.item() == 3.0


def test_fp8_linear_forward_saturated_input():
    # x[0, 0] = 1000 saturates to 448 at scale 1; W = [[1, 0, 0], [0.5, 1, 2]]:
    #   y[0] = [448, 224 + 1 + 0] = [448, 225];   x[1] = [-449, 0, 1] -> [-448, 0, 1]:
    #   y[1] = [-448, -224 + 0 + 2] = [-448, -222]
    r = DelayedScaling()
    st = _linear_state_scale_one(r)
    x = torch.tensor([[1000.0, 1.0, 0.0], [-449.0, 0.0, 1.0]])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 2.0]])
    y, st2 = fp8ops.fp8_linear(x, w, None, st, recipe=r)
    assert y.tolist() == [[448.0, 225.0], [-448.0, -222.0]]
    assert st2.input.pending_amax.item() == 1000.0  # the observation is the raw amax


def test_fp8_linear_forward_rounds_input_to_nearest_even():
    # x = [1.0625, 1.1875, 1.07] -> E4M3 [1.0 (tie, even), 1.25 (tie, even), 1.125 (nearest)]
    # W = [[1, 1, 1], [1, 0, -8]]: y = [1 + 1.25 + 1.125, 1 - 9] = [3.375, -8]
    r = DelayedScaling()
    st = _linear_state_scale_one(r)
    y, _ = fp8ops.fp8_linear(
        torch.tensor([[1.0625, 1.1875, 1.07]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, -8.0]]), None, st, recipe=r
    )
    assert y.tolist() == [[3.375, -8.0]]


# ------------------------------------------------------------------------------------------------
# 2. Round to nearest, ties to even (at scale 1)

# (x, byte, value). E4M3 in [1, 2): spacing 2**-3 = 0.125, mantissa m = (v - 1) / 0.125.
E4M3_ROUNDING = [
    (1.0, 0x38, 1.0),  # 0 0111 000
    (1.0625, 0x38, 1.0),  # tie of 1.0 (m 000) and 1.125 (m 001) -> even 1.0
    (1.0624, 0x38, 1.0),  # just below the tie
    (1.0626, 0x39, 1.125),  # just above the tie
    (1.07, 0x39, 1.125),  # |1.07 - 1| = 0.07 > |1.125 - 1.07| = 0.055
    (1.1875, 0x3A, 1.25),  # tie of 1.125 (m 001) and 1.25 (m 010) -> even 1.25
    (1.3125, 0x3A, 1.25),  # tie of 1.25 (m 010) and 1.375 (m 011) -> 1.25
    (1.4375, 0x3C, 1.5),  # tie of 1.375 (m 011) and 1.5 (m 100) -> 1.5
    (1.9375, 0x40, 2.0),  # tie of 1.875 (m 111) and 2.0 (0 1000 000) -> 2.0, carries into the exponent
    (17.0, 0x58, 16.0),  # [16, 32): spacing 2; tie of 16 (0 1011 000) and 18 (m 001) -> 16
    (19.0, 0x5A, 20.0),  # tie of 18 (m 001) and 20 (m 010) -> 20
    (-1.0625, 0xB8, -1.0),  # negatives mirror: sign bit 0x80
    (-1.07, 0xB9, -1.125),
    (-1.1875, 0xBA, -1.25),
    # subnormals: e = 0, value m * 2**-9; smallest 2**-9, largest 7 * 2**-9; smallest normal 2**-6
    (2.0**-9, 0x01, 2.0**-9),
    (2.0**-10, 0x00, 0.0),  # exactly half the smallest subnormal: tie of 0 and 1 unit -> 0
    (1.01 * 2.0**-10, 0x01, 2.0**-9),  # just above half -> 1 unit
    (0.99 * 2.0**-10, 0x00, 0.0),  # just below half -> 0
    (2.0**-11, 0x00, 0.0),  # below half: flushes to 0
    (3 * 2.0**-10, 0x02, 2.0**-8),  # 1.5 units: tie of 1 and 2 -> 2
    (5 * 2.0**-10, 0x02, 2.0**-8),  # 2.5 units: tie of 2 and 3 -> 2
    (7 * 2.0**-10, 0x04, 2.0**-7),  # 3.5 units: tie of 3 and 4 -> 4
    (15 * 2.0**-10, 0x08, 2.0**-6),  # 7.5 units: tie of 7 (0x07) and 8 = smallest normal 0 0001 000
    (-(2.0**-10), 0x80, -0.0),  # mirrors to negative zero
    (-3 * 2.0**-10, 0x82, -(2.0**-8)),
]

# E5M2 in [1, 2): spacing 2**-2 = 0.25.
E5M2_ROUNDING = [
    (1.0, 0x3C, 1.0),  # 0 01111 00
    (1.125, 0x3C, 1.0),  # tie of 1.0 (m 00) and 1.25 (m 01) -> 1.0
    (1.1, 0x3C, 1.0),
    (1.2, 0x3D, 1.25),
    (1.375, 0x3E, 1.5),  # tie of 1.25 (m 01) and 1.5 (m 10) -> 1.5
    (1.625, 0x3E, 1.5),  # tie of 1.5 (m 10) and 1.75 (m 11) -> 1.5
    (1.875, 0x40, 2.0),  # tie of 1.75 (m 11) and 2.0 (0 10000 00) -> 2.0
    (-1.125, 0xBC, -1.0),
    (-1.375, 0xBE, -1.5),
    # subnormals: value m * 2**-16; smallest 2**-16, smallest normal 2**-14 (0 00001 00)
    (2.0**-16, 0x01, 2.0**-16),
    (2.0**-17, 0x00, 0.0),  # half the smallest subnormal: tie -> 0
    (1.01 * 2.0**-17, 0x01, 2.0**-16),
    (2.0**-18, 0x00, 0.0),
    (3 * 2.0**-17, 0x02, 2.0**-15),  # 1.5 units -> 2
    (5 * 2.0**-17, 0x02, 2.0**-15),  # 2.5 units -> 2
    (7 * 2.0**-17, 0x04, 2.0**-14),  # 3.5 units: tie of 3 (0x03) and 4 = smallest normal -> 4
    (-(2.0**-17), 0x80, -0.0),
    (-3 * 2.0**-17, 0x82, -(2.0**-15)),
]


def _decode(byte, fmt):
    """Pure-Python decoding of a finite FP8 byte (no torch)."""
    e_bits, m_bits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    sign = -1.0 if byte & 0x80 else 1.0
    e = (byte >> m_bits) & ((1 << e_bits) - 1)
    m = byte & ((1 << m_bits) - 1)
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + m / 2**m_bits) * 2.0 ** (e - bias)


def _rne_brute_force(x, fmt):
    """Pure-Python round-to-nearest-even over the enumerated finite grid (no torch), for x within range."""
    top = 0x7E if fmt == "e4m3" else 0x7B
    best = None
    for b in range(top + 1):
        b = b | (0x80 if math.copysign(1.0, x) < 0 else 0)
        d = abs(_decode(b, fmt) - x)
        if best is None or d < best[0] or (d == best[0] and b % 2 == 0):
            best = (d, b)
    return best[1]


def test_hand_tables_are_self_consistent():
    """Guards the literal tables against typos: each byte decodes to its value, and each value is the
    nearest-even FP8 number to x by brute force over the grid (pure Python)."""
    for table, fmt in ((E4M3_ROUNDING, "e4m3"), (E5M2_ROUNDING, "e5m2")):
        for x, byte, value in table:
            assert _decode(byte, fmt) == value, (fmt, x)
            assert _rne_brute_force(float(torch.tensor(x)), fmt) == byte, (fmt, x)
    for table, fmt in ((E4M3_SATURATION, "e4m3"), (E5M2_SATURATION, "e5m2")):
        for _, byte, value in table:
            assert _decode(byte, fmt) == value


@pytest.mark.parametrize("x, byte, value", E4M3_ROUNDING)
def test_e4m3_round_to_nearest_even(x, byte, value):
    r = DelayedScaling(fp8_format=Format.E4M3)
    q, _ = fp8ops.quantize(torch.tensor([x]), _scale_one(r, "forward"), recipe=r)
    assert q.data.dtype == E4M3 and _bits(q) == [byte]
    assert fp8ops.dequantize(q).tolist() == [value]


@pytest.mark.parametrize("x, byte, value", E5M2_ROUNDING)
def test_e5m2_round_to_nearest_even(x, byte, value):
    r = DelayedScaling(fp8_format=Format.E5M2)
    q, _ = fp8ops.quantize(torch.tensor([x]), _scale_one(r, "forward"), recipe=r)
    assert q.data.dtype == E5M2 and _bits(q) == [byte]
    assert fp8ops.dequantize(q).tolist() == [value]


def test_rounding_whole_tensor_with_transpose():
    # The same E4M3 cases in one (2, 3) tensor, with the transposed copy written in the same pass.
    r = DelayedScaling()
    x = torch.tensor([[1.0625, 1.1875, 1.07], [2.0**-10, 3 * 2.0**-10, -1.0625]])
    q, _ = fp8ops.quantize(x, _scale_one(r, "forward"), recipe=r, transpose=True)
    assert _bits(q) == [0x38, 0x3A, 0x39, 0x00, 0x02, 0xB8]
    assert q.data_t.view(torch.uint8).tolist() == [[0x38, 0x00], [0x3A, 0x02], [0x39, 0xB8]]


# ------------------------------------------------------------------------------------------------
# 3. Scale computation and first-step calibration


def test_uncalibrated_delayed_state_uses_current_scaling():
    r = DelayedScaling()
    s0 = r.init(role="forward")
    assert not s0.calibrated and s0.scale.item() == 1.0
    # amax 3.5 -> scale 448 / 3.5 = 128 (exact); x * 128 = [128, -448]
    q, s1 = fp8ops.quantize(torch.tensor([1.0, -3.5]), s0, recipe=r)
    assert _bits(q) == [0x70, 0xFE]  # 128 = 2**7: 0 1110 000; -448: 1 1111 110
    assert q.inv_scale.item() == 0.0078125  # 1 / 128
    assert fp8ops.dequantize(q).tolist() == [1.0, -3.5]
    assert s1.pending_amax.item() == 3.5 and s1.scale.item() == 1.0 and not s1.calibrated  # no update yet


def test_uncalibrated_first_step_avoids_saturation():
    # amax 896 -> scale 0.5: x * 0.5 = [448, 0.5], no saturation (at scale 1, 896 would clamp to 448)
    r = DelayedScaling()
    q, _ = fp8ops.quantize(torch.tensor([896.0, 1.0]), r.init(role="forward"), recipe=r)
    assert _bits(q) == [0x7E, 0x30]  # 0.5 = 0 0110 000
    assert fp8ops.dequantize(q).tolist() == [896.0, 1.0]


def test_fp8_linear_first_step_calibrates():
    # Fresh DelayedScaling state: x = [[896, 1]] -> scale 0.5 (exact, no saturation);
    # W = [[1.75, -0.875]] -> scale 448 / 1.75 = 256 -> [448, -224] (exact).
    # y = 896 * 1.75 - 0.875 = 1568 - 0.875 = 1567.125. (At scale 1: 448 * 1.75 - 0.875 = 783.125.)
    r = DelayedScaling()
    y, st = fp8ops.fp8_linear(
        torch.tensor([[896.0, 1.0]]), torch.tensor([[1.75, -0.875]]), None, LinearState.init(r), recipe=r
    )
    assert y.tolist() == [[1567.125]]
    assert st.input.pending_amax.item() == 896.0 and st.weight.pending_amax.item() == 1.75


def test_update_after_first_observation():
    r = DelayedScaling(amax_history_len=4)
    _, s = fp8ops.quantize(torch.tensor([1.0, -3.5]), r.init(role="forward"), recipe=r)
    s = fp8ops.update(s, recipe=r)
    assert s.calibrated
    assert s.scale.item() == 128.0  # 448 / 3.5
    assert s.amax_history.tolist() == [3.5, 0.0, 0.0, 0.0]  # index 0 newest
    assert s.pending_amax.item() == 0.0
    # Calibrated: quantize uses the state's scale, not x's own amax: 7 * 128 = 896 saturates.
    q, _ = fp8ops.quantize(torch.tensor([7.0, 0.5]), s, recipe=r)
    # 0.5 * 128 = 64 = 2**6: exponent field 6 + 7 = 13 -> 0 1101 000 = 0x68
    assert _bits(q) == [0x7E, 0x68]


@pytest.mark.parametrize(
    "margin, power_2, amax, scale",
    [
        (0, False, 3.5, 128.0),  # 448 / 3.5
        (1, False, 3.5, 64.0),  # 448 / 3.5 / 2
        (2, False, 3.5, 32.0),  # 448 / 3.5 / 4
        (0, False, 7.0, 64.0),  # 448 / 7
        (0, True, 3.0, 128.0),  # 448 / 3 = 149.33 -> down to 2**7
        (0, True, 5.0, 64.0),  # 448 / 5 = 89.6 -> 2**6
        (1, True, 3.0, 64.0),  # 149.33 / 2 = 74.67 -> 2**6
        (0, True, 3.5, 128.0),  # already a power of two: unchanged
        (0, True, 1000.0, 0.25),  # 0.448 -> 2**-2
    ],
)
def test_scale_margin_and_power_of_two(margin, power_2, amax, scale):
    r = DelayedScaling(margin=margin, power_2_scale=power_2)
    assert _calibrated(r, "forward", amax).scale.item() == scale


def test_power_2_scale_quantizes_with_rounded_scale():
    # amax 3 -> scale 128 (not 149.33): x = [3, 1] -> [384, 128] exact; dequantize exact.
    r = DelayedScaling(power_2_scale=True)
    s = _calibrated(r, "forward", 3.0)
    q, _ = fp8ops.quantize(torch.tensor([3.0, 1.0]), s, recipe=r)
    assert _bits(q) == [0x7C, 0x70]  # 384 = 1.5 * 2**8: 0 1111 100; 128: 0 1110 000
    assert q.inv_scale.item() == 2.0**-7
    assert fp8ops.dequantize(q).tolist() == [3.0, 1.0]


def _history(recipe, observations):
    s = recipe.init(role="forward")
    for a in observations:
        s = fp8ops.update(s.observe(torch.tensor(a)), recipe=recipe)
    return s


@pytest.mark.parametrize("algo, scale", [("max", 64.0), ("most_recent", 224.0)])
def test_amax_compute_algo(algo, scale):
    # observations 1, 7, 2 (oldest first) -> history [2, 7, 1] (index 0 newest)
    r = DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    s = _history(r, [1.0, 7.0, 2.0])
    assert s.amax_history.tolist() == [2.0, 7.0, 1.0]
    assert s.scale.item() == scale  # max: 448 / 7; most_recent: 448 / 2


def test_history_window_drops_old_amax():
    # L = 2: observations 7, 2, 1 -> history [1, 2]; 7 left the window: scale 448 / 2 = 224
    r = DelayedScaling(amax_history_len=2)
    s = _history(r, [7.0, 2.0, 1.0])
    assert s.amax_history.tolist() == [1.0, 2.0]
    assert s.scale.item() == 224.0


def test_callable_amax_compute_algo():
    # mean of the history [2, 7, 1] = 10 / 3 -> 448 / (10/3) = 134.4; with power_2_scale: 128
    r = DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.mean(-1), power_2_scale=True)
    assert _history(r, [1.0, 7.0, 2.0]).scale.item() == 128.0


@pytest.mark.parametrize("bad", [0.0, NAN, INF, -INF])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_zero_or_non_finite_observation_keeps_scale(bad, algo):
    # After a real observation (7 -> scale 64), an update that sees 0, NaN or +-inf keeps 64 and
    # records 0 (no information) at index 0: NaN / inf never enter the history.
    r = DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    s = _history(r, [7.0])
    assert s.scale.item() == 64.0
    s2 = fp8ops.update(s.observe(torch.tensor(bad)), recipe=r)
    assert s2.calibrated and s2.scale.item() == 64.0
    assert s2.amax_history.tolist() == [0.0, 7.0, 0.0]
    assert s2.pending_amax.item() == 0.0
    # the same through grad_amax of the update
    s3 = fp8ops.update(s, recipe=r, grad_amax=torch.tensor(bad))
    assert s3.scale.item() == 64.0 and s3.amax_history.tolist() == [0.0, 7.0, 0.0]


def test_non_finite_observation_with_history_len_one_keeps_scale():
    # L = 1: the only entry becomes 0 -> amax 0 -> the old scale stays (max algo too)
    r = DelayedScaling(amax_history_len=1)
    s = _history(r, [7.0, INF])
    assert s.amax_history.tolist() == [0.0] and s.scale.item() == 64.0


@pytest.mark.parametrize("pending", [0.0, NAN])
def test_update_that_observed_nothing_keeps_state_uncalibrated(pending):
    r = DelayedScaling()
    s = r.init(role="forward").observe(torch.tensor(pending))
    s2 = fp8ops.update(s, recipe=r)
    assert not s2.calibrated
    assert s2.scale.item() == 1.0
    # the next quantize still calibrates with current scaling: amax 3.5 -> scale 128
    q, _ = fp8ops.quantize(torch.tensor([1.0, -3.5]), s2, recipe=r)
    assert _bits(q) == [0x70, 0xFE]


@pytest.mark.parametrize(
    "fmt, role, scale",
    [
        (Format.HYBRID, "forward", 64.0),  # E4M3: 448 / 7
        (Format.HYBRID, "backward", 8192.0),  # E5M2: 57344 / 7 = 8192 (57344 = 7 * 2**13)
        (Format.E4M3, "backward", 64.0),
        (Format.E5M2, "forward", 8192.0),
    ],
)
def test_scale_uses_the_role_format_max(fmt, role, scale):
    r = DelayedScaling(fp8_format=fmt)
    assert _calibrated(r, role, 7.0).scale.item() == scale


def test_hybrid_gradient_first_step_uses_e5m2_max():
    # uncalibrated backward state, x = [7, -1] -> scale 57344 / 7 = 8192 -> [57344, -8192]
    r = DelayedScaling()
    q, _ = fp8ops.quantize(torch.tensor([7.0, -1.0]), r.init(role="backward"), recipe=r)
    # 57344: 0 11110 11 = 0x7B; -8192 = -2**13: exponent 13 + 15 = 28 = 11100 -> 1 11100 00 = 0xF0
    assert q.data.dtype == E5M2 and _bits(q) == [0x7B, 0xF0]
    assert q.inv_scale.item() == 2.0**-13


def test_current_scaling_per_tensor_recomputes_each_call():
    r = CurrentScaling()
    s = r.init(role="forward")
    # call 1: amax 3.5 -> scale 128 -> [128, -448]
    q1, s = fp8ops.quantize(torch.tensor([1.0, -3.5]), s, recipe=r)
    assert _bits(q1) == [0x70, 0xFE] and q1.inv_scale.item() == 2.0**-7
    # call 2: amax 7 -> scale 64 -> [32, 448]; the earlier amax plays no part
    q2, s = fp8ops.quantize(torch.tensor([0.5, 7.0]), s, recipe=r)
    assert _bits(q2) == [0x60, 0x7E] and q2.inv_scale.item() == 2.0**-6  # 32 = 2**5: 0 1100 000
    assert fp8ops.dequantize(q2).tolist() == [0.5, 7.0]
    # with margin 1: 448 / 7 / 2 = 32 -> [16, 224]
    q3, _ = fp8ops.quantize(torch.tensor([0.5, 7.0]), None, recipe=CurrentScaling(margin=1))
    assert _bits(q3) == [0x58, 0x76]  # 16: 0 1011 000; 224 = 1.75 * 2**7: 0 1110 110


def test_current_scaling_rowwise_scales():
    # row 0 = [1, 2]:     amax 2  -> scale 448 / 2 = 224;  x * 224 = [224, 448]
    # row 1 = [10, -20]:  amax 20 -> scale 448 / 20 = 22.4, which float32 cannot hold: the correctly
    #   rounded quotient is the float32 nearest 22.4 = 1.4 * 2**4; 1.4 = 1.0110 0110 0110 ... (binary),
    #   23 mantissa bits 0110011 00110011 00110011, next bit 0 -> rounds down -> bits 0x41B33333
    #   = 11744051 * 2**-19 = 22.399999618530273.
    #   10 * s = 224 - 2**-18 -> float32 (ulp 2**-16 at 224) rounds to 224;
    #   20 * s = 448 - 2**-17 -> float32 (ulp 2**-15 at 448) rounds to 448.
    r = CurrentScaling(granularity="row")
    q, _ = fp8ops.quantize(torch.tensor([[1.0, 2.0], [10.0, -20.0]]), None, recipe=r)
    assert q.inv_scale.shape == (2, 1)
    assert _bits(q) == [0x76, 0x7E, 0x76, 0xFE]
    s22 = torch.tensor(0x41B33333, dtype=torch.int32).view(torch.float32)
    assert s22.item() == 22.399999618530273
    # inv_scale is the float32 reciprocal of each row's scale: 1/224 and 1/22.4f
    expected_inv = torch.reciprocal(torch.stack([torch.tensor(224.0), s22])).reshape(2, 1)
    assert torch.equal(q.inv_scale, expected_inv)
    # dequantizing multiplies by the rounded reciprocal: back to x within about one float32 ulp
    y = fp8ops.dequantize(q)
    assert torch.allclose(y, torch.tensor([[1.0, 2.0], [10.0, -20.0]]), rtol=2**-23, atol=0)


def test_current_scaling_rowwise_rows_are_independent():
    # a huge row does not squash a small one: rows [448*4, 1] and [0.5, 0.25]
    # row 0 scale 448 / 1792 = 0.25 -> [448, 0.25]; row 1 scale 448 / 0.5 = 896 -> [448, 224]
    r = CurrentScaling(granularity="row")
    q, _ = fp8ops.quantize(torch.tensor([[1792.0, 1.0], [0.5, 0.25]]), None, recipe=r)
    assert _bits(q) == [0x7E, 0x28, 0x7E, 0x76]  # 0.25 = 2**-2: 0 0101 000 = 0x28
    # 1 / 0.25 = 4 exactly; 1 / 896 is the float32 reciprocal of 896
    assert torch.equal(q.inv_scale.reshape(-1), torch.reciprocal(torch.tensor([0.25, 896.0])))
    assert fp8ops.dequantize(q)[0].tolist() == [1792.0, 1.0]


# ------------------------------------------------------------------------------------------------
# 4. The output-gradient observation leaves as the gradient of the probe

# c = dy: max |c| = 7. Every entry is exact in E5M2 (7 = 1.75 * 4, 0.5, 1, 2).
C_GRAD = [[1.0, -7.0], [2.0, 0.5]]


def test_fp8_linear_probe_gradient_is_amax_of_dy_and_grads_exact():
    # most_recent: the calibration step's amaxes (448, 57344) must not mask this step's in the update
    r = DelayedScaling(amax_compute_algo="most_recent")
    st = _linear_state_scale_one(r)
    x = torch.tensor(X_EXACT, requires_grad=True)
    w = torch.tensor(W_EXACT, requires_grad=True)
    b = torch.tensor(B_EXACT, requires_grad=True)
    probe = torch.zeros((), requires_grad=True)
    y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=r, grad_probe=probe)
    (y * torch.tensor(C_GRAD)).sum().backward()
    assert probe.grad.item() == 7.0
    # dx = c @ W:  row 0 = [1, -1, 2] - 7 * [0.5, 3, -2] = [-2.5, -22, 16]
    #              row 1 = 2 * [1, -1, 2] + 0.5 * [0.5, 3, -2] = [2.25, -0.5, 3]
    assert x.grad.tolist() == [[-2.5, -22.0, 16.0], [2.25, -0.5, 3.0]]
    # dW = c^T @ x: row 0 = 1 * [1, 2, -0.5] + 2 * [3, 0.25, 4] = [7, 2.5, 7.5]
    #               row 1 = -7 * [1, 2, -0.5] + 0.5 * [3, 0.25, 4] = [-5.5, -13.875, 5.5]
    assert w.grad.tolist() == [[7.0, 2.5, 7.5], [-5.5, -13.875, 5.5]]
    assert b.grad.tolist() == [3.0, -6.5]  # column sums of c
    # update with the probe gradient: grad_output scale 57344 / 7 = 8192
    st3 = fp8ops.update(st2, recipe=r, grad_amax=probe.grad)
    assert st3.grad_output.scale.item() == 8192.0
    assert st3.input.scale.item() == 112.0  # 448 / amax(x) = 448 / 4
    assert st3.grad_output.amax_history[0].item() == 7.0


def test_fp8_linear_probe_sees_raw_amax_and_dy_saturates():
    # dy = [[1e5, 0], [0, 0]]: the observation is 1e5 (not clamped); at scale 1 in E5M2 the
    # quantized dy saturates to 57344, so dx row 0 = 57344 * W[0] = [57344, -57344, 114688].
    r = DelayedScaling()
    st = _linear_state_scale_one(r)
    x = torch.tensor(X_EXACT, requires_grad=True)
    w = torch.tensor(W_EXACT)
    probe = torch.zeros((), requires_grad=True)
    y, _ = fp8ops.fp8_linear(x, w, None, st, recipe=r, grad_probe=probe)
    (y * torch.tensor([[1.0e5, 0.0], [0.0, 0.0]])).sum().backward()
    assert probe.grad.item() == 1.0e5
    assert x.grad.tolist() == [[57344.0, -57344.0, 114688.0], [0.0, 0.0, 0.0]]


def test_fp8_linear_probe_with_leading_dims_and_fresh_state():
    # (2, 1, 2) input, fresh (uncalibrated) state; loss = (y * c).sum() with max |c| = 5
    r = DelayedScaling()
    x = torch.tensor(X_EXACT).reshape(2, 1, 3).requires_grad_()
    probe = torch.zeros((), requires_grad=True)
    y, _ = fp8ops.fp8_linear(x, torch.tensor(W_EXACT), None, LinearState.init(r), recipe=r, grad_probe=probe)
    c = torch.tensor([[[0.5, -5.0]], [[3.0, 1.0]]])
    (y * c).sum().backward()
    assert probe.grad.item() == 5.0


def test_fake_quantize_probe_gradient():
    # loss = (y * c).sum(), c = [3, -5, 0.25]: amax(dy) = 5
    r = DelayedScaling()
    probe = torch.zeros((), requires_grad=True)
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y, _ = fp8ops.fake_quantize(x, FakeQuantState.init(r), recipe=r, grad_probe=probe)
    (y * torch.tensor([3.0, -5.0, 0.25])).sum().backward()
    assert probe.grad.item() == 5.0
