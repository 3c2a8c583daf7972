"""The fp8 tensor-core decode tiles (`triton_attn.DECODE_FP8_QUERY_QUANT` and
`DECODE_FP8_PV_MMA`) against their torch emulation (`kernels/query_quant_ref.py`) and the
exact reference.

- The emulation rounds queries per row to e4m3 (amax / 448) and stays within a stated distance
  of the exact fp8-cache attention (it rounds, so it is not equal to it).
- The kernel's decode tile equals the emulation (same rounding; fp32 summation order and the
  output's 16 bits differ), over a plain and a key-minor V, padded head size, 3 query heads per
  KV head, for both options (DECODE_FP8_PV_MMA: P V only, q not rounded); with split-KV (each
  split its own running max, which the emulation does not follow) it is held to the emulation's
  distance from the exact reference instead.
- Prefill steps and e5m2 caches keep the 16-bit products: the options change decode tiles over
  e4m3 only.

Natively on a GPU (bf16 queries too); without one, in a child under `TRITON_INTERPRET=1`, with
the interpreter's fp32 -> fp8 cast replaced by torch's (Triton 3.9's rounds wrongly where the
mantissa carries into the exponent: 125.4 became 64, not 128), so that the rounding compared is
the GPU's.
"""

import numpy as np
import pytest
import torch

from nanovllm.kernels import query_quant_ref
from paged_batches import random_paged_batch, reference_attention
from triton_interpreter import HAS_TRITON, INTERPRETED, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
CHILD_TIMEOUT_S = 120
Q_DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
FP8 = torch.float8_e4m3fn
# mean |kernel - emulation| / mean |output|: the same rounding, but fp32 sums in another order
# (the fp8 tensor cores' own), the GPU's exp2 and division, and a 16-bit output; where an fp32
# value lands on the other side of an e4m3 rounding step, one probability moves by 6%. On an
# H200 the kernel was 1.3-1.5e-3 from the emulation over 3-tile contexts (under the interpreter:
# 0), the plain fp8 path (which rounds neither q nor P) ~4e-3
EMULATION_TOL = 2.5e-3
# |emulation - exact| / max |output| bound, and the least it must differ (it rounds q and P)
ROUNDING_TOL, ROUNDING_MIN = 1e-2, 1e-4


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_fp8_query_quant_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


# option -> the emulation's q_scales: both products in fp8 (q rounded per row), or P V only
OPTIONS = {"DECODE_FP8_QUERY_QUANT": "row", "DECODE_FP8_PV_MMA": "none"}


@pytest.fixture
def fp8_casts(monkeypatch):
    """(interpreter) fp32 -> fp8 casts rounded as on the GPU."""
    if INTERPRETED:
        import triton.language as tl
        from triton.runtime import interpreter
        if not hasattr(interpreter, "_convert_float"):  # another Triton's interpreter: its own casts
            return
        to_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
        convert = interpreter._convert_float

        def torch_convert(data, input_dtype, output_dtype, rounding_mode):
            if input_dtype == tl.float32 and output_dtype in to_torch:
                values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
                return values.to(to_torch[output_dtype]).view(torch.uint8).numpy()
            return convert(data, input_dtype, output_dtype, rounding_mode)
        monkeypatch.setattr(interpreter, "_convert_float", torch_convert)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_quantize_rows_scales_each_row_to_e4m3_max(gen):
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[0, 0] = 0.0
    values, scale = query_quant_ref.quantize_rows(x)
    assert torch.equal(values, values.to(FP8).float()), "not e4m3 values"
    assert torch.equal(values.abs().amax(-1), torch.where(x.abs().amax(-1) > 0, 448.0, 0.0))
    assert scale[0, 0].item() == 1.0
    # e4m3: 3 mantissa bits (within 2**-4 relative) down to 2**-6; below it subnormal steps of 2**-9, so
    # within half a step of the row's scale (a randn value ~1e-4 of its row's max lands there)
    error = (values * scale - x).abs()
    assert (error <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10)).all(), error.max()
    token, token_scale = query_quant_ref.quantize_rows(x, "token")
    assert (token_scale == token_scale[:, :1]).all() and (token.abs().amax((-2, -1)) == 448.0).all()
    with pytest.raises(ValueError, match="q_scales"):
        query_quant_ref.quantize_rows(x, "head")


