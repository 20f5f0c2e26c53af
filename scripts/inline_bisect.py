"""How far a compiled ``fp8ops.nn`` model's free-running training drifts from eager's, with the
library ops' Triton kernels inside the compiled graphs or not, op group by op group.

Trains the model of ``tests/test_nn_compile.py`` (every module kind; 4 SGD steps of 2 micro-batches,
Inductor on the GPU in bf16) eagerly and compiled, each run on its own from the same start (the test
itself compares step by step from shared parameters), with ``kernels._library.INLINE_IN_GRAPHS``
set to each ``--inline`` choice (one process per case, side by side), and prints per case the
difference of the losses (over their mean magnitude), the parameters' update errors (difference
over the eager update plus the parameter's rounding step) and the relative differences of the
scales against the eager run. ``--loss linear`` is the loss that test had before (a fixed random
cotangent, under which the training diverges), ``squared`` a squared error to random targets.

    python scripts/inline_bisect.py [--inline all none casts rest] [--recipes delayed current]
        [--fullgraph both] [--loss squared] [--jobs 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys

CASTS = frozenset({"amax", "cast", "cast_transpose", "cast_transpose_dbias"})
REST = frozenset({"norm_fwd", "norm_amax", "norm_bwd", "act_fwd", "act_amax", "act_bwd", "act_bwd_amax"})
CHOICES = {"all": True, "none": False, "casts": CASTS, "rest": REST}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(mod, recipe, backend, fullgraph, loss_kind):
    """The free-running training of the test's model as that test ran it before it compared step by
    step: 4 SGD steps of 2 micro-batches, the compiled model on its own from the first step on.
    ``loss_kind`` "linear": ``(y * g).sum()`` for a random cotangent g at step size 0.05 (the
    parameters and losses grow 1000-fold in 4 steps); "squared": ``((y - t)**2).sum() / 2`` for a
    random target t at step size 0.01 (bounded)."""
    import torch

    import fp8ops.nn

    model = mod._model(recipe, "cuda", torch.bfloat16)
    if fullgraph:
        fp8ops.nn.prepare_probes(model, forwards=2)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    init = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05 if loss_kind == "linear" else 0.01)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(4):
        for _ in range(2):
            x = torch.randn(mod.S, mod.B, mod.H, device="cuda", generator=g).to(torch.bfloat16)
            t = torch.randn(mod.S, mod.B, mod.H, device="cuda", generator=g).to(torch.bfloat16).float()
            y = run(x).float()
            loss = (y * t).sum() if loss_kind == "linear" else (y - t).square().sum() / 2
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        fp8ops.nn.update_scaling(model)
    params = model.state_dict()
    updates = {k: (params[k].float() - init[k], params[k].detach()) for k in params}
    return torch.stack(losses), updates, mod._states(model)


def _update_error(c_update, update, param) -> float:
    """The norm of the difference of two updates over the norm of the eager update plus the norm of
    the parameter's rounding step (``eps * |p|`` per element: a bf16 parameter near 1 moves by 0 or
    2**-7 in a small step)."""
    import torch

    step = torch.finfo(param.dtype).eps * param.float().abs()
    return float((c_update - update).norm() / (update.norm() + step.norm()).clamp_min(1e-12))


def _child(inline: str, recipe: str, fullgraph: bool, loss_kind: str) -> dict:
    import torch

    from kernels import _library

    _library.INLINE_IN_GRAPHS = CHOICES[inline]
    spec = importlib.util.spec_from_file_location("nn_compile", os.path.join(REPO, "tests", "test_nn_compile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.RECIPES[recipe]
    torch._dynamo.reset()
    losses, updates, states = _train(mod, r, None, False, loss_kind)
    torch._dynamo.reset()
    c_losses, c_updates, c_states = _train(mod, r, "inductor", fullgraph, loss_kind)
    rel = ((c_losses - losses).abs() / losses.abs().mean()).tolist()
    upd = {k: _update_error(c_updates[k][0], *updates[k]) for k in updates}
    plain = {k: float((c_updates[k][0] - updates[k][0]).norm() / updates[k][0].norm().clamp_min(1e-12))
             for k in updates}
    scl = {k: float(((c_states[k].float() - states[k].float()).abs() / states[k].float().abs().clamp_min(1e-12)).max())
           for k in states if k.endswith(".scale")}
    worst = sorted(upd.items(), key=lambda kv: -kv[1])[:4]
    worst_plain = sorted(plain.items(), key=lambda kv: -kv[1])[:4]
    worst_scales = sorted(scl.items(), key=lambda kv: -kv[1])[:6]
    return {"inline": inline, "recipe": recipe, "fullgraph": fullgraph, "loss": loss_kind,
            "eager_losses": [round(float(v), 2) for v in losses],
            "loss_diff_over_mean_abs_loss": [round(v, 4) for v in rel],
            "worst_update_errors": {k: round(v, 4) for k, v in worst},
            "worst_plain_relative_update_diffs": {k: round(v, 4) for k, v in worst_plain},
            "worst_scales_rel": {k: round(v, 4) for k, v in worst_scales},
            "scales": {k: [round(float(states[k]), 4), round(float(c_states[k]), 4)] for k, _ in worst_scales}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inline", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    p.add_argument("--recipes", nargs="+", default=["delayed", "current"], choices=["none", "delayed", "current"])
    p.add_argument("--fullgraph", default="both", choices=["both", "yes", "no"])
    p.add_argument("--loss", default="squared", choices=["linear", "squared"])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.child[2] == "1", a.child[3])))
        return
    fgs = {"both": [False, True], "yes": [True], "no": [False]}[a.fullgraph]
    cases = list(itertools.product(a.inline, a.recipes, fgs))
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=REPO)
    results = []
    for i in range(0, len(cases), a.jobs):
        procs = [(c, subprocess.Popen([sys.executable, __file__, "--child", c[0], c[1], "1" if c[2] else "0", a.loss],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
                 for c in cases[i:i + a.jobs]]
        for c, proc in procs:
            out, err = proc.communicate()
            if proc.returncode == 0:
                r = json.loads(out.strip().splitlines()[-1])
            else:
                r = {"inline": c[0], "recipe": c[1], "fullgraph": c[2], "error": err.strip().splitlines()[-3:]}
            print(json.dumps(r), flush=True)
            results.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
