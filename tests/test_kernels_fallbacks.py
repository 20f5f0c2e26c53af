"""Inductor lowers every library op through the fallback ``kernels._library.inductor_fallbacks``
made beforehand, never through the implicit fallback it makes on first meeting an op (whose log
line torch 2.11 formats from the call's arguments eagerly, exponential in the graph's depth)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import fp8ops
from fp8ops.kernels import _library

# A fresh process (the fallbacks are process-wide): the GPT of the composition tests with its head
# and loss in linear_cross_entropy, whose op is first met at the end of the forward, compiled on
# CPU with FP8 states (every library op an opaque call there) and stepped once; with Inductor's
# graph log at INFO, every implicit fallback's message is formatted, and the script records those
# made for an fp8ops op. Inductor's caches are off: a graph found there is not lowered again.
_SCRIPT = textwrap.dedent("""
    import io, logging
    import torch
    import torch._inductor.exc as exc
    import torch.utils._pytree as pytree
    import fp8ops
    from fp8ops.testing import composition

    implicit = []
    for cls in (exc.MissingOperatorWithDecomp, exc.MissingOperatorWithoutDecomp):
        original = cls.operator_str

        def record(target, args, kwargs, _original=original):
            implicit.append(str(target))
            return _original(target, args, kwargs)

        cls.operator_str = staticmethod(record)
    log = logging.getLogger("torch._inductor.graph")
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(io.StringIO()))  # a handler that formats the message

    recipe = fp8ops.DelayedScaling()
    gpt, params = composition.make_model("cpu", layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=64, steps=1,
                                         fused_loss=True)
    params = pytree.tree_map(lambda t: t.detach().requires_grad_(), params)
    states = composition.init_states(gpt, recipe, "cpu")
    tok = torch.randint(0, 64, (2, 16))

    def loss_of(st, pr, tok, tgt):
        return composition.gpt_loss(params, st, pr, tok, tgt, model=gpt, recipe=recipe, dtype=torch.float32)

    loss, _ = torch.compile(loss_of, fullgraph=True)(states, fp8ops.make_probes(states), tok, tok)
    loss.backward()
    assert torch.isfinite(loss), loss
    print("IMPLICIT", sorted(set(t for t in implicit if t.startswith("fp8ops"))))
""")


def test_compiled_model_takes_no_implicit_fallback_of_a_library_op() -> None:
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("IMPLICIT")]
    assert line == ["IMPLICIT []"], run.stdout[-2000:]


def test_every_library_op_has_its_fallback_after_a_trace() -> None:
    from torch._inductor.lowering import lowerings

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    t = torch.randint(0, 16, (4,))
    loss = torch.compile(fp8ops.linear_cross_entropy, fullgraph=True)(x, w, t)
    loss.backward()
    assert _library._DEFINED, "no library op recorded"
    missing = [str(op) for op in _library._DEFINED if op not in lowerings]
    assert not missing, missing
    torch.testing.assert_close(loss, fp8ops.linear_cross_entropy(x, w, t))


def test_an_op_defined_after_the_first_trace_gets_its_fallback_at_once() -> None:
    from torch._inductor.lowering import lowerings

    _library.inductor_fallbacks()
    spec = _library.OpSpec("fallbacks_test_defined_late(Tensor x) -> Tensor", cuda=lambda x: x.clone(),
                           fake=lambda x: torch.empty_like(x))
    packet = _library.define(spec, cpu=lambda x: x + 1)
    assert packet.default in lowerings
    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(packet, fullgraph=True)(x), x + 1)
