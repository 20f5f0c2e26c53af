"""Run pytest and report every test after which a process-wide torch setting has changed
(matmul precision, TF32, reduced-precision reductions, SDPA backends and their priority, cuDNN,
determinism, default dtype), with the values before and after.

    PYTHONPATH=scripts python -m pytest -p global_state_check -m gpu -q tests/test_transformer_layer_gpu.py
    (STATE_LOG=path also appends each change to that file; works with pytest-xdist)
"""
import os
import sys

import pytest
import torch


def snapshot() -> dict:
    b = torch.backends
    s = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul.allow_tf32": b.cuda.matmul.allow_tf32,
        "matmul.allow_fp16_reduced": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "matmul.allow_bf16_reduced": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cudnn.allow_tf32": b.cudnn.allow_tf32,
        "cudnn.deterministic": b.cudnn.deterministic,
        "cudnn.benchmark": b.cudnn.benchmark,
        "flash_sdp": b.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": b.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": b.cuda.math_sdp_enabled(),
        "cudnn_sdp": b.cuda.cudnn_sdp_enabled(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
    }
    try:
        s["sdp_priority"] = tuple(torch._C._get_sdp_priority_order())
    except Exception:  # noqa: BLE001
        pass
    for name in ("fp32_precision",):
        for obj, label in ((b.cuda.matmul, "matmul"), (b.cudnn, "cudnn")):
            if hasattr(obj, name):
                s[f"{label}.{name}"] = getattr(obj, name)
    return s


_last: dict = {}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):  # noqa: ARG001
    global _last
    now = snapshot()
    diff = {k: (_last.get(k), v) for k, v in now.items() if _last and _last.get(k) != v}
    if diff:
        line = f"GLOBAL STATE CHANGED after {item.nodeid}: {diff}\n"
        sys.__stderr__.write(line)
        if os.environ.get("STATE_LOG"):
            with open(os.environ["STATE_LOG"], "a") as f:
                f.write(line)
    _last = now


def pytest_runtest_setup(item):  # noqa: ARG001
    global _last
    if not _last:
        _last = snapshot()


if __name__ == "__main__":
    sys.exit(pytest.main([*sys.argv[1:], "-p", "global_state_check"]))
