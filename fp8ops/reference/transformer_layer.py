"""FP32 reference for :func:`fp8ops.transformer_layer`, and the seed's basic transformer layer.

Two things live here:

1. The *basic layer* of the seed tutorial (Transformer Engine's quickstart: a GPT encoder layer in
   plain ``torch.nn``), rewritten as :class:`BasicMLP`, :class:`DotProductAttention` (two ``bmm``
   and a masked softmax), :class:`SDPADotProductAttention` (the same through
   ``F.scaled_dot_product_attention``) and :class:`BasicTransformerLayer`. Layout (S, B, H)::

       res = x;  x = LN1(x)
       qkv = x W_qkv^T + b_qkv                       (S, B, 3H), viewed (S, B, h, 3d) per head
       q, k, v = split(qkv, d, dim=-1)               each (S, B, h, d): rows interleaved per head
       x = proj(attention(q, k, v, mask));  x = res + dropout(x)
       res = x;  x = LN2(x);  x = fc2(gelu_tanh(fc1(x)));  return x + res

   ``attention_mask`` is the seed's: a bool tensor broadcastable to (B, h, Sq, Skv), **True where a
   score is masked out** (it is filled with -10000 before the softmax).

2. :func:`transformer_layer`: the high-precision math of every :class:`fp8ops.TransformerConfig`
   (pre/post norm, LayerNorm/RMSNorm, any activation, GQA, causal/padding/packed masks), written
   directly from the equations in float32 on the flat parameter dict of the public op. It is the
   specification the public op is tested against; it has no FP8 and no attention dropout (the
   hidden dropouts, when training, draw from torch's generator in the public op's order).

References:
    NVIDIA Transformer Engine, "Getting Started" (docs/examples/quickstart.ipynb,
    quickstart_utils.py); Vaswani et al., "Attention Is All You Need" (2017).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .norm import branch_scale

if TYPE_CHECKING:
    from ..transformer_layer import TransformerConfig

__all__ = [
    "BasicMLP",
    "BasicTransformerLayer",
    "DotProductAttention",
    "SDPADotProductAttention",
    "activation",
    "norm",
    "transformer_layer",
]

_SEED_MASK_FILL = -10000.0  # the seed's masked_fill value (finite: a fully masked row stays finite)


class DotProductAttention(torch.nn.Module):
    """The seed's attention: ``softmax(q k^T / sqrt(d) masked) v`` with two batched matmuls.

    Args:
        num_attention_heads: h.
        kv_channels: d, the head dim.
        attention_dropout: dropout probability on the attention probabilities (training only).

    Shapes (forward): q, k, v (S, B, h, d) -> context (S, B, h·d).
    """

    def __init__(self, num_attention_heads: int, kv_channels: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels
        self.projection_size = kv_channels * num_attention_heads
        self.norm_factor = math.sqrt(kv_channels)
        self.dropout = torch.nn.Dropout(attention_dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        sq, b, h, _ = query.shape
        sk = key.shape[0]
        # (S, B, h, d) -> (B·h, S, d)
        q = query.reshape(sq, b * h, -1).transpose(0, 1)
        k = key.reshape(sk, b * h, -1).transpose(0, 1)
        v = value.reshape(sk, b * h, -1).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) / self.norm_factor  # (B·h, Sq, Sk)
        scores = scores.view(b, h, sq, sk)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, _SEED_MASK_FILL)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.bmm(probs.view(b * h, sq, sk), v)  # (B·h, Sq, d)
        # (B·h, Sq, d) -> (Sq, B, h·d)
        return context.view(b, h, sq, -1).permute(2, 0, 1, 3).reshape(sq, b, self.projection_size)


class SDPADotProductAttention(DotProductAttention):
    """:class:`DotProductAttention` through ``torch.nn.functional.scaled_dot_product_attention``.

    The same inputs, outputs and mask convention (True = masked out); PyTorch picks its fused
    backend (flash, memory-efficient, cuDNN or math). The baseline a PyTorch user would write.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        sq, b = query.shape[0], query.shape[1]
        # (S, B, h, d) -> (B, h, S, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        keep = None if attention_mask is None else ~attention_mask
        p = self.dropout.p if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p)  # (B, h, Sq, d)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.projection_size)


