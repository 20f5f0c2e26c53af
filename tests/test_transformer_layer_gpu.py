"""transformer_layer on CUDA at a real-ish size (hidden 1024, 16 heads, seq 512, batch 2, bf16):
parity with the seed's BasicTransformerLayer (forward and every gradient, error rule vs float64),
the FP8 error budget vs bf16, and masks / GQA / packed sequences through the fused kernels."""

import copy
import importlib

import attrs
import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling
from fp8ops.reference import transformer_layer as R
from fp8ops.reference.transformer_layer import BasicTransformerLayer
from fp8ops.testing import assert_close_rule, sqnr
from fp8ops.transformer_layer import (
    TransformerConfig,
    init_transformer_params,
    init_transformer_state,
    params_from_basic_layer,
    transformer_layer,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S, B, H, FFN, HEADS = 512, 2, 1024, 4096, 16
CFG = TransformerConfig(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                        hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def seed_layer():
    torch.manual_seed(0)
    m = BasicTransformerLayer(H, FFN, HEADS, attention_dropout=0.0, hidden_dropout=0.0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if n in ("ln1.weight", "ln2.weight") else 0.0))
    return m.cuda()


def _data(seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(S, B, H, device="cuda", generator=g),
            torch.randn(S, B, H, device="cuda", generator=g) * 1e-2)


def _leaf(t, dtype):
    return t.detach().to(dtype).clone().requires_grad_()


def _run_seed(m, x, dy, dtype, mask=None):
    m = copy.deepcopy(m).to(dtype)
    xx = _leaf(x, dtype)
    y = m(xx, mask)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, {n: p.grad for n, p in m.named_parameters()}


def _run_ours(m, x, dy, dtype, cfg=CFG, recipe=None, state=None, **kw):
    sd = {k: _leaf(v, dtype) for k, v in m.state_dict().items()}
    params = params_from_basic_layer(sd, cfg)
    xx = _leaf(x, dtype)
    probes = fp8ops.make_probes(state) if state is not None else None
    y, st = transformer_layer(params, xx, state, config=cfg, recipe=recipe, probes=probes, **kw)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, {k: v.grad for k, v in sd.items()}, st, probes


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_bf16_matches_seed_layer(seed_layer, mask):
    """err(ours, bf16) <= 2 x err(the seed layer in bf16) + atol, both against the seed in float64."""
    x, dy = _data()
    seed_mask, cfg = None, CFG
    if mask == "causal":
        seed_mask = torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1)
        cfg = attrs.evolve(CFG, self_attn_mask_type="causal")
    y64, dx64, g64 = _run_seed(seed_layer, x, dy, torch.float64, seed_mask)
    yt, dxt, gt = _run_seed(seed_layer, x, dy, torch.bfloat16, seed_mask)
    y, dx, g, _, _ = _run_ours(seed_layer, x, dy, torch.bfloat16, cfg)
    assert_close_rule(y, y64, yt, k=2.0, atol=1e-2, name="y")
    assert_close_rule(dx, dx64, dxt, k=2.0, atol=1e-4, name="dx")
    for name in g64:
        scale = float(g64[name].abs().max())
        assert_close_rule(g[name], g64[name], gt[name], k=2.0, atol=1e-3 * scale, name=f"d {name}")


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
def test_fp8_within_error_budget_of_bf16(seed_layer, recipe):
    """FP8 (calibrated after one step) vs the same layer in bf16, both against float32: SQNR floors."""
    x, dy = _data()
    state = init_transformer_state(CFG, recipe, device="cuda")
    _, _, _, state, probes = _run_ours(seed_layer, *_data(seed=2), torch.bfloat16, CFG, recipe, state)
    state = fp8ops.update(state, recipe=recipe, grad_amax={k: p.grad for k, p in probes.items()})
    y8, dx8, g8, _, _ = _run_ours(seed_layer, x, dy, torch.bfloat16, CFG, recipe, state)
    y16, dx16, g16, _, _ = _run_ours(seed_layer, x, dy, torch.bfloat16)
    y32, dx32, g32, _, _ = _run_ours(seed_layer, x, dy, torch.float32)
    budget = {"y": (y8, y16, y32, 25.0), "dx": (dx8, dx16, dx32, 20.0)}
    for k in g32:
        budget[k] = (g8[k], g16[k], g32[k], 12.0)
    for name, (a8, a16, a32, floor) in budget.items():
        s8, s16 = sqnr(a8.float(), a32), sqnr(a16.float(), a32)
        assert s8 > floor, f"{name}: FP8 SQNR {s8:.1f} dB < floor {floor} dB (bf16: {s16:.1f} dB)"


