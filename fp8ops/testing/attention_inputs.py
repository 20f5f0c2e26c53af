"""Seeded attention inputs for tests: q/k/v in each layout, a fused QKV projection's strided
slices, a causal document mask, and two score mods that the Hopper backward calls in different ways (used
by the Hopper attention GPU tests, forward and backward)."""

from __future__ import annotations

from typing import Any

import torch

from ..attention import and_masks, causal_mask, document_mask

__all__ = ["additive_named", "docs_mask", "fused_qkv", "qkv", "rand", "scaled_score"]


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """Standard normal values of ``shape`` from a generator seeded with ``seed``, cast to ``dtype``."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(dtype)


def qkv(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, D: int, dtype: torch.dtype = torch.bfloat16,
        layout: str = "bhsd", seed: int = 0, *, device: str) -> list[torch.Tensor]:
    """q, k, v in ``layout`` ("bhsd", "bshd" or "sbhd"), seeds ``seed``, ``seed + 1``, ``seed + 2``."""
    shape = {"bhsd": lambda h, s: (B, h, s, D), "bshd": lambda h, s: (B, s, h, D),
             "sbhd": lambda h, s: (s, B, h, D)}[layout]
    return [rand(shape(Hq, Sq), dtype, seed, device), rand(shape(Hkv, Skv), dtype, seed + 1, device),
            rand(shape(Hkv, Skv), dtype, seed + 2, device)]


def fused_qkv(S: int, B: int, H: int, D: int, seed: int, *, device: str) -> list[torch.Tensor]:
    """q, k, v as strided (S, B, H, D) slices of one bf16 (S, B, 3, H, D) projection output."""
    x = rand((S, B, 3, H, D), torch.bfloat16, seed, device)
    return [x[:, :, 0], x[:, :, 1], x[:, :, 2]]


def docs_mask(S: int, *, device: str, docs: int = 5) -> Any:
    """Causal attention within ``docs`` equal documents of a length-``S`` sequence (a mask_mod)."""
    ids = (torch.arange(S, device=device) * docs) // S
    return and_masks(causal_mask(), document_mask(ids))


def scaled_score(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    """A score mod that is not additive (its derivative in the score, 0.5, is called by the kernels)."""
    return score * 0.5 + 0.03125 * (kv_idx - q_idx)


def additive_named(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    """An additive score mod written in named steps: its derivative is 1, which the Hopper backward
    skips (``codegen.score_grad_identity`` follows the named steps)."""
    shifted = score + 0.125 * h
    return shifted - 0.03125 * (q_idx - kv_idx)
