"""Compile the Hopper attention forward and backward for sm_90 without a GPU; print each variant's PTX, resource
usage and shared memory as one JSON line (used by tests/test_attention_hopper.py, in a process of
its own: the interpreter must be off). Exit code 3: this Triton cannot compile Gluon offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

from fp8ops.kernels import _attention_hopper as H
from fp8ops.kernels import _attention_hopper_bwd as HB
from fp8ops.kernels import attention as K


@triton.jit
def _alibi_like(score, b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return score + tl.load(t0 + h) * (kv_idx - q_idx).to(tl.float32)


@triton.jit
def _document_like(b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return (tl.load(t0 + q_idx) == tl.load(t0 + kv_idx)) & (q_idx >= kv_idx)


def _document_runs():
    # the library's document mask with causal (its twin reads one bound of a run per tile row)
    import torch

    from fp8ops.attention import and_masks, causal_mask, document_mask

    return and_masks(causal_mask(), document_mask(torch.zeros(8192, dtype=torch.int64))).spec.fwd_jit()


@triton.jit
def _causal_like(b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return q_idx >= kv_idx


_RUNS_TYPES = {"mt0": "*i64", "mt1": "*i32", "mt2": "*i32"}  # the ids, the runs' starts and ends

VARIANTS = {
    "d64_causal": dict(D=64),
    "d128_none": dict(D=128, band=False),
    "d256_causal": dict(D=256),
    "d128_alibi": dict(D=128, score=_alibi_like),
    "d128_document_block_mask": dict(D=128, band=False, mask=_document_like, sparse=True),
    "d128_alibi_relative": dict(D=128, score=_alibi_like, rel=True),
    "bwd_d64_causal": dict(D=64, backward=True),
    "bwd_d128_causal": dict(D=128, backward=True),
    "bwd_d128_causal_no_cast": dict(D=128, backward=True, cast=False),
    "bwd_d128_alibi": dict(D=128, score=_alibi_like, backward=True),
    "bwd_d128_alibi_no_grad": dict(D=128, score=_alibi_like, score_mode=2, backward=True),
    "bwd_d128_alibi_relative": dict(D=128, score=_alibi_like, score_mode=3, backward=True),
    "bwd_d128_document_block_mask": dict(D=128, band=False, mask=_document_like, sparse=True, backward=True),
    "d128_document_runs": dict(D=128, band=False, mask="runs", sparse=True, types=_RUNS_TYPES),
    "bwd_d128_document_runs": dict(D=128, band=False, mask="runs", sparse=True, backward=True, types=_RUNS_TYPES),
    "bwd_d128_document_runs_no_cast": dict(D=128, band=False, mask="runs", sparse=True, backward=True,
                                           types=_RUNS_TYPES, cast=False),
    "bwd_d128_causal_mask_mod_band": dict(D=128, band=2, mask=_causal_like, backward=True),
    "bwd_d128_causal_block_mask": dict(D=128, mask=_causal_like, sparse=True, backward=True),
    "d128_none_dropout": dict(D=128, band=False, dropout=True),
    "d128_causal": dict(D=128),
    "d128_causal_dropout": dict(D=128, dropout=True),
    "bwd_d128_causal_dropout": dict(D=128, backward=True, dropout=True),
    "d64_causal_dropout": dict(D=64, dropout=True),
    "bwd_d128_none_dropout": dict(D=128, band=False, backward=True, dropout=True),
    "bwd_d64_causal_dropout": dict(D=64, backward=True, dropout=True),
}


def _aligned(kern, sig: dict) -> dict:
    """Pointers and strides taken as multiples of 16, as the launcher's tensors give them (the JIT
    specialises on it, and row loads and stores vectorise on it)."""
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
            if sig[n].startswith("*") or n.startswith("stride_")}


def compile_backward(D, *, band=True, score=None, mask=None, sparse=False, score_mode=1, types=None, dropout=False,
                     cast=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows):
        return f"tensordesc<bf16[{rows},{D}],{gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)!r}>"

    consts = dict(SCORE_FN=score or K._identity_score_mod, GRAD_FN=K._identity_score_grad,
                  MASK_FN=mask or K._all_visible, SCORE_MODE=0 if score is None else score_mode,
                  HAS_MASK_MOD=mask is not None,
                  BAND=band, BLOCK_SPARSE=sparse, SPARSE_Q=128, SPARSE_KV=128, BLOCK_M=HB.BWD_BLOCK_M,
                  BLOCK_N=HB.BWD_BLOCK_N, HEAD_D=D, STAGES=HB.BWD_STAGES, CONSUMER_REGS=240, NEW_WS=H._NEW_WS,
                  DROPOUT=dropout, CAST=cast, CAST_ROWS=HB.CAST_ROWS)
    kern = HB._hopper_bwd_kernel
    sig, fixed = {}, {}
    for i, n in enumerate(kern.arg_names):
        if types and n in types:
            sig[n] = types[n]
        elif n in ("q_desc", "do_desc"):
            sig[n] = desc(HB.BWD_BLOCK_M)
        elif n in ("k_desc", "v_desc"):
            sig[n] = desc(HB.BWD_BLOCK_N // 2)
        elif n == "dq_desc" or (n == "cast_desc" and not cast):
            sig[n] = f"tensordesc<fp32[{HB.BWD_BLOCK_M},{D // 2}],{HB._dq_layout(D)!r}>"
        elif n == "cast_desc":
            sig[n] = f"tensordesc<fp32[{HB.CAST_ROWS},{D}],{HB._cast_layout()!r}>"
        elif n == "cnt_ptr":
            sig[n] = "*i32" if cast else "*fp32"
        elif n == "dq_ptr":
            sig[n] = "*bf16"
        elif n in ("sm_scale", "drop_scale"):
            sig[n] = "fp32"
        elif n == "seed_ptr":
            sig[n] = "*i64"
        elif n in consts:
            sig[n], fixed[(i,)] = "constexpr", consts[n]
        elif n in ("dk_ptr", "dv_ptr"):
            sig[n] = "*bf16"
        elif n in ("qn_ptr", "qi_ptr", "fqn_ptr", "fqi_ptr"):
            sig[n] = "*i32"
        elif n.endswith("_ptr") or (n[:2] in ("st", "mt") and n[2:].isdigit()) or (n[0] == "g" and n[1:].isdigit()):
            sig[n] = "*fp32"
        else:
            sig[n] = "i32"
    return triton.compile(GluonASTSource(kern, sig, fixed, _aligned(kern, sig)), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": 168})


def compile_variant(D, *, band=True, score=None, mask=None, sparse=False, rel=False, types=None, dropout=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = H.hopper_config(D)

    def desc(rows):
        return f"tensordesc<bf16[{rows},{D}],{gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)!r}>"

    consts = dict(SCORE_FN=score or K._identity_score_mod, MASK_FN=mask or K._all_visible,
                  HAS_SCORE_MOD=score is not None, SCORE_REL=rel, HAS_MASK_MOD=mask is not None, BAND=band,
                  REVERSE=band,
                  BLOCK_SPARSE=sparse, SPARSE_Q=128, SPARSE_KV=128, BLOCK_M=H.BLOCK_M, BLOCK_N=cfg.block_n,
                  HEAD_D=D, STAGES=cfg.stages, Q_BUFS=cfg.q_bufs, CONSUMER_REGS=240, NEW_WS=H._NEW_WS,
                  DROPOUT=dropout)
    kern = H._hopper_fwd_kernel
    sig, fixed = {}, {}
    for i, n in enumerate(kern.arg_names):
        if types and n in types:
            sig[n] = types[n]
        elif n in ("q_desc", "o_desc"):
            sig[n] = desc(H.BLOCK_M // 2)
        elif n in ("k_desc", "v_desc"):
            sig[n] = desc(cfg.block_n)
        elif n in ("sm_scale", "drop_scale"):
            sig[n] = "fp32"
        elif n == "seed_ptr":
            sig[n] = "*i64"
        elif n in consts:
            sig[n], fixed[(i,)] = "constexpr", consts[n]
        elif n.endswith("_ptr") or (n[:2] in ("st", "mt") and n[2:].isdigit()):
            sig[n] = "*i32" if n[:2] in ("kv", "fk", "sc") else "*fp32"
        else:
            sig[n] = "i32"
    return triton.compile(GluonASTSource(kern, sig, fixed, _aligned(kern, sig)), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": 168})


def _cuobjdump(kernel, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resources(kernel) -> str:
    return _cuobjdump(kernel, "-res-usage")


def loops(kernel) -> list[dict]:
    """The kernel's loops in its SASS (each backward branch and the code it jumps back over, longer
    than 30 instructions): their first and last addresses, instructions, warpgroup products (HGMMA)
    and local-memory loads and stores (LDL / STL: spilled registers), shortest first."""
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", _cuobjdump(kernel, "-sass"))]
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) > 30:
                out.append({"start": int(m.group(1), 16), "end": addr, "instructions": len(body),
                            "hgmma": sum("HGMMA" in t for t in body), "ldl": sum("LDL" in t for t in body),
                            "stl": sum("STL" in t for t in body)})
    return sorted(out, key=lambda x: x["instructions"])


def main(names: list[str]) -> int:
    # --resources: one line per variant, its registers and spill stack; --loops: one line per loop
    brief = names[0] if names and names[0] in ("--resources", "--loops") else None
    if brief:
        names = names[1:]
    if not H.AVAILABLE:
        print("this Triton has no Gluon warp specialisation")
        return 3
    facts = {}
    for name in names:
        try:
            opts = dict(VARIANTS[name])
            if opts.get("mask") == "runs":
                opts["mask"] = _document_runs()
            kernel = compile_backward(**opts) if opts.pop("backward", False) else compile_variant(**opts)
        except TypeError as e:  # a GluonASTSource that takes no explicit target
            print(f"offline Gluon compilation unavailable: {e}")
            return 3
        facts[name] = {"ptx": kernel.asm["ptx"], "resources": resources(kernel), "shared": kernel.metadata.shared,
                       "loops": loops(kernel)}
        if brief == "--resources":
            print(name, " ".join(w for w in facts[name]["resources"].split() if w.startswith(("REG", "STACK"))),
                  flush=True)
        elif brief:
            for loop in facts[name]["loops"]:
                print(name, " ".join(f"{k} {v}" for k, v in loop.items()), flush=True)
    if not brief:
        print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
