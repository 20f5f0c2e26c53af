"""Sphinx configuration of the fp8ops API reference (``docs/api/``).

Build: ``python -m sphinx -W --keep-going -b html docs/api OUTDIR`` (tests/test_docs.py runs it).
The pages are autodoc directives over the installed ``fp8ops`` package: the reference is the
docstrings (Google style, read by napoleon). Building imports ``fp8ops`` and runs nothing else.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

project = "fp8ops"
author = "fp8ops contributors"
copyright = "fp8ops contributors"  # noqa: A001  (Sphinx's name)

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

root_doc = "index"
exclude_patterns = ["_build"]
templates_path: list[str] = []
html_static_path: list[str] = []
html_theme = "alabaster"
html_title = "fp8ops API reference"

# Public names are documented where users reach them: fp8ops.<name>.
add_module_names = True
python_use_unqualified_type_names = True

# Signatures stay short; the types go to the parameter list.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # no torch.nn.Module docstrings on forward / extra_repr
autodoc_default_options = {"members": True}

# Google-style docstrings (Args:, Returns:, Raises:, Example:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" sections as fields, not as attribute entries (no duplicates)
napoleon_use_rtype = False
napoleon_preprocess_types = False
napoleon_attr_annotations = True
napoleon_custom_sections = [("Members", "params_style")]  # Enum members (fp8ops.Format)

# References to torch, attrs and private helpers are not resolved (no network, no intersphinx):
# a missing link is not an error; a malformed docstring is.
nitpicky = False


def _attribute_doc(name: str, obj: Any) -> list[str] | None:
    """The docstring under the assignment that defines ``obj`` in an ``fp8ops`` module.

    ``fp8ops.E4M3_MAX`` and the like are re-exported from the module that defines and documents
    them; autodoc only looks for attribute docs in ``fp8ops/__init__.py``, so find the defining one.
    """
    from sphinx.pycode import ModuleAnalyzer

    for modname in sorted(m for m in sys.modules if m == "fp8ops" or m.startswith("fp8ops.")):
        module = sys.modules[modname]
        if getattr(module, name, _MISSING) is not obj or modname == "fp8ops":
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # noqa: BLE001  (a module without source: keep looking)
            continue
        if ("", name) in docs:
            return list(docs[("", name)])
    return None


_MISSING = object()


def _process_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what != "data" or not name.startswith("fp8ops.") or name.count(".") != 1:
        return
    doc = _attribute_doc(name.split(".", 1)[1], obj)
    if doc is not None:
        lines[:] = doc


def setup(app: Any) -> None:
    importlib.import_module("fp8ops")
    app.connect("autodoc-process-docstring", _process_docstring)
