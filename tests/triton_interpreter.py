"""Triton kernel tests without a GPU: the same test file, re-run under Triton's interpreter.

`TRITON_INTERPRET=1` must be in the environment before triton is first imported, so a
kernel test file cannot switch it on for itself. Without a GPU, the file's one
`RUN_HERE`-skipped test calls `rerun_under_interpreter(__file__)`, which runs the file
again in a child `python -m pytest` with the interpreter on from the start; there
`RUN_HERE` is true and the kernel tests run. With a GPU they run natively.

In the interpreter child, `patch_language_once` takes out the interpreter's main cost:
Triton 3.9 re-patches `triton.language` (an `inspect.getmembers` over each module) at
every call of a `@triton.jit` helper from a kernel (`tl.rand`, `tl.cdiv`, the kernels'
own helpers), about half of a sampling kernel's interpreted time. The helpers then run
under the patch their kernel's launch put in place, which is the same patch.
"""
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = HAS_TRITON and (torch.cuda.is_available() or INTERPRETED)
# for a kernel test: skipped where it runs in the interpreter child instead
needs_kernels = pytest.mark.skipif(not RUN_HERE, reason="runs natively on GPU or in the interpreter child")
SHOWN_STDOUT_CHARS, SHOWN_STDERR_CHARS = 8000, 2000  # of a failed child's report


def patch_language_once() -> None:
    """Make the interpreter patch each language module once per launch, not once per
    helper call; a no-op where Triton's interpreter is not shaped as in 3.9."""
    from triton.runtime import interpreter
    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or not hasattr(scope_type, "restore") or getattr(patch_lang, "once", False):
        return
    in_effect = set()  # ids of the language modules the running launch has patched
    langs_of = {}      # function -> ids of the language modules its globals hold

    def once(fn):
        if fn not in langs_of:
            langs_of[fn] = {id(v) for v in fn.__globals__.values() if isinstance(v, types.ModuleType)} & {
                id(triton.language), id(triton.language.core)}
        langs = langs_of[fn]
        if in_effect and langs <= in_effect:
            return scope_type()  # a helper inside a launch: its patch is already in place
        scope = patch_lang(fn)
        in_effect.update(langs)
        return scope

    def restore(scope):  # only a launch's own scope is ever restored
        in_effect.clear()
        original_restore(scope)
    original_restore = scope_type.restore
    once.once = True
    interpreter._patch_lang, scope_type.restore = once, restore


if HAS_TRITON and INTERPRETED:
    import triton
    patch_language_once()


def rerun_under_interpreter(path: str, timeout_s: float) -> None:
    """Run the test file `path` in a child pytest with TRITON_INTERPRET=1; assert it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-SHOWN_STDOUT_CHARS:] + proc.stderr[-SHOWN_STDERR_CHARS:]
