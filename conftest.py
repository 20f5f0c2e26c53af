"""Test-session setup shared by tests/ and property_tests/.

Without a CUDA device, Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must be
set before any kernel is defined, so before fp8ops is imported. On a GPU machine kernels compile
normally and the interpreter tests are skipped.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
    )
    settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is only needed by property_tests/
    pass


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The graphs that ``torch.compile`` builds while the test runs (a list, filled as they are
    compiled): every ``torch.compile`` call gets a backend that records each graph and runs it as
    traced, so that counting costs no Inductor compile."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": counting}))
    return graphs
