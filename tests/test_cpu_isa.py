"""ATEN_CPU_CAPABILITY=avx2 runs the CPU path as on an AVX2-only CPU: the flags the engine's choices read
lose the instruction sets above AVX2, "auto" picks fp32, and the C++ kernels are built without AVX512
(the `avx2_only` fixture: conftest.py)."""
import pytest
import torch

from nanovllm.utils import cpp_compiler, device

# A kernel that writes whether its build had AVX512F and AVX2 enabled
ISA_PROBE = """
#include <cstdint>
extern "C" void kernel(int64_t* out) {
#ifdef __AVX512F__
    out[0] = 1;
#else
    out[0] = 0;
#endif
#ifdef __AVX2__
    out[1] = 1;
#else
    out[1] = 0;
#endif
}
"""


def test_flags_above_avx2_dropped(avx2_only):
    flags = device.cpu_flags()
    assert not any(f.startswith(device.ABOVE_AVX2_FLAG_PREFIXES) for f in flags)
    assert not device.cpu_has_fast_bf16()
    assert device.cpu_kind() == "avx2"
    assert device.resolve_dtype("auto", torch.device("cpu"), "bfloat16") == torch.float32


def test_native_flags_kept(monkeypatch):
    monkeypatch.delenv(device.CPU_CAPABILITY_ENV, raising=False)
    device.cpu_flags.cache_clear()
    try:
        native = device.cpu_flags()
        monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "avx2")
        device.cpu_flags.cache_clear()
        limited = device.cpu_flags()
    finally:
        device.cpu_flags.cache_clear()
    assert limited <= native
    assert {f for f in native if not f.startswith(device.ABOVE_AVX2_FLAG_PREFIXES)} == limited


def test_other_spellings_ignored_as_torch_ignores_them(monkeypatch):
    """torch reads only the exact "avx2" (it warns and keeps its own ISA on "AVX2"): so does the engine."""
    monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "AVX2")
    assert not device.cpu_limited_to_avx2()
    monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "avx2")
    assert device.cpu_limited_to_avx2()


@pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler")
@pytest.mark.skipif("avx2" not in device.cpu_flags(), reason="the CPU has no AVX2")
def test_kernels_built_without_avx512(avx2_only):
    probe = cpp_compiler.build(ISA_PROBE, ["int64_t*"])
    assert probe is not None
    out = torch.full((2,), -1, dtype=torch.int64)
    probe(out)
    assert out.tolist() == [0, 1]