# (num_cached, q_len) per sequence; heads; kv heads; head_dim; kwargs
CASES = {
    "decode": ([(0, 1), (69, 1), (149, 1), (300, 1)], 8, 2, 64, dict(max_seqlen_q=1)),
    "decode_gqa3_d40": ([(0, 1), (63, 1), (64, 1), (200, 1)], 6, 2, 40, dict(max_seqlen_q=1)),
    "decode_split3": ([(0, 1), (69, 1), (149, 1)], 8, 2, 64, dict(max_seqlen_q=1, num_splits=3)),
}
BLOCK_SIZE = 16


def _batch(gen, case: str):
    seqs, heads, kv_heads, d, kwargs = CASES[case]
    return random_paged_batch(gen, seqs, heads, kv_heads, d, BLOCK_SIZE, FP8), kwargs


def _emulated(paged: dict, q: torch.Tensor, block_n: int, q_scales: str = "row") -> torch.Tensor:
    return query_quant_ref.paged_attention(
        q, paged["k_cache"], paged["v_cache"], **paged["batch"], scale=q.shape[-1] ** -0.5,
        k_scale=paged["k_scale"], v_scale=paged["v_scale"], block_n=block_n, q_scales=q_scales).float()


def test_emulation_rounds_within_its_stated_distance_of_the_exact_attention(gen):
    for case in ("decode", "decode_gqa3_d40"):
        paged, _ = _batch(gen, case)
        exact = reference_attention(paged)
        for q_scales in OPTIONS.values():
            distance = _relative(_emulated(paged, paged["q"], 128, q_scales), exact)
            assert ROUNDING_MIN < distance < ROUNDING_TOL, (case, q_scales, distance, f"seed {gen.initial_seed()}")


@needs_kernels
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("v_key_minor", [False, True])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_decode_tile_equals_its_emulation(gen, monkeypatch, fp8_casts, option, case, v_key_minor, dtype):
    from nanovllm.kernels import triton_attn
    monkeypatch.setattr(triton_attn, option, True)
    paged, kwargs = _batch(gen, case)
    q = paged["q"].to(dtype)
    v_cache = paged["v_cache"]
    if v_key_minor:  # the layout new_kv_cache gives with the option on
        v_cache = triton_attn.new_kv_cache(v_cache.shape, FP8, torch.device("cpu"))[1]
        v_cache.view(torch.uint8).copy_(paged["v_cache"].view(torch.uint8))
        assert v_cache.stride(1) == 1
    scales = dict(k_scale=paged["k_scale"].to(DEVICE), v_scale=paged["v_scale"].to(DEVICE))
    got = triton_attn.paged_attention(q.to(DEVICE), paged["k_cache"].to(DEVICE), v_cache.to(DEVICE),
                                      **{n: t.to(DEVICE) for n, t in paged["batch"].items()},
                                      scale=q.shape[-1] ** -0.5, **scales, **kwargs).float().cpu()
    seed = f"seed {gen.initial_seed()}"
    assert not got.isnan().any(), seed
    emulated = _emulated(paged, q, triton_attn.DECODE_FP8_BLOCK_N, OPTIONS[option])
    if "num_splits" in kwargs:
        assert _relative(got, reference_attention(paged)) < ROUNDING_TOL, seed
    else:
        assert ((got - emulated).abs().mean() / emulated.abs().mean()).item() < EMULATION_TOL, seed
        assert _relative(got, emulated) < ROUNDING_TOL, seed


@needs_kernels
@pytest.mark.parametrize("option", list(OPTIONS))
def test_prefill_and_e5m2_keep_16_bit_products(monkeypatch, option):
    from nanovllm.kernels import triton_attn
    assert not triton_attn._fp8_mma(FP8, torch.bfloat16, 1, option=False)
    assert triton_attn._fp8_mma(FP8, torch.bfloat16, 1, option=True)
    assert not triton_attn._fp8_mma(FP8, torch.bfloat16, 2, option=True)
    assert not triton_attn._fp8_mma(torch.float8_e5m2, torch.float16, 1, option=True)
    assert not triton_attn._fp8_mma(FP8, torch.float32, 1, option=True)
    assert triton_attn.new_kv_cache((2, 16, 2, 8), FP8, torch.device("cpu"))[1].is_contiguous()
    monkeypatch.setattr(triton_attn, option, True)
    k, v = triton_attn.new_kv_cache((2, 16, 2, 8), FP8, torch.device("cpu"))
    assert k.is_contiguous() and v.stride(1) == 1
    assert triton_attn.new_kv_cache((2, 16, 2, 8), torch.float8_e5m2, torch.device("cpu"))[1].is_contiguous()