class BasicMLP(torch.nn.Module):
    """The seed's MLP: ``fc2(gelu_tanh(fc1(x)))`` with ``linear1`` (F, H) and ``linear2`` (H, F)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(F.gelu(self.linear1(x), approximate="tanh"))


class BasicTransformerLayer(torch.nn.Module):
    """The seed's GPT encoder layer (pre-LayerNorm), built from plain PyTorch modules.

    Parameter names are the seed's (``ln1``, ``qkv_projection``, ``projection``, ``ln2``,
    ``mlp.linear1``, ``mlp.linear2``); :func:`fp8ops.params_from_basic_layer` converts its
    ``state_dict`` to the flat parameters of :func:`fp8ops.transformer_layer`.

    Args:
        hidden_size: H.
        ffn_hidden_size: F.
        num_attention_heads: h (the head dim is H / h).
        layernorm_eps: LayerNorm epsilon.
        attention_dropout: dropout on the attention probabilities.
        hidden_dropout: dropout on the attention block's output, before the residual add.
        attention_impl: "bmm" (the seed's :class:`DotProductAttention`) or "sdpa"
            (:class:`SDPADotProductAttention`).

    Shapes (forward): x (S, B, H) -> (S, B, H); ``attention_mask`` as :class:`DotProductAttention`.

    Example:
        >>> import torch
        >>> from fp8ops.reference.transformer_layer import BasicTransformerLayer
        >>> layer = BasicTransformerLayer(32, 64, 4, attention_dropout=0.0, hidden_dropout=0.0)
        >>> layer(torch.randn(8, 2, 32)).shape
        torch.Size([8, 2, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        layernorm_eps: float = 1e-5,
        attention_dropout: float = 0.1,
        hidden_dropout: float = 0.1,
        *,
        attention_impl: str = "bmm",
    ) -> None:
        super().__init__()
        if attention_impl not in ("bmm", "sdpa"):
            raise ValueError(f"BasicTransformerLayer: attention_impl must be 'bmm' or 'sdpa', got {attention_impl!r}")
        if hidden_size % num_attention_heads != 0:
            raise ValueError(
                f"BasicTransformerLayer: hidden_size ({hidden_size}) must be a multiple of num_attention_heads "
                f"({num_attention_heads})"
            )
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        attn_cls = DotProductAttention if attention_impl == "bmm" else SDPADotProductAttention
        self.attention = attn_cls(num_attention_heads, self.kv_channels, attention_dropout)
        self.projection = torch.nn.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = BasicMLP(hidden_size, ffn_hidden_size)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        res = x
        x = self.ln1(x)
        # fused QKV projection; each head's rows are [q_h | k_h | v_h]
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, self.kv_channels, dim=3)  # (S, B, h, d) each
        x = self.attention(q, k, v, attention_mask)
        x = self.dropout(self.projection(x))
        x = res + x
        res = x
        x = self.mlp(self.ln2(x))
        return x + res


# ------------------------------------------------------------------------------------------------
# The reference math of fp8ops.transformer_layer


def norm(x: Tensor, weight: Tensor, bias: Tensor | None, *, rms: bool, eps: float, zero_centered_gamma: bool) -> Tensor:
    """LayerNorm (biased variance) or RMSNorm over the last dim, in float32."""
    x = x.to(torch.float32)
    g = weight.to(torch.float32) + (1.0 if zero_centered_gamma else 0.0)
    if rms:
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * g
    else:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).square().mean(-1, keepdim=True)
        y = (x - mean) * torch.rsqrt(var + eps) * g
    return y if bias is None else y + bias.to(torch.float32)


def activation(h: Tensor, act: str) -> Tensor:
    """The activations of :data:`fp8ops.activation.ACTIVATIONS` in float32; gated ones split [a | b]."""
    h = h.to(torch.float32)
    if act in ("swiglu", "geglu", "reglu"):
        a, b = h.chunk(2, dim=-1)
        inner = {"swiglu": "silu", "geglu": "gelu_tanh", "reglu": "relu"}[act]
        return activation(a, inner) * b
    if act == "gelu":
        return F.gelu(h)
    if act == "gelu_tanh":
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
    if act == "relu":
        return torch.relu(h)
    if act == "squared_relu":
        return torch.relu(h).square()
    if act == "silu":
        return h * torch.sigmoid(h)
    if act == "qgelu":
        return h * torch.sigmoid(1.702 * h)
    raise ValueError(f"activation: unknown activation {act!r}")


def _attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d)) v over ``visible``; q (B, hq, S, d), k/v (B, hkv, S, d), GQA by
    repeating each kv head for hq / hkv consecutive query heads. A row with nothing visible is 0."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1)
    p = torch.where(visible.any(-1, keepdim=True), p, torch.zeros_like(p))
    return torch.einsum("bhij,bhjd->bhid", p, v)


