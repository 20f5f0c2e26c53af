"""Run pytest with the CUDA caching allocator's free blocks filled with a value (NaN by default)
before every test: a kernel that reads memory it never wrote then shows it in its results.

    python scripts/dirty_memory_check.py nan -m gpu -q tests/test_attention_gpu.py
"""
import sys

import pytest
import torch


def dirty(value: float) -> None:
    keep = [torch.full((size,), value, device="cuda")
            for size in [2**8, 2**12, 2**16, 2**18] * 32 + [2**22] * 32 + [2**26] * 16]
    torch.cuda.synchronize()
    del keep  # the blocks stay in the allocator's cache, holding `value`


class _Dirty:
    def __init__(self, value: float) -> None:
        self.value = value

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):  # noqa: ARG002
        dirty(self.value)


if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[2:], plugins=[_Dirty(float(sys.argv[1]))]))
