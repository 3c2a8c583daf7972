"""Triton kernel tests without a GPU: the same test file, re-run under Triton's interpreter.

`TRITON_INTERPRET=1` must be in the environment before triton is first imported, so a
kernel test file cannot switch it on for itself. Without a GPU, the file's one
`RUN_HERE`-skipped test calls `rerun_under_interpreter(__file__)`, which runs the file
again in a child `python -m pytest` with the interpreter on from the start; there
`RUN_HERE` is true and the kernel tests run. With a GPU they run natively.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = HAS_TRITON and (torch.cuda.is_available() or INTERPRETED)
# for a kernel test: skipped where it runs in the interpreter child instead
needs_kernels = pytest.mark.skipif(not RUN_HERE, reason="runs natively on GPU or in the interpreter child")
SHOWN_STDOUT_CHARS, SHOWN_STDERR_CHARS = 8000, 2000  # of a failed child's report


def rerun_under_interpreter(path: str, timeout_s: float) -> None:
    """Run the test file `path` in a child pytest with TRITON_INTERPRET=1; assert it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-SHOWN_STDOUT_CHARS:] + proc.stderr[-SHOWN_STDERR_CHARS:]
