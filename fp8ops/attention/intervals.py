"""Interval arithmetic over a lowered mod, for the index ranges of its ``modmath.load`` reads.

:func:`_mod_facts` evaluates the SSA code of a registered mod (:mod:`.codegen`) with ``b, h,
q_idx, kv_idx`` ranging over a call's sizes, and returns the kind of its result and the range of
every load index; :func:`~.checks._check_mod_statically` turns them into errors before the
kernels run (a read outside a captured tensor there would not raise).
"""

from __future__ import annotations

import ast
import functools
import math
from typing import NamedTuple

import torch

from .codegen import _Lowered
from .mods import _SPECS


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
        if spec.facts_key is not None:  # an explicit twin that reads its buffers as this spec does
            return _mod_facts(spec.facts_key, dims, buf_kinds)
        return "?", ()  # other explicit Triton twins: nothing to read
    low = spec.lowered
    idx = [_Iv("int", 0.0, float(n - 1)) for n in dims]
    names = list(low.params)
    params = dict(zip(names[-4:], idx))
    if len(names) == 5:
        params[names[0]] = _Iv("float", -_IV_INF, _IV_INF)
    ev = _IntervalEval(low, params, buf_kinds)
    kind = ev.run()
    return kind.kind, tuple((slot, iv.lo, iv.hi) for slot, iv in ev.loads)
