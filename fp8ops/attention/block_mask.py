"""Block masks: :class:`BlockMask` and :func:`create_block_mask`.

A block mask evaluates a mask mod once over (B, H, Sq, Skv) and classifies every (query block,
key block) pair as empty, partial or full; the kernels skip empty blocks and run full ones
without the mask. The reference math expands it back to elements
(``fp8ops.reference.attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from .checks import _check_mod_result, _index, _load_error, _mod_label
from .mods import MaskMod, ScoreMod


@attrs.frozen(init=False, eq=False, repr=False)
class BlockMask:
    """Block-level sparsity of a mask: which (query block, key block) pairs are empty, partial or full.

    Build it once with :func:`create_block_mask` and reuse it for every call with the same
    sequence lengths. The kernels skip empty blocks and evaluate ``mask_mod`` only on partial
    blocks (full blocks run unmasked), in the forward and the backward.

    In the shapes below, B' and H' are 1 or the batch / query-head count; NQ, NKV the block counts.

    Attributes:
        kv_num_blocks: (B', H', NQ) int32, partial key blocks per query block; ``kv_indices``
            (B', H', NQ, NKV) int32 lists them first. ``full_kv_num_blocks`` / ``full_kv_indices``:
            the same for full blocks.
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transposed lists (per key
            block), used by the dK/dV backward kernel.
        seq_lengths: (Sq, Skv). block_size: (block_q, block_kv), powers of two >= 16.
        mask_mod: the :class:`MaskMod` applied inside partial blocks.

    Example:
        >>> import fp8ops
        >>> bm = fp8ops.create_block_mask(fp8ops.causal_mask(), None, None, 256, 256, block_size=64)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 1, 1, 1]]], [[[0, 1, 2, 3]]])
        >>> round(bm.sparsity(), 3)
        0.375
    """

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_num_blocks: Tensor
    q_indices: Tensor
    full_q_num_blocks: Tensor
    full_q_indices: Tensor
    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    mask_mod: MaskMod

    def __init__(self, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor,
                 full_kv_indices: Tensor, q_num_blocks: Tensor, q_indices: Tensor, full_q_num_blocks: Tensor,
                 full_q_indices: Tensor, seq_lengths: tuple[int, int], block_size: tuple[int, int],
                 mask_mod: MaskMod) -> None:
        for name, val in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                          ("full_kv_num_blocks", full_kv_num_blocks), ("full_kv_indices", full_kv_indices),
                          ("q_num_blocks", q_num_blocks), ("q_indices", q_indices),
                          ("full_q_num_blocks", full_q_num_blocks), ("full_q_indices", full_q_indices)):
            object.__setattr__(self, name, val)
        object.__setattr__(self, "seq_lengths", (int(seq_lengths[0]), int(seq_lengths[1])))
        object.__setattr__(self, "block_size", (int(block_size[0]), int(block_size[1])))
        object.__setattr__(self, "mask_mod", mask_mod)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', Sq, Skv): the element-level shape the mask covers (B', H' may be 1: broadcast)."""
        return (int(self.kv_num_blocks.shape[0]), int(self.kv_num_blocks.shape[1]), *self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def block_states(self) -> Tensor:
        """(B', H', NQ, NKV) int8: 0 empty, 1 partial, 2 full."""
        nkv = self.kv_indices.shape[-1]
        pos = torch.arange(nkv, device=self.device)
        out = torch.zeros(self.kv_indices.shape, dtype=torch.int8, device=self.device)
        for num, idx, val in ((self.kv_num_blocks, self.kv_indices, 1),
                              (self.full_kv_num_blocks, self.full_kv_indices, 2)):
            src = ((pos < num[..., None]).to(torch.int8) * val)
            out = out.scatter_reduce(-1, idx.long(), src, reduce="amax")
        return out

    def sparsity(self) -> float:
        """The fraction of (query block, key block) pairs that are empty (skipped)."""
        s = self.block_states()
        return float((s == 0).float().mean())

    def to(self, device: str | torch.device) -> BlockMask:
        """A copy on ``device`` (the mask_mod's captured tensors are not moved)."""
        t = [getattr(self, n).to(device) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                    "full_kv_indices", "q_num_blocks", "q_indices",
                                                    "full_q_num_blocks", "full_q_indices")]
        return BlockMask(*t, self.seq_lengths, self.block_size, self.mask_mod)

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"sparsity={self.sparsity():.2%}, mask_mod={self.mask_mod.name})")


