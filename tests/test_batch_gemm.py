"""kernels/triton_batch_gemm.py against the product it stands in for, the fp8 rowwise-scaled
(x * x_scale) @ (w * w_scale)^T, over ragged row and feature counts (neither a multiple of
the tile) and two tiles; and `tile_for`'s choice from its table. Natively on a GPU; without one, in the interpreter child
(tests/triton_interpreter.py)."""

import pytest
import torch

from triton_interpreter import HAS_TRITON, RUN_HERE, OnGpu, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
CHILD_TIMEOUT_S = 300
TILES = [(64, 64, 128, 4, 4), (128, 32, 256, 4, 3)]
# the output's bf16 rounding (2**-9 relative per element) and, on Hopper, the fp8 tensor cores' own
# accumulator (Triton's default for fp8 products, as `_scaled_mm(use_fast_accum=True)`)
BF16_OUTPUT_REL = 5e-3


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_batch_gemm_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float().cpu() - expected).norm() / expected.norm()).item()


@needs_kernels
@pytest.mark.parametrize("m", [1, 37, 70])
@pytest.mark.parametrize("tile", TILES)
def test_scaled_fp8_linear_matches_the_rowwise_product(gen, m, tile):
    from nanovllm.kernels import triton_batch_gemm
    from nanovllm.layers.quantization import fp8
    n, k = 130, 512
    x_fp8, x_scale = fp8.quantize_rows(torch.randn(m, k, generator=gen) * 3)
    w_fp8, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    w_scale = w_scale.reshape(1, -1).contiguous()
    expected = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale.t()).t()
    got = triton_batch_gemm.scaled_fp8_linear(*(t.to(DEVICE) for t in (x_fp8, x_scale, w_fp8, w_scale)), tile)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel(got, expected) < BF16_OUTPUT_REL, f"seed {gen.initial_seed()}"


def _engine_tiles() -> list[tuple]:
    """Every distinct tile of the engine's tables (FP8_TILES and FP8_TILES_BY_SHAPE)."""
    from nanovllm.kernels import triton_batch_gemm as bg
    tables = [bg.FP8_TILES] + [table for _, table in bg.FP8_TILES_BY_SHAPE]
    return sorted({tuple(tile) for table in tables for _, tile in table if tile is not None})


@needs_kernels
@pytest.mark.parametrize("tile", _engine_tiles() if HAS_TRITON else [])
def test_every_tile_the_engine_takes_matches_the_rowwise_product(gen, tile):
    test_scaled_fp8_linear_matches_the_rowwise_product(gen, 70, tile)


def test_tile_for_reads_its_table_by_rows_and_dtype(monkeypatch):
    """A batch takes the first entry whose row bound holds; None entries, larger batches, a K the
    tile does not divide, 16-bit operands and CPU tensors go to cuBLAS (None); `row_bounds` lists
    the entries with a tile."""
    from nanovllm.kernels import triton_batch_gemm as bg
    small, large = (64, 32, 128, 4, 5), (64, 64, 128, 4, 4)
    monkeypatch.setattr(bg, "FP8_TILES", ((16, small), (64, None), (128, large)))
    monkeypatch.setattr(bg, "FP8_TILES_BY_SHAPE", ())
    w8 = torch.empty(8, 256, dtype=torch.float8_e4m3fn)
    w16 = torch.empty(8, 256, dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn

    def rows(m, k=256, dtype=e4m3):
        return torch.empty(m, k, dtype=dtype).as_subclass(OnGpu)
    assert bg.tile_for(rows(1), w8) == small and bg.tile_for(rows(16), w8) == small
    assert bg.tile_for(rows(17), w8) is None and bg.tile_for(rows(64), w8) is None
    assert bg.tile_for(rows(65), w8) == large and bg.tile_for(rows(128), w8) == large
    assert bg.tile_for(rows(129), w8) is None
    assert bg.row_bounds() == [16, 128]
    assert bg.tile_for(rows(16, k=192), torch.empty(8, 192, dtype=e4m3)) is None
    assert bg.tile_for(rows(16), w16) is None and bg.tile_for(rows(16, dtype=torch.bfloat16), w8) is None
    assert bg.tile_for(torch.empty(16, 256, dtype=e4m3), w8) is None  # a CPU tensor


def test_tile_for_prefers_the_weight_shapes_own_table(monkeypatch):
    """A weight [N, K] listed in FP8_TILES_BY_SHAPE reads that table (its own row bounds and tiles,
    cuBLAS where it says None), other shapes FP8_TILES; `row_bounds` covers every table, once each."""
    from nanovllm.kernels import triton_batch_gemm as bg
    default, own = (64, 32, 128, 4, 5), (64, 64, 256, 4, 3)
    monkeypatch.setattr(bg, "FP8_TILES", ((16, default), (128, default)))
    monkeypatch.setattr(bg, "FP8_TILES_BY_SHAPE", (((8, 512), ((32, own), (64, None), (256, own))),))
    e4m3 = torch.float8_e4m3fn
    x = lambda m, k: torch.empty(m, k, dtype=e4m3).as_subclass(OnGpu)  # noqa: E731
    listed, other = torch.empty(8, 512, dtype=e4m3), torch.empty(16, 512, dtype=e4m3)
    assert bg.tile_for(x(32, 512), listed) == own and bg.tile_for(x(32, 512), other) == default
    assert bg.tile_for(x(33, 512), listed) is None and bg.tile_for(x(200, 512), listed) == own
    assert bg.tile_for(x(200, 512), other) is None
    assert bg.row_bounds() == [16, 32, 128, 256]
