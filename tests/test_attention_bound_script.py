"""scripts/attn_bwd_bound_check.py's copies of the Hopper backward (the timing on the GPU needs one):
its text edits still find the code they take out of the current kernel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("attn_bwd_bound_check", ROOT / "scripts" / "attn_bwd_bound_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copies_lose_the_dq_reductions_and_then_the_dq_products():
    bc = _script()
    source = Path(bc.KERNEL).read_text()
    copies = bc.diagnostic_sources(source)
    assert list(copies) == ["no dQ reductions", "no dQ reductions or products"]
    assert source.count("_tma_add(dq_desc") == 2
    for label, text in copies.items():
        assert "_tma_add(dq_desc" not in text, label
        compile(text, label, "exec")  # still a module
    no_reduction, no_dq = copies.values()
    # the second copy differs from the first by the tile loop's two dQ products and their wait only
    assert no_reduction.count("warpgroup_mma(") - no_dq.count("warpgroup_mma(") == 2
    assert "deps=[dq, dv, dk]" in no_reduction and "deps=[dq, dv, dk]" not in no_dq
    # nothing else changes: the kernel less the edited lines
    assert len(source.splitlines()) - len(no_reduction.splitlines()) == 2


def test_a_kernel_whose_code_moved_is_refused():
    bc = _script()
    source = Path(bc.KERNEL).read_text()
    with pytest.raises(ValueError, match="dQ products"):
        bc.diagnostic_sources(source.replace(bc._DQ_PRODUCTS, ""))
    with pytest.raises(ValueError, match="dQ reduction"):
        bc.diagnostic_sources(source.replace(bc._REDUCTION, "pass", 1))