def _lists(state: Tensor, val: int) -> tuple[Tensor, Tensor]:
    hit = (state == val).to(torch.int32)
    num = hit.sum(-1, dtype=torch.int32)
    idx = torch.sort(hit, dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return num.contiguous(), idx.contiguous()


def create_block_mask(
    mask_mod: MaskMod | Callable[..., Any],
    B: int | None,
    H: int | None,
    Sq: int,
    Skv: int,
    *,
    block_size: int | tuple[int, int] = 128,
    device: str | torch.device | None = None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once and classify every block as empty, partial or full.

    Cost: one evaluation of the mask over (B, H, Sq, Skv) in chunks; build it once per shape and
    reuse it (it does not depend on q, k, v).

    Args:
        mask_mod: a :class:`MaskMod` (or a function, wrapped with :func:`mask_mod`).
        B, H: batch and query-head counts the mask depends on; None when it does not (broadcast).
        Sq, Skv: sequence lengths.
        block_size: the block size (or (block_q, block_kv)): a power of two >= 16; the kernels'
            tiles divide it. 128 is a good default.
        device: where the lists live (default: the device of the mask's captured tensors, else CPU);
            it must be the device of q at the call.

    Returns:
        A :class:`BlockMask`.

    Raises:
        TypeError: ``mask_mod`` is not a mask, or does not return a bool tensor.
        ValueError: bad sizes; a ``mask_mod`` result that does not broadcast to (B, H, Sq, Skv)
            with 4 dims; a ``modmath.load`` index outside the tensor the mask captures (a mask
            built for other sizes).

    Example:
        >>> import fp8ops
        >>> bm = fp8ops.create_block_mask(fp8ops.sliding_window_mask(128), None, None, 512, 512, block_size=64)
        >>> bm.block_states()[0, 0, 4].tolist()      # empty, partial (1) and full (2) key blocks
        [0, 0, 1, 2, 1, 0, 0, 0]
    """
    where = "create_block_mask"
    if not isinstance(mask_mod, MaskMod):
        if isinstance(mask_mod, ScoreMod) or not callable(mask_mod):
            raise TypeError(f"{where}: mask_mod must be a MaskMod or a function (b, h, q_idx, kv_idx) -> bool")
        mask_mod = MaskMod(mask_mod)
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for v in (bq, bkv):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{where}: block_size must be a power of two >= 16, got {block_size!r}")
    for name, v in (("Sq", Sq), ("Skv", Skv)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {v!r}")
    for name, v in (("B", B), ("H", H)):
        if v is not None and (_index(v) is None or _index(v) < 1):  # type: ignore[operator]
            raise ValueError(f"{where}: {name} must be an int >= 1, or None when the mask does not depend on it, "
                             f"got {v!r}")
    nb = 1 if B is None else _index(B)
    nh = 1 if H is None else _index(H)
    if device is None:
        device = mask_mod.buffers[0].device if mask_mod.buffers else torch.device("cpu")
    dev = torch.device(device)
    label = _mod_label(mask_mod)
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    b_idx = torch.arange(nb, device=dev).view(nb, 1, 1, 1)
    h_idx = torch.arange(nh, device=dev).view(1, nh, 1, 1)
    kv_idx = torch.arange(Skv, device=dev).view(1, 1, 1, Skv)
    # In-range elements per block, to tell full blocks from partial ones at the sequence ends.
    rows_in = torch.clamp(Sq - torch.arange(nq, device=dev) * bq, max=bq)
    cols_in = torch.clamp(Skv - torch.arange(nkv, device=dev) * bkv, max=bkv)
    inrange = rows_in[:, None] * cols_in[None, :]  # (NQ, NKV)
    counts = torch.empty((nb, nh, nq, nkv), dtype=torch.int64, device=dev)
    chunk = max(1, (1 << 24) // max(1, nb * nh * bq * nkv * bkv))
    pad_kv = nkv * bkv - Skv
    with torch.no_grad():
        for r0 in range(0, nq, chunk):
            r1 = min(nq, r0 + chunk)
            q_idx = torch.arange(r0 * bq, min(Sq, r1 * bq), device=dev).view(1, 1, -1, 1)
            shape = (nb, nh, q_idx.shape[2], Skv)
            try:
                r = mask_mod(b_idx, h_idx, q_idx, kv_idx)
            except IndexError as e:
                raise ValueError(
                    _load_error(e, "mask_mod", label, where, "(B, H, Sq, Skv)", (nb, nh, Sq, Skv))) from None
            r = _check_mod_result(r, "mask_mod", label, where, shape, "(B, H, Sq, Skv)", (nb, nh, Sq, Skv))
            m = torch.broadcast_to(torch.as_tensor(r, device=dev), shape).to(torch.int32)
            m = torch.nn.functional.pad(m, (0, pad_kv, 0, (r1 - r0) * bq - q_idx.shape[2]))
            m = m.view(nb, nh, r1 - r0, bq, nkv, bkv)
            counts[:, :, r0:r1] = m.sum(dim=(3, 5))
    state = torch.where(counts == 0, 0, torch.where(counts == inrange, 2, 1)).to(torch.int8)
    kvn, kvi = _lists(state, 1)
    fkvn, fkvi = _lists(state, 2)
    st = state.transpose(-1, -2)
    qn, qi = _lists(st, 1)
    fqn, fqi = _lists(st, 2)
    return BlockMask(kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, (Sq, Skv), (bq, bkv), mask_mod)
