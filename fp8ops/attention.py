"""Attention with fused score/mask modifications, block sparsity, packed sequences and GQA.

``out, new_state = attention(q, k, v, state=None, ...)`` is scaled dot-product attention::

    s_ij   = scale * q_i . k_j               then  s_ij = score_mod(s_ij, b, h, i, j)
    out_i  = sum_j softmax_j(s_ij over the visible j) v_j
    visible(i, j) = window/causal band  &  mask_mod(b, h, i, j)  &  block_mask  &  same sequence

On CUDA it runs fused Triton kernels (``fp8ops.kernels.attention``): softmax in fp32 with exp2,
the mods compiled into the kernels, empty blocks skipped and full blocks run without the mask.
On the CPU it runs the FP32 reference math (:mod:`fp8ops.reference.attention`), so it works
everywhere and composes with ``torch.func`` and ``torch.compile``.

Mods are written once as plain Python over a few operations (arithmetic, comparisons, ``&``,
``|``, ``~`` and :data:`modmath`), and run both as PyTorch (the eager twin: the function itself)
and inside the Triton kernels (a twin generated from its source, with its derivative for the
backward)::

    @fp8ops.score_mod
    def softcap30(score, b, h, q_idx, kv_idx):
        return 30.0 * modmath.tanh(score / 30.0)

Numbers and tensors a mod closes over are captured: numbers become constants of the kernel,
tensors (read with ``modmath.load(table, index)``) become kernel arguments and get gradients when
they require them (a learned bias table). Ready mods: :func:`causal_mask`,
:func:`sliding_window_mask`, :func:`prefix_lm_mask`, :func:`document_mask`, :func:`alibi`,
:func:`softcap`, :func:`relative_position_bias`; combine masks with :func:`and_masks` /
:func:`or_masks`.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import inspect
import linecache
import math
import operator
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import torch
from torch import Tensor

from ._checks import check_float_tensor
from ._glue import refuse_compiled_transform
from .kernels import attention as _K
from .kernels._library import define as _define
from .reference import attention as _ref
from .reference.attention import LAYOUTS, MASKED_ROW_LSE

__all__ = [
    "MASKED_ROW_LSE",
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "alibi",
    "and_masks",
    "attention",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "mask_mod",
    "modmath",
    "or_masks",
    "prefix_lm_mask",
    "relative_position_bias",
    "score_mod",
    "sliding_window_mask",
    "softcap",
]

_MAX_BUFFERS = _K.MAX_MOD_BUFFERS


# ------------------------------------------------------------------------------------------------
# modmath: the math a mod may use (PyTorch implementations; the kernels get Triton twins).


def _is_t(x: Any) -> bool:
    return isinstance(x, Tensor)


def _values_readable(t: Tensor) -> bool:
    """Whether reading ``t``'s values on the host is possible and cheap enough to validate with:
    not while torch.compile traces, not for meta tensors, nor for tensors wrapped by a ``torch.func``
    transform (a vmap-batched tensor has no single value to read)."""
    if torch.compiler.is_compiling() or t.is_meta:
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


class _LoadIndexError(IndexError):
    """``modmath.load(table, index)`` with an index outside ``[0, table.numel())`` (the eager twin).

    The public ops catch it around mod calls and raise a ValueError naming the mod and the call's
    sizes; it stays an IndexError for code that calls a mod directly."""

    def __init__(self, table: Tensor, lo: int | None, hi: int | None, detail: str = "") -> None:
        self.shape = tuple(table.shape)
        self.numel = table.numel()
        self.lo, self.hi = lo, hi
        got = f"indices in [{lo}, {hi}]" if lo is not None else detail
        super().__init__(f"modmath.load: index out of range for a table of shape {self.shape} "
                         f"({self.numel} elements, valid flat indices [0, {self.numel - 1}]): got {got}")


class _ModMath:
    """The math namespace of score/mask mods: ``from fp8ops import modmath``.

    Each function takes tensors (or numbers) and works elementwise with broadcasting, in PyTorch
    (the eager twin) and in Triton (inside the kernels), where its derivative is known too:

    ``exp, exp2, log, log2, sqrt, tanh, sigmoid, abs`` (one argument), ``minimum(a, b)``,
    ``maximum(a, b)``, ``where(cond, a, b)``, ``clamp(x, lo, hi)``, and ``load(table, index)``:
    ``table.reshape(-1)[index]`` for a captured tensor (flat, row-major integer index in
    ``[0, table.numel())``; outside it the eager twin raises IndexError, where the kernels would
    read outside the table).

    Example:
        >>> import torch
        >>> from fp8ops import modmath
        >>> modmath.clamp(torch.tensor([-2.0, 0.5, 3.0]), 0.0, 1.0)
        tensor([0.0000, 0.5000, 1.0000])
    """

    __slots__ = ()

    @staticmethod
    def exp(x: Any) -> Any:
        return torch.exp(x) if _is_t(x) else math.exp(x)

    @staticmethod
    def exp2(x: Any) -> Any:
        return torch.exp2(x) if _is_t(x) else 2.0**x

    @staticmethod
    def log(x: Any) -> Any:
        return torch.log(x) if _is_t(x) else math.log(x)

    @staticmethod
    def log2(x: Any) -> Any:
        return torch.log2(x) if _is_t(x) else math.log2(x)

    @staticmethod
    def sqrt(x: Any) -> Any:
        return torch.sqrt(x) if _is_t(x) else math.sqrt(x)

    @staticmethod
    def tanh(x: Any) -> Any:
        return torch.tanh(x) if _is_t(x) else math.tanh(x)

    @staticmethod
    def sigmoid(x: Any) -> Any:
        return torch.sigmoid(x) if _is_t(x) else 1.0 / (1.0 + math.exp(-x))

    @staticmethod
    def abs(x: Any) -> Any:
        return torch.abs(x) if _is_t(x) else builtins.abs(x)

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        if _is_t(a) and _is_t(b):
            return torch.minimum(a, b)
        if _is_t(a):
            return torch.clamp(a, max=b)
        if _is_t(b):
            return torch.clamp(b, max=a)
        return builtins.min(a, b)

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        if _is_t(a) and _is_t(b):
            return torch.maximum(a, b)
        if _is_t(a):
            return torch.clamp(a, min=b)
        if _is_t(b):
            return torch.clamp(b, min=a)
        return builtins.max(a, b)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        if not _is_t(cond):
            return a if cond else b
        return torch.where(cond, a, b)

    @staticmethod
    def clamp(x: Any, lo: Any, hi: Any) -> Any:
        return _ModMath.minimum(_ModMath.maximum(x, lo), hi)

    @staticmethod
    def load(table: Tensor, index: Any) -> Tensor:
        flat = table.reshape(-1)
        n = flat.numel()
        if _is_t(index):
            if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
                raise TypeError(f"modmath.load: index must be an integer tensor (a flat, row-major position "
                                f"in the table), got {index.dtype}")
            # Negative indices would wrap here but read before the table in the kernels: refuse both
            # ends. One host read, skipped where values cannot be read (tracing, vmap-batched).
            if index.numel() and _values_readable(index):
                lo, hi = torch.stack(index.aminmax()).tolist()
                if lo < 0 or hi >= n:
                    raise _LoadIndexError(table, lo, hi)
        elif isinstance(index, int) and not isinstance(index, bool) and not 0 <= index < n:
            raise _LoadIndexError(table, index, index)
        try:
            return flat[index]
        except IndexError as e:
            raise _LoadIndexError(table, None, None, str(e)) from None


modmath = _ModMath()
"""The math namespace of mods (see :class:`_ModMath`): ``exp exp2 log log2 sqrt tanh sigmoid abs
minimum maximum where clamp load``."""

_NS_FUNCS = ("exp", "exp2", "log", "log2", "sqrt", "tanh", "sigmoid", "abs", "minimum", "maximum", "where",
             "clamp", "load")
_NS_BY_ID = {id(getattr(_ModMath, n)): n for n in _NS_FUNCS}


# ------------------------------------------------------------------------------------------------
# From a Python mod to its Triton twin: resolve free names, lower to straight-line SSA code, emit
# the forward source and (for score mods) a forward-mode derivative.

_SCORE_ARITY = 5
_MASK_ARITY = 4


class ModError(TypeError):
    """A mod uses something its Triton twin cannot express."""


def _mod_error(fn: Any, msg: str) -> ModError:
    name = getattr(fn, "__qualname__", repr(fn))
    return ModError(
        f"{name}: {msg}. A mod body may use its arguments, numbers, +, -, *, /, //, %, **(small int), "
        f"comparisons, &, |, ~, local assignments and fp8ops.modmath functions; it may close over numbers "
        f"and tensors (read tensors with modmath.load(table, index)). Otherwise pass explicit twins: "
        f"ScoreMod(fn, triton=..., triton_grad=...) / MaskMod(fn, triton=...)"
    )


_NS, _MODULE, _BUFFER, _CONST, _BUILTIN, _NSFUNC = "ns", "module", "buffer", "const", "builtin", "nsfunc"


def _classify(value: Any) -> tuple[str, Any]:
    if value is modmath:
        return _NS, None
    if isinstance(value, types.ModuleType):
        return _MODULE, value
    if isinstance(value, Tensor):
        return _BUFFER, value
    if isinstance(value, (bool, int, float)):
        return _CONST, value
    if value is float or value is int:
        return _BUILTIN, value
    if callable(value) and id(value) in _NS_BY_ID:
        return _NSFUNC, _NS_BY_ID[id(value)]
    return "other", value


def _fn_ast(fn: Any, arity: int) -> tuple[list[str], list[ast.stmt] | None, ast.expr | None]:
    """(parameter names, body statements or None, lambda body or None)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise _mod_error(fn, f"its source is not available ({e})") from None
    code = fn.__code__
    node: ast.AST | None = None
    candidates: list[ast.AST] = []
    for text in (src, src.strip().rstrip(",").rstrip(")"), "(" + src.strip().rstrip(",") + ")"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        candidates = [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.Lambda))
                      and (not isinstance(n, ast.FunctionDef) or n.name == code.co_name)]
        if candidates:
            break
    want = list(code.co_varnames[: code.co_argcount])
    matches = [n for n in candidates if [a.arg for a in n.args.args] == want]  # type: ignore[attr-defined]
    if code.co_name != "<lambda>":
        matches = [n for n in matches if isinstance(n, ast.FunctionDef)] or matches
    if len(matches) != 1:
        raise _mod_error(fn, "its definition could not be located unambiguously in its source (define it with def)")
    node = matches[0]
    args = node.args  # type: ignore[attr-defined]
    if args.vararg or args.kwarg or args.kwonlyargs or args.defaults or args.posonlyargs:
        raise _mod_error(fn, "it must take plain positional arguments only")
    params = [a.arg for a in args.args]
    if len(params) != arity:
        raise _mod_error(fn, f"it must take {arity} arguments, got {len(params)}")
    for p in params:
        if p.startswith("_fp8_"):
            raise _mod_error(fn, f"argument names starting with _fp8_ are reserved ({p})")
    if isinstance(node, ast.Lambda):
        return params, None, node.body
    return params, node.body, None  # type: ignore[attr-defined]


def _free_values(fn: Any) -> dict[str, Any]:
    """Values of the names a function reads from its closure, its globals and the builtins."""
    code = fn.__code__
    out: dict[str, Any] = {}
    if fn.__closure__:
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                out[name] = cell.cell_contents
            except ValueError:
                pass
    for name in code.co_names:
        if name in out:
            continue
        if name in fn.__globals__:
            out[name] = fn.__globals__[name]
        elif hasattr(builtins, name):
            out[name] = getattr(builtins, name)
    return out


