"""benchmarks/emulated_isa.py, the CPU benchmarks' `--isa avx2`: a bad value and a half-emulated
environment are refused, the environment it sets holds our engine to the AVX2 kind, and the
sitecustomize it gives vLLM's process makes torch report no AVX512 (so vLLM loads its AVX2 kernels)."""
import os
import subprocess
import sys

import pytest

from benchmarks import emulated_isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bad_isa_refused():
    with pytest.raises(ValueError, match="--isa"):
        emulated_isa.check("avx512")


def test_native_refused_where_torch_is_held_to_avx2(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY"):
        emulated_isa.check("native")
    emulated_isa.check("avx2")


def test_env_set_and_label(monkeypatch):
    for key in emulated_isa.AVX2_ENV:
        monkeypatch.delenv(key, raising=False)
    assert emulated_isa.env_set("native") and not emulated_isa.env_set("avx2")
    for key, value in emulated_isa.AVX2_ENV.items():
        monkeypatch.setenv(key, value)
    assert emulated_isa.env_set("avx2")
    emulated_isa.run_with_isa_env("avx2", "/nonexistent.py", [])  # set already: no re-run
    assert emulated_isa.label("avx2", "avx2 avx512f") == "avx2 (emulated on avx2 avx512f)"
    assert emulated_isa.llamacpp_venv("avx2") != emulated_isa.llamacpp_venv("native")


def _child(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}, cwd=ROOT).stdout.strip()


def test_the_environment_makes_our_kind_avx2():
    code = "from nanovllm.utils.device import cpu_kind; print(cpu_kind())"
    assert _child(code, {**emulated_isa.AVX2_ENV, "PYTHONPATH": ROOT}) == "avx2"


def test_vllm_sitecustomize_hides_avx512():
    code = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"
    assert _child(code, emulated_isa.vllm_env("avx2")) == "False False"
