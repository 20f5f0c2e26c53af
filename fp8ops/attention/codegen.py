"""From a Python mod to its Triton twin: the code generator of score and mask mods.

:func:`_capture` resolves what a mod closes over (numbers become kernel constants, tensors buffer
slots ``_fp8_t0..3``); :func:`_lower` parses its source and lowers the body to straight-line SSA
code over generated names (:class:`_Lowering`); :func:`_fwd_source` emits the Triton source of
the forward twin and :func:`_bwd_source`, for score mods, its forward-mode derivative
(:class:`_Tangents`) with the scatter of the captured tensors' gradients; :func:`_jit_source`
compiles generated source with ``triton.jit``. :mod:`.mods` keeps the results in its registry.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import math
import textwrap
import types
from typing import Any, NamedTuple

from torch import Tensor

from ..kernels import attention as _K
from .mod_math import _NS_BY_ID, _NS_FUNCS, modmath

_MAX_BUFFERS = _K.MAX_MOD_BUFFERS


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


_TRANSCENDENTAL = {f"_fp8_mm_{n}" for n in ("exp", "exp2", "log", "log2", "sqrt", "tanh", "sigmoid")}


def tile_math(low: _Lowered) -> bool:
    """Whether a score mod computes a transcendental function or a true division per score: a call
    of one (or a ``/``) whose operands depend on the score or a position (not only on b and h, which
    are one value per kernel program). Such mods make the softmax tile the bottleneck, where the
    Hopper forward measured slower than the portable one (soft-capping: 16.4 against 13.1 ms at
    d = 128, 32.1 against 20.7 at d = 64; docs/benchmarks/attention_hopper_h100.md)."""
    deps = _dependencies(low)
    tile = {low.params[0], low.params[3], low.params[4]}

    def depends(node: ast.AST) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and (n.id in tile or deps.get(n.id, set()) & tile):
                return True
        return False

    for node in [e for _, e in low.stmts] + [low.ret]:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _TRANSCENDENTAL:
                if any(depends(a) for a in n.args):
                    return True
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and (depends(n.left) or depends(n.right)):
                return True
    return False


def score_grad_identity(fn: Any, low: _Lowered, needs: tuple[bool, ...]) -> bool:
    """Whether a score mod's derivative in the score is the constant 1 and no captured tensor it
    loads needs a gradient: an additive bias such as ALiBi, whose backward is the plain one (the
    kernels then skip the derivative call and the mask it takes)."""
    if any(slot < len(needs) and needs[slot] for _, slot, _, _ in low.loads):
        return False
    tan = _Tangents(fn, low.params[0])
    for n, e in low.stmts:
        t = tan.d(e, "s")
        if t is not None:
            # a literal stays a literal, so "score + bias" through named steps is still recognised
            tan.names[(n, "s")] = t if t == "1.0" else f"_fp8_ds_{n}"
    return tan.d(low.ret, "s") == "1.0"


def relative_bias(low: _Lowered) -> bool:
    """Whether a score mod is ``score + slope * (kv_idx - q_idx) + c`` with ``slope`` and ``c``
    depending only on b and h (ALiBi and its variants), followed through named steps: the Hopper
    forward then adds ``slope * (kv - q)`` per key column and folds the rest into the row's LSE
    instead of calling the mod per score. Anything else that depends on a position (a comparison, a
    table indexed by it, a product of positions) makes the answer False."""
    score, b, h, q, kv = low.params
    deps = _dependencies(low)
    exprs = dict(low.stmts)
    uniform_params = {b, h}

    def uniform(node: ast.AST) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and (n.id in (score, q, kv) or not deps.get(n.id, set()) <= uniform_params):
                return False
        return True

    def add(x: dict, y: dict, sign: float) -> dict:
        out = {k: dict(v) for k, v in x.items()}
        for var, terms in y.items():
            acc = out.setdefault(var, {})
            for f, c in terms.items():
                acc[f] = acc.get(f, 0.0) + sign * c
        return out

    def lin(node: ast.expr) -> dict | None:
        # {variable: {uniform factors: number}}: the coefficients of score, kv and q (uniform terms dropped)
        if uniform(node):
            return {}
        if isinstance(node, ast.Name):
            if node.id in (score, kv, q):
                return {node.id: {(): 1.0}}
            return lin(exprs[node.id]) if node.id in exprs else None
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            x = lin(node.operand)
            return None if x is None else add({}, x, -1.0 if isinstance(node.op, ast.USub) else 1.0)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            x, y = lin(node.left), lin(node.right)
            if x is None or y is None:
                return None
            return add(x, y, 1.0 if isinstance(node.op, ast.Add) else -1.0)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and uniform(node.right):
            node = ast.BinOp(ast.BinOp(ast.Constant(1.0), ast.Div(), node.right), ast.Mult(), node.left)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for u, o in ((node.left, node.right), (node.right, node.left)):
                if uniform(u):
                    x = lin(o)
                    if x is None:
                        return None
                    if isinstance(u, ast.Constant) and isinstance(u.value, (int, float)):
                        return {v: {f: c * u.value for f, c in t.items()} for v, t in x.items()}
                    fac = ast.unparse(u)
                    return {v: {tuple(sorted((*f, fac))): c for f, c in t.items()} for v, t in x.items()}
        return None

    form = lin(low.ret)
    if form is None:
        return False
    nz = {v: {f: c for f, c in t.items() if c != 0.0} for v, t in form.items()}
    k_terms, q_terms = nz.get(kv, {}), nz.get(q, {})
    return (nz.get(score) == {(): 1.0} and bool(k_terms) and q_terms == {f: -c for f, c in k_terms.items()}
            and set(nz) <= {score, kv, q})


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
                    # the where broadcasts the index to the tile (layout included, for Gluon callers)
                    f"    tl.atomic_add(_fp8_g{slot} + tl.where(_fp8_valid, {iname}, 0), "
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