def _const_src(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return repr(v)
    v = float(v)
    if math.isnan(v):
        return "float('nan')"
    if math.isinf(v):
        return "float('inf')" if v > 0 else "(-float('inf'))"
    return repr(v)


def _const_node(v: Any) -> ast.expr:
    return ast.parse(_const_src(v), mode="eval").body


class _Lowered(NamedTuple):
    params: tuple[str, ...]
    stmts: tuple[tuple[str, ast.expr], ...]
    ret: ast.expr
    loads: tuple[tuple[int, int, str, str], ...]  # (site, buffer slot, index name, value name)


class _Lowering:
    """Lowers a mod body to SSA statements over generated names (see :func:`_lower`)."""

    def __init__(self, fn: Any, params: list[str], env: dict[str, tuple[str, Any]], slots: dict[int, int],
                 assigned: set[str]) -> None:
        self.fn = fn
        self.params = params
        self.env = env
        self.slots = slots  # id(tensor) -> buffer slot
        self.assigned = assigned
        self.ssa: dict[str, str] = {}
        self.stmts: list[tuple[str, ast.expr]] = []
        self.loads: list[tuple[int, int, str, str]] = []
        self.n = 0

    def err(self, msg: str) -> ModError:
        return _mod_error(self.fn, msg)

    def resolve(self, node: ast.expr) -> tuple[str, Any]:
        # A free name or an attribute chain on modules / modmath.
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            raise self.err(f"name {node.id!r} is not defined")
        if isinstance(node, ast.Attribute):
            kind, val = self.resolve(node.value)
            if kind == _NS:
                if node.attr not in _NS_FUNCS:
                    raise self.err(f"modmath has no function {node.attr!r} (it has {', '.join(_NS_FUNCS)})")
                return _NSFUNC, node.attr
            if kind == _MODULE:
                if not hasattr(val, node.attr):
                    raise self.err(f"{val.__name__}.{node.attr} does not exist")
                return _classify(getattr(val, node.attr))
            raise self.err(f"attribute access {ast.unparse(node)!r} is not supported")
        raise self.err(f"{ast.unparse(node)!r} is not supported")

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"_fp8_{prefix}{self.n}"

    def expr(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Name):
            if node.id in self.params:
                return ast.Name(node.id, ast.Load())
            if node.id in self.ssa:
                return ast.Name(self.ssa[node.id], ast.Load())
            if node.id in self.assigned:
                raise self.err(f"local {node.id!r} is used before it is assigned")
            kind, val = self.resolve(node)
            if kind == _CONST:
                return _const_node(val)
            if kind == _BUFFER:
                raise self.err(f"tensor {node.id!r} can only be read with modmath.load({node.id}, index)")
            raise self.err(f"{node.id!r} cannot be used as a value")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float)):
                return _const_node(node.value)
            raise self.err(f"constant {node.value!r} is not a number")
        if isinstance(node, ast.Attribute):
            kind, val = self.resolve(node)
            if kind == _CONST:
                return _const_node(val)
            raise self.err(f"{ast.unparse(node)!r} cannot be used as a value")
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow):
                exp = node.right
                kexp = None
                if isinstance(exp, ast.Constant) and isinstance(exp.value, int) and not isinstance(exp.value, bool):
                    kexp = exp.value
                if kexp is None or not 0 <= kexp <= 8:
                    raise self.err("** needs a literal integer exponent between 0 and 8 (use modmath.exp/log)")
                base = self.expr(node.left)
                if kexp == 0:
                    return _const_node(1.0)
                out: ast.expr = base
                for _ in range(kexp - 1):
                    out = ast.BinOp(out, ast.Mult(), base)
                return out
            ok = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitAnd, ast.BitOr, ast.BitXor,
                  ast.LShift, ast.RShift)
            if not isinstance(node.op, ok):
                raise self.err(f"operator {type(node.op).__name__} is not supported")
            return ast.BinOp(self.expr(node.left), node.op, self.expr(node.right))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                raise self.err("'not' is not supported on tensors; use ~")
            return ast.UnaryOp(node.op, self.expr(node.operand))
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1:
                raise self.err("chained comparisons are not supported; combine single comparisons with &")
            if isinstance(node.ops[0], (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                raise self.err("only <, <=, >, >=, ==, != comparisons are supported")
            return ast.Compare(self.expr(node.left), node.ops, [self.expr(node.comparators[0])])
        if isinstance(node, ast.Call):
            if node.keywords:
                raise self.err("keyword arguments are not supported in calls")
            kind, val = self.resolve(node.func)
            if kind == _BUILTIN:
                try:
                    folded = val(*[ast.literal_eval(a) for a in node.args])
                except (ValueError, TypeError, SyntaxError):
                    raise self.err(f"{val.__name__}() is only supported on literals, e.g. float('-inf')") from None
                return _const_node(folded)
            if kind != _NSFUNC:
                raise self.err(f"call of {ast.unparse(node.func)!r} is not supported")
            if val == "load":
                if len(node.args) != 2 or not isinstance(node.args[0], ast.Name):
                    raise self.err("modmath.load takes (captured_tensor, index)")
                bkind, tensor = self.resolve(node.args[0])
                if bkind != _BUFFER:
                    raise self.err(f"the first argument of modmath.load must be a captured tensor, "
                                   f"got {node.args[0].id!r}")
                slot = self.slots[id(tensor)]
                index = self.expr(node.args[1])
                site = len(self.loads)
                iname, vname = f"_fp8_i{site}", f"_fp8_l{site}"
                self.stmts.append((iname, index))
                args = [ast.Name(f"_fp8_t{slot}", ast.Load()), ast.Name(iname, ast.Load())]
                self.stmts.append((vname, ast.Call(ast.Name("_fp8_mm_load", ast.Load()), args, [])))
                self.loads.append((site, slot, iname, vname))
                return ast.Name(vname, ast.Load())
            arity = {"minimum": 2, "maximum": 2, "where": 3, "clamp": 3}.get(val, 1)
            if len(node.args) != arity:
                raise self.err(f"modmath.{val} takes {arity} argument(s)")
            return ast.Call(ast.Name(f"_fp8_mm_{val}", ast.Load()), [self.expr(a) for a in node.args], [])
        if isinstance(node, ast.BoolOp):
            raise self.err("'and'/'or' are not supported on tensors; use & and |")
        if isinstance(node, ast.IfExp):
            raise self.err("conditional expressions are not supported; use modmath.where(cond, a, b)")
        if isinstance(node, ast.Subscript):
            raise self.err("indexing is not supported; use modmath.load(table, index)")
        raise self.err(f"expression {ast.unparse(node)!r} is not supported")

    def assign(self, target: str, value: ast.expr) -> None:
        if target in self.params:
            raise self.err(f"assigning to the argument {target!r} is not supported; use a new name")
        name = self.fresh("v")
        self.stmts.append((name, self.expr(value)))
        self.ssa[target] = name

    def body(self, stmts: list[ast.stmt]) -> ast.expr:
        ret: ast.expr | None = None
        for i, st in enumerate(stmts):
            if ret is not None:
                raise self.err("statements after return are not supported")
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str):
                continue  # a docstring
            if isinstance(st, ast.Pass):
                continue
            if isinstance(st, ast.Assign):
                if len(st.targets) != 1 or not isinstance(st.targets[0], ast.Name):
                    raise self.err("only single-name assignments are supported")
                self.assign(st.targets[0].id, st.value)
            elif isinstance(st, ast.AnnAssign) and st.value is not None and isinstance(st.target, ast.Name):
                self.assign(st.target.id, st.value)
            elif isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                self.assign(st.target.id, ast.BinOp(ast.Name(st.target.id, ast.Load()), st.op, st.value))
            elif isinstance(st, ast.Return) and st.value is not None:
                ret = self.expr(st.value)
            else:
                raise self.err(f"statement {type(st).__name__} is not supported (straight-line code only; "
                               f"use modmath.where instead of if)")
        if ret is None:
            raise self.err("it must end with a return statement")
        return ret


def _capture(fn: Any) -> tuple[dict[str, tuple[str, Any]], tuple[Tensor, ...], dict[int, int], tuple[Any, ...]]:
    """What a mod closes over: (name -> (kind, value), captured tensors in slot order, id(tensor) ->
    slot, the cache key of the lowering: the code object and the constants, not the tensors)."""
    values = _free_values(fn)
    env: dict[str, tuple[str, Any]] = {}
    buffers: list[Tensor] = []
    slots: dict[int, int] = {}
    key_parts: list[Any] = []
    for name in sorted(values):
        kind, val = _classify(values[name])
        env[name] = (kind, val)
        if kind == _BUFFER:
            if id(val) not in slots:
                slots[id(val)] = len(buffers)
                buffers.append(val)
            key_parts.append((name, "t", slots[id(val)]))
        elif kind == _CONST:
            key_parts.append((name, type(val).__name__, val))
        elif kind == _MODULE:
            key_parts.append((name, "m", val.__name__))
        else:
            key_parts.append((name, kind))
    if len(buffers) > _MAX_BUFFERS:
        raise _mod_error(fn, f"it captures {len(buffers)} tensors; at most {_MAX_BUFFERS} are supported")
    return env, tuple(buffers), slots, (fn.__code__, tuple(key_parts))


def _lower(fn: Any, arity: int, env: dict[str, tuple[str, Any]], slots: dict[int, int]) -> _Lowered:
    """The mod's body as straight-line SSA code over generated names (parses its source)."""
    params, body, lam = _fn_ast(fn, arity)
    assigned: set[str] = set()
    if body is not None:
        for st in body:
            for n in ast.walk(st):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    assigned.add(n.id)
    low = _Lowering(fn, params, env, slots, assigned)
    ret = low.expr(lam) if lam is not None else low.body(body or [])
    return _Lowered(tuple(params), tuple(low.stmts), ret, tuple(low.loads))


def _add(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return f"({a}) + ({b})"


def _neg(a: str | None) -> str | None:
    return None if a is None else f"-({a})"


def _scaled(t: str | None, factor: str) -> str | None:
    return None if t is None else f"({t}) * ({factor})"


class _Tangents:
    """Forward-mode derivatives of lowered code along directions "s" (the score) and "l<k>" (the
    value of load site k)."""

    def __init__(self, fn: Any, score: str) -> None:
        self.fn = fn
        self.score = score
        self.names: dict[tuple[str, str], str] = {}

    def d(self, node: ast.expr, dirn: str) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == self.score:
                return "1.0" if dirn == "s" else None
            if node.id.startswith("_fp8_l") and dirn == f"l{node.id[6:]}":
                return "1.0"
            return self.names.get((node.id, dirn))
        if isinstance(node, ast.Constant):
            return None
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return _neg(self.d(node.operand, dirn))
            if isinstance(node.op, ast.UAdd):
                return self.d(node.operand, dirn)
            return None
        if isinstance(node, ast.Compare):
            return None
        if isinstance(node, ast.BinOp):
            da, db = self.d(node.left, dirn), self.d(node.right, dirn)
            a, b = ast.unparse(node.left), ast.unparse(node.right)
            op = node.op
            if isinstance(op, ast.Add):
                return _add(da, db)
            if isinstance(op, ast.Sub):
                return _add(da, _neg(db))
            if isinstance(op, ast.Mult):
                return _add(_scaled(da, b), _scaled(db, a))
            if isinstance(op, ast.Div):
                t1 = None if da is None else f"({da}) / ({b})"
                t2 = None if db is None else f"({a}) * ({db}) / (({b}) * ({b}))"
                return _add(t1, _neg(t2))
            if da is not None or db is not None:
                raise _mod_error(self.fn, f"{type(op).__name__} of a score-dependent value has no derivative")
            return None
        if isinstance(node, ast.Call):
            fname = node.func.id  # type: ignore[attr-defined]
            name = fname[len("_fp8_mm_"):]
            args = node.args
            src = [ast.unparse(a) for a in args]
            if name in ("minimum", "maximum", "where", "clamp"):
                if name == "where":
                    da, db = self.d(args[1], dirn), self.d(args[2], dirn)
                    if da is None and db is None:
                        return None
                    return f"_fp8_mm_where({src[0]}, {da or '0.0'}, {db or '0.0'})"
                if name == "clamp":
                    if self.d(args[1], dirn) is not None or self.d(args[2], dirn) is not None:
                        raise _mod_error(self.fn, "clamp bounds that depend on the score have no derivative here")
                    dx = self.d(args[0], dirn)
                    if dx is None:
                        return None
                    return f"_fp8_mm_where((({src[0]}) >= ({src[1]})) & (({src[0]}) <= ({src[2]})), {dx}, 0.0)"
                da, db = self.d(args[0], dirn), self.d(args[1], dirn)
                if da is None and db is None:
                    return None
                cmp = "<=" if name == "minimum" else ">="
                return f"_fp8_mm_where(({src[0]}) {cmp} ({src[1]}), {da or '0.0'}, {db or '0.0'})"
            du = self.d(args[0], dirn)
            if du is None:
                return None
            u = src[0]
            if name == "exp":
                return f"_fp8_mm_exp({u}) * ({du})"
            if name == "exp2":
                return f"_fp8_mm_exp2({u}) * 0.6931471805599453 * ({du})"
            if name == "log":
                return f"({du}) / ({u})"
            if name == "log2":
                return f"({du}) / (({u}) * 0.6931471805599453)"
            if name == "sqrt":
                return f"({du}) / (2.0 * _fp8_mm_sqrt({u}))"
            if name == "tanh":
                return f"(1.0 - _fp8_mm_tanh({u}) * _fp8_mm_tanh({u})) * ({du})"
            if name == "sigmoid":
                return f"_fp8_mm_sigmoid({u}) * (1.0 - _fp8_mm_sigmoid({u})) * ({du})"
            if name == "abs":
                return f"_fp8_mm_where(({u}) >= 0, {du}, -({du}))"
            if name == "load":
                return None
        raise _mod_error(self.fn, f"no derivative for {ast.unparse(node)!r}")


_BUF_PARAMS = ", ".join(f"_fp8_t{i}" for i in range(_MAX_BUFFERS))
_GRAD_PARAMS = ", ".join(f"_fp8_g{i}" for i in range(_MAX_BUFFERS))


def _fwd_source(low: _Lowered, name: str) -> str:
    lines = [f"def {name}({', '.join(low.params)}, {_BUF_PARAMS}):"]
    lines += [f"    {n} = {ast.unparse(e)}" for n, e in low.stmts]
    lines.append(f"    return {ast.unparse(low.ret)}")
    return "\n".join(lines) + "\n"


def _dependencies(low: _Lowered) -> dict[str, set[str]]:
    """For every SSA name, the mod arguments its value depends on (loads depend on their index)."""
    deps: dict[str, set[str]] = {}
    params = set(low.params)

    def of(node: ast.AST) -> set[str]:
        out: set[str] = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                if n.id in params:
                    out.add(n.id)
                elif n.id in deps:
                    out |= deps[n.id]
        return out

    for name, expr in low.stmts:
        deps[name] = of(expr)
    return deps


def _bwd_source(fn: Any, low: _Lowered, name: str, needs: tuple[bool, ...]) -> str:
    """Source of ``name(_fp8_ds, <params>, _fp8_valid, t0..t3, g0..g3) -> ds * dmod/dscore`` that also
    scatters ``ds * dmod/dload`` into the gradient buffers of the captured tensors in ``needs``."""
    tan = _Tangents(fn, low.params[0])
    dirs = ["s"] + [f"l{site}" for site, slot, _, _ in low.loads if slot < len(needs) and needs[slot]]
    lines = [f"def {name}(_fp8_ds, {', '.join(low.params)}, _fp8_valid, {_BUF_PARAMS}, {_GRAD_PARAMS}):"]
    for n, e in low.stmts:
        lines.append(f"    {n} = {ast.unparse(e)}")
        for dirn in dirs:
            t = tan.d(e, dirn)
            if t is not None:
                tname = f"_fp8_d{dirn}_{n}"
                lines.append(f"    {tname} = {t}")
                tan.names[(n, dirn)] = tname
    deps = _dependencies(low)
    uniform = {low.params[1], low.params[2]}  # b and h are scalars inside a kernel program
    for site, slot, iname, _ in low.loads:
        if slot < len(needs) and needs[slot]:
            t = tan.d(low.ret, f"l{site}")
            if t is None:
                continue
            if deps[iname] <= uniform:
                # One table entry for the whole tile (e.g. a per-head slope): reduce, then one atomic.
                lines.append(f"    tl.atomic_add(_fp8_g{slot} + {iname}, "
                             f"tl.sum(tl.where(_fp8_valid, _fp8_ds * ({t}), 0.0)), sem='relaxed')")
            else:
                lines.append(
                    f"    tl.atomic_add(_fp8_g{slot} + ({iname} + tl.zeros(_fp8_ds.shape, tl.int32)), "
                    f"_fp8_ds * ({t}), mask=_fp8_valid, sem='relaxed')"
                )
    ds = tan.d(low.ret, "s")
    lines.append(f"    return _fp8_ds * ({ds if ds is not None else '0.0'})")
    return "\n".join(lines) + "\n"


def _triton_scope() -> dict[str, Any]:
    import triton
    import triton.language as tl

    scope: dict[str, Any] = {"tl": tl, "triton": triton}
    scope.update({f"_fp8_mm_{n}": f for n, f in _K.MODMATH_TRITON.items()})
    return scope


def _jit_source(source: str, name: str, scope: dict[str, Any]) -> Any:
    """``triton.jit`` of generated source (registered with linecache so inspect can read it)."""
    import triton

    filename = f"<fp8ops-mod {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = dict(scope)
    exec(compile(source, filename, "exec"), ns)  # noqa: S102  (our own generated code)
    fn = ns[name]
    fn.__module__ = "fp8ops.attention"
    return triton.jit(fn)


class _ModSpec:
    """Everything about a mod except its tensors: how to build its Triton twins (kept in a registry
    keyed by a string, so the compiled kernels never hold a captured tensor)."""

    def __init__(self, kind: str, n_buffers: int, *, fn: Any = None, lowered: _Lowered | None = None,
                 children: tuple[tuple[_ModSpec, int], ...] = (), op: str = "",
                 triton_fn: Any = None, triton_grad: Any = None, label: str = "") -> None:
        self.kind = kind
        self.n_buffers = n_buffers
        # Only the name of the function is kept (for messages): a spec outlives the tensors that
        # the mod which created it captured.
        self.fn = types.SimpleNamespace(__qualname__=getattr(fn, "__qualname__", label or repr(fn)))
        self.lowered = lowered
        self.children = children
        self.op = op
        self.triton_fn = triton_fn
        self.triton_grad = triton_grad
        self.label = label
        self._fwd: Any = None
        self._grad: dict[tuple[bool, ...], Any] = {}
        if lowered is not None:
            digest = hashlib.sha256(_fwd_source(lowered, "f").encode()).hexdigest()[:16]
            self.key = f"{kind}:{digest}"
        elif children:
            self.key = f"{kind}:{op}(" + ",".join(f"{c.key}@{off}" for c, off in children) + ")"
        else:
            self.key = f"{kind}:explicit:{id(triton_fn)}:{id(triton_grad)}"
        self.name = "_fp8ops_" + hashlib.sha256(self.key.encode()).hexdigest()[:16]

    @property
    def differentiable(self) -> bool:
        return self.lowered is not None or self.triton_grad is not None

    def fwd_jit(self) -> Any:
        if self._fwd is None:
            if self.triton_fn is not None:
                self._fwd = self.triton_fn
            elif self.lowered is not None:
                self._fwd = _jit_source(_fwd_source(self.lowered, self.name), self.name, _triton_scope())
            else:
                scope = _triton_scope()
                terms = []
                for i, (child, off) in enumerate(self.children):
                    scope[f"_fp8_m{i}"] = child.fwd_jit()
                    bufs = [f"_fp8_t{off + j}" if j < child.n_buffers else "None" for j in range(_MAX_BUFFERS)]
                    terms.append(f"(_fp8_m{i}(b, h, q_idx, kv_idx, {', '.join(bufs)}))")
                if not terms:
                    terms = ["((q_idx >= 0) | (kv_idx >= 0))"]
                joiner = " & " if self.op == "and" else " | "
                src = f"def {self.name}(b, h, q_idx, kv_idx, {_BUF_PARAMS}):\n    return {joiner.join(terms)}\n"
                self._fwd = _jit_source(src, self.name, scope)
        return self._fwd

    def grad_jit(self, needs: tuple[bool, ...]) -> Any:
        if self.kind != "score":
            raise TypeError("only score mods have a derivative")
        if self.triton_fn is not None:
            if self.triton_grad is None:
                raise NotImplementedError(
                    f"attention: the score_mod {self.label} has an explicit Triton twin but no triton_grad; "
                    f"pass ScoreMod(fn, triton=..., triton_grad=...) to differentiate through it on CUDA")
            return self.triton_grad
        assert self.lowered is not None
        needs = tuple(bool(x) for x in needs)
        if needs not in self._grad:
            name = f"{self.name}_bwd" + "".join("1" if x else "0" for x in needs)
            self._grad[needs] = _jit_source(_bwd_source(self.fn, self.lowered, name, needs), name, _triton_scope())
        return self._grad[needs]

    def sources(self, needs: tuple[bool, ...] = ()) -> tuple[str, str | None]:
        """The generated Triton source of the twin and of its derivative (for reading)."""
        if self.lowered is None:
            raise ValueError("this mod has no generated source")
        fwd = _fwd_source(self.lowered, self.name)
        bwd = _bwd_source(self.fn, self.lowered, f"{self.name}_bwd", needs) if self.kind == "score" else None
        return fwd, bwd


_SPECS: dict[str, _ModSpec] = {}
_LOWER_CACHE: dict[tuple[Any, ...], _ModSpec] = {}


def _register(spec: _ModSpec) -> _ModSpec:
    return _SPECS.setdefault(spec.key, spec)


class _Mod:
    __slots__ = ("buffers", "fn", "key", "name")
    kind = ""
    arity = 0

    def __init__(self, fn: Callable[..., Any], *, triton: Any = None, triton_grad: Any = None,
                 buffers: Sequence[Tensor] = (), name: str | None = None) -> None:
        cls = type(self).__name__
        if isinstance(fn, _Mod):
            raise TypeError(f"{cls}: fn is already a {type(fn).__name__}")
        if not callable(fn):
            raise TypeError(f"{cls}: fn must be a function, got {type(fn).__name__}")
        label = name or getattr(fn, "__qualname__", repr(fn))
        if triton is None:
            if triton_grad is not None or tuple(buffers):
                raise TypeError(f"{cls}: triton_grad and buffers go with an explicit triton twin")
            spec, bufs = self._lowered_spec(fn, label)
        else:
            bufs = tuple(buffers)
            for t in bufs:
                if not isinstance(t, Tensor):
                    raise TypeError(f"{cls}: buffers must be tensors, got {type(t).__name__}")
            if len(bufs) > _MAX_BUFFERS:
                raise ValueError(f"{cls}: at most {_MAX_BUFFERS} buffers, got {len(bufs)}")
            spec = _register(_ModSpec(self.kind, len(bufs), fn=fn, triton_fn=triton, triton_grad=triton_grad,
                                      label=label))
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "buffers", bufs)
        object.__setattr__(self, "key", spec.key)
        object.__setattr__(self, "name", label)

    def _lowered_spec(self, fn: Any, label: str) -> tuple[_ModSpec, tuple[Tensor, ...]]:
        # Cheap when the same code with the same constants was seen before (a mod rebuilt every
        # step around new tensors): the source is parsed once.
        if not hasattr(fn, "__code__"):
            raise _mod_error(fn, "it is not a Python function")
        env, bufs, slots, cache_key = _capture(fn)
        full_key = (self.kind, self.arity, *cache_key)
        spec = _LOWER_CACHE.get(full_key)
        if spec is None:
            lowered = _lower(fn, self.arity, env, slots)
            spec = _register(_ModSpec(self.kind, len(bufs), fn=fn, lowered=lowered, label=label))
            _LOWER_CACHE[full_key] = spec
        return spec, bufs

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    @property
    def spec(self) -> _ModSpec:
        return _SPECS[self.key]

    def triton_source(self) -> str:
        """The generated Triton source of this mod's kernel twin (and derivative, for score mods)."""
        fwd, bwd = self.spec.sources(tuple(t.requires_grad for t in self.buffers))
        return fwd if bwd is None else fwd + "\n" + bwd

    def __repr__(self) -> str:
        t = f", buffers={[tuple(b.shape) for b in self.buffers]}" if self.buffers else ""
        return f"{type(self).__name__}({self.name}{t})"


class ScoreMod(_Mod):
    """A score modification ``score_mod(score, b, h, q_idx, kv_idx) -> new score``, with its twins.

    Built from a plain function (usually with the :func:`score_mod` decorator): the function itself
    is the eager PyTorch twin, and a Triton twin plus its derivative are generated from its source.
    ``score`` is fp32; ``b`` the batch (or sequence) index, ``h`` the query head, ``q_idx`` /
    ``kv_idx`` the positions (inside the sequence for packed inputs); all broadcast together. Numbers
    it closes over become kernel constants; tensors (up to 4, read with ``modmath.load``) become
    kernel arguments and receive gradients when they require grad.

    Explicit twins (for bodies the generator cannot express)::

        ScoreMod(fn, triton=jit_fn, triton_grad=jit_grad, buffers=(t0, ...))
        jit_fn(score, b, h, q_idx, kv_idx, t0, t1, t2, t3) -> score
        jit_grad(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3) -> ds * d/dscore

    where ``t*`` are the buffers' flat data pointers (None when absent) and ``g*`` fp32 gradient
    buffers (None when not needed).

    Example:
        >>> import torch
        >>> from fp8ops import ScoreMod, modmath
        >>> double = ScoreMod(lambda score, b, h, q_idx, kv_idx: score * 2.0)
        >>> double(torch.ones(2), 0, 0, 0, 0)
        tensor([2., 2.])
    """

    __slots__ = ()
    kind = "score"
    arity = _SCORE_ARITY

    def __call__(self, score: Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return self.fn(score, b, h, q_idx, kv_idx)


class MaskMod(_Mod):
    """A mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: the query attends to the key), with twins.

    Built like :class:`ScoreMod` (see :func:`mask_mod`); explicit twins take
    ``triton=jit_fn`` with ``jit_fn(b, h, q_idx, kv_idx, t0, t1, t2, t3) -> bool``. A mask has no
    gradient.

    Example:
        >>> import torch
        >>> from fp8ops import MaskMod
        >>> causal = MaskMod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        >>> causal(0, 0, torch.arange(3)[:, None], torch.arange(3)[None, :])
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """

    __slots__ = ()
    kind = "mask"
    arity = _MASK_ARITY

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)


def score_mod(fn: Callable[..., Any]) -> ScoreMod:
    """Decorator: one Python definition of a score modification for PyTorch and the Triton kernels.

    The body may use its arguments, numbers, arithmetic, comparisons, ``&``/``|``/``~``, local
    assignments and :data:`modmath`; it may close over numbers (kernel constants) and tensors (read
    with ``modmath.load(table, index)``; gradients flow to them). ``//`` and ``%`` truncate toward
    zero in Triton and floor in PyTorch: keep their operands non-negative.

    Example:
        >>> import torch, fp8ops
        >>> from fp8ops import modmath
        >>> @fp8ops.score_mod
        ... def soft(score, b, h, q_idx, kv_idx):
        ...     return 5.0 * modmath.tanh(score / 5.0)
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out, _ = fp8ops.attention(q, k, v, score_mod=soft)
        >>> out.shape
        torch.Size([1, 2, 4, 8])
    """
    return ScoreMod(fn)


def mask_mod(fn: Callable[..., Any]) -> MaskMod:
    """Decorator: one Python definition of a mask for PyTorch and the Triton kernels (see :func:`score_mod`).

    Example:
        >>> import torch, fp8ops
        >>> @fp8ops.mask_mod
        ... def local(b, h, q_idx, kv_idx):
        ...     return (q_idx - kv_idx <= 2) & (kv_idx - q_idx <= 2)
        >>> q = k = v = torch.randn(1, 1, 8, 4)
        >>> fp8ops.attention(q, k, v, mask_mod=local)[0].shape
        torch.Size([1, 1, 8, 4])
    """
    return MaskMod(fn)


def _combine(op: str, mods: tuple[Any, ...]) -> MaskMod:
    where = f"{op}_masks"
    ms: list[MaskMod] = []
    for m in mods:
        if isinstance(m, MaskMod):
            ms.append(m)
        elif isinstance(m, ScoreMod):
            raise TypeError(f"{where}: expected mask mods, got a ScoreMod")
        elif callable(m):
            ms.append(MaskMod(m))
        else:
            raise TypeError(f"{where}: expected mask mods, got {type(m).__name__}")
    bufs: list[Tensor] = []
    children: list[tuple[_ModSpec, int]] = []
    for m in ms:
        children.append((m.spec, len(bufs)))
        bufs.extend(m.buffers)
    if len(bufs) > _MAX_BUFFERS:
        raise ValueError(f"{where}: the masks capture {len(bufs)} tensors together; at most {_MAX_BUFFERS}")
    spec = _register(_ModSpec("mask", len(bufs), children=tuple(children), op=op,
                              label=f"{where}({', '.join(m.name for m in ms)})"))
    fns = tuple(ms)

    def eager(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out: Any = True
        for m in fns:
            r = m(b, h, q_idx, kv_idx)
            out = r if out is True else (out & r if op == "and" else out | r)
        if out is True:
            return (torch.as_tensor(q_idx) >= 0) | (torch.as_tensor(kv_idx) >= 0)
        return out

    mod = MaskMod.__new__(MaskMod)
    object.__setattr__(mod, "fn", eager)
    object.__setattr__(mod, "buffers", tuple(bufs))
    object.__setattr__(mod, "key", spec.key)
    object.__setattr__(mod, "name", spec.label)
    return mod


def and_masks(*mods: MaskMod | Callable[..., Any]) -> MaskMod:
    """A mask visible where all of ``mods`` are (no mods: everything visible).

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.and_masks(fp8ops.causal_mask(), fp8ops.sliding_window_mask(2))
        >>> m(0, 0, torch.tensor(3), torch.arange(4))
        tensor([False, False,  True,  True])
    """
    return _combine("and", mods)


def or_masks(*mods: MaskMod | Callable[..., Any]) -> MaskMod:
    """A mask visible where any of ``mods`` is.

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.or_masks(fp8ops.causal_mask(), fp8ops.prefix_lm_mask(2))
        >>> m(0, 0, torch.tensor(0), torch.arange(4))
        tensor([ True,  True, False, False])
    """
    return _combine("or", mods)


# ------------------------------------------------------------------------------------------------
# The library of ready mods.


def causal_mask() -> MaskMod:
    """Causal mask: query ``i`` sees keys ``j <= i`` (top-left aligned). Prefer ``causal=True``,
    which skips the invisible blocks without a block mask.

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.causal_mask()(0, 0, torch.tensor(1), torch.arange(3))
        tensor([ True,  True, False])
    """

    def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    return MaskMod(causal)


def sliding_window_mask(window: int) -> MaskMod:
    """Causal sliding window: query ``i`` sees the ``window`` keys ``i - window < j <= i``.

    Equivalent to ``window=window`` of :func:`attention`, which also skips invisible blocks.

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.sliding_window_mask(2)(0, 0, torch.tensor(3), torch.arange(5))
        tensor([False, False,  True,  True, False])
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window_mask: window must be an int >= 1, got {window!r}")
    w = int(window)

    def sliding_window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        d = q_idx - kv_idx
        return (d >= 0) & (d < w)

    return MaskMod(sliding_window)


def prefix_lm_mask(prefix_len: int | Tensor) -> MaskMod:
    """Prefix-LM: keys in the prefix are visible to every query, the rest causally.

    Args:
        prefix_len: the prefix length, an int for every sequence or a (B,) integer tensor (one
            per batch entry / packed sequence).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.prefix_lm_mask(2)(0, 0, torch.tensor(0), torch.arange(4))
        tensor([ True,  True, False, False])
    """
    if isinstance(prefix_len, Tensor):
        if prefix_len.dim() != 1 or prefix_len.is_floating_point():
            raise ValueError(f"prefix_lm_mask: a tensor prefix_len must be a 1-D integer (B,) tensor, "
                             f"got {tuple(prefix_len.shape)} {prefix_len.dtype}")
        lengths = prefix_len

        def prefix_lm(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (kv_idx <= q_idx) | (kv_idx < modmath.load(lengths, b))

        return MaskMod(prefix_lm)
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_lm_mask: prefix_len must be an int >= 0 or a (B,) tensor, got {prefix_len!r}")
    n = int(prefix_len)

    def prefix_lm_const(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx <= q_idx) | (kv_idx < n)

    return MaskMod(prefix_lm_const)


def document_mask(document_ids: Tensor) -> MaskMod:
    """Document masking over packed sequences: a query sees only keys of its own document.

    Combine with :func:`causal_mask` (``and_masks``) for causal packed training, and build a
    :class:`BlockMask` from it so that blocks between documents are skipped.

    Args:
        document_ids: (S,) or (B, S) integer tensor: the document of each position (the same
            ids for queries and keys, so Sq == Skv == S).

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.document_mask(torch.tensor([0, 0, 1, 1]))
        >>> m(0, 0, torch.tensor(2), torch.arange(4))
        tensor([False, False,  True,  True])
    """
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or document_ids.dim() not in (1, 2):
        raise ValueError("document_mask: document_ids must be an (S,) or (B, S) integer tensor")
    ids = document_ids
    if ids.dim() == 1:

        def document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return modmath.load(ids, q_idx) == modmath.load(ids, kv_idx)

        return MaskMod(document)
    seq = int(ids.shape[1])

    def document_batched(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return modmath.load(ids, b * seq + q_idx) == modmath.load(ids, b * seq + kv_idx)

    return MaskMod(document_batched)


def alibi(num_heads: int | Tensor) -> ScoreMod:
    """ALiBi: adds ``slope_h * (kv_idx - q_idx)`` to the score (Press et al., 2022).

    Args:
        num_heads: the number of query heads (the paper's geometric slopes, computed in the
            kernel, including the rule for head counts that are not powers of two), or an (H,)
            tensor of slopes (learnable: it receives a gradient when it requires grad).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.alibi(2)(torch.zeros(()), 0, torch.tensor(0), torch.tensor(3), torch.arange(4))
        tensor([-0.1875, -0.1250, -0.0625,  0.0000])
    """
    if isinstance(num_heads, Tensor):
        if num_heads.dim() != 1 or not num_heads.is_floating_point():
            raise ValueError("alibi: a slopes tensor must be a 1-D float (H,) tensor")
        slopes = num_heads

        def alibi_slopes(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + modmath.load(slopes, h) * (kv_idx - q_idx)

        return ScoreMod(alibi_slopes)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi: num_heads must be an int >= 1 or a slopes tensor, got {num_heads!r}")
    n = 2 ** int(math.floor(math.log2(num_heads)))  # closest power of two <= num_heads
    step = -8.0 / n
    step2 = -4.0 / n

    def alibi_geometric(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        # Heads < n: 2^(-8 (h + 1) / n); the others interleave the 2n-head sequence.
        slope = modmath.where(h < n, modmath.exp2(step * (h + 1)), modmath.exp2(step2 * (2 * (h - n) + 1)))
        return score + slope * (kv_idx - q_idx)

    return ScoreMod(alibi_geometric)


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping: ``cap * tanh(score / cap)`` (Gemma 2 uses cap 50 for attention logits).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.softcap(10.0)(torch.tensor([0.0, 5.0]), 0, 0, 0, 0)
        tensor([0.0000, 4.6212])
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    c = float(cap)
    inv = 1.0 / c

    def tanh_softcap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return c * modmath.tanh(score * inv)

    return ScoreMod(tanh_softcap)


def relative_position_bias(table: Tensor) -> ScoreMod:
    """Adds a bias by relative position: ``score + table[h, kv_idx - q_idx + R]`` (learnable).

    Args:
        table: (H, 2R + 1) or (2R + 1,) float tensor (one row per query head, or shared); relative
            distances beyond ``R`` are clamped to the ends. It receives a gradient when it
            requires grad.

    Example:
        >>> import torch, fp8ops
        >>> mod = fp8ops.relative_position_bias(torch.tensor([-1.0, 0.0, 1.0]))
        >>> mod(torch.zeros(()), 0, 0, torch.tensor(2), torch.arange(5))
        tensor([-1., -1.,  0.,  1.,  1.])
    """
    if not isinstance(table, Tensor) or not table.is_floating_point() or table.dim() not in (1, 2) \
            or table.shape[-1] % 2 != 1:
        raise ValueError("relative_position_bias: table must be a float (H, 2R + 1) or (2R + 1,) tensor")
    width = int(table.shape[-1])
    r = (width - 1) // 2
    bias = table
    if table.dim() == 1:

        def rel_bias_shared(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + modmath.load(bias, modmath.clamp(kv_idx - q_idx, -r, r) + r)

        return ScoreMod(rel_bias_shared)

    def rel_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + modmath.load(bias, h * width + modmath.clamp(kv_idx - q_idx, -r, r) + r)

    return ScoreMod(rel_bias)


# ------------------------------------------------------------------------------------------------
# Block masks


@attrs.frozen(init=False, eq=False, repr=False)
class BlockMask:
    """Block-level sparsity of a mask: which (query block, key block) pairs are empty, partial or full.

    Build it once with :func:`create_block_mask` and reuse it for every call with the same
    sequence lengths. The kernels skip empty blocks and evaluate ``mask_mod`` only on partial
    blocks (full blocks run unmasked), in the forward and the backward.

    Attributes (B', H' are 1 or the batch / query-head count; NQ, NKV the block counts):
        kv_num_blocks: (B', H', NQ) int32, partial key blocks per query block; ``kv_indices``
            (B', H', NQ, NKV) int32 lists them first. ``full_kv_num_blocks`` / ``full_kv_indices``:
            the same for full blocks.
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transposed lists (per key
            block), used by the dK/dV backward kernel.
        seq_lengths: (Sq, Skv). block_size: (block_q, block_kv), powers of two >= 16.
        mask_mod: the :class:`MaskMod` applied inside partial blocks.

    Example:
        >>> import fp8ops
        >>> bm = fp8ops.create_block_mask(fp8ops.causal_mask(), None, None, 256, 256, block_size=64)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 1, 1, 1]]], [[[0, 1, 2, 3]]])
        >>> round(bm.sparsity(), 3)
        0.375
    """

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_num_blocks: Tensor
    q_indices: Tensor
    full_q_num_blocks: Tensor
    full_q_indices: Tensor
    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    mask_mod: MaskMod

    def __init__(self, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor,
                 full_kv_indices: Tensor, q_num_blocks: Tensor, q_indices: Tensor, full_q_num_blocks: Tensor,
                 full_q_indices: Tensor, seq_lengths: tuple[int, int], block_size: tuple[int, int],
                 mask_mod: MaskMod) -> None:
        for name, val in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                          ("full_kv_num_blocks", full_kv_num_blocks), ("full_kv_indices", full_kv_indices),
                          ("q_num_blocks", q_num_blocks), ("q_indices", q_indices),
                          ("full_q_num_blocks", full_q_num_blocks), ("full_q_indices", full_q_indices)):
            object.__setattr__(self, name, val)
        object.__setattr__(self, "seq_lengths", (int(seq_lengths[0]), int(seq_lengths[1])))
        object.__setattr__(self, "block_size", (int(block_size[0]), int(block_size[1])))
        object.__setattr__(self, "mask_mod", mask_mod)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', Sq, Skv): the element-level shape the mask covers (B', H' may be 1: broadcast)."""
        return (int(self.kv_num_blocks.shape[0]), int(self.kv_num_blocks.shape[1]), *self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def block_states(self) -> Tensor:
        """(B', H', NQ, NKV) int8: 0 empty, 1 partial, 2 full."""
        nkv = self.kv_indices.shape[-1]
        pos = torch.arange(nkv, device=self.device)
        out = torch.zeros(self.kv_indices.shape, dtype=torch.int8, device=self.device)
        for num, idx, val in ((self.kv_num_blocks, self.kv_indices, 1),
                              (self.full_kv_num_blocks, self.full_kv_indices, 2)):
            src = ((pos < num[..., None]).to(torch.int8) * val)
            out = out.scatter_reduce(-1, idx.long(), src, reduce="amax")
        return out

    def sparsity(self) -> float:
        """The fraction of (query block, key block) pairs that are empty (skipped)."""
        s = self.block_states()
        return float((s == 0).float().mean())

    def to(self, device: str | torch.device) -> BlockMask:
        """A copy on ``device`` (the mask_mod's captured tensors are not moved)."""
        t = [getattr(self, n).to(device) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                    "full_kv_indices", "q_num_blocks", "q_indices",
                                                    "full_q_num_blocks", "full_q_indices")]
        return BlockMask(*t, self.seq_lengths, self.block_size, self.mask_mod)

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"sparsity={self.sparsity():.2%}, mask_mod={self.mask_mod.name})")


