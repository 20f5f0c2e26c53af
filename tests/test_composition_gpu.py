"""Model-level composition matrix on the GPU (marker ``gpu``): a 2-layer GPT built from
``transformer_layer``, 8 AdamW steps with probes and ``fp8ops.update``, in every execution mode
(eager autograd, ``torch.compile`` default / ``fullgraph=True`` / ``mode="reduce-overhead"``,
``torch.func.grad`` / ``grad_and_value`` / ``vjp``), for ``recipe=None`` and each recipe, in
float32 and bfloat16: the loss curve and every first-step gradient compared with eager.

The ``torch.func`` transforms run eager's kernels: bitwise equal. The compiled modes run Inductor,
which fuses the torch ops around fp8ops's kernels and may round differently: held to a stated
tolerance. torch.compile on CUDA without FP8 once returned gradients with a relative error of 1.0
(a no-op ``.to`` returned from an autograd.Function's forward; see ``fp8ops._glue.cast``).
"""

from __future__ import annotations

import pytest
import torch

from fp8ops.testing import composition as C

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _eager(recipe: str, dtype: str) -> C.StepResult:
    return C.eager_result(recipe, DTYPES[dtype], "cuda")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
@pytest.mark.parametrize("mode", ["func.grad", "func.grad_and_value", "func.vjp"])
def test_func_transform_is_bitwise_eager(mode: str, recipe: str, dtype: str) -> None:
    want = _eager(recipe, dtype)
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda")
    assert got.losses == want.losses, (mode, recipe, dtype)
    for k, g in want.grads.items():
        assert torch.equal(got.grads[k], g), f"{mode} {recipe} {dtype}: gradient of parameter {k} differs"
    for k, g in C.probe_leaves(want).items():
        assert torch.equal(C.probe_leaves(got)[k], g), f"{mode} {recipe} {dtype}: probe gradient {k} differs"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
@pytest.mark.parametrize("mode", ["compile", "fullgraph", "reduce-overhead"])
def test_compiled_mode_matches_eager(mode: str, recipe: str, dtype: str) -> None:
    """Bounds: fp8ops.testing.composition.check_compiled."""
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda")
    e = C.check_compiled(got, recipe, DTYPES[dtype], "cuda", what=f"{mode} {recipe} {dtype}")
    print(f"\ncomposition {mode:16s} {recipe:8s} {dtype:9s} grad {e['grad']:.2e} (param {e['grad_key']}) "
          f"probe {e['probe']:.2e} loss {e['loss']:.2e} | bounds grad {e['grad_tol']:.2e} loss {e['loss_tol']:.2e}")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("mode", ["func.grad", "fullgraph", "reduce-overhead"])
def test_fp8_head_mode_matches_eager(mode: str, recipe: str) -> None:
    """The GPT with its tied head through fp8_linear (FP8 GEMMs, a state of its own), bf16: the
    torch.func transform bitwise, the compiled modes within check_compiled's bounds."""
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=torch.bfloat16, device="cuda", fp8_head=True)
    if mode.startswith("func."):
        want = C.eager_result(recipe, torch.bfloat16, "cuda", fp8_head=True)
        assert got.losses == want.losses, (mode, recipe)
        for k, g in want.grads.items():
            assert torch.equal(got.grads[k], g), f"{mode} {recipe}: gradient of parameter {k} differs"
        return
    e = C.check_compiled(got, recipe, torch.bfloat16, "cuda", what=f"FP8 head {mode} {recipe}", fp8_head=True)
    print(f"\ncomposition FP8 head {mode:16s} {recipe:8s} grad {e['grad']:.2e} loss {e['loss']:.2e} | "
          f"bounds grad {e['grad_tol']:.2e} loss {e['loss_tol']:.2e}")


@pytest.mark.parametrize("recipe", ["delayed", "current"])  # row-wise scaling writes no transposed copy
@pytest.mark.parametrize("mode", ["compile", "fullgraph", "reduce-overhead"])
def test_compiled_opaque_tensor_map_calls_match_eager(mode: str, recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model with the casts and activations that write a transposed FP8 copy kept opaque in the
    compiled graph and storing that copy through a tensor map (``kernels._library.opaque_for_tma_store``;
    by default only from 2**26 elements, here from the first): bf16, within check_compiled's bounds
    of eager, and the rule did keep calls opaque."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from fp8ops.kernels import _library, activation, quantize

    if not _library.tma_store_ok(torch.empty(16, 16, dtype=torch.float8_e4m3fn, device="cuda")):
        pytest.skip("tensor maps need compute capability 9.0 or newer")
    # graphs traced anew under the lowered threshold, none taken from a cache
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    monkeypatch.setattr(_library, "TMA_STORE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(_library, "OPAQUE_IN_GRAPHS_MIN_ELEMENTS", 0)
    kept: list[tuple[int, ...]] = []

    def counted(x: torch.Tensor, shape: tuple[int, ...]) -> bool:
        ok = _library.opaque_for_tma_store(x, shape)
        if ok:
            kept.append(tuple(shape))
        return ok

    for module in (activation, quantize):
        monkeypatch.setattr(module, "opaque_for_tma_store", counted)
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=torch.bfloat16, device="cuda")
    assert kept, f"{mode} {recipe}: no call stayed opaque for a tensor-map store"
    e = C.check_compiled(got, recipe, torch.bfloat16, "cuda", what=f"opaque tensor-map calls {mode} {recipe}")
    print(f"\ncomposition opaque TMA {mode:16s} {recipe:8s} {len(kept)} opaque decisions, grad {e['grad']:.2e} "
          f"loss {e['loss']:.2e} | bounds grad {e['grad_tol']:.2e} loss {e['loss_tol']:.2e}")


@pytest.mark.parametrize("mode", ["fullgraph", "reduce-overhead"])
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_fused_loss_mode_matches_eager(mode: str, recipe: str) -> None:
    """The GPT with its head and loss through linear_cross_entropy, bf16: compiled within
    check_compiled's bounds of its eager run; eager within a bf16 rounding of the matmul head's
    (the batch's 32 tokens make the mean's scale a power of two)."""
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=torch.bfloat16, device="cuda", fused_loss=True)
    e = C.check_compiled(got, recipe, torch.bfloat16, "cuda", what=f"fused loss {mode} {recipe}", fused_loss=True)
    plain = C.compare(C.eager_result(recipe, torch.bfloat16, "cuda"),
                      C.eager_result(recipe, torch.bfloat16, "cuda", fused_loss=True))
    assert plain["grad"] < 1e-2 and plain["loss"] < 1e-3, plain
    print(f"\ncomposition fused loss {mode:16s} {recipe:8s} grad {e['grad']:.2e} loss {e['loss']:.2e} | "
          f"bounds grad {e['grad_tol']:.2e} loss {e['loss_tol']:.2e}; against the matmul head {plain['grad']:.2e}")
