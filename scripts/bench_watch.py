"""Run one ``python -m fp8ops.bench`` suite with a watchdog that writes every thread's Python stack.

A suite that stops making progress (a compile that never returns, a wait on the GPU) leaves no
traceback when a time limit kills it. This runs the suite in-process with a thread that, every
``--every`` seconds, appends the stacks of all other threads to ``--stacks`` with a time stamp
(``sys._current_frames``), so the last dump of a stalled run shows where it waits. The thread
needs the GIL: a run stuck in C code that holds it leaves the dumps stopped at that time, which
says as much. (``faulthandler.dump_traceback_later`` needs no GIL but crashed the interpreter
when it fired during an import.) Inductor's compile workers are other processes; set
``TORCHINDUCTOR_COMPILE_THREADS=1`` to keep compilation in this one.

Usage::

    python scripts/bench_watch.py --stacks OUT/stacks.txt --every 45 -- gpt --hidden 512 --no-eager \\
        --impls "fp8ops FP8, fused loss"
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stacks", required=True, help="file the stack dumps are appended to")
    p.add_argument("--every", type=float, default=60.0, help="seconds between dumps (default 60)")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the arguments of python -m fp8ops.bench")
    args = p.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    out = open(args.stacks, "a", buffering=1)  # noqa: SIM115  (open for the process's life)
    t0 = time.monotonic()

    done = threading.Event()

    def dump(me: int) -> str:
        # the frames are referenced only inside this call: a frame held past its function's return
        # keeps its locals alive (a loss, its autograd graph), and an AccumulateGrad node kept so
        # from one step, made on the default stream, makes a CUDA-graph capture of a later backward
        # wait on that stream, which ends the capture (seen with a watcher that kept its last frame
        # until the next dump)
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"\n=== t = {time.monotonic() - t0:.0f} s\n"]
        frames, frame = sys._current_frames(), None
        try:
            for ident, frame in frames.items():
                if ident != me:
                    parts.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)))
        finally:
            del frame, frames
        return "".join(parts)

    def watch() -> None:
        me = threading.get_ident()
        while not done.wait(args.every):
            out.write(dump(me))

    threading.Thread(target=watch, daemon=True).start()
    from fp8ops.bench.__main__ import main as bench_main

    try:
        return bench_main(bench)
    finally:
        done.set()


if __name__ == "__main__":
    sys.exit(main())