def _lists(state: Tensor, val: int) -> tuple[Tensor, Tensor]:
    hit = (state == val).to(torch.int32)
    num = hit.sum(-1, dtype=torch.int32)
    idx = torch.sort(hit, dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return num.contiguous(), idx.contiguous()


def create_block_mask(
    mask_mod: MaskMod | Callable[..., Any],
    B: int | None,
    H: int | None,
    Sq: int,
    Skv: int,
    *,
    block_size: int | tuple[int, int] = 128,
    device: str | torch.device | None = None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once and classify every block as empty, partial or full.

    Cost: one evaluation of the mask over (B, H, Sq, Skv) in chunks; build it once per shape and
    reuse it (it does not depend on q, k, v).

    Args:
        mask_mod: a :class:`MaskMod` (or a function, wrapped with :func:`mask_mod`).
        B, H: batch and query-head counts the mask depends on; None when it does not (broadcast).
        Sq, Skv: sequence lengths.
        block_size: the block size (or (block_q, block_kv)): a power of two >= 16; the kernels'
            tiles divide it. 128 is a good default.
        device: where the lists live (default: the device of the mask's captured tensors, else CPU);
            it must be the device of q at the call.

    Returns:
        A :class:`BlockMask`.

    Raises:
        TypeError: ``mask_mod`` is not a mask, or does not return a bool tensor.
        ValueError: bad sizes; a ``mask_mod`` result that does not broadcast to (B, H, Sq, Skv)
            with 4 dims; a ``modmath.load`` index outside the tensor the mask captures (a mask
            built for other sizes).

    Example:
        >>> import fp8ops
        >>> bm = fp8ops.create_block_mask(fp8ops.sliding_window_mask(128), None, None, 512, 512, block_size=64)
        >>> bm.block_states()[0, 0, 4].tolist()      # empty, partial (1) and full (2) key blocks
        [0, 0, 1, 2, 1, 0, 0, 0]
    """
    where = "create_block_mask"
    if not isinstance(mask_mod, MaskMod):
        if isinstance(mask_mod, ScoreMod) or not callable(mask_mod):
            raise TypeError(f"{where}: mask_mod must be a MaskMod or a function (b, h, q_idx, kv_idx) -> bool")
        mask_mod = MaskMod(mask_mod)
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for v in (bq, bkv):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{where}: block_size must be a power of two >= 16, got {block_size!r}")
    for name, v in (("Sq", Sq), ("Skv", Skv)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {v!r}")
    for name, v in (("B", B), ("H", H)):
        if v is not None and (_index(v) is None or _index(v) < 1):  # type: ignore[operator]
            raise ValueError(f"{where}: {name} must be an int >= 1, or None when the mask does not depend on it, "
                             f"got {v!r}")
    nb = 1 if B is None else _index(B)
    nh = 1 if H is None else _index(H)
    if device is None:
        device = mask_mod.buffers[0].device if mask_mod.buffers else torch.device("cpu")
    dev = torch.device(device)
    label = _mod_label(mask_mod)
    nq, nkv = -(-Sq // bq), -(-Skv // bkv)
    b_idx = torch.arange(nb, device=dev).view(nb, 1, 1, 1)
    h_idx = torch.arange(nh, device=dev).view(1, nh, 1, 1)
    kv_idx = torch.arange(Skv, device=dev).view(1, 1, 1, Skv)
    # In-range elements per block, to tell full blocks from partial ones at the sequence ends.
    rows_in = torch.clamp(Sq - torch.arange(nq, device=dev) * bq, max=bq)
    cols_in = torch.clamp(Skv - torch.arange(nkv, device=dev) * bkv, max=bkv)
    inrange = rows_in[:, None] * cols_in[None, :]  # (NQ, NKV)
    counts = torch.empty((nb, nh, nq, nkv), dtype=torch.int64, device=dev)
    chunk = max(1, (1 << 24) // max(1, nb * nh * bq * nkv * bkv))
    pad_kv = nkv * bkv - Skv
    with torch.no_grad():
        for r0 in range(0, nq, chunk):
            r1 = min(nq, r0 + chunk)
            q_idx = torch.arange(r0 * bq, min(Sq, r1 * bq), device=dev).view(1, 1, -1, 1)
            shape = (nb, nh, q_idx.shape[2], Skv)
            try:
                r = mask_mod(b_idx, h_idx, q_idx, kv_idx)
            except IndexError as e:
                raise ValueError(
                    _load_error(e, "mask_mod", label, where, "(B, H, Sq, Skv)", (nb, nh, Sq, Skv))) from None
            r = _check_mod_result(r, "mask_mod", label, where, shape, "(B, H, Sq, Skv)", (nb, nh, Sq, Skv))
            m = torch.broadcast_to(torch.as_tensor(r, device=dev), shape).to(torch.int32)
            m = torch.nn.functional.pad(m, (0, pad_kv, 0, (r1 - r0) * bq - q_idx.shape[2]))
            m = m.view(nb, nh, r1 - r0, bq, nkv, bkv)
            counts[:, :, r0:r1] = m.sum(dim=(3, 5))
    state = torch.where(counts == 0, 0, torch.where(counts == inrange, 2, 1)).to(torch.int8)
    kvn, kvi = _lists(state, 1)
    fkvn, fkvi = _lists(state, 2)
    st = state.transpose(-1, -2)
    qn, qi = _lists(st, 1)
    fqn, fqi = _lists(st, 2)
    return BlockMask(kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, (Sq, Skv), (bq, bkv), mask_mod)


# ------------------------------------------------------------------------------------------------
# The Triton path: kernels specialized per mod pair, autograd glue.


class _Static(NamedTuple):
    """Static configuration of one attention call (Python constants only)."""

    score_key: str | None
    mask_key: str | None
    score_slots: tuple[int, ...]  # unique-buffer index of each score_mod buffer
    mask_slots: tuple[int, ...]
    needs: tuple[bool, ...]  # score_mod buffers that need a gradient
    scale: float
    left: int | None
    right: int | None
    layout: str  # "bhsd" | "bshd" | "sbhd" | "thd"
    max_q: int | None
    max_kv: int | None
    dropout_p: float
    sparse_block: tuple[int, int] | None
    dq_mode: str
    fwd_config: tuple[tuple[str, int], ...] | None
    bwd_config: tuple[tuple[str, int], ...] | None


@functools.lru_cache(maxsize=None)
def _kernels(score_key: str | None, mask_key: str | None, needs: tuple[bool, ...]) -> _K.AttentionKernels:
    sm = _SPECS[score_key] if score_key is not None else None
    mm = _SPECS[mask_key] if mask_key is not None else None
    if sm is None:
        return _K.specialize(None, None, None, mm.fwd_jit() if mm is not None else None)
    grad = grad_dq = None
    if sm.differentiable:
        grad = sm.grad_jit(needs)
        grad_dq = sm.grad_jit(tuple(False for _ in needs))
    return _K.specialize(sm.fwd_jit(), grad, grad_dq, mm.fwd_jit() if mm is not None else None)


@torch._dynamo.assume_constant_result
def _kernel_for(which: str, score_key: str | None, mask_key: str | None, needs: tuple[bool, ...]) -> Any:
    # Runs once per (mods, kernel) even under torch.compile: its result, a @triton.jit kernel, is a
    # constant of the traced graph.
    return getattr(_kernels(score_key, mask_key, needs), which)


def _flat(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _alloc_layout(shape4: tuple[int, int, int, int], layout: str, dtype: torch.dtype, device: torch.device,
                  zero: bool) -> Tensor:
    """A (B, H, S, D) view of a new tensor stored in ``layout`` (``thd``: (T, H, D) itself)."""
    make = torch.zeros if zero else torch.empty
    if layout == "thd":
        return make(shape4, dtype=dtype, device=device)
    B, H, S, D = shape4
    phys = {"bhsd": (B, H, S, D), "bshd": (B, S, H, D), "sbhd": (S, B, H, D)}[layout]
    return _ref.to_bhsd(make(phys, dtype=dtype, device=device), layout)


def _alloc_lse(q: Tensor, layout: str) -> Tensor:
    if layout == "thd":
        # Packed rows after the last sequence are never visited: they keep the masked-row value.
        return torch.full(q.shape[:2], MASKED_ROW_LSE, dtype=torch.float32, device=q.device)
    B, H, S, _ = q.shape
    phys = {"bhsd": (B, H, S), "bshd": (B, S, H), "sbhd": (S, B, H)}[layout]
    t = torch.empty(phys, dtype=torch.float32, device=q.device)
    return {"bhsd": t, "bshd": t.transpose(1, 2), "sbhd": t.permute(1, 2, 0)}[layout]


def _sparsity(bm: tuple[Tensor | None, ...], static: _Static) -> tuple[Any, Any]:
    if static.sparse_block is None:
        return None, None
    bq, bkv = static.sparse_block
    kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi = bm
    return (_K.BlockSparsity(kvn, kvi, fkvn, fkvi, bq, bkv), _K.BlockSparsity(qn, qi, fqn, fqi, bq, bkv))


@functools.lru_cache(maxsize=256)
def _parse_static(static: str) -> _Static:
    """The :class:`_Static` of ``repr(tuple(static))`` (the form the library ops take)."""
    return _Static(*ast.literal_eval(static))


def _attention_fwd_outputs(q: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    varlen = layout == "thd"
    out_shape = (q.shape[0], q.shape[1], v.shape[2]) if varlen else (*q.shape[:3], v.shape[3])
    out = _alloc_layout(out_shape, layout, q.dtype, q.device, zero=varlen)  # type: ignore[arg-type]
    return out, _alloc_lse(q, layout)


def _attention_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None,
                        seed: Tensor | None, kvn: Tensor | None, kvi: Tensor | None, fkvn: Tensor | None,
                        fkvi: Tensor | None, buffers: list[Tensor], static: str) -> tuple[Tensor, Tensor]:
    """``fp8ops::attention_fwd``: the fused forward, ``(out, lse)`` as (B, Hq, Sq, Dv) / (B, Hq, Sq)
    views stored in the layout of ``static`` (packed: (Tq, Hq, Dv) / (Tq, Hq)). The kernel comes
    from the registry of generated mods (:data:`_SPECS`) through the keys in ``static``, the
    ``repr`` of the call's :class:`_Static`; ``buffers`` are the unique captured tensors."""
    st = _parse_static(static)
    kern = _K.AttentionKernels(_kernels(st.score_key, st.mask_key, st.needs).fwd, None, None, None)
    out, lse = _attention_fwd_outputs(q, v, st.layout)
    flat = [_flat(t) for t in buffers]
    bs = None
    if st.sparse_block is not None:
        assert kvn is not None and kvi is not None and fkvn is not None and fkvi is not None
        bs = _K.BlockSparsity(kvn, kvi, fkvn, fkvi, *st.sparse_block)
    _K.attention_fwd_launch(
        q, k, v, out, lse, sm_scale=st.scale, kernels=kern,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=st.max_q, max_seqlen_kv=st.max_kv,
        window=(st.left, st.right), has_score_mod=st.score_key is not None, has_mask_mod=st.mask_key is not None,
        score_buffers=tuple(flat[i] for i in st.score_slots), mask_buffers=tuple(flat[i] for i in st.mask_slots),
        block_sparsity=bs, dropout_p=st.dropout_p, dropout_seed=seed,
        config=dict(st.fwd_config) if st.fwd_config else None,
    )
    return out, lse


def _attention_fwd_fake(q, k, v, cu_q, cu_kv, seed,  # type: ignore[no-untyped-def]
                        kvn, kvi, fkvn, fkvi, buffers, static):
    return _attention_fwd_outputs(q, v, _parse_static(static).layout)


def _attention_fwd_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    # vmap = a loop over the batch entries (the autograd.Function's own vmap rule normally runs
    # first; this one covers direct calls of the op under vmap).
    def pick(a: Any, d: Any, i: int) -> Any:
        if isinstance(a, (list, tuple)):
            dims = d if isinstance(d, (list, tuple)) else [d] * len(a)
            return [pick(x, dd, i) for x, dd in zip(a, dims)]
        return a if d is None or not isinstance(a, Tensor) else a.select(d, i)

    outs = [torch.ops.fp8ops.attention_fwd(*[pick(a, d, i) for a, d in zip(args, in_dims)])
            for i in range(info.batch_size)]
    return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


# A low-level library op (kernels/_library.py: no custom_op wrapper layers on the host path). The
# CPU kernel serves CPU tensors under TRITON_INTERPRET=1 (the CPU path of attention() runs the
# reference math and never calls it).
_define(
    "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_q, Tensor? cu_kv, Tensor? seed, Tensor? kvn, "
    "Tensor? kvi, Tensor? fkvn, Tensor? fkvi, Tensor[] buffers, str static) -> (Tensor, Tensor)",
    cuda=_attention_fwd_impl, cpu=_attention_fwd_impl, fake=_attention_fwd_fake,
)
torch.library.register_vmap("fp8ops::attention_fwd", _attention_fwd_vmap)


class _AttentionFunction(torch.autograd.Function):
    """Autograd glue of the Triton path. Inputs: q, k, v as (B, H, S, D) views (or packed (T, H, D)),
    cu_seqlens, dropout seed, the 8 block-mask tensors, the static config, the unique captured
    tensors of the mods. Outputs: out (B, Hq, Sq, Dv) view and lse (B, Hq, Sq) view."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None,  # type: ignore[override]
                seed: Tensor | None, kvn: Any, kvi: Any, fkvn: Any, fkvi: Any, qn: Any, qi: Any, fqn: Any,
                fqi: Any, static: _Static, *buffers: Tensor) -> tuple[Tensor, Tensor]:
        # One opaque library op (see _attention_fwd_impl): torch.compile records a single node and
        # never re-generates the kernel, whose mods are globals of a specialized copy.
        out, lse = torch.ops.fp8ops.attention_fwd(q, k, v, cu_q, cu_kv, seed, kvn, kvi, fkvn, fkvi,
                                                  list(buffers), repr(tuple(static)))
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, cu_q, cu_kv, seed, *rest = inputs
        bm, static, buffers = rest[:8], rest[8], rest[9:]
        out, lse = output
        ctx.static = static
        ctx.n_buffers = len(buffers)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, seed, *bm, *buffers)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        static: _Static = ctx.static
        q, k, v, out, lse, cu_q, cu_kv, seed, *rest = ctx.saved_tensors
        bm, buffers = rest[:8], rest[8:]
        with torch.no_grad():
            if dout is None and dlse is None:
                return (None,) * (15 + ctx.n_buffers)
            if dout is None:
                dout = torch.zeros_like(out)
            if static.score_key is not None and not _SPECS[static.score_key].differentiable:
                _SPECS[static.score_key].grad_jit(static.needs)  # raises, naming the mod
            # A library op, so that torch.func transforms (grad, vmap of grad) see plain tensors.
            grads = torch.ops.fp8ops.attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_kv, seed, *bm,
                                                   list(buffers), repr(tuple(static)))
        buf_grads = [g if _needs_slot(static, i) else None for i, g in enumerate(grads[3:])]
        return (grads[0], grads[1], grads[2], None, None, None, *([None] * 8), None, *buf_grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        # vmap = a loop over the batched entries (exact semantics; the batches seen in practice,
        # micro-batches or ensembles, are small).
        outs = []
        for i in range(info.batch_size):
            sample = [a if d is None or not isinstance(a, Tensor) else a.select(d, i) for a, d in zip(args, in_dims)]
            outs.append(_AttentionFunction.apply(*sample))
        return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


def _needs_slot(static: _Static, slot: int) -> bool:
    return any(static.needs[j] for j, i in enumerate(static.score_slots) if i == slot)


def _bwd_static(static: str) -> _Static:
    return _parse_static(static)


@torch.library.custom_op("fp8ops::attention_bwd", mutates_args=())
def _attention_bwd_op(
    dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor | None, cu_kv: Tensor | None, seed: Tensor | None,
    kvn: Tensor | None, kvi: Tensor | None, fkvn: Tensor | None, fkvi: Tensor | None,
    qn: Tensor | None, qi: Tensor | None, fqn: Tensor | None, fqi: Tensor | None,
    buffers: list[Tensor], static: str,
) -> list[Tensor]:
    """Attention backward (the fused kernels): ``[dq, dk, dv, *buffer_grads]``; a buffer that needs
    no gradient gets an empty tensor. ``static`` is ``repr`` of the call's :class:`_Static`."""
    st = _bwd_static(static)
    varlen = st.layout == "thd"
    kern = _K.AttentionKernels(
        None,
        _kernel_for("bwd_preprocess", st.score_key, st.mask_key, st.needs),
        _kernel_for("bwd_dkdv", st.score_key, st.mask_key, st.needs),
        _kernel_for("bwd_dq", st.score_key, st.mask_key, st.needs),
    )
    dq = torch.zeros_like(q) if varlen else torch.empty_like(q)
    dk = torch.zeros_like(k) if varlen else torch.empty_like(k)
    dv = torch.zeros_like(v) if varlen else torch.empty_like(v)
    flat = [_flat(t) for t in buffers]
    grads = [torch.zeros(b.numel() if _needs_slot(st, i) else 0, dtype=torch.float32, device=q.device)
             for i, b in enumerate(buffers)]
    bs, bst = _sparsity((kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi), st)
    _K.attention_bwd_launch(
        dout, q, k, v, out, lse, dlse, dq, dk, dv, sm_scale=st.scale, kernels=kern,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=st.max_q, max_seqlen_kv=st.max_kv,
        window=(st.left, st.right), has_score_mod=st.score_key is not None, has_mask_mod=st.mask_key is not None,
        score_buffers=tuple(flat[i] for i in st.score_slots), mask_buffers=tuple(flat[i] for i in st.mask_slots),
        score_buffer_grads=tuple(grads[i] if st.needs[j] else None for j, i in enumerate(st.score_slots)),
        block_sparsity=bs, block_sparsity_t=bst, dropout_p=st.dropout_p, dropout_seed=seed,
        dq_mode=st.dq_mode, config=dict(st.bwd_config) if st.bwd_config else None,
    )
    return [dq, dk, dv] + [g.view(b.shape).to(b.dtype) if g.numel() else g.to(b.dtype)
                           for g, b in zip(grads, buffers)]


@_attention_bwd_op.register_fake
def _attention_bwd_fake(dout, dlse, q, k, v, out, lse, cu_q, cu_kv, seed,  # type: ignore[no-untyped-def]
                        kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, buffers, static):
    st = _bwd_static(static)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + [
        torch.empty_like(b) if _needs_slot(st, i) else b.new_empty((0,)) for i, b in enumerate(buffers)]


def _attention_bwd_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    # vmap (e.g. of torch.func.grad) = a loop over the batch entries.
    def pick(a: Any, d: Any, i: int) -> Any:
        if isinstance(a, (list, tuple)):
            dims = d if isinstance(d, (list, tuple)) else [d] * len(a)
            return [pick(x, dd, i) for x, dd in zip(a, dims)]
        return a if d is None or not isinstance(a, Tensor) else a.select(d, i)

    outs = [torch.ops.fp8ops.attention_bwd(*[pick(a, d, i) for a, d in zip(args, in_dims)])
            for i in range(info.batch_size)]
    return [torch.stack([o[j] for o in outs]) for j in range(len(outs[0]))], [0] * len(outs[0])


torch.library.register_vmap("fp8ops::attention_bwd", _attention_bwd_vmap)


def _distinct(*ts: Tensor) -> list[Tensor]:
    # autograd.Function.apply under torch.compile cannot take the same tensor twice.
    out: list[Tensor] = []
    for t in ts:
        if any(t is o for o in out):
            t = t.view(t.shape)
        out.append(t)
    return out


def _attention_triton(
    q: Tensor, k: Tensor, v: Tensor, *, score_mod: ScoreMod | None, mask_mod: MaskMod | None,
    block_mask: BlockMask | None, scale: float, left: int | None, right: int | None, layout: str,
    cu_q: Tensor | None, cu_kv: Tensor | None, max_q: int | None, max_kv: int | None,
    dropout_p: float, seed: Tensor | None, dq_mode: str = "separate",
    fwd_config: dict[str, int] | None = None, bwd_config: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused path on tensors in ``layout`` (or packed with ``layout="thd"``): ``(out, lse)`` in
    the same layout. Works on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    varlen = layout == "thd"
    if varlen:
        q4, k4, v4 = q, k, v
    else:
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    uniq: list[Tensor] = []

    def slot(t: Tensor) -> int:
        for i, u in enumerate(uniq):
            if u is t:
                return i
        uniq.append(t)
        return len(uniq) - 1

    sm_bufs = score_mod.buffers if score_mod is not None else ()
    mm_bufs = mask_mod.buffers if mask_mod is not None else ()
    score_slots = tuple(slot(t) for t in sm_bufs)
    mask_slots = tuple(slot(t) for t in mm_bufs)
    needs = tuple(bool(t.requires_grad) and torch.is_grad_enabled() for t in sm_bufs)
    bm: tuple[Any, ...] = (None,) * 8
    if block_mask is not None:
        bm = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
              block_mask.full_q_num_blocks, block_mask.full_q_indices)
    static = _Static(
        score_key=score_mod.key if score_mod is not None else None,
        mask_key=mask_mod.key if mask_mod is not None else None,
        score_slots=score_slots, mask_slots=mask_slots, needs=needs, scale=float(scale),
        left=left, right=right, layout=layout, max_q=max_q, max_kv=max_kv, dropout_p=float(dropout_p),
        sparse_block=block_mask.block_size if block_mask is not None else None, dq_mode=dq_mode,
        fwd_config=tuple(sorted(fwd_config.items())) if fwd_config else None,
        bwd_config=tuple(sorted(bwd_config.items())) if bwd_config else None,
    )
    q4, k4, v4 = _distinct(q4, k4, v4)
    refuse_compiled_transform("attention", q4)
    out4, lse3 = _AttentionFunction.apply(q4, k4, v4, cu_q, cu_kv, seed, *bm, static, *uniq)
    if varlen:
        return out4, lse3
    return _ref.from_bhsd(out4, layout), _ref.lse_from_bhs(lse3, layout)


# ------------------------------------------------------------------------------------------------
# The public op


def _as_mod(m: Any, cls: type, name: str, where: str, arity: int) -> Any:
    if m is None or isinstance(m, cls):
        return m
    other = MaskMod if cls is ScoreMod else ScoreMod
    if isinstance(m, other):
        raise TypeError(f"{where}: {name} got a {other.__name__}; pass it as "
                        f"{'mask_mod' if other is MaskMod else 'score_mod'}")
    if not callable(m):
        raise TypeError(f"{where}: {name} must be a {cls.__name__} or a function, got {type(m).__name__}")
    if not torch.compiler.is_compiling():
        try:
            n = len(inspect.signature(m).parameters)
        except (TypeError, ValueError):
            n = arity
        if n != arity:
            args = "(score, b, h, q_idx, kv_idx)" if arity == 5 else "(b, h, q_idx, kv_idx)"
            raise TypeError(f"{where}: {name} must take {args}, got a function of {n} argument(s) "
                            f"(a mod factory such as fp8ops.softcap must be called: softcap(30.0))")
    return m


def _check_seed(seed: Any, where: str) -> None:
    """``dropout_seed``: None, an int in int64 range or a 1-element integer tensor (checked even when
    ``dropout_p`` is 0: a wrong seed is a bug either way)."""
    if seed is None:
        return
    if isinstance(seed, Tensor):
        if seed.dtype == torch.bool or seed.is_floating_point() or seed.is_complex():
            raise TypeError(f"{where}: dropout_seed must be an int or a 1-element integer tensor, got a tensor of "
                            f"dtype {seed.dtype}")
        if seed.numel() != 1:
            raise ValueError(f"{where}: dropout_seed must be an int or a 1-element integer tensor, got a tensor of "
                             f"shape {tuple(seed.shape)}")
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: dropout_seed must be an int, a 1-element integer tensor or None, got {seed!r}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"{where}: dropout_seed must fit in int64 ([-2**63, 2**63)), got {seed}")


def _seed_tensor(seed: Any, device: torch.device, where: str) -> Tensor:
    _check_seed(seed, where)
    if seed is None:
        return torch.randint(-(2**62), 2**62, (), dtype=torch.int64, device=device)
    if isinstance(seed, Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(seed, dtype=torch.int64, device=device)


def _use_kernels(q: Tensor) -> bool:
    """Whether the fused Triton kernels run (CUDA tensors) or the reference math (anything else)."""
    return q.is_cuda


def _max_len(cu: Tensor) -> int:
    # A host sync; used only where the offsets were not read by _check_offsets (torch.compile tracing).
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def _check_cu(cu: Any, name: str, device: torch.device, where: str) -> None:
    """The form of a ``cu_seqlens`` argument (its values are checked by :func:`_check_offsets`)."""
    what = "a 1-D int32 tensor (B + 1,) of the sequences' start offsets in the packed tokens"
    if not isinstance(cu, Tensor):
        raise TypeError(f"{where}: {name} must be {what}, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{where}: {name} must be {what}, got dtype {cu.dtype}; convert it once with "
                         f"{name}.to(torch.int32)")
    if cu.dim() != 1:
        raise ValueError(f"{where}: {name} must be {what}, got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise ValueError(f"{where}: {name} must be {what} with at least 2 entries (0 and the end of the first "
                         f"sequence), got {cu.numel()} entr{'y' if cu.numel() == 1 else 'ies'}")
    if cu.device != device:
        raise ValueError(f"{where}: {name} must be on q's device {device}, got {cu.device}; move it once with "
                         f"{name}.to(q.device)")


def _shown(vals: list[int]) -> str:
    return str(vals) if len(vals) <= 12 else f"[{', '.join(map(str, vals[:6]))}, ..., {', '.join(map(str, vals[-3:]))}]"


def _check_offsets(cu_q: Tensor, cu_kv: Tensor | None, tq: int, tkv: int, where: str) -> tuple[int, int]:
    """Check the values of the packed-sequence offsets; returns the longest query and key sequences.

    One device-to-host read for both tensors (``cu_kv`` None: ``cu_q`` serves k and v too). Offsets
    must start at 0, never decrease, and end at the packed length: ``cu[-1] == T`` (a token after
    ``cu[-1]`` would belong to no sequence and come out as 0 without a word).
    """
    vals = (cu_q if cu_kv is None else torch.cat([cu_q, cu_kv])).tolist()
    n = cu_q.numel()
    if cu_kv is None:
        checks = [("cu_seqlens_q", vals, tq, "q"),
                  ("cu_seqlens_q (used for k and v too: cu_seqlens_kv is None)", vals, tkv, "k and v")]
    else:
        checks = [("cu_seqlens_q", vals[:n], tq, "q"), ("cu_seqlens_kv", vals[n:], tkv, "k and v")]
    longest = []
    for name, offs, total, of in checks:
        short = name.split(" ")[0]
        if offs[0] != 0:
            raise ValueError(f"{where}: {name} must start at 0 (offsets of sequences packed without a gap), got "
                             f"{_shown(offs)}")
        lens = [b - a for a, b in zip(offs[:-1], offs[1:])]
        bad = next((i for i, m in enumerate(lens) if m < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: {name} must be non-decreasing (sequence i spans {short}[i]:{short}[i + 1]), "
                             f"got {short}[{bad}] = {offs[bad]} > {short}[{bad + 1}] = {offs[bad + 1]} in "
                             f"{_shown(offs)}")
        if offs[-1] != total:
            where_ = "past" if offs[-1] > total else "before the end of"
            raise ValueError(f"{where}: {name} ends at {offs[-1]}, {where_} the {total} packed tokens of {of} "
                             f"(dim 0); the offsets must end at T = {total}, every token in one sequence "
                             f"({_shown(offs)})")
        longest.append(max(lens))
    return longest[0], longest[-1]


def _index(v: Any) -> int | None:
    """``v`` as an int (None stays None) for integer-like arguments; bools and non-integers give None."""
    if isinstance(v, bool) or isinstance(v, float):
        return None
    try:
        return int(operator.index(v))
    except TypeError:
        return None


# ------------------------------------------------------------------------------------------------
# Checking mods against a call: eager results (the reference path) and, before the kernels run,
# the index ranges of their modmath.load reads (interval arithmetic on the lowered code).


def _mod_label(m: Any) -> str:
    return str(getattr(m, "name", None) or getattr(m, "__qualname__", None) or repr(m))


def _check_mod_result(r: Any, kind: str, label: str, where: str, shape: tuple[int, ...], shown: str,
                      full: tuple[int, ...] | None = None) -> Any:
    """The eager result of a mod, checked: a score (real tensor or number) or a mask (bool tensor or
    bool), of ``shape`` or broadcastable to it with the same number of dims (or 0-d). ``full``: the
    shape to name in the message (``shape`` is a chunk of it)."""
    if kind == "mask_mod":
        if isinstance(r, bool):
            return r
        if not isinstance(r, Tensor):
            raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), got "
                            f"{type(r).__name__}")
        if r.dtype != torch.bool:
            raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), got dtype "
                            f"{r.dtype}; return a comparison, e.g. (x != 0) for a 0/1 tensor x")
    else:
        if isinstance(r, (int, float)) and not isinstance(r, bool):
            return torch.tensor(float(r))
        if not isinstance(r, Tensor):
            raise TypeError(f"{where}: score_mod {label} must return the new score as a tensor, got "
                            f"{type(r).__name__}")
        if r.dtype == torch.bool or r.is_complex():
            raise TypeError(f"{where}: score_mod {label} must return a real-valued score tensor, got dtype "
                            f"{r.dtype} (a mask belongs in mask_mod)")
    if r.dim() != 0 and (r.dim() != len(shape) or any(a not in (1, b) for a, b in zip(r.shape, shape))):
        args = "(b, h, q_idx, kv_idx)" if kind == "mask_mod" else "(score, b, h, q_idx, kv_idx)"
        raise ValueError(f"{where}: {kind} {label} returned shape {tuple(r.shape)}; expected the shape of the "
                         f"scores {shown} = {full or shape}, or one that broadcasts to it with the same "
                         f"{len(shape)} dims (each 1 or the full size): compute it elementwise from the mod's "
                         f"arguments {args}, which broadcast to that shape")
    return r


def _load_error(e: IndexError, kind: str, label: str, where: str, dims_name: str, dims: tuple[int, ...]) -> str:
    if isinstance(e, _LoadIndexError) and e.lo is not None:
        got = (f"reads a captured tensor of shape {e.shape} ({e.numel} elements) at flat indices "
               f"[{e.lo}, {e.hi}] with modmath.load, which needs 0 <= index < {e.numel}")
    else:
        got = f"raised IndexError ({e}): a tensor it captures is too small"
    return (f"{where}: {kind} {label} {got}, for this call's {dims_name} = {dims}; the mod was built for other "
            f"sizes: rebuild it (and the tensors it captures) for these")


def _checked_mod(mod: Any, kind: str, where: str, shape: tuple[int, ...], shown: str, dims_name: str,
                 dims: tuple[int, ...]) -> Any:
    """``mod`` wrapped for the reference math: its result checked, its read errors made ValueErrors."""
    if mod is None:
        return None
    label = _mod_label(mod)

    def run(*args: Any) -> Any:
        try:
            r = mod(*args)
        except IndexError as e:
            raise ValueError(_load_error(e, kind, label, where, dims_name, dims)) from None
        return _check_mod_result(r, kind, label, where, shape, shown)

    return run


_IV_INF = math.inf


class _Iv(NamedTuple):
    """An abstract value of lowered mod code: its kind ("bool", "int", "float" or "?") and a range
    [lo, hi] (possibly infinite) that contains every value it takes."""

    kind: str
    lo: float
    hi: float


_IV_ANY = _Iv("?", -_IV_INF, _IV_INF)


def _iv_kind(a: str, b: str) -> str:
    if a == b:
        return a
    if "?" in (a, b):
        return "?"
    return "float" if "float" in (a, b) else "int"


def _iv_num(a: str) -> str:
    return "int" if a == "bool" else a  # arithmetic on bools gives integers


def _iv_mul(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y


def _iv_floordiv(x: float, y: float) -> float:
    if math.isinf(x):
        return x
    return 0.0 if math.isinf(y) else float(x // y)


class _IntervalEval:
    """Interval arithmetic over a lowered mod (its SSA statements), for the ranges of its indices."""

    def __init__(self, low: _Lowered, params: dict[str, _Iv], buf_kinds: tuple[str, ...]) -> None:
        self.low = low
        self.env: dict[str, _Iv] = dict(params)
        self.buf_kinds = buf_kinds
        self.loads: list[tuple[int, _Iv]] = []  # (buffer slot, index range) per load site

    def run(self) -> _Iv:
        for name, expr in self.low.stmts:
            self.env[name] = self.ev(expr, self.env)
        return self.ev(self.low.ret, self.env)

    def ev(self, node: ast.expr, env: dict[str, _Iv]) -> _Iv:
        if isinstance(node, ast.Constant):
            v = node.value
            kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float"
            return _Iv(kind, float(v), float(v)) if not math.isnan(float(v)) else _Iv(kind, -_IV_INF, _IV_INF)
        if isinstance(node, ast.Name):
            return env.get(node.id, _IV_ANY)
        if isinstance(node, ast.UnaryOp):
            a = self.ev(node.operand, env)
            if isinstance(node.op, ast.USub):
                return _Iv(_iv_num(a.kind), -a.hi, -a.lo)
            if isinstance(node.op, ast.UAdd):
                return a
            if isinstance(node.op, ast.Invert) and a.kind == "bool":
                return _Iv("bool", 0.0, 1.0)
            return _Iv(a.kind, -_IV_INF, _IV_INF)
        if isinstance(node, ast.Compare):
            return _Iv("bool", 0.0, 1.0)
        if isinstance(node, ast.BinOp):
            return self.binop(node.op, self.ev(node.left, env), self.ev(node.right, env))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fname = node.func.id
            if fname == "float":  # float('inf') / float('nan') constants
                return _Iv("float", -_IV_INF, _IV_INF)
            name = fname[len("_fp8_mm_"):]
            if name == "load":
                slot = int(node.args[0].id[len("_fp8_t"):])  # type: ignore[attr-defined]
                self.loads.append((slot, self.ev(node.args[1], env)))
                kind = self.buf_kinds[slot] if slot < len(self.buf_kinds) else "?"
                return _Iv(kind, 0.0, 1.0) if kind == "bool" else _Iv(kind, -_IV_INF, _IV_INF)
            if name == "where":
                return self.where(node.args, env)
            args = [self.ev(a, env) for a in node.args]
            if name == "minimum":
                return _Iv(_iv_kind(args[0].kind, args[1].kind), min(args[0].lo, args[1].lo),
                           min(args[0].hi, args[1].hi))
            if name == "maximum":
                return _Iv(_iv_kind(args[0].kind, args[1].kind), max(args[0].lo, args[1].lo),
                           max(args[0].hi, args[1].hi))
            if name == "clamp":
                x, lo, hi = args
                kind = _iv_kind(_iv_kind(x.kind, lo.kind), hi.kind)
                return _Iv(kind, min(max(x.lo, lo.lo), hi.lo), min(max(x.hi, lo.hi), hi.hi))
            if name == "abs":
                a = args[0]
                if a.lo >= 0:
                    return a
                if a.hi <= 0:
                    return _Iv(a.kind, -a.hi, -a.lo)
                return _Iv(a.kind, 0.0, max(-a.lo, a.hi))
            return _Iv("float", -_IV_INF, _IV_INF)  # exp, log, tanh, ...: not index material
        return _IV_ANY

    @staticmethod
    def binop(op: ast.operator, a: _Iv, b: _Iv) -> _Iv:
        kind = _iv_kind(_iv_num(a.kind), _iv_num(b.kind))
        if isinstance(op, ast.Add):
            return _Iv(kind, a.lo + b.lo, a.hi + b.hi)
        if isinstance(op, ast.Sub):
            return _Iv(kind, a.lo - b.hi, a.hi - b.lo)
        if isinstance(op, ast.Mult):
            ps = [_iv_mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return _Iv(kind, min(ps), max(ps))
        if isinstance(op, ast.Div):
            return _Iv("float", -_IV_INF, _IV_INF)
        # // and % floor in PyTorch and truncate in Triton: bounded here only for non-negative operands.
        if isinstance(op, ast.FloorDiv) and a.lo >= 0 and b.lo > 0:
            return _Iv(kind, _iv_floordiv(a.lo, b.hi), _iv_floordiv(a.hi, b.lo))
        if isinstance(op, ast.Mod) and a.lo >= 0 and b.lo > 0:
            return a if a.hi < b.lo else _Iv(kind, 0.0, min(a.hi, b.hi - 1))
        if isinstance(op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            if a.kind == "bool" and b.kind == "bool":
                return _Iv("bool", 0.0, 1.0)
            if isinstance(op, ast.BitAnd) and a.lo >= 0 and b.lo >= 0:
                return _Iv(kind, 0.0, min(a.hi, b.hi))
        return _Iv(kind, -_IV_INF, _IV_INF)

    def where(self, args: list[ast.expr], env: dict[str, _Iv]) -> _Iv:
        # Each branch under what the condition says about a name it compares (index guards such as
        # where(i < n, i, 0)); a branch that cannot be taken does not count.
        outs = []
        for branch, truth in ((args[1], True), (args[2], False)):
            benv = self.narrow(args[0], truth, env)
            if benv is not None:
                outs.append(self.ev(branch, benv))
        if not outs:
            return _IV_ANY
        kind = outs[0].kind if len(outs) == 1 else _iv_kind(outs[0].kind, outs[1].kind)
        return _Iv(kind, min(o.lo for o in outs), max(o.hi for o in outs))

    _FLIP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}
    _NEGATE = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq,
               ast.NotEq: ast.Eq}

    def narrow(self, cond: ast.expr, truth: bool, env: dict[str, _Iv]) -> dict[str, _Iv] | None:
        """``env`` with the ranges the condition implies when it is ``truth`` (None: impossible)."""
        if isinstance(cond, ast.BinOp) and isinstance(cond.op, ast.BitAnd) and truth:
            left = self.narrow(cond.left, True, env)
            return None if left is None else self.narrow(cond.right, True, left)
        if isinstance(cond, ast.BinOp) and isinstance(cond.op, ast.BitOr) and not truth:
            left = self.narrow(cond.left, False, env)
            return None if left is None else self.narrow(cond.right, False, left)
        if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Invert):
            return self.narrow(cond.operand, not truth, env)
        if not isinstance(cond, ast.Compare) or len(cond.ops) != 1:
            return env
        op, lhs, rhs = type(cond.ops[0]), cond.left, cond.comparators[0]
        if not isinstance(lhs, ast.Name):
            if not isinstance(rhs, ast.Name):
                return env
            op, lhs, rhs = self._FLIP[op], rhs, lhs
        if not truth:
            op = self._NEGATE[op]
        x, r = self.ev(lhs, env), self.ev(rhs, env)
        step = 1.0 if x.kind in ("int", "bool") and r.kind in ("int", "bool") else 0.0
        lo, hi = x.lo, x.hi
        if op is ast.Lt:
            hi = min(hi, r.hi - step)
        elif op is ast.LtE:
            hi = min(hi, r.hi)
        elif op is ast.Gt:
            lo = max(lo, r.lo + step)
        elif op is ast.GtE:
            lo = max(lo, r.lo)
        elif op is ast.Eq:
            lo, hi = max(lo, r.lo), min(hi, r.hi)
        if lo > hi:
            return None
        out = dict(env)
        out[lhs.id] = _Iv(x.kind, lo, hi)  # type: ignore[union-attr]
        return out


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


@functools.lru_cache(maxsize=1024)
def _mod_facts(key: str, dims: tuple[int, int, int, int], buf_kinds: tuple[str, ...]
               ) -> tuple[str, tuple[tuple[int, float, float], ...]]:
    """(kind of the result, (buffer slot, lo, hi) of every modmath.load index) of the registered mod
    ``key`` called with b, h, q_idx, kv_idx in [0, dims[i]) ("?" and no loads where unknown)."""
    spec = _SPECS.get(key)
    if spec is None:
        return "?", ()
    if spec.children:
        kinds, loads = [], []
        for child, off in spec.children:
            kind, child_loads = _mod_facts(child.key, dims, buf_kinds[off:off + child.n_buffers])
            kinds.append(kind)
            loads += [(slot + off, lo, hi) for slot, lo, hi in child_loads]
        bad = next((k for k in kinds if k not in ("bool", "?")), None)
        return bad or ("bool" if all(k == "bool" for k in kinds) else "?"), tuple(loads)
    if spec.lowered is None:
        return "?", ()  # explicit Triton twins: nothing to read
    low = spec.lowered
    idx = [_Iv("int", 0.0, float(n - 1)) for n in dims]
    names = list(low.params)
    params = dict(zip(names[-4:], idx))
    if len(names) == 5:
        params[names[0]] = _Iv("float", -_IV_INF, _IV_INF)
    ev = _IntervalEval(low, params, buf_kinds)
    kind = ev.run()
    return kind.kind, tuple((slot, iv.lo, iv.hi) for slot, iv in ev.loads)


def _check_mod_statically(mod: Any, kind: str, where: str, dims_name: str, dims: tuple[int, int, int, int]) -> None:
    """Before the kernels run a mod: refuse a mask that is not boolean and a modmath.load whose index
    range (interval arithmetic over b, h, q_idx, kv_idx in [0, dims)) leaves its captured tensor —
    the kernels would read outside it. Indices that depend on loaded values or the score are not
    bounded here, and are not checked."""
    if mod is None or min(dims) < 1 or not isinstance(mod, _Mod):
        return
    bufs = mod.buffers
    result, loads = _mod_facts(mod.key, dims, tuple(_dtype_kind(t.dtype) for t in bufs))
    label = _mod_label(mod)
    if kind == "mask_mod" and result in ("int", "float"):
        raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), but it returns "
                        f"{'an integer' if result == 'int' else 'a float'} expression; return a comparison, e.g. "
                        f"(x != 0) for a 0/1 value x")
    for slot, lo, hi in loads:
        n = bufs[slot].numel()
        if math.isinf(lo) or math.isinf(hi) or (lo >= 0 and hi < n):
            continue
        raise ValueError(
            f"{where}: {kind} {label} reads a captured tensor of shape {tuple(bufs[slot].shape)} ({n} elements) "
            f"with modmath.load at flat indices up to [{int(lo)}, {int(hi)}] for this call's {dims_name} = {dims}, "
            f"which needs 0 <= index < {n}; the mod was built for other sizes: rebuild it (and the tensors it "
            f"captures) for these, or bound the index with modmath.clamp")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Any = None,
    *,
    recipe: Any = None,
    score_mod: ScoreMod | Callable[..., Tensor] | None = None,
    mask_mod: MaskMod | Callable[..., Tensor] | None = None,
    block_mask: BlockMask | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_kv: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | Tensor | None = None,
    deterministic: bool = False,
    backend: str = "auto",
) -> tuple[Any, None]:
    """Scaled dot-product attention with score/mask mods, block sparsity, packed sequences and GQA.

    Math::

        s_ij = scale * q_i . k_j;   s_ij = score_mod(s_ij, b, h, i, j)          (fp32)
        visible(i, j) = (i - left <= j <= i + right) & mask_mod(b, h, i, j) & block_mask
        lse_i = log sum_{visible j} exp(s_ij);   out_i = sum_{visible j} exp(s_ij - lse_i) v_j

    A query row with no visible key gets ``out = 0`` and ``lse = MASKED_ROW_LSE`` (-1e30: finite,
    and ``exp`` of it is 0, so it drops out of any ``logaddexp`` merge) — never NaN.

    Args:
        q: (B, Hq, Sq, D) in ``layout`` (``"bshd"``: (B, Sq, Hq, D); ``"sbhd"``: (Sq, B, Hq, D)), or
            packed (Tq, Hq, D) with ``cu_seqlens_q``, or a jagged nested tensor (B, j, Hq, D).
            float32, bfloat16 or float16.
        k: (B, Hkv, Skv, D) in the same layout (packed (Tkv, Hkv, D)); ``Hq`` a multiple of ``Hkv``
            (GQA/MQA). Skv may differ from Sq (cross-attention).
        v: (B, Hkv, Skv, Dv), like k.
        state: None (attention in the input precision). FP8 attention will take a state here.
        recipe: None (reserved for FP8 attention).
        score_mod: a :class:`ScoreMod` (or a function ``(score, b, h, q_idx, kv_idx) -> score``,
            wrapped with :func:`score_mod`). Elementwise: its result has the scores' shape
            (B, H, Sq, Skv), or broadcasts to it with the same 4 dims (each 1 or the full size).
        mask_mod: a :class:`MaskMod` (or a function ``(b, h, q_idx, kv_idx) -> bool``) returning a
            bool tensor shaped like the scores (or broadcasting to them, as for ``score_mod``).
            Evaluated on every key tile in the band unless ``block_mask`` says which blocks are
            full. Tensors that mods read with ``modmath.load`` must cover every index the call
            produces (b < B, h < H, q_idx < Sq, kv_idx < Skv; for packed sequences b is the sequence
            and the positions are inside it).
        block_mask: a :class:`BlockMask` for (Sq, Skv) from :func:`create_block_mask`; its
            ``mask_mod`` is used when ``mask_mod`` is None. Not with packed sequences.
        causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).
        window: ``w`` (the ``w`` most recent keys: ``i - w < j <= i``) or ``(left, right)``
            (``i - left <= j <= i + right``, None = unbounded). Combines with ``causal``.
        scale: score scale, a finite number > 0; default ``D ** -0.5``.
        layout: ``"bhsd"``, ``"bshd"`` or ``"sbhd"`` for dense inputs (outputs use the same).
        cu_seqlens_q: (B + 1,) int32 start offsets of the packed sequences in q, on q's device:
            ``0 = cu[0] <= cu[1] <= ... <= cu[B] <= Tq`` (sequence ``i`` is rows
            ``cu[i]:cu[i + 1]``, no gaps). Rows after ``cu[B]`` belong to no sequence: their
            output is 0 and their lse ``MASKED_ROW_LSE``.
        cu_seqlens_kv: the same for k/v (default: ``cu_seqlens_q``).
        max_seqlen_q, max_seqlen_kv: the longest sequences, or None (computed). In eager mode the
            offsets are validated on every call with one small device-to-host read of
            ``cu_seqlens_*`` (which also yields these maxima), whether or not they are passed; a
            value below the longest sequence is an error. Under ``torch.compile`` the offsets are
            not read (not validated); pass both there to avoid a host sync.
        return_lse: also return the log-sum-exp (natural log), shaped like q without its last dim.
        dropout_p: probability of dropping an attention weight (training); 0 disables it.
        dropout_seed: int or 1-element integer tensor; None draws one from torch's generator. The
            mask is a hash of (seed, b, h, i, j): the same seed gives the same mask everywhere.
        deterministic: on CUDA, compute dQ in its own kernel so that gradients are bitwise
            reproducible. By default a masked attention (causal, window, ``mask_mod`` or
            ``block_mask``) accumulates dQ with float32 atomics inside the dK/dV kernel, the
            faster scheme there (docs/benchmarks/attention_mods.md); unmasked attention always
            uses the separate dQ kernel, which is faster without masks.
        backend: ``"triton"`` (fp8ops's fused kernels), ``"sdpa"`` (PyTorch's
            ``scaled_dot_product_attention``, cuDNN first, then flash) or ``"auto"``: on CUDA, SDPA
            for the cases it covers — dense bf16/fp16 inputs without ``score_mod``, ``mask_mod``,
            ``block_mask``, window or packed sequences (``causal`` allowed), without ``return_lse``,
            ``deterministic`` or an explicit ``dropout_seed`` (SDPA draws its dropout mask from
            torch's generator) — where cuDNN's attention is the faster kernel; Triton otherwise.
            The CPU always runs the reference math.

    Returns:
        ``(out, None)`` where ``out`` is shaped like q with head dim Dv, or ``((out, lse), None)``
        with ``return_lse``. Gradients flow to q, k, v, to tensors captured by ``score_mod``, and
        through ``lse``.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix), including
            offsets that are not valid packed-sequence offsets, a ``score_mod``/``mask_mod`` result
            of the wrong shape or (masks) not bool, and a ``modmath.load`` index outside its
            captured tensor (a mod built for a smaller batch, head count or sequence length; on
            CUDA found before the kernels run for indices computed from b, h, q_idx, kv_idx).
        NotImplementedError: a ``state`` or ``recipe`` (FP8 attention is not available yet).

    Example:
        >>> import torch, fp8ops
        >>> q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
        >>> out, state = fp8ops.attention(q, k, v, causal=True)     # GQA: 8 query heads, 2 kv heads
        >>> out.shape, state
        (torch.Size([2, 8, 16, 32]), None)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        >>> torch.allclose(out, ref, atol=1e-5)
        True

    References:
        Vaswani et al. (2017); Dao, "FlashAttention-2" (2023); Dong et al., "Flex Attention" (2024).
    """
    where = "attention"
    if state is not None or recipe is not None:
        raise NotImplementedError(
            f"{where}: FP8 attention (state/recipe) is not available yet; pass state=None and recipe=None "
            f"to run in the input precision")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if m is not None and (_index(m) is None or _index(m) < 0):  # type: ignore[operator]
            raise TypeError(f"{where}: {name} must be None or an int >= 0 (the longest sequence), got {m!r}")
    max_seqlen_q = _index(max_seqlen_q)
    max_seqlen_kv = _index(max_seqlen_kv)
    # Step 1: nested (jagged) tensors are sugar for packed sequences.
    nested = isinstance(q, Tensor) and q.is_nested
    njt_transposed = False
    offsets = None
    if nested:
        if not (isinstance(k, Tensor) and k.is_nested and isinstance(v, Tensor) and v.is_nested):
            raise TypeError(f"{where}: q is a nested tensor, so k and v must be nested tensors too")
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError(f"{where}: nested tensors carry their own offsets; do not pass cu_seqlens")
        if q.layout != torch.jagged:
            raise ValueError(f"{where}: nested tensors must use layout=torch.jagged")
        njt_transposed = q._ragged_idx == 2  # (B, H, j, D), as SDPA takes them
        if njt_transposed:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if q._ragged_idx != 1 or q.dim() != 4:
            raise ValueError(f"{where}: nested tensors must be (B, j, H, D) or (B, H, j, D) with the ragged dim j")
        offsets = q.offsets()
        cu_seqlens_q = offsets.to(torch.int32)
        cu_seqlens_kv = k.offsets().to(torch.int32)
        max_seqlen_q = q._maybe_max_seqlen if max_seqlen_q is None else max_seqlen_q
        max_seqlen_kv = k._maybe_max_seqlen if max_seqlen_kv is None else max_seqlen_kv
        q, k, v = q.values(), k.values(), v.values()

    # Step 2: validate.
    q = check_float_tensor(q, "q", where)
    k = check_float_tensor(k, "k", where)
    v = check_float_tensor(v, "v", where)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{where}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{where}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    varlen = cu_seqlens_q is not None
    if cu_seqlens_kv is not None and not varlen:
        raise ValueError(f"{where}: cu_seqlens_kv needs cu_seqlens_q")
    longest: tuple[int, int] | None = None  # (longest q, longest kv sequence) when the offsets were read
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is not None:
                _check_cu(cu, name, q.device, where)
        cu_q = cu_seqlens_q
        cu_kv = cu_seqlens_kv if cu_seqlens_kv is not None else cu_q
        if cu_kv.shape != cu_q.shape:  # type: ignore[union-attr]
            raise ValueError(f"{where}: cu_seqlens_q and cu_seqlens_kv must have the same length (B + 1), got "
                             f"{cu_q.numel()} and {cu_kv.numel()}")  # type: ignore[union-attr]
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"{where}: with cu_seqlens, q, k, v must be packed (T, H, D), got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        # The values: one host read of the offsets per call in eager mode, also when max_seqlen_* are
        # given (wrong offsets silently drop or zero rows); not while torch.compile traces. Nested
        # tensors' offsets are valid by construction: read only when their longest sequence is unknown.
        if nested and max_seqlen_q is not None and max_seqlen_kv is not None:
            longest = (int(max_seqlen_q), int(max_seqlen_kv))
        elif _values_readable(cu_q) and _values_readable(cu_kv):  # type: ignore[arg-type]
            longest = _check_offsets(cu_q, None if cu_kv is cu_q else cu_kv,  # type: ignore[arg-type]
                                     q.shape[0], k.shape[0], where)
            for name, m, n, of in (("max_seqlen_q", max_seqlen_q, longest[0], "cu_seqlens_q"),
                                   ("max_seqlen_kv", max_seqlen_kv, longest[1], "cu_seqlens_kv")):
                if m is not None and m < n:
                    raise ValueError(f"{where}: {name} = {m} is less than the longest sequence in {of} ({n}); "
                                     f"the kernels would skip the rows past it. Pass {name} >= {n}, or None")
        if block_mask is not None:
            raise ValueError(f"{where}: block_mask is not available with packed sequences; use mask_mod "
                             f"(positions are inside each sequence), or pack into one batch with document_mask")
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        if k.shape[2] != d or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"{where}: k must be (Tkv, Hkv, {d}) and v (Tkv, Hkv, Dv), got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        eff_layout = "thd"
        nseq = cu_q.numel() - 1  # type: ignore[union-attr]

        def mod_dims(longest: tuple[int, int] | None) -> tuple[Any, str]:
            # The ranges of the mods' (b, h, q_idx, kv_idx): sequence index and positions inside it.
            return (None if longest is None else (nseq, hq, *longest)), "(sequences, H, longest Sq, longest Skv)"
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{where}: q, k, v must be 4-D in layout {layout!r}, got shapes {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)} (packed (T, H, D) inputs need cu_seqlens_q)")
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
        if k4.shape[0] != q4.shape[0] or k4.shape[3] != q4.shape[3] or v4.shape[:3] != k4.shape[:3]:
            raise ValueError(
                f"{where}: shapes do not match in layout {layout!r} (as (B, H, S, D): q {tuple(q4.shape)}, "
                f"k {tuple(k4.shape)}, v {tuple(v4.shape)}): k needs q's batch and head dim, v k's (B, H, S)")
        hq, hkv, d = q4.shape[1], k4.shape[1], q4.shape[3]
        eff_layout = layout
        dense_dims = (q4.shape[0], hq, q4.shape[2], k4.shape[2])

        def mod_dims(longest: tuple[int, int] | None) -> tuple[Any, str]:
            return dense_dims, "(B, H, Sq, Skv)"
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{where}: the query heads ({hq}) must be a multiple of the key/value heads ({hkv})")
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: causal must be a bool, got {causal!r}")
    left, right = _ref.normalize_window(window, causal, where=where)
    if scale is None:
        sm_scale = d**-0.5 if d > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where}: scale must be a number or None, got {scale!r}")
    elif not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a finite number > 0 (the softmax temperature), got {scale!r}")
    else:
        sm_scale = float(scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{where}: return_lse must be True or False, got {return_lse!r}")
    score_mod = _as_mod(score_mod, ScoreMod, "score_mod", where, _SCORE_ARITY)
    mask_mod = _as_mod(mask_mod, MaskMod, "mask_mod", where, _MASK_ARITY)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"{where}: block_mask must be a BlockMask (fp8ops.create_block_mask), got "
                            f"{type(block_mask).__name__}")
        sq, skv = q4.shape[2], k4.shape[2]
        b_, h_, bsq, bskv = block_mask.shape
        if (bsq, bskv) != (sq, skv):
            raise ValueError(f"{where}: block_mask was built for (Sq, Skv) = {(bsq, bskv)}, got {(sq, skv)}")
        if b_ not in (1, q4.shape[0]) or h_ not in (1, hq):
            raise ValueError(f"{where}: block_mask covers (B, H) = {(b_, h_)}; expected 1 or {(q4.shape[0], hq)}")
        if block_mask.device != q.device:
            raise ValueError(f"{where}: block_mask is on {block_mask.device}, q on {q.device}; use "
                             f"block_mask.to(q.device) once, or create_block_mask(..., device=q.device)")
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{where}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    _check_seed(dropout_seed, where)
    seed = _seed_tensor(dropout_seed, q.device, where) if dropout_p > 0.0 else None
    if not isinstance(deterministic, bool):
        raise TypeError(f"{where}: deterministic must be True or False, got {deterministic!r}")
    for name, t in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        for buf in getattr(t, "buffers", ()):
            if buf.device != q.device:
                raise ValueError(f"{where}: a tensor captured by {name} is on {buf.device}, q on {q.device}")

    # Step 3: run: SDPA or the fused kernels on CUDA, the reference math elsewhere.
    if backend not in ("auto", "triton", "sdpa"):
        raise ValueError(f"{where}: backend must be 'auto', 'triton' or 'sdpa', got {backend!r}")
    why_not_sdpa = _sdpa_unsupported(
        q, v, nested=nested, varlen=varlen, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
        left=left, right=right, return_lse=return_lse, deterministic=deterministic, dropout_p=dropout_p,
        dropout_seed=dropout_seed)
    if backend == "sdpa" and why_not_sdpa is not None:
        raise ValueError(f"{where}: backend='sdpa' cannot run this call ({why_not_sdpa}); use backend='triton'")
    if backend != "triton" and why_not_sdpa is None:
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
        out4 = _sdpa(q4, k4, v4, causal=right == 0, scale=sm_scale, dropout_p=dropout_p, gqa=hq != hkv)
        return _ref.from_bhsd(out4, layout), None
    if _use_kernels(q):
        if max(d, v.shape[-1]) > 256:
            raise ValueError(f"{where}: head dims up to 256 are supported on CUDA, got {d} and {v.shape[-1]}")
        if score_mod is not None and not isinstance(score_mod, ScoreMod):
            score_mod = ScoreMod(score_mod)
        if mask_mod is not None and not isinstance(mask_mod, MaskMod):
            mask_mod = MaskMod(mask_mod)
        if varlen:
            if max_seqlen_q is None:
                max_seqlen_q = longest[0] if longest is not None else _max_len(cu_q)
            if max_seqlen_kv is None:
                max_seqlen_kv = longest[1] if longest is not None else _max_len(cu_kv)
        dims, dims_name = mod_dims(longest)
        if dims is not None and not torch.compiler.is_compiling():
            _check_mod_statically(score_mod, "score_mod", where, dims_name, dims)
            _check_mod_statically(mask_mod, "mask_mod", where, dims_name, dims)
        out, lse = _attention_triton(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, scale=sm_scale,
            left=left, right=right, layout=eff_layout, cu_q=cu_q if varlen else None,
            cu_kv=cu_kv if varlen else None, max_q=max_seqlen_q if varlen else None,
            max_kv=max_seqlen_kv if varlen else None, dropout_p=dropout_p, seed=seed,
            dq_mode=_dq_mode(deterministic, masked=left is not None or right is not None
                             or mask_mod is not None or block_mask is not None),
        )
    else:
        out, lse = _reference_path(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                   scale=sm_scale, left=left, right=right, layout=eff_layout,
                                   cu_q=cu_q if varlen else None, cu_kv=cu_kv if varlen else None,
                                   dropout_p=dropout_p, seed=seed, dims=mod_dims(longest))

    # Step 4: repackage.
    if nested:
        out = torch.nested.nested_tensor_from_jagged(out, offsets)
        lse = torch.nested.nested_tensor_from_jagged(lse, offsets)
        if njt_transposed:
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return ((out, lse) if return_lse else out), None


