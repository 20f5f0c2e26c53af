"""The layout rules of DESIGN.md §2, checked on the source tree (no import of the package needed).

- No module outside ``kernels/``, ``fp8ops/bench/`` and the demo above 700 lines.
- No import cycle among fp8ops's modules (module-level imports; imports inside functions are
  deferred on purpose and not counted).
- The reference (``fp8ops/reference/``) imports nothing from the ops it specifies.
- Kernels import only torch, triton, the standard library and each other; nothing imports the
  bare name ``kernels`` (a different PyPI package has that name).
- One op, one stem: a public op ``fp8ops.<op>`` is defined in ``fp8ops/<stem>.py`` (or the package
  ``fp8ops/<stem>/``), specified in ``fp8ops/reference/<stem>.py`` by a function of the same name,
  and tested in ``tests/test_<stem>*.py``; every other module, kernel module and test file is named
  after a stem, a component library op shared by several public ops, or one named cross-cutting
  concern.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fp8ops"
KERNELS = ROOT / "kernels"
MAX_LINES = 700


def _module_name(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        parts = ("fp8ops", "kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = sorted(PKG.rglob("*.py")) + sorted(KERNELS.glob("*.py"))
    return {_module_name(p): p for p in files}


SOURCES = _sources()


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _top_level_imports(module: str, path: Path) -> set[str]:
    """fp8ops modules imported at module level (not inside functions or TYPE_CHECKING blocks)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_pkg, node.level, node.module) if node.level else (node.module or "")
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from . import x` imports x

    visit(tree.body)
    return {m for m in found if m in SOURCES}


GRAPH = {m: _top_level_imports(m, p) - {m} for m, p in SOURCES.items()}


def test_module_sizes() -> None:
    too_long = []
    for module, path in SOURCES.items():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "kernels" or rel.parts[:2] == ("fp8ops", "bench") or rel.name == "demo.py":
            continue
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            too_long.append(f"{rel}: {n} lines")
    assert not too_long, f"modules above {MAX_LINES} lines (split them by concern): {too_long}"


def test_no_import_cycles() -> None:
    # A package importing its own submodules (fp8ops/__init__ re-exporting) is the usual one-way
    # dependency; a cycle is a path from a module back to itself through module-level imports.
    def parents(m: str) -> set[str]:
        parts = m.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    sys.setrecursionlimit(10_000)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if n in parents(m):  # importing an enclosing package runs its __init__ first: not a cycle edge
                continue
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_reference_imports_no_op() -> None:
    bad = []
    for m, deps in GRAPH.items():
        if not m.startswith("fp8ops.reference"):
            continue
        for d in deps:
            allowed = (d.startswith("fp8ops.reference") or d.startswith("fp8ops.kernels")
                       or d in {"fp8ops", "fp8ops.formats", "fp8ops.state", "fp8ops.recipes"})
            if not allowed:
                bad.append(f"{m} imports {d}")
    assert not bad, f"the reference must not import the ops it specifies: {bad}"


# Public op -> its stem. The stem is the op's name; two families share one: the norm ops (one
# kernel with an RMS flag) and quantize / dequantize.
OPS = {
    "adamw_quantize_": "optim",
    "attention": "attention",
    "dequantize": "quantize",
    "fake_quantize": "fake_quantize",
    "fp8_linear": "fp8_linear",
    "fused_ln_mlp": "fused_ln_mlp",
    "layer_norm": "norm",
    "layernorm_linear": "layernorm_linear",
    "linear_cross_entropy": "linear_cross_entropy",
    "quantize": "quantize",
    "rms_norm": "norm",
    "tied_embedding": "tied_embedding",
    "transformer_layer": "transformer_layer",
}
# Library ops used inside several public ops, with the same stem in fp8ops/, reference/, kernels/
# and tests/: the scaled GEMM (fp8_linear, layernorm_linear, fused_ln_mlp) and the fused
# activations (fused_ln_mlp).
COMPONENTS = {"activation", "gemm"}
# Modules that are not ops: formats, recipes and state; the module API; the demo.
INFRASTRUCTURE = {"formats", "recipes", "state", "state_dict", "update", "parallel", "graph_step", "nn", "demo", "bench",
                  "testing", "reference", "kernels"}
# Test files about a concern that crosses ops (named after it, not after a stem); "kernels": the
# launch path and finalize kernels that the kernel modules share (kernels/_library.py, _reduce.py).
CROSS_CUTTING_TESTS = {"autocast", "kernels", "composition", "docs", "layout", "numerics", "op_checks", "state_checks",
                       "distributed", "recipes", "state", "nn", "demo", "graph_step"}
STEMS = set(OPS.values()) | COMPONENTS


def _test_stem(name: str, suffix: str) -> str | None:
    """The stem or concern a test file ``test_<x>[_...]`` names (the longest known prefix)."""
    body = name.removeprefix("test_").removesuffix(suffix)
    known = sorted(STEMS | CROSS_CUTTING_TESTS, key=len, reverse=True)
    return next((k for k in known if body == k or body.startswith(k + "_")), None)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_is_found_by_its_stem(op: str) -> None:
    import fp8ops

    stem = OPS[op]
    module = getattr(fp8ops, op).__module__
    assert module == f"fp8ops.{stem}" or module.startswith(f"fp8ops.{stem}."), (
        f"fp8ops.{op} is defined in {module}, expected fp8ops/{stem}.py or the package fp8ops/{stem}/")
    ref = PKG / "reference" / f"{stem}.py"
    assert ref.exists(), f"{op}: no reference module {ref.relative_to(ROOT)}"
    assert f"def {op}(" in ref.read_text(), f"{op}: {ref.relative_to(ROOT)} defines no function {op}"
    tests = sorted((ROOT / "tests").glob(f"test_{stem}*.py"))
    assert tests, f"{op}: no tests/test_{stem}*.py"


def test_every_module_is_named_after_a_stem() -> None:
    bad = []
    for path in sorted(PKG.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("_") or path.name in {"__pycache__", "py.typed"}:
            continue
        if name not in STEMS | INFRASTRUCTURE:
            bad.append(f"fp8ops/{path.name}")
    for path in sorted((PKG / "reference").glob("*.py")) + sorted(KERNELS.glob("*.py")):
        if not path.stem.startswith("_") and path.stem not in STEMS:
            bad.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if _test_stem(path.stem, "") is None:
            bad.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "property_tests").glob("test_*.py")):
        if not path.stem.endswith("_props") or _test_stem(path.stem, "_props") is None:
            bad.append(str(path.relative_to(ROOT)))
    assert not bad, (f"files not named after an op's stem {sorted(STEMS)}, a concern "
                     f"{sorted(CROSS_CUTTING_TESTS)} or infrastructure {sorted(INFRASTRUCTURE)}: {bad}")


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_only_torch_and_triton(path: Path) -> None:
    allowed_roots = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] not in allowed_roots]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if (node.module or "").split(".")[0] not in allowed_roots:
                bad.append(node.module)
    assert not bad, f"{path.name} imports {bad}; kernels take raw tensors and import only torch and triton"


def test_nothing_imports_the_bare_name_kernels() -> None:
    bad = []
    for path in [*PKG.rglob("*.py"), *KERNELS.glob("*.py"), *(ROOT / "tests").glob("*.py"),
                 *(ROOT / "property_tests").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kernels" for a in node.names):
                bad.append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kernels":
                bad.append(str(path.relative_to(ROOT)))
    assert not bad, f"import fp8ops.kernels, never the bare name kernels: {bad}"


def test_gpu_check_runs_every_gpu_test_file() -> None:
    """scripts/gpu_check.sh's default test groups name every file that holds GPU tests."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    groups = re.search(r'TEST_GROUPS=\$\{TEST_GROUPS:-"([^"]*)"\}', script)
    assert groups, "scripts/gpu_check.sh: no default TEST_GROUPS"
    named = {p for g in groups.group(1).split(";") for p in g.split(":", 1)[1].split()}
    files = sorted(ROOT.glob("tests/test_*.py")) + sorted(ROOT.glob("property_tests/test_*.py"))
    gpu = [p for p in files if p.stem.endswith("_gpu") or (p != Path(__file__).resolve() and "mark.gpu" in p.read_text())]
    missing = [str(p.relative_to(ROOT)) for p in gpu
               if str(p.relative_to(ROOT)) not in named and str(p.parent.relative_to(ROOT)) not in named]
    assert not missing, f"GPU test files that scripts/gpu_check.sh does not run by default: {missing}"