def test_gqa_padding_causal_and_packed_match_reference():
    cfg = TransformerConfig(hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_gqa_groups=2,
                            hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="padding_causal",
                            normalization="RMSNorm", activation="swiglu")
    g = torch.Generator(device="cuda").manual_seed(3)
    params = init_transformer_params(cfg, device="cuda", generator=g)
    params = {k: v * 8 if v.dim() == 2 else v for k, v in params.items()}
    x = torch.randn(96, 3, 256, device="cuda", generator=g)
    valid = torch.ones(3, 96, dtype=torch.bool, device="cuda")
    valid[1, 70:] = False
    valid[2, 17:] = False
    y, _ = transformer_layer(params, x, None, config=cfg, recipe=None, attention_mask=valid)
    yr, _ = R.transformer_layer(params, x, config=cfg, attention_mask=valid)
    torch.testing.assert_close(y, yr, rtol=1e-3, atol=1e-3)
    # packed: the valid tokens of each sequence, concatenated
    lens = valid.sum(1).tolist()
    packed = torch.cat([x[:n, i] for i, n in enumerate(lens)])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    yp, _ = transformer_layer(params, packed, None, config=cfg, recipe=None, cu_seqlens=cu, max_seqlen=max(lens))
    for i, n in enumerate(lens):
        torch.testing.assert_close(yp[cu[i]:cu[i + 1]], y[:n, i], rtol=1e-3, atol=1e-3)


_CACHE_ROLES = {"qkv.weight": ("qkv", "weight"), "q.weight": ("qkv", "weight"), "k.weight": ("qkv", "weight"),
                "v.weight": ("qkv", "weight"), "proj.weight": ("proj", "weight"),
                "fc1.weight": ("mlp", "fc1_weight"), "fc2.weight": ("mlp", "fc2_weight")}


@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "unfused_qkv"])
@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_weight_cache_gives_the_same_bits_on_the_gpu(fused, rname):
    """Every GEMM weight quantized once (``quantize_weight``) gives the bits of the layer quantizing
    them: output, dx, every parameter and probe gradient and the new state, over 2 micro-batches."""
    dev = "cuda"
    cfg = TransformerConfig(hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, self_attn_mask_type="causal", fuse_qkv_params=fused)
    recipe = DelayedScaling() if rname == "delayed" else CurrentScaling()
    g = torch.Generator(device=dev).manual_seed(0)
    params = {k: v.to(dev, torch.bfloat16) for k, v in init_transformer_params(cfg).items()}
    data = [(torch.randn(64, 2, 256, device=dev, generator=g).bfloat16(),
             torch.randn(64, 2, 256, device=dev, generator=g).bfloat16()) for _ in range(3)]
    state0 = init_transformer_state(cfg, recipe, device=dev)
    if rname == "delayed":  # calibrate: one step and an update
        probes = fp8ops.make_probes(state0)
        y, state0 = transformer_layer({k: v.clone().requires_grad_() for k, v in params.items()}, data[2][0],
                                      state0, config=cfg, recipe=recipe, probes=probes)
        y.backward(data[2][1])
        state0 = fp8ops.update(state0, recipe=recipe, grad_amax={k: p.grad for k, p in probes.items()})
    runs = []
    for cached in (False, True):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        state, caches = dict(state0), {}
        if cached:
            for key in (k for k in _CACHE_ROLES if k in leaves):
                skey, role = _CACHE_ROLES[key]
                caches[key], ws = fp8ops.quantize_weight(leaves[key], getattr(state[skey], role), recipe=recipe)
                state[skey] = state[skey].replace(**{role: ws})
        got = []
        for x, dy in data[:2]:
            x = x.clone().requires_grad_()
            probes = fp8ops.make_probes(state)
            y, state = transformer_layer(leaves, x, state, config=cfg, recipe=recipe, probes=probes,
                                         weight_cache=caches or None)
            y.backward(dy)
            got += [y.detach(), x.grad, *(probes[k].grad for k in sorted(probes))]
        got += [leaves[k].grad for k in sorted(leaves)]
        runs.append((got, fp8ops.state_dict(state)))
    (a, sa), (b, sb) = runs
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"{rname} fused={fused}: output/gradient {i} differs with weight caches"
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{rname} fused={fused}: state {k} differs with weight caches"


def _attention_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    words = ("sdpa", "flash", "fmha", "attention")
    return sorted({e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and any(w in e.name.lower() for w in words)})


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["none", "delayed"])
def test_compiled_layer_runs_the_attention_kernels_of_the_eager_layer(recipe):
    """With attention dropout the layer's attention runs through SDPA; under torch.compile it must
    run the same kernels as eager (cuDNN first). Left to SDPA's own choice, the compiled layer ran
    flash attention, whose backward took 1.5x cuDNN's at the seed size."""
    cfg = attrs.evolve(CFG, hidden_dropout=0.1, attention_dropout=0.1)
    params = {k: v.to(device="cuda", dtype=torch.bfloat16).requires_grad_()
              for k, v in init_transformer_params(cfg, generator=torch.Generator().manual_seed(0)).items()}
    state = init_transformer_state(cfg, recipe, device="cuda") if recipe is not None else None
    x, dy = (t.bfloat16() for t in _data())
    x.requires_grad_()

    def layer(x, state):
        return transformer_layer(params, x, state, config=cfg, recipe=recipe)[0]

    compiled = torch.compile(layer, fullgraph=True)
    found = {}
    for name, f in (("eager", layer), ("compiled", compiled)):
        found[name] = _attention_kernels(lambda f=f: f(x, state).backward(dy))
    assert found["eager"], "no attention kernel found in the eager step's profile"
    assert found["compiled"] == found["eager"], found