def _sdpa_unsupported(q: Tensor, v: Tensor, *, nested: bool, varlen: bool, score_mod: Any, mask_mod: Any,
                      block_mask: Any, left: int | None, right: int | None, return_lse: bool,
                      deterministic: bool, dropout_p: float, dropout_seed: Any) -> str | None:
    """Why PyTorch's SDPA cannot run this call with fp8ops's semantics (None: it can)."""
    reasons = [
        (not q.is_cuda, "not on CUDA"),
        (q.dtype not in (torch.bfloat16, torch.float16), "dtype is not bf16/fp16"),
        (nested or varlen, "packed sequences"),
        (score_mod is not None or mask_mod is not None or block_mask is not None, "a score/mask mod or block mask"),
        (left is not None or right not in (None, 0), "a window"),
        (return_lse, "return_lse"),
        (deterministic, "deterministic=True"),
        (dropout_p > 0.0 and dropout_seed is not None, "an explicit dropout_seed"),
        (q.shape[-1] != v.shape[-1] or q.shape[-1] > 256 or q.shape[-1] % 8 != 0, "the head dims"),
    ]
    return next((why for bad, why in reasons if bad), None)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, dropout_p: float, gqa: bool) -> Tensor:
    """PyTorch's fused attention on (B, H, S, D) views, cuDNN's kernel first, flash second."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call() -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa)

    if torch.compiler.is_compiling():  # the compiled graph keeps SDPA's own backend choice
        return call()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        return call()


def _dq_mode(deterministic: bool, *, masked: bool) -> str:
    """The dQ scheme of the backward: "atomic" (dQ accumulated by the dK/dV kernel with float32
    atomics, faster when masks skip blocks) unless the attention is unmasked or must be
    deterministic, else "separate" (a dQ kernel of its own)."""
    return "atomic" if masked and not deterministic else "separate"


def _reference_path(q: Tensor, k: Tensor, v: Tensor, *, score_mod: Any, mask_mod: Any, block_mask: Any,
                    scale: float, left: int | None, right: int | None, layout: str, cu_q: Tensor | None,
                    cu_kv: Tensor | None, dropout_p: float, seed: Tensor | None,
                    dims: tuple[Any, str] = (None, "")) -> tuple[Tensor, Tensor]:
    """The FP32 reference math, differentiable with autograd (the CPU path). ``dims``: the ranges of
    the mods' (b, h, q_idx, kv_idx) and their name, for the messages of the mod checks."""
    mod_dims, dims_name = dims
    if layout == "thd":
        assert cu_q is not None and cu_kv is not None
        seg_q, pos_q = _ref.segments(cu_q, q.shape[0])
        seg_kv, pos_kv = _ref.segments(cu_kv, k.shape[0])
        n = cu_q.numel() - 1
        seg_kv = torch.where(seg_kv >= n, seg_kv + 1, seg_kv)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        shape = (1, q.shape[1], q.shape[0], k.shape[0])
        shown = "(1, H, Tq, Tkv) (packed sequences)"
        score_mod = _checked_mod(score_mod, "score_mod", "attention", shape, shown, dims_name, mod_dims)
        mask_mod = _checked_mod(mask_mod, "mask_mod", "attention", shape, shown, dims_name, mod_dims)
        out, lse = _ref.attention_math(
            q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, scale=scale, left=left, right=right,
            seg_q=seg_q, seg_kv=seg_kv, pos_q=pos_q, pos_kv=pos_kv, num_seqs=n,
            dropout_p=dropout_p, dropout_seed=seed)
        return out.squeeze(0).transpose(0, 1).contiguous(), lse.squeeze(0).transpose(0, 1).contiguous()
    q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    shape = (q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])
    score_mod = _checked_mod(score_mod, "score_mod", "attention", shape, "(B, H, Sq, Skv)", dims_name, mod_dims)
    mask_mod = _checked_mod(mask_mod, "mask_mod", "attention", shape, "(B, H, Sq, Skv)", dims_name, mod_dims)
    out, lse = _ref.attention_math(q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                   scale=scale, left=left, right=right, dropout_p=dropout_p, dropout_seed=seed)
    return _ref.from_bhsd(out, layout).contiguous(), _ref.lse_from_bhs(lse, layout).contiguous()
