"""Programmatic dependent launch (PDL): a GPU kernel starting before the one ahead of it ends.

Inside a CUDA graph each kernel still starts only when the kernel before it has finished, and a
short one then spends much of its life ramping up: its first loads leave only once it runs. A
one-sequence decode step is a chain of ~7 such kernels a layer, 2-5 us each (RESULTS.md
"Thirteenth session"). On Hopper and later, a kernel launched with PDL may start as soon as
every program of the kernel before it has called `launch_dependents` (or ended); it then runs
up to its `wait_for_prior_grid`, which returns once that kernel has finished and its writes
are visible. What comes before the wait overlaps the kernel ahead: the skinny products
(triton_skinny_gemm.py) load their weights there, which no kernel writes once the engine has
started (a weight written by a kernel must be followed by a synchronization or a kernel launched
without PDL before a product reads it early; a decode step starts with torch's embedding lookup).

The rule for a kernel launched with PDL: every program reaches `wait_for_prior_grid`, before any
`return` (even a program with nothing to do), and before it reads anything an earlier kernel wrote
or writes anything (an earlier kernel may still be reading it). Since each such kernel finishes
only after its wait, waiting for the kernel just ahead also waits for every kernel before that
one. Kernels launched without PDL (torch's and cuBLAS's, the decode round's input advance) keep
the usual order, and the wait returns at once after them.

The kernels that take part have a `PDL` constexpr and are launched with `**launch_options(device)`;
it is the same for every launch on a device, so it adds no compiled variants. (`launch_pdl` is
part of Triton's compile key: `ENABLED` must be set before an engine starts, or kernels compile
again.)
"""
import functools

import torch
import triton
import triton.language as tl

ENABLED = True             # module switch, for benchmarks' A/B (set before an engine starts)
MIN_CAPABILITY = (9, 0)    # griddepcontrol: sm_90 (Hopper) and later


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an NVIDIA GPU of MIN_CAPABILITY or later, not
    under Triton's interpreter (which runs no PTX)."""
    if not ENABLED or device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    """An NVIDIA GPU of MIN_CAPABILITY or later (ROCm reports its own architecture numbers here)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for launching a PDL-aware kernel on `device`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """Block until the kernel ahead has finished and its writes are visible (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel start once every program of this one has called this (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
