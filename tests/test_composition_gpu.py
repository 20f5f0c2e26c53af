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
from torch.utils import _pytree as pytree

from fp8ops.testing import composition as C

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative (Frobenius) error bounds against eager, per compute dtype: float32 differs by
# reassociation and TF32-free cuBLAS choices only; bfloat16's fused casts round differently and FP8
# quantization can move an element across a rounding boundary.
GRAD_TOL = {"float32": 2e-3, "bfloat16": 5e-2}
LOSS_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
_EAGER: dict[tuple[str, str], C.StepResult] = {}


def _eager(recipe: str, dtype: str) -> C.StepResult:
    if (recipe, dtype) not in _EAGER:
        _EAGER[recipe, dtype] = C.train("eager", recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda")
    return _EAGER[recipe, dtype]


def _probe_grads(r: C.StepResult) -> dict[str, torch.Tensor]:
    leaves = [t for t in pytree.tree_leaves(r.probe_grads) if isinstance(t, torch.Tensor)]
    return {str(i): t for i, t in enumerate(leaves)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
@pytest.mark.parametrize("mode", ["func.grad", "func.grad_and_value", "func.vjp"])
def test_func_transform_is_bitwise_eager(mode: str, recipe: str, dtype: str) -> None:
    want = _eager(recipe, dtype)
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda")
    assert got.losses == want.losses, (mode, recipe, dtype)
    for k, g in want.grads.items():
        assert torch.equal(got.grads[k], g), f"{mode} {recipe} {dtype}: gradient of parameter {k} differs"
    for k, g in _probe_grads(want).items():
        assert torch.equal(_probe_grads(got)[k], g), f"{mode} {recipe} {dtype}: probe gradient {k} differs"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
@pytest.mark.parametrize("mode", ["compile", "fullgraph", "reduce-overhead"])
def test_compiled_mode_matches_eager(mode: str, recipe: str, dtype: str) -> None:
    want = _eager(recipe, dtype)
    got = C.train(mode, recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda")
    err, key = C.max_rel_error(want.grads, got.grads)
    perr, _ = C.max_rel_error(_probe_grads(want), _probe_grads(got))
    lerr = max(abs(a - b) / abs(a) for a, b in zip(want.losses, got.losses))
    print(f"\ncomposition {mode:16s} {recipe:8s} {dtype:9s} grad {err:.2e} (param {key}) probe {perr:.2e} "
          f"loss {lerr:.2e}")
    assert err <= GRAD_TOL[dtype], f"{mode} {recipe} {dtype}: parameter {key} gradient relative error {err:.2e}"
    assert perr <= GRAD_TOL[dtype], f"{mode} {recipe} {dtype}: probe gradient relative error {perr:.2e}"
    assert lerr <= LOSS_TOL[dtype], f"{mode} {recipe} {dtype}: loss curves differ by {lerr:.2e}"
