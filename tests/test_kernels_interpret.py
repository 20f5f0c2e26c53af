"""The Triton kernels under the interpreter, from the plain test command: the tests marked
``interpret`` need ``TRITON_INTERPRET=1`` before Triton is imported, so this test runs them in a
child process with it set (``python -m pytest -q`` alone would skip them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs them")
def test_the_interpret_tests_pass_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpret", "tests", "property_tests"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join(r.stdout.splitlines()[-40:])
    assert r.returncode == 0, f"{' '.join(cmd)} failed (exit {r.returncode}):\n{tail}\n{r.stderr[-2000:]}"
    assert " passed" in tail and " failed" not in tail, tail
