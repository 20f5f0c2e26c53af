"""The documentation is tested like code.

1. Every public name (``fp8ops.__all__``) has a ``### name`` heading in docs/api.md.
2. Every ```python block of docs/*.md and docs/kernels/*.md runs: the blocks of one page run in
   order in one fresh namespace, so a page reads (and executes) top to bottom.
3. The docstring examples of the public modules pass under ``doctest``.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import re
import time
from pathlib import Path

import pytest

import fp8ops

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# ```python at the start of a line, the body, then ``` alone on a line.
_PY_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^###[ \t]+(\S+)[ \t]*$", re.MULTILINE)

_DOCTEST_MODULES = [
    "fp8ops.formats",
    "fp8ops.recipes",
    "fp8ops.state",
    "fp8ops.quantize",
    "fp8ops.fake_quantize",
    "fp8ops.linear",
    "fp8ops.norm",
    "fp8ops.layernorm_linear",
    "fp8ops.mlp",
    "fp8ops.transformer",
    "fp8ops.nn",
    "fp8ops.reference.transformer",
    "fp8ops.attention",
    "fp8ops.reference.gemm",
]


def _doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + sorted((DOCS / "kernels").glob("*.md"))


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number of the body, body)`` of each ```python block, in order."""
    blocks = []
    for m in _PY_BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        blocks.append((line, m.group(1)))
    return blocks


# ------------------------------------------------------------------------------------------------
# 1. API reference coverage


def test_api_md_has_a_heading_for_every_public_name() -> None:
    api = DOCS / "api.md"
    assert api.is_file(), f"{api} is missing"
    headings = set(_HEADING.findall(api.read_text(encoding="utf-8")))
    missing = [name for name in fp8ops.__all__ if name not in headings]
    assert not missing, (
        f"docs/api.md has no '### name' heading for these names of fp8ops.__all__: {missing}; "
        f"add a section (signature, description, arguments/returns, example) for each"
    )


# ------------------------------------------------------------------------------------------------
# 2. Every python example in the docs runs


def test_docs_pages_exist() -> None:
    names = {p.relative_to(DOCS).as_posix() for p in _doc_pages()}
    for page in ("index.md", "formats_and_recipes.md", "scaling_state.md", "api.md", "kernels/quantize.md",
                 "kernels/attention.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_docs_python_blocks_run(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    rel = page.relative_to(ROOT).as_posix()
    for line, body in _python_blocks(text):
        # Pad with newlines so tracebacks point at the line of the .md file.
        code = compile("\n" * (line - 1) + body, rel, "exec")
        start = time.perf_counter()
        try:
            exec(code, namespace)
        except Exception as e:
            raise AssertionError(f"{rel}: the python block starting at line {line} raised {type(e).__name__}: {e}") from e
        elapsed = time.perf_counter() - start
        assert elapsed < 30.0, f"{rel}: the python block at line {line} took {elapsed:.1f}s; keep doc examples small"


# ------------------------------------------------------------------------------------------------
# 3. Docstring examples of the library


@pytest.mark.parametrize("module_name", _DOCTEST_MODULES)
def test_module_doctests(module_name: str) -> None:
    module = importlib.import_module(module_name)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module_name}: no docstring examples found"
    assert result.failed == 0, (
        f"{module_name}: {result.failed} of {result.attempted} docstring examples failed "
        f"(fix the docstring, or the code if the docstring is right):\n{report.getvalue()}"
    )