@pytest.mark.parametrize("form", ["dropout_seed", "packed_sequences"])
def test_attention_gradient_into_the_qkv_projection_equals_the_split_ones(form, monkeypatch):
    """Where the layer's attention runs the fused kernels, their backward writes dq, dk and dv into
    one gradient of the QKV projection; the layer's output is the same bits as with three gradients
    and autograd's backward of the split (a concatenation), and every gradient as close to it as two
    such runs are to each other (the Hopper backward sums dQ in float32 in no fixed order)."""
    op = importlib.import_module("fp8ops.attention.op")
    cfg = TransformerConfig(hidden_size=1024, ffn_hidden_size=2048, num_attention_heads=8, num_gqa_groups=4,
                            hidden_dropout=0.0, attention_dropout=0.1 if form == "dropout_seed" else 0.0,
                            self_attn_mask_type="causal" if form == "dropout_seed" else "padding_causal")
    params = {k: v.to(torch.bfloat16) for k, v in
              init_transformer_params(cfg, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)).items()}
    g = torch.Generator(device="cuda").manual_seed(5)
    if form == "dropout_seed":
        x = torch.randn(512, 2, 1024, device="cuda", generator=g).bfloat16()
        kw = dict(dropout_seed=torch.tensor(77, device="cuda"))
    else:
        x = torch.randn(700, 1024, device="cuda", generator=g).bfloat16()
        kw = dict(cu_seqlens=torch.tensor([0, 128, 500, 700], dtype=torch.int32, device="cuda"), max_seqlen=372)
    dy = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    used, real = [], op._packed_qkv
    results = []
    for packed in (True, False, False):
        def spy(qkv, *args, packed=packed):
            if not packed:  # the layer's attention as three views with three gradients
                return None
            used.append(qkv is not None)
            return real(qkv, *args)

        monkeypatch.setattr(op, "_packed_qkv", spy)
        ps = {k: v.clone().requires_grad_() for k, v in params.items()}
        xx = x.clone().requires_grad_()
        y, _ = transformer_layer(ps, xx, None, config=cfg, recipe=None, **kw)
        y.backward(dy)
        results.append({"y": y.detach(), "dx": xx.grad, **{k: p.grad for k, p in ps.items()}})
    assert used == [True], used
    mine, ref, again = results
    assert torch.equal(mine["y"], ref["y"])
    for name in mine:
        floor = float((again[name].float() - ref[name].float()).abs().max())
        err = float((mine[name].float() - ref[name].float()).abs().max())
        assert err <= 2 * floor + 1e-3 * float(ref[name].float().abs().max()), (name, err, floor)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_hidden_dropouts_in_the_norm_kernels_match_the_reference(norm_position):
    """With training dropout the layer's hidden dropouts run in its norm kernels (a seed drawn from
    torch's generator): on CUDA, in float32, the layer equals the float32 reference drawing from the
    same generator state, forward and every gradient."""
    cfg = attrs.evolve(CFG, hidden_dropout=0.2, mlp_hidden_dropout=0.3, norm_position=norm_position)
    params = {k: v.cuda() for k, v in init_transformer_params(cfg, generator=torch.Generator().manual_seed(3)).items()}
    x, dy = _data(4)
    outs = []
    for fn in (lambda p, xx: transformer_layer(p, xx, None, config=cfg, recipe=None, training=True)[0],
               lambda p, xx: R.transformer_layer(p, xx, config=cfg, training=True)[0]):
        pp = {k: _leaf(v, torch.float32) for k, v in params.items()}
        xx = _leaf(x, torch.float32)
        torch.manual_seed(21)
        y = fn(pp, xx)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, {k: v.grad for k, v in pp.items()}))
    (y, gx, gp), (yr, gxr, gpr) = outs

    def rel(a, b):  # a mask that differed would be off by tens of percent
        return float((a - b).norm() / b.norm())

    assert rel(y, yr) < 1e-4 and rel(gx, gxr) < 1e-3, (rel(y, yr), rel(gx, gxr))
    for k in gp:
        assert rel(gp[k], gpr[k]) < 1e-3, (k, rel(gp[k], gpr[k]))
    # the dropout is on: not the layer without it
    y0, _ = transformer_layer(params, x, None, config=cfg, recipe=None, training=False)
    assert not torch.allclose(y, y0, atol=1e-3)
