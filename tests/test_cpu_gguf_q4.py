"""kernels/cpu_gguf_q4.py (the C++ GGUF Q4_0 / Q4_1 product for a few rows) against the fp32
product with the `gguf` package's dequantized weight. Skipped where no C++ compiler is found (the
last test checks that `pack` and `q4_linear` then return None)."""
import functools

import pytest
import torch

from nanovllm.kernels import cpu_gguf_q4
from nanovllm.utils import cpp_compiler

gguf = pytest.importorskip("gguf")
needs_compiler = pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler found")

TYPES = ["Q4_0", "Q4_1"]
# fp32 y against x @ dequant(W)^T (fp32), as a fraction of sum |x| |w| (the size of the terms summed):
# only the summation order and where the rounding falls differ (~1e-7 measured; a wrong nibble,
# row or scale is off by ~1e-2 or more)
FP32_TOL = 2e-6
# bf16 y: one rounding of the fp32 sum to bf16 (half a 2^-8 step of |y|) on top
BF16_REL = 2 ** -8


def _random_rows(n: int, k: int, type_name: str, gen: torch.Generator) -> torch.Tensor:
    """GGUF rows [n, bytes] uint8: random nibbles, scales d in (0, 0.02), Q4_1 mins in (-0.1, 0.1)."""
    blocks = n * k // 32
    raw = torch.randint(0, 256, (blocks, cpu_gguf_q4.GGUF_BLOCK_BYTES[type_name]), dtype=torch.uint8, generator=gen)
    f16 = [torch.rand(blocks, generator=gen) * 0.02]
    if type_name == "Q4_1":
        f16.append((torch.rand(blocks, generator=gen) - 0.5) * 0.2)
    raw[:, :2 * len(f16)] = torch.stack(f16, -1).to(torch.float16).view(torch.uint8)
    return raw.reshape(n, -1)


def _dequantized(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The gguf package's numpy dequantizer (the reference).  # [n, k] fp32"""
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name])).float()


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Asserts y is x @ w^T within the tolerance of y's dtype; returns the largest error relative
    to sum |x| |w|."""
    ref = x.float() @ w.T                       # [m, n]
    scale = x.float().abs() @ w.abs().T         # [m, n]: the terms' size
    err = (y.float() - ref).abs()
    if y.dtype == torch.float32:
        assert (err <= FP32_TOL * scale).all(), (err / scale).max()
    else:
        assert (err <= FP32_TOL * scale + BF16_REL * ref.abs()).all()
    return float((err / scale).max())


@needs_compiler
@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_the_dequantized_reference(type_name, dtype, isa):
    """M = 1, 3, 8 rows; 100 outputs (three full tiles of 32 and four rows of a padded one); 5 blocks."""
    if isa == "avx2" and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("no AVX2 on this CPU")
    gen = torch.Generator().manual_seed(len(type_name) + (dtype == torch.float32))
    raw = _random_rows(100, 160, type_name, gen)
    packed, w = cpu_gguf_q4.pack(raw, type_name), _dequantized(raw, type_name)
    for m in (1, 3, 8):
        x = torch.randn(m, 160, generator=gen).to(dtype)
        y = cpu_gguf_q4.q4_linear(x, packed, isa)
        assert y.shape == (m, 100) and y.dtype == dtype
        _check(y, x, w)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", TYPES)
def test_a_layer_shape_on_one_and_two_threads(type_name, threads):
    """SmolLM2's down projection shape (576 x 1536, 48 blocks a row), every row count 1..8 (one call
    of the C++), and more rows (calls of MAX_ROWS rows, the last one shorter)."""
    gen = torch.Generator().manual_seed(threads)
    raw = _random_rows(576, 1536, type_name, gen)
    packed, w = cpu_gguf_q4.pack(raw, type_name), _dequantized(raw, type_name)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in [*range(1, cpu_gguf_q4.MAX_ROWS + 1), cpu_gguf_q4.MAX_ROWS + 1, 2 * cpu_gguf_q4.MAX_ROWS + 3]:
            x = torch.randn(m, 1536, generator=gen)
            _check(cpu_gguf_q4.q4_linear(x, packed), x, w)
    finally:
        torch.set_num_threads(saved)


@needs_compiler
@pytest.mark.parametrize("type_name", TYPES)
def test_extreme_values(type_name):
    """Rows of all-0 and all-15 nibbles, the largest and a subnormal f16 scale, negative and
    positive mins: the f16 scales are read exactly and the 4-bit values at their ends."""
    gen = torch.Generator().manual_seed(7)
    raw = _random_rows(40, 64, type_name, gen).reshape(40, 2, -1)
    scales = 2 if type_name == "Q4_1" else 1
    f16 = raw[..., :2 * scales].contiguous().view(torch.float16)  # [40, 2, scales]
    f16[0], f16[1], f16[2, :, 0] = 1000.0, -1000.0, 6e-8           # big scales (and mins); a subnormal d
    raw[..., :2 * scales] = f16.view(torch.uint8)
    raw[0, :, 2 * scales:], raw[1, :, 2 * scales:], raw[2, :, 2 * scales:] = 0xFF, 0x00, 0xF0
    raw = raw.reshape(40, -1)
    packed, w = cpu_gguf_q4.pack(raw, type_name), _dequantized(raw, type_name)
    assert w[0].abs().max() >= 7000 and w[2].abs().min() > 0
    x = torch.randn(3, 64, generator=gen)
    _check(cpu_gguf_q4.q4_linear(x, packed), x, w)


@needs_compiler
def test_what_the_kernel_does_not_take():
    gen = torch.Generator().manual_seed(0)
    packed = cpu_gguf_q4.pack(_random_rows(32, 64, "Q4_0", gen), "Q4_0")
    assert cpu_gguf_q4.pack(torch.zeros(32, 144, dtype=torch.uint8), "Q4_K") is None  # another type
    assert cpu_gguf_q4.q4_linear(torch.randn(2, 64).half(), packed) is None             # fp16
    with pytest.raises(ValueError):
        cpu_gguf_q4.q4_linear(torch.randn(2, 96), packed)                               # wrong in_features
    with pytest.raises(ValueError):
        cpu_gguf_q4.pack(torch.zeros(32, 19, dtype=torch.uint8), "Q4_0")                # not whole blocks


def test_without_a_compiler_pack_and_q4_linear_return_none(tmp_path, monkeypatch):
    """No C++ compiler and no library built before (an empty cache directory): None, no error."""
    monkeypatch.setattr(cpp_compiler, "cpp_compiler_found", lambda: False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_gguf_q4, "_build", functools.cache(cpu_gguf_q4._build.__wrapped__))
    raw = _random_rows(32, 64, "Q4_1", torch.Generator().manual_seed(0))
    assert cpu_gguf_q4.pack(raw, "Q4_1") is None
    packed = cpu_gguf_q4.PackedQ4(cpu_gguf_q4._tiles(raw.reshape(32, 2, -1), "Q4_1"), "Q4_1", 32, 64)
    assert cpu_gguf_q4.q4_linear(torch.randn(1, 64), packed) is None
    assert not cpu_gguf_q4.prepare(torch.float32, "Q4_1")
