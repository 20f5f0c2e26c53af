"""fp8ops.nn.convert on a GPT-2-style model written in plain torch.nn: the Linear layers become
fp8ops.nn.Linear in place over the same Parameter objects (names, identities, state_dict keys
unchanged), the output stays within FP8 error of the unconverted model, evaluation records no
amaxes, and a short AdamW run with fp8ops.nn.update_scaling learns with calibrated, finite states."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fp8ops
import fp8ops.nn as fnn
from fp8ops import DelayedScaling

VOCAB, H, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 16, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(H)
        self.c_attn = torch.nn.Linear(H, 3 * H)
        self.c_proj = torch.nn.Linear(H, H)
        self.ln_2 = torch.nn.LayerNorm(H)
        self.c_fc = torch.nn.Linear(H, 4 * H)
        self.mlp_proj = torch.nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:       # (B, S, H)
        b, s, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(H, dim=-1)
        q, k, v = (t.view(b, s, HEADS, H // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, H)
        self.wpe = torch.nn.Embedding(SEQ, H)
        self.h = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(H)
        self.lm_head = torch.nn.Linear(H, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _no_head(fqn, module):
    return fqn != "lm_head" and fnn.default_convert_filter(fqn, module)


def _model(tied=False, seed=0):
    torch.manual_seed(seed)
    return GPT(tied)


def _tokens(seed):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_convert_keeps_parameters_names_and_output(tied):
    model = _model(tied)
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.AdamW(model.parameters())                  # built before: must train the new modules
    recipe = DelayedScaling()
    out = fnn.convert(model, recipe, filter=_no_head)
    assert out is model
    converted = [n for n, m in model.named_modules() if isinstance(m, fnn.Linear)]
    assert converted == [f"h.{i}.{n}" for i in range(LAYERS) for n in ("c_attn", "c_proj", "c_fc", "mlp_proj")]
    assert type(model.lm_head) is torch.nn.Linear
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    for n, p in model.named_parameters():
        assert p is params[n], n
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    lin = model.h[0].c_attn
    assert lin.recipe is recipe and lin.training and lin.weight.dtype == torch.float32
    assert (lin.in_features, lin.out_features) == (H, 3 * H)
    if tied:
        assert model.lm_head.weight is model.wte.weight
    # untouched values; FP8 output within tolerance of the unconverted model (after one calibrating step)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    idx = _tokens(1)
    model(idx).logsumexp(-1).mean().backward()
    fnn.update_scaling(model)
    model.zero_grad()
    model.eval()
    with torch.no_grad():
        got, want = model(idx), ref(idx)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.1, rel


def test_default_filter_skips_sizes_that_are_not_multiples_of_16_and_errors():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10),
                                torch.nn.Linear(24, 32))
    shared = torch.nn.Linear(16, 16)
    model.append(shared)
    model.append(shared)                                         # one layer under two names
    fnn.convert(model, DelayedScaling())
    assert [type(m) is fnn.Linear for m in model] == [True, False, False, False, True, True]
    assert model[4] is model[5]
    everything = torch.nn.Sequential(torch.nn.Linear(24, 10))
    fnn.convert(everything, DelayedScaling(), filter=lambda fqn, m: True)   # CPU runs any size
    assert isinstance(everything[0], fnn.Linear) and everything(torch.randn(3, 24)).shape == (3, 10)
    mha = torch.nn.TransformerEncoderLayer(32, 4, 64)
    fnn.convert(mha, DelayedScaling())                            # the MHA's out_proj subclass is left alone
    assert type(mha.self_attn.out_proj) is not fnn.Linear and isinstance(mha.linear1, fnn.Linear)
    with pytest.raises(TypeError, match="from_linear"):
        fnn.convert(torch.nn.Linear(16, 16), DelayedScaling())
    with pytest.raises(TypeError, match="filter must be a callable"):
        fnn.convert(model, DelayedScaling(), filter="lm_head")
    with pytest.raises(TypeError, match="recipe"):
        fnn.convert(model, "fp8")


def test_converted_model_records_nothing_in_eval_or_no_grad():
    model = fnn.convert(_model(), DelayedScaling(), filter=_no_head)
    idx = _tokens(2)
    model(idx).sum().backward()
    fnn.update_scaling(model)
    fp8 = [m for m in model.modules() if isinstance(m, fnn.Linear)]
    before = [copy.deepcopy(m.fp8_state) for m in fp8]
    model.eval()
    model(idx)                                                    # eval mode, gradients enabled
    model.train()
    with torch.no_grad():
        model(idx)                                                # training mode, no_grad
    for m, s in zip(fp8, before):
        assert m._probes == []
        for a, b in zip(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(s)):
            assert torch.equal(a, b)


def test_converted_model_trains_with_adamw_and_update_scaling():
    model = _model()
    recipe = DelayedScaling(amax_history_len=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fnn.convert(model, recipe, filter=_no_head)
    losses = []
    for step in range(20):
        idx = _tokens(100 + step)
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx.reshape(-1))   # copy task: predict the input
        loss.backward()
        opt.step()
        opt.zero_grad()
        fnn.update_scaling(model)                                 # once per step, after the backward
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    for name, m in model.named_modules():
        if isinstance(m, fnn.Linear):
            for role in ("input", "weight", "grad_output"):
                s = getattr(m.fp8_state, role)
                assert bool(s.calibrated), (name, role)
                assert all(bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(s)), (name, role)
                assert float(s.scale) > 0, (name, role)
