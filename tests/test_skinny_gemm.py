"""The skinny product (`kernels/triton_skinny_gemm.py`) against `F.linear`, and when layers take it.

Runs natively on a GPU (bf16 included, and the engine's linear layers dispatching to it);
without one, the kernel tests re-run under Triton's interpreter (tests/triton_interpreter.py).
"""
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# relative to the output's scale: one rounding to the output dtype, fp32 sums in another order
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_skinny_gemm_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _check(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, x_stride_pad: int = 0) -> None:
    from nanovllm.kernels import triton_skinny_gemm
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x_full = torch.randn(rows, k + x_stride_pad, generator=g).to(dtype)
    x = x_full[:, :k].to(DEVICE)  # rows strided past k where x_stride_pad > 0
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    y = triton_skinny_gemm.skinny_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (rows, n) and y.dtype == dtype
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("k", [1024, 2048])
def test_matches_linear_at_each_row_count(dtype, rows, k):
    _check(rows, n=96, k=k, dtype=dtype, bias=False)


@needs_kernels
@pytest.mark.parametrize("n,k", [(40, 520), (7, 64), (130, 1536)])
def test_ragged_shapes_and_bias(n, k):
    """Feature counts that are not a multiple of the block, reductions not a multiple of
    BLOCK_K (520: a partial second load), unrolled (K <= UNROLLED_MAX_K) and looped (1536),
    a bias, rows strided past their length."""
    _check(2, n, k, torch.float16, bias=True, x_stride_pad=8)


@needs_kernels
def test_block_n_fills_the_grid():
    from nanovllm.kernels.triton_skinny_gemm import MAX_BLOCK_N, MIN_BLOCK_N, PROGRAMS_PER_SM, block_n
    sms = 132
    for features in (64, 1024, 4096, 6144, 151936):
        bn = block_n(features, sms)
        assert MIN_BLOCK_N <= bn <= MAX_BLOCK_N
        programs = -(-features // bn)
        # the largest block that still leaves PROGRAMS_PER_SM programs a multiprocessor
        assert bn == MIN_BLOCK_N or programs >= PROGRAMS_PER_SM * sms
        assert bn == MAX_BLOCK_N or -(-features // (2 * bn)) < PROGRAMS_PER_SM * sms


def test_applies_only_to_few_rows_of_16bit_gpu_tensors():
    from nanovllm.kernels.triton_skinny_gemm import MAX_ROWS, applies
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not applies(torch.zeros(1, 16, dtype=torch.bfloat16), w)  # on the CPU: never
    if HAS_CUDA:
        wc = w.cuda()
        assert applies(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert applies(torch.zeros(MAX_ROWS, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not applies(torch.zeros(MAX_ROWS + 1, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not applies(torch.zeros(1, 16, device="cuda"), wc.float())  # fp32: cuBLAS
        column_major = torch.zeros(16, 8, dtype=torch.bfloat16, device="cuda").t()  # [8, 16], stride (1, 8)
        assert not applies(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"), column_major)


@pytest.mark.skipif(not HAS_CUDA, reason="the layers dispatch to it on the GPU only")
def test_linear_layer_runs_it_for_few_rows():
    """A dense layer's product at up to MAX_ROWS rows goes through the skinny kernel (same
    values as F.linear to rounding), at more rows through cuBLAS (F.linear exactly)."""
    from nanovllm.kernels import triton_skinny_gemm
    from nanovllm.layers.linear import ReplicatedLinear
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ReplicatedLinear(256, 384, bias=True).cuda()
    finally:
        torch.set_default_dtype(torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    calls = []
    real = triton_skinny_gemm.skinny_linear
    triton_skinny_gemm.skinny_linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        for rows in (1, 2, 3):
            x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
            y = layer(x)
            ref = F.linear(x, layer.weight, layer.bias)
            if rows <= triton_skinny_gemm.MAX_ROWS:
                torch.testing.assert_close(y.float(), ref.float(), atol=0.1, rtol=1e-2)
            else:
                assert torch.equal(y, ref)
    finally:
        triton_skinny_gemm.skinny_linear = real
    assert calls == [r for r in (1, 2, 3) if r <= triton_skinny_gemm.MAX_ROWS] != []
