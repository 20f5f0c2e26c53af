"""A switch of fp8ops off and on, on the seed layer's full training steps of ``python -m fp8ops.bench
layer`` (fp8ops delayed scaling, eager, dropout 0.1: fresh probes, forward, backward,
``fp8ops.update``), timed back to back: ``--switch fuse_dbias`` (:data:`fp8ops._operands.FUSE_DBIAS`,
the bias gradients from the quantizing pass over dy instead of ``dy.sum(0)``), ``hopper_dropout``
(:data:`fp8ops.attention.op.HOPPER_DROPOUT`: the attention with dropout on the Hopper kernels
instead of cuDNN) or ``qkv_gradient`` (:data:`fp8ops.attention.op.QKV_GRADIENT`: one gradient of
the QKV projection written by the attention backward instead of three concatenated).

The two settings alternate over ``--rounds`` rounds (the order flips every round), each timing
``--steps`` steps after two untimed ones; prints µs per step of every round, the medians and
their ratio, and the kernels of one step of each setting whose time differs.

    python scripts/layer_ab_check.py [--switch fuse_dbias|hopper_dropout|qkv_gradient] [--rounds 6]
                                     [--steps 20] [--graph] [--json OUT]

``--graph``: each setting's step captured once as a CUDA graph (``fp8ops.graph_step``, the switch
set during its warm-up and capture), and each round times its replays both back to back and as
steps each started on an idle GPU (a synchronize and 20 ms idle before each, as ``bench layer``'s
first column); the profiled steps are eager as without it.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

import fp8ops
from fp8ops import _operands
from fp8ops.attention import op as attention_op
from fp8ops.bench.layer import SEED, _fp8ops_case
from fp8ops.reference.transformer_layer import BasicTransformerLayer
from fp8ops.transformer_layer import TransformerConfig

SWITCHES = {"fuse_dbias": (_operands, "FUSE_DBIAS"),
            "hopper_dropout": (attention_op, "HOPPER_DROPOUT"),
            "qkv_gradient": (attention_op, "QKV_GRADIENT")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="fuse_dbias")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--graph", action="store_true", help="time graph replays (see the module docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mod, name = SWITCHES[args.switch]
    H, F_, h, S, B = (SEED[k] for k in ("hidden", "ffn", "heads", "seq", "batch"))
    config = TransformerConfig(hidden_size=H, ffn_hidden_size=F_, num_attention_heads=h,
                               hidden_dropout=args.dropout, attention_dropout=args.dropout)
    torch.manual_seed(0)
    seed_state = {k: v.clone() for k, v in BasicTransformerLayer(H, F_, h).state_dict().items()}
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16) * 1e-2
    step, _, _ = _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x, dy)
    default = getattr(mod, name)
    times: dict[bool, list[float]] = {False: [], True: []}
    idle: dict[bool, list[float]] = {False: [], True: []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    runs = {False: step, True: step}
    if args.graph:  # one graph per setting, captured with the switch set
        for on in (False, True):
            setattr(mod, name, on)
            gfn, carry0 = step.carry_step
            graphed = fp8ops.graph_step(gfn, args_by_reference=(1,))
            carry = [carry0]

            def run(xx, dd, graphed=graphed, carry=carry):
                carry[0], _ = graphed(carry[0], xx, dd)

            for _ in range(3):
                run(x, dy)
            assert graphed.stats["replays"], graphed.stats
            runs[on] = run
    try:
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                setattr(mod, name, on)
                fn = runs[on]
                for _ in range(2):
                    fn(x, dy)
                torch.cuda.synchronize()
                ev[0].record()
                for _ in range(args.steps):
                    fn(x, dy)
                ev[1].record()
                torch.cuda.synchronize()
                times[on].append(ev[0].elapsed_time(ev[1]) * 1e3 / args.steps)
                line = f"round {r} {name}={on}: {times[on][-1]:.1f} µs/step"
                if args.graph:
                    one = []
                    for _ in range(args.steps):
                        torch.cuda.synchronize()
                        time.sleep(0.02)
                        ev[0].record()
                        fn(x, dy)
                        ev[1].record()
                        ev[1].synchronize()
                        one.append(ev[0].elapsed_time(ev[1]) * 1e3)
                    idle[on].append(statistics.median(one))
                    line += f" back to back, {idle[on][-1]:.1f} from idle"
                print(line, flush=True)
        kernels = {}
        for on in (False, True):
            setattr(mod, name, on)
            step(x, dy)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(x, dy)
                torch.cuda.synchronize()
            rows: dict[str, float] = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    rows[e.name[:70]] += e.device_time
            kernels[on] = rows
    finally:
        setattr(mod, name, default)
    med = {on: statistics.median(v) for on, v in times.items()}
    print(f"median µs/step: off {med[False]:.1f}, on {med[True]:.1f}, on/off {med[True] / med[False]:.4f}")
    med_idle = {on: statistics.median(v) for on, v in idle.items() if v}
    if med_idle:
        print(f"from idle: off {med_idle[False]:.1f}, on {med_idle[True]:.1f}, "
              f"on/off {med_idle[True] / med_idle[False]:.4f}")
    diff = sorted(set(kernels[False]) | set(kernels[True]),
                  key=lambda k: -abs(kernels[True].get(k, 0.0) - kernels[False].get(k, 0.0)))
    for k in diff[:10]:
        print(f"  {kernels[False].get(k, 0.0):9.1f} {kernels[True].get(k, 0.0):9.1f} µs  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "switch": name, "steps": args.steps, "us": {
                "off": times[False], "on": times[True]}, "median": {"off": med[False], "on": med[True]},
                "graph": args.graph, "idle_us": {"off": idle[False], "on": idle[True]},
                "idle_median": {str(k): v for k, v in med_idle.items()},
                "kernels": {"off": kernels[False], "on": kernels[True]}}, f, indent=1)


if __name__ == "__main__":
    main()
