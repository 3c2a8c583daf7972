"""Triton kernel tests without a GPU: the same test file, re-run under Triton's interpreter.

`TRITON_INTERPRET=1` must be in the environment before triton is first imported, so a
kernel test file cannot switch it on for itself. Without a GPU, the file's one
`RUN_HERE`-skipped test calls `rerun_under_interpreter(__file__)`, which runs the file
again in a child `python -m pytest` with the interpreter on from the start; there
`RUN_HERE` is true and the kernel tests run. With a GPU they run natively. In a whole
session, the first such test (named `test_*_under_triton_interpreter`, registered by
conftest) runs every selected kernel file in one child, and each file's test reports its
own file's outcome.

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
import tempfile
import types
from xml.etree import ElementTree

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = HAS_TRITON and (torch.cuda.is_available() or INTERPRETED)
# for a kernel test: skipped where it runs in the interpreter child instead
needs_kernels = pytest.mark.skipif(not RUN_HERE, reason="runs natively on GPU or in the interpreter child")


class OnGpu(torch.Tensor):
    """A CPU tensor that says `is_cuda` (`t.as_subclass(OnGpu)`): for the host-side choices a kernel
    module makes from a tensor's metadata (which tile, which form), tested without a GPU."""

    @property
    def is_cuda(self):
        return True
SHOWN_STDOUT_CHARS, SHOWN_STDERR_CHARS = 8000, 2000  # of a failed child's report
DEFAULT_CHILD_TIMEOUT_S = 600  # for a registered file that sets no CHILD_TIMEOUT_S of its own
_batch: dict[str, float] = {}           # path -> child timeout, registered by conftest
_reports: dict[str, str | None] = {}    # path -> None where its child tests passed, else the report


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


def register_batch(timeouts: dict[str, float]) -> None:
    """The kernel test files (path -> child timeout) whose interpreter tests this session runs
    (conftest's collection hook): the first of them runs them all in one child."""
    _batch.update({os.path.abspath(path): timeout for path, timeout in timeouts.items()})


def rerun_under_interpreter(path: str, timeout_s: float) -> None:
    """Run the test file `path` in a child pytest with TRITON_INTERPRET=1; assert it passed.
    With other registered files still to run, the one child runs those too (a child's start-up,
    torch and transformers imported and the test modules collected, costs seconds)."""
    path = os.path.abspath(path)
    if path not in _reports:
        batch = {p: t for p, t in _batch.items() if p not in _reports} if path in _batch else {}
        _reports.update(_run_child({**batch, path: timeout_s}))
    assert _reports[path] is None, _reports[path]


def _run_child(timeouts: dict[str, float]) -> dict[str, str | None]:
    """One child pytest under the interpreter over the files of `timeouts` -> path -> report."""
    paths = list(timeouts)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *paths]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=sum(timeouts.values()))
        except subprocess.TimeoutExpired as e:
            return dict.fromkeys(paths, f"the interpreter child ({len(paths)} files) ran past {e.timeout} s")
        outcomes = _outcomes(xml, paths) if os.path.exists(xml) else {}
    shown = proc.stdout[-SHOWN_STDOUT_CHARS:] + proc.stderr[-SHOWN_STDERR_CHARS:]
    reports = {}
    for path in paths:
        passed, failures = outcomes.get(path, (0, []))
        if proc.returncode in (0, 1) and passed and not failures:
            reports[path] = None   # exit status 1: a failure in another of the files
        else:
            reports[path] = (f"{os.path.basename(path)} under the interpreter: {passed} passed, exit status "
                             f"{proc.returncode}\n" + "\n".join(failures)[-SHOWN_STDOUT_CHARS:] + "\n" + shown)
    return reports


def _outcomes(xml: str, paths: list[str]) -> dict[str, tuple[int, list[str]]]:
    """path -> (tests passed, failure and error texts) from a child's JUnit XML report."""
    stems = {os.path.splitext(os.path.basename(p))[0]: p for p in paths}
    outcomes = {p: (0, []) for p in paths}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        names = f"{case.get('classname', '')}.{case.get('name', '')}".split(".")
        path = next((stems[n] for n in names if n in stems), None)
        bad = [f"{case.get('name')}: {e.get('message', '')}\n{e.text or ''}" for e in case
               if e.tag in ("failure", "error")]
        if path is None:
            if bad:   # not one of the files (a collection error outside them?): every file fails
                outcomes = {p: (n, f + bad) for p, (n, f) in outcomes.items()}
            continue
        passed, failures = outcomes[path]
        skipped = any(e.tag == "skipped" for e in case)
        outcomes[path] = (passed + (not bad and not skipped), failures + bad)
    return outcomes


def reversed_grid_idx(set_grid_idx):
    """The interpreter's `InterpreterBuilder.set_grid_idx` with a grid's programs numbered last to
    first: the interpreter runs them one after another in grid order, so they then run in reverse."""
    def set_reversed(builder, x, y, z):
        nx, ny, nz = builder.grid_dim
        set_grid_idx(builder, nx - 1 - x, ny - 1 - y, nz - 1 - z)
    return set_reversed


def run_programs_in_reverse(monkeypatch) -> None:
    """Under the interpreter, run each launch's programs in reverse grid order: a kernel whose
    program reads what another program of the same launch writes, and counts on it being written
    first, then reads it unwritten. (Natively programs run side by side in no set order, which such
    a kernel races.) For a whole run: `-p reverse_program_order`."""
    from triton.runtime import interpreter
    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx",
                        reversed_grid_idx(interpreter.InterpreterBuilder.set_grid_idx))
