"""Training losses of a GPT whose tied output head runs in FP8, next to the same GPT with a bf16
head and next to bf16 throughout.

The model is the GPT of ``fp8ops.testing.composition`` (``transformer_layer`` layers, final norm,
head tied to the token embedding; ``make_model(fp8_head=True)`` puts the head through
``fp8ops.fp8_linear``). The data is real text with a large vocabulary: the bytes of the Python
standard library's ``.py`` files (``fp8ops.demo.load_corpus``, every tenth file held out) read in
pairs, one token per pair of bytes (vocabulary 65536), so the head's softmax spans as many entries
as a GPT-2 vocabulary. Runs, each from the same initial parameters on the same batches: ``bf16``
(no FP8), ``FP8 layers, bf16 head`` and ``FP8 layers, FP8 head`` (delayed scaling); float32 master
weights, bf16 compute, AdamW (fused, betas 0.9 / 0.95, weight decay 0.1 on matrices) with linear
warm-up and cosine decay, the loss compiled with ``fullgraph=True``. Reported per run: the training
loss curve, the mean training loss of the last tenth of the steps, and the held-out loss every
``--eval-every`` steps; then each FP8 run's relative difference from ``bf16``.

    python scripts/gpt_fp8_head.py [--steps 600] [--hidden 512] [--layers 6] [--json OUT]

Needs a CUDA GPU (`--device cpu` runs it in float32 on the CPU, as a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.demo import _lr_at, load_corpus
from fp8ops.testing import composition as C

VOCAB = 65536


def pairs(data: torch.Tensor) -> torch.Tensor:
    """One int64 token per pair of bytes of a uint8 stream."""
    d = data[: data.numel() // 2 * 2].long().view(-1, 2)
    return d[:, 0] * 256 + d[:, 1]


def windows(stream: torch.Tensor, starts: torch.Tensor, seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = stream[starts[:, None] + torch.arange(seq + 1)].to(device)
    return w[:, :-1], w[:, 1:]


HEAD_RECIPES = {
    "delayed": fp8ops.DelayedScaling(),
    "delayed-e4m3": fp8ops.DelayedScaling(fp8_format=fp8ops.Format.E4M3),
    "current": fp8ops.CurrentScaling(),
    "current-e4m3": fp8ops.CurrentScaling(fp8_format=fp8ops.Format.E4M3),
}
"""The head's recipes ``--head-recipes`` can name (HYBRID: E4M3 forward, E5M2 gradients)."""


def run(label: str, recipe_name: str, fp8_head: bool, args: argparse.Namespace, train: torch.Tensor,
        val: torch.Tensor, head: str | None = None) -> dict:
    recipe = C.make_recipe(recipe_name)
    head_recipe = None if head is None else HEAD_RECIPES[head]
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model, params = C.make_model(dev, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                                 batch=args.batch, vocab=VOCAB, steps=1, seed=args.seed, fp8_head=fp8_head)
    g0 = torch.Generator().manual_seed(args.seed)  # GPT-2's embedding scale (the test model's is larger)
    params["tok"] = (torch.randn(params["tok"].shape, generator=g0) * 0.02).to(dev)
    leaves, spec = pytree.tree_flatten(params)
    master = [t.detach().clone().requires_grad_() for t in leaves]
    decay = [p for p in master if p.dim() >= 2]
    rest = [p for p in master if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=dev == "cuda")
    states = C.init_states(model, recipe, dev, head_recipe=head_recipe)

    def loss_fn(ps, st, pr, x, y):
        return C.gpt_loss(ps, st, pr, x, y, model=model, recipe=recipe, dtype=dtype, head_recipe=head_recipe)

    def held_out_loss() -> float:
        with torch.no_grad():
            ps = pytree.tree_unflatten(master, spec)
            losses = [float(loss_fn(ps, states, None, *windows(val, s, args.seq, dev))[0]) for s in val_starts]
        return sum(losses) / len(losses)

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    g = torch.Generator().manual_seed(args.seed + 1)  # the batches
    starts = torch.randint(0, train.numel() - args.seq - 1, (args.steps, args.batch), generator=g)
    val_starts = torch.linspace(0, val.numel() - args.seq - 2, 8 * args.batch).long().view(8, args.batch)
    curve, evals = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, args.steps, args.lr)
        x, y = windows(train, starts[step], args.seq, dev)
        opt.zero_grad(set_to_none=True)
        probes = None if states is None else fp8ops.make_probes(states)
        loss, new = compiled(pytree.tree_unflatten(master, spec), states, probes, x, y)
        loss.backward()
        opt.step()
        if states is not None:
            grads = pytree.tree_map(lambda p: p.grad, probes)
            if head_recipe is None:
                states = fp8ops.update(new, recipe=recipe, grad_amax=grads)
            else:  # the head's state with its own recipe
                states = (fp8ops.update(new[:-1], recipe=recipe, grad_amax=grads[:-1])
                          + fp8ops.update(new[-1:], recipe=head_recipe, grad_amax=grads[-1:]))
        curve.append(loss.detach())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            vl = held_out_loss()
            evals.append((step + 1, vl))
            print(f"{label:36s} step {step + 1:5d}  train {float(loss.detach()):.4f}  val {vl:.4f}", flush=True)
    curve_f = [float(v) for v in curve]
    tail = curve_f[-max(1, args.steps // 10):]
    return {"label": label, "recipe": recipe_name, "fp8_head": fp8_head, "head_recipe": head, "train_loss": curve_f,
            "train_tail_mean": sum(tail) / len(tail), "val": evals, "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="initial parameters and batch order")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--head-recipes", nargs="+", default=["delayed"], choices=sorted(HEAD_RECIPES),
                   help="the FP8 head's recipes to train with (default: delayed, as the layers)")
    p.add_argument("--no-bf16-head", action="store_true", help="skip the run with FP8 layers and a bf16 head")
    p.add_argument("--device", default="cuda", help="cuda (bf16 compute) or cpu (float32, a smoke run)")
    p.add_argument("--json", default=None, help="write the curves and the summary here")
    args = p.parse_args()
    corpus = load_corpus()
    train, val = pairs(corpus.train), pairs(corpus.val)
    print(f"corpus: {train.numel()} training tokens, {val.numel()} held out (byte pairs, vocabulary {VOCAB})")
    runs = [run("bf16", "none", False, args, train, val)]
    if not args.no_bf16_head:
        runs.append(run("FP8 layers, bf16 head", "delayed", False, args, train, val))
    for h in args.head_recipes:
        runs.append(run(f"FP8 layers, FP8 head ({h})", "delayed", True, args, train, val, head=h))
    base = runs[0]
    print()
    print(f"{'run':36s} {'train (last 10 %)':>18s} {'val (last)':>11s} {'train vs bf16':>14s} {'val vs bf16':>12s}")
    for r in runs:
        dt = r["train_tail_mean"] / base["train_tail_mean"] - 1
        dv = r["val"][-1][1] / base["val"][-1][1] - 1
        r["train_vs_bf16"], r["val_vs_bf16"] = dt, dv
        print(f"{r['label']:36s} {r['train_tail_mean']:18.4f} {r['val'][-1][1]:11.4f} {dt:+14.2%} {dv:+12.2%}")
    if args.json:
        with open(args.json, "w") as f:
            gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            json.dump({"args": vars(args), "gpu": gpu, "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
