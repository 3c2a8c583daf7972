"""The CPU benchmarks' `--isa avx2`: every engine run as on an AVX2-only CPU, on a newer one.

Developers' machines may have AVX2 only (no AVX512, no AVX512-BF16: the engine then runs fp32,
utils/device.resolve_dtype). On an AVX512 machine each engine is held to AVX2 by its own switch:

- nano-vLLM and HF transformers (torch): ATEN_CPU_CAPABILITY=avx2 (torch's kernels; our engine
  also drops the flags above AVX2 and builds its C++ kernels for x86-64-v3: utils/device.py) and
  ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's products). Both are read at start-up, so a benchmark given
  `--isa avx2` runs itself again with them set (`run_with_isa_env`).
- vLLM's CPU backend: the same variables, and benchmarks/avx2_vllm/sitecustomize.py on its
  PYTHONPATH, which makes torch report no AVX512, so vLLM loads its AVX2 kernels (vllm/_C_AVX2).
- llama.cpp: a build of its own with AVX512 off (bench_cpu.py's "llamacpp-avx2" venv).

What it cannot change: the core, its clocks, caches and memory are this machine's, so the figures
are a proxy for an AVX2-only CPU, not one.
"""
import os
import sys

ISAS = ("native", "avx2")
# The environment that holds torch (and our kernels) and oneDNN to AVX2
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
VLLM_SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "avx2_vllm")


def check(isa: str) -> None:
    """ValueError for an unknown --isa, or for --isa native in an environment that holds torch to AVX2
    (the anchors would run natively beside an engine held to AVX2)."""
    if isa not in ISAS:
        raise ValueError(f"--isa must be one of {', '.join(ISAS)}, got {isa!r}")
    if isa == "native" and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        raise ValueError("ATEN_CPU_CAPABILITY=avx2 is set: pass --isa avx2 (every engine held to AVX2) or unset it")


def env_set(isa: str) -> bool:
    """Whether this process runs with `isa`'s environment (always, for native)."""
    return isa == "native" or all(os.environ.get(k) == v for k, v in AVX2_ENV.items())


def run_with_isa_env(isa: str, script: str, argv: list[str]) -> None:
    """Replace this process by `script argv` with `isa`'s environment, unless it has it already."""
    if not env_set(isa):
        os.execve(sys.executable, [sys.executable, script, *argv], {**os.environ, **AVX2_ENV})


def label(isa: str, real_flags: str) -> str:
    """The results' `isa`: "native", or "avx2 (emulated on <the CPU's real flags>)"."""
    return isa if isa == "native" else f"{isa} (emulated on {real_flags})"


def vllm_env(isa: str) -> dict[str, str]:
    """The environment of vLLM's process beyond isa's: the sitecustomize that hides AVX512 from it."""
    return {"PYTHONPATH": VLLM_SITECUSTOMIZE_DIR if isa == "avx2" else ""}


def llamacpp_venv(isa: str) -> str:
    """The anchor venv of the llama.cpp build for `isa` (bench_cpu.ANCHOR_VENVS)."""
    return "llamacpp" if isa == "native" else "llamacpp-avx2"
