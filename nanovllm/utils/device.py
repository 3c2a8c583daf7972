"""Resolve `Config.device` and `Config.dtype` ("auto") into a torch device and dtype, and read
the CPU's instruction sets that the CPU path's choices are keyed by."""
import functools
import os

import torch

DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU flags that make bf16 matrix products fast (AMX tiles, or AVX512 bf16 dot products).
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# torch's own switch for the vector instructions its CPU kernels use ("default", "avx2", "avx512").
# Set to "avx2" on a newer CPU, the engine also chooses and builds its kernels as on an AVX2-only CPU:
# the flags of the instruction sets above AVX2 are dropped (with ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's
# products, that runs the AVX2 kind's choices and kernels on an AVX512 machine; not limited: MKL's own
# products, unless MKL_ENABLE_INSTRUCTIONS=AVX2, and torch.compile's C++, built with -march=native).
CPU_CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
# /proc/cpuinfo flags of those instruction sets (prefixes: avx512f, avx512_bf16, amx_tile, avx_vnni, ...)
ABOVE_AVX2_FLAG_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    return torch.device(device)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags from /proc/cpuinfo (empty where it cannot be read), without those above
    AVX2 where ATEN_CPU_CAPABILITY is "avx2"."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()
    if cpu_limited_to_avx2():
        return frozenset(f for f in flags if not f.startswith(ABOVE_AVX2_FLAG_PREFIXES))
    return flags


def cpu_limited_to_avx2() -> bool:
    """Whether ATEN_CPU_CAPABILITY asks for AVX2 at most (read as torch and Inductor read it: the exact,
    lower-case value; another spelling such as "AVX2" is ignored by them, so here too)."""
    return os.environ.get(CPU_CAPABILITY_ENV) == "avx2"


def cpu_has_fast_bf16() -> bool:
    return any(flag in cpu_flags() for flag in FAST_BF16_CPU_FLAGS)


def cpu_kind() -> str:
    """The CPU kind the measured per-kind choices are keyed by (kernel crossovers such as
    MAX_INT4_ROWS): "avx512_bf16" where bf16 products are fast (AVX512-BF16 or AMX), else "avx2"."""
    return "avx512_bf16" if cpu_has_fast_bf16() else "avx2"


def resolve_dtype(dtype: str, device: torch.device, model_dtype: str | None) -> torch.dtype:
    """"auto": the model's dtype on GPU (fp32 checkpoints run in bf16); on CPU bf16 where
    the CPU multiplies bf16 fast, else fp32."""
    if dtype != "auto":
        return DTYPE_NAMES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    chosen = DTYPE_NAMES.get(str(model_dtype).removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if chosen == torch.float32 else chosen
