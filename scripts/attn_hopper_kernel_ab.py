"""The Hopper attention kernels against an earlier copy of themselves on one GPU: same inputs, the
outputs compared (forward: bitwise; backward: dK and dV bitwise, dQ within the order of its float32
sums), timed in alternating rounds (minimum of ten CUDA-event timings per round, two rounds). B = 8,
H = 4096 / d, S = 8192 (or SEQ), bf16; the document mask is the benchmark's (``fp8ops.bench.attention``).

    python scripts/attn_hopper_kernel_ab.py fwd OLD/_attention_hopper.py [causal128 document128 ...]
    python scripts/attn_hopper_kernel_ab.py bwd OLD/_attention_hopper_bwd.py [--set NAME=VALUE ...] [causal128 ...]

``main(..., new_path=FILE)`` times a kernel file in place of the current kernel (``scripts/attn_bwd_bound_check.py``).
``--set NAME=VALUE``: a module-level setting of the current kernel's module (an int; e.g.
``--set CAST_IN_KERNEL=0``) for the new arm; the output file then carries the settings in its name.

OLD: the earlier file (e.g. ``git show REV:kernels/_attention_hopper.py > old/_attention_hopper.py``),
loaded as a sibling module of ``fp8ops.kernels`` and swapped in for the current launcher. Writes
``$OUT/hopper_<pass>_ab.json`` (or ./).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_hopper_bwd_time import event_times_ms  # noqa: E402  (the sibling script's timing)

from fp8ops.bench.attention import _documents  # noqa: E402

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
K = importlib.import_module("fp8ops.kernels.attention")
CASES = ["causal128", "alibi128", "window128", "document128", "none128", "causal64", "causal256"]
# also: "causalmask128", causal_mask() as a mask_mod without a block mask; "causalblock128", with its block mask;
# "causaldrop128", causal with dropout 0.1 (a fixed seed: both arms draw the same mask)


def _inputs(case: str, grad: bool) -> tuple[list[torch.Tensor], dict]:
    variant = case.rstrip("0123456789")
    d = int(case[len(variant):])
    S = int(os.environ.get("SEQ", 8192))
    H, B = (4096 // d if d <= 128 else 32), 65536 // S
    torch.manual_seed(0)
    qkv = [torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)]
    left, right = R.normalize_window((1024, 0) if variant == "window" else None,
                                     variant in ("causal", "alibi", "causaldrop"))
    kw = dict(score_mod=A.alibi(H) if variant == "alibi" else None, mask_mod=None, block_mask=None, left=left,
              right=right, scale=d**-0.5, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
              dropout_p=0.0, seed=None)
    if grad:
        kw.update(dq_mode="auto", bwd_config={"HOPPER": 2})
    if variant == "causaldrop":
        kw.update(dropout_p=0.1, seed=torch.tensor(1234, dtype=torch.int64, device="cuda"))
    if variant in ("causalmask", "causalblock"):
        kw.update(mask_mod=A.causal_mask())
    if variant == "causalblock":
        kw.update(block_mask=A.create_block_mask(A.causal_mask(), None, None, S, S, device="cuda"))
    if variant == "document":
        mm = A.and_masks(A.causal_mask(), A.document_mask(_documents(S, seed=S).cuda()))
        kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, S, S, device="cuda"))
    return qkv, kw


def _launcher_from(path: str, name: str, tag: str):
    """The launcher ``name`` of a kernel file loaded as a sibling module of ``fp8ops.kernels`` (called
    without the keywords it does not take)."""
    spec = importlib.util.spec_from_file_location(f"fp8ops.kernels._{name}_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    known = inspect.signature(fn).parameters

    def arm(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in known})

    return arm


def main(which: str, old_path: str, cases: list[str], new_path: str | None = None) -> dict:
    """Time the launcher of the current kernel (or of the file ``new_path``) against the file
    ``old_path``'s, case by case; {case: its row}."""
    name = "hopper_fwd" if which == "fwd" else "hopper_bwd"
    original = getattr(K, name)
    new_arm = original if new_path is None else _launcher_from(new_path, name, "new")
    arms = {"new": new_arm, "old": _launcher_from(old_path, name, "earlier")}
    res = {}
    for case in cases:
        (q, k, v), kw = _inputs(case, which == "bwd")
        if which == "bwd":
            out, _ = A._attention_triton(q, k, v, **kw)
            do = torch.randn_like(out)

            def run():
                return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        else:
            def run():
                with torch.no_grad():
                    return A._attention_triton(q, k, v, **kw)
        got, row = {}, {"new": [], "old": []}
        for _ in range(2):
            for arm, fn in arms.items():
                setattr(K, name, fn)
                got[arm] = [t.clone() for t in run()]
                row[arm].append(min(event_times_ms(run, 10)))
        setattr(K, name, original)
        n, o = got["new"], got["old"]
        if which == "fwd":
            row.update(bitwise_equal=all(torch.equal(a, b) for a, b in zip(n, o)))
        else:
            row.update(dk_dv_bitwise_equal=torch.equal(n[1], o[1]) and torch.equal(n[2], o[2]),
                       dq_max_abs_diff=(n[0].float() - o[0].float()).abs().max().item(),
                       dq_max_abs=o[0].float().abs().max().item())
        res[case] = row
        print(case, json.dumps(row), flush=True)
    return res


def _apply_sets(which: str, args: list[str]) -> tuple[list[str], str]:
    """Take the ``--set NAME=VALUE`` pairs out of ``args`` and set them on the current kernel's
    module; (the remaining args, a file-name tag of the settings)."""
    mod = sys.modules[getattr(K, "hopper_fwd" if which == "fwd" else "hopper_bwd").__module__]
    rest, tags = [], []
    it = iter(args)
    for a in it:
        if a != "--set":
            rest.append(a)
            continue
        spec = next(it, "")
        name, _, value = spec.partition("=")
        if not hasattr(mod, name) or not value.lstrip("-").isdigit():
            raise SystemExit(f"attn_hopper_kernel_ab.py: --set wants NAME=INT with NAME a setting of "
                             f"{mod.__name__}, got {spec!r}")
        setattr(mod, name, int(value))
        tags.append(f"{name}{value}")
    return rest, "".join(f"_{t}" for t in tags)


if __name__ == "__main__":
    which, old_path, *args = sys.argv[1:]
    picked, tag = _apply_sets(which, args)
    result = main(which, old_path, picked or CASES)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__}
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"hopper_{which}_ab{tag}.json"), "w") as f:
        json.dump({"environment": meta, "cases": result}, f, indent=1)