def transformer_layer(
    params: dict[str, Tensor],
    x: Tensor,
    state: Any = None,
    *,
    config: TransformerConfig,
    recipe: Any = None,
    probes: Any = None,
    attention_mask: Tensor | None = None,
    block_mask: Any = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    training: bool = False,
    dropout_seed: Any = None,
    layout: str = "sbh",
) -> tuple[Tensor, None]:
    """Reference forward of :func:`fp8ops.transformer_layer` in float32 (no FP8, no attention dropout).

    Same arguments as the public op; ``state``/``recipe`` must be None and the attention dropout
    must be off (``training=False`` or ``attention_dropout=0``). With ``training=True`` the hidden
    dropouts (``hidden_dropout`` on the attention block's output, then ``mlp_hidden_dropout`` on the
    MLP block's output) draw from torch's generator in the public op's order, so for float32 x both
    draw the same masks from the same generator state: the dropouts that the public op runs in a
    norm kernel (``hidden_dropout``, and post-norm's ``mlp_hidden_dropout`` too) are the norm
    kernels' hash mask (:func:`fp8ops.reference.norm.branch_keep` over the (S * B, H) rows) of a
    seed drawn as the public op draws it, pre-norm's ``mlp_hidden_dropout`` is ``F.dropout`` on
    (S, B, H) tensors.
    ``layout="bsh"``: x and y are (B, S, H). Returns ``(y, None)`` with y in x's dtype;
    differentiable with autograd in ``params`` and ``x``.
    """
    if state is not None or recipe is not None:
        raise NotImplementedError("reference transformer_layer: no FP8 (state and recipe must be None)")
    if training and config.attention_dropout > 0:
        raise ValueError("reference transformer_layer: no attention dropout; pass training=False or a config "
                         "with attention_dropout=0")
    if layout not in ("sbh", "bsh"):
        raise ValueError(f"reference transformer_layer: layout must be 'sbh' or 'bsh', got {layout!r}")
    if layout == "bsh" and cu_seqlens is None:
        y, _ = transformer_layer(params, x.transpose(0, 1), config=config, attention_mask=attention_mask,
                                 block_mask=block_mask, training=training)
        return y.transpose(0, 1), None
    cfg = config

    def drop(t: Tensor, p: float) -> Tensor:
        # the public op's F.dropout on a tensor of the same shape: the same mask for float32 x
        return F.dropout(t, p, training=True) if training and p > 0 else t

    def hash_drop(t: Tensor, p: float) -> Tensor:
        # the public op's dropout in a norm kernel: its seed drawn as the op draws it, then the hash
        # mask of the (S * B, H) rows
        if not (training and p > 0):
            return t
        seed = torch.randint(-(2**62), 2**62, (), dtype=torch.int64, device=t.device)
        S_, B_, H_ = t.shape
        return t * branch_scale(seed, S_ * B_, H_, p).reshape(S_, B_, H_)
    p = {k: t.to(torch.float32) for k, t in params.items()}
    rms = cfg.normalization == "RMSNorm"
    hq, hkv, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    packed = cu_seqlens is not None
    xs = x.to(torch.float32)
    if packed:
        xs = xs.unsqueeze(1)  # (T, 1, H): one sequence of all tokens, split by the mask below
    S, B = xs.shape[0], xs.shape[1]

    def ln(t: Tensor, name: str) -> Tensor:
        return norm(t, p[f"{name}.weight"], p.get(f"{name}.bias"), rms=rms, eps=cfg.layernorm_epsilon,
                    zero_centered_gamma=cfg.zero_centered_gamma)

    def lin(t: Tensor, name: str) -> Tensor:
        return F.linear(t, p[f"{name}.weight"], p.get(f"{name}.bias"))

    # Step 1: which keys each query sees, (B, 1, S, S).
    i = torch.arange(S, device=x.device)
    visible = torch.ones(B, 1, S, S, dtype=torch.bool, device=x.device)
    if cfg.self_attn_mask_type in ("causal", "padding_causal"):
        visible = visible & (i[None, :] <= i[:, None])
    if attention_mask is not None:
        visible = visible & attention_mask.to(torch.bool)[:, None, None, :]
    if packed:
        seg = torch.bucketize(i, cu_seqlens.to(torch.int64)[1:], right=True)  # (T,) sequence of each token
        visible = visible & (seg[:, None] == seg[None, :])  # causal above: same order inside a sequence
    if block_mask is not None:
        bb = torch.arange(B, device=x.device)[:, None, None, None]
        hh = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=x.device)
        visible = visible & block_mask.mask_mod(bb, hh, i[None, None, :, None], i[None, None, None, :])

    # Step 2: attention block.
    h_in = ln(xs, "ln1") if cfg.norm_position == "pre" else xs
    if cfg.fuse_qkv_params:
        qkv = lin(h_in, "qkv")
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    else:
        q, k, v = lin(h_in, "q"), lin(h_in, "k"), lin(h_in, "v")
    # (S, B, h·d) -> (B, h, S, d)
    q = q.reshape(S, B, hq, d).permute(1, 2, 0, 3)
    k = k.reshape(S, B, hkv, d).permute(1, 2, 0, 3)
    v = v.reshape(S, B, hkv, d).permute(1, 2, 0, 3)
    ctx = _attention(q, k, v, visible).permute(2, 0, 1, 3).reshape(S, B, hq * d)
    s1 = xs + hash_drop(lin(ctx, "proj"), cfg.hidden_dropout)

    # Step 3: MLP block.
    if cfg.norm_position == "pre":
        y = s1 + drop(lin(activation(lin(ln(s1, "ln2"), "fc1"), cfg.activation), "fc2"), cfg.mlp_hidden_dropout)
    else:
        h1 = ln(s1, "ln1")
        y = ln(h1 + hash_drop(lin(activation(lin(h1, "fc1"), cfg.activation), "fc2"), cfg.mlp_hidden_dropout), "ln2")
    if packed:
        y = y.squeeze(1)
    return y.to(x.dtype), None
