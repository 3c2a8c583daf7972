"""Programmatic dependent launch (`kernels/triton_pdl.py`) changes no output.

With it, a kernel of a decode step starts while the one ahead of it still runs and waits inside
for that one's results; a kernel that read or wrote anything before its wait would race, and
tokens or logprobs would move. Checked two ways on a GPU with PDL (sm_90 or later; elsewhere the
kernels never launch with it and these tests skip):

- deterministically: a kernel that lets the next one start at once and only writes its output
  after a long spin, followed by each kind of PDL consumer of that output (RMSNorm, a one-row
  product in either form, SiLU-and-mul, the fp8 activations' quantization, alone or fused into
  the RMSNorm and SiLU-and-mul, and the fp8 batch product): a consumer reading before its wait
  would see the old values;
- end to end: an engine with PDL on and the same engine with it off give the same ids and
  logprobs bit for bit, one sequence at a time (one-row steps: the skinny products, split-KV
  decodes) and batched, over a bf16 and an fp8 KV cache, with the one-row products in either
  form, and with fp8 weights.
"""
import gc

import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from tiny_models import random_prompts
from triton_interpreter import HAS_TRITON

HAS_PDL_GPU = False
if HAS_TRITON and torch.cuda.is_available():
    from nanovllm.kernels import triton_pdl
    HAS_PDL_GPU = torch.cuda.get_device_capability() >= triton_pdl.MIN_CAPABILITY
needs_pdl_gpu = pytest.mark.skipif(not HAS_PDL_GPU, reason="needs a GPU with programmatic dependent launch")
# iterations of the late writer's dependent multiply-adds: ~0.2 ms on an H200, far longer than a launch
LATE_WRITE_SPINS = 200_000


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel module imports triton")
def test_enabled_only_on_pdl_gpus():
    from nanovllm.kernels import triton_pdl
    assert not triton_pdl.enabled(torch.device("cpu"))
    assert triton_pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    if HAS_PDL_GPU:
        assert triton_pdl.launch_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["spins"])
    def _late_writer_kernel(out_ptr, src_ptr, n, spins, BLOCK: tl.constexpr):
        """out = src, written only after `spins` dependent multiply-adds; the next kernel may start
        at once."""
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        spin = tl.zeros((BLOCK,), tl.float32)
        for _ in range(spins):
            spin = spin * 0.5 + 1.0  # ends at exactly 2.0
        values = tl.load(src_ptr + offs, mask=ok) * (spin * 0.5)
        tl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=ok)


def _late_write(out: torch.Tensor, values: torch.Tensor) -> None:
    """out[:] = values, by a kernel that lets the next kernel start before it spins and writes."""
    block = 1024
    _late_writer_kernel[(triton.cdiv(out.numel(), block),)](out, values, out.numel(), LATE_WRITE_SPINS,
                                                             BLOCK=block)


@needs_pdl_gpu
@pytest.mark.parametrize("whole_row", [True, False])
def test_consumers_wait_for_a_late_writer(monkeypatch, whole_row):
    from nanovllm.kernels import triton_ops, triton_skinny_gemm
    monkeypatch.setattr(triton_skinny_gemm, "WHOLE_ROW_MAX_BYTES", 1 << 30 if whole_row else 0)
    g = torch.Generator(device="cuda").manual_seed(5)
    k, n = 1024, 512
    values = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    ref_norm = triton_ops.rms_norm(values, norm_w, 1e-6)
    ref_product = triton_skinny_gemm.skinny_linear(values, w, None)
    ref_norm_product, _ = triton_skinny_gemm.skinny_norm_linear(values, None, norm_w, 1e-6, w, None)
    for _ in range(3):
        x = torch.zeros_like(values)
        torch.cuda.synchronize()
        _late_write(x, values)
        norm = triton_ops.rms_norm(x, norm_w, 1e-6)
        _late_write(x, -values)
        _late_write(x, values)
        product = triton_skinny_gemm.skinny_linear(x, w, None)
        _late_write(x, -values)
        _late_write(x, values)
        norm_product, _ = triton_skinny_gemm.skinny_norm_linear(x, None, norm_w, 1e-6, w, None)
        torch.cuda.synchronize()
        assert torch.equal(norm, ref_norm)
        assert torch.equal(product, ref_product)
        assert torch.equal(norm_product, ref_norm_product)
    torch.testing.assert_close(product.float(), F.linear(values.float(), w.float()), atol=0.05, rtol=0.02)


@needs_pdl_gpu
def test_batch_consumers_wait_for_a_late_writer():
    """SiLU-and-mul, the fp8 quantization of activations and the fp8 batch product each read
    what a late writer wrote last (batches of 40 rows: the batch product's tile)."""
    from nanovllm.kernels import triton_batch_gemm, triton_ops
    from nanovllm.layers.quantization import fp8
    g = torch.Generator(device="cuda").manual_seed(6)
    rows, k, n = 40, 1024, 512
    values = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w_fp8, w_scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5)
    w_scale = w_scale.reshape(1, -1).contiguous()
    values_fp8, values_scale = fp8.quantize_rows(values)
    tile = triton_batch_gemm.tile_for(values_fp8, w_fp8)
    assert tile is not None
    ref_silu = triton_ops.silu_and_mul(values)
    ref_product = triton_batch_gemm.scaled_fp8_linear(values_fp8, values_scale, w_fp8, w_scale, tile)
    for _ in range(3):
        x = torch.zeros_like(values)
        x_fp8, x_scale = torch.zeros_like(values_fp8), torch.zeros_like(values_scale)
        torch.cuda.synchronize()
        _late_write(x, values)
        silu = triton_ops.silu_and_mul(x)
        _late_write(x, -values)
        _late_write(x, values)
        quantized, scale = fp8.quantize_rows(x)
        _late_write(x_fp8.view(torch.uint8), values_fp8.view(torch.uint8))
        _late_write(x_scale, values_scale)
        product = triton_batch_gemm.scaled_fp8_linear(x_fp8, x_scale, w_fp8, w_scale, tile)
        x_fp8.zero_()
        _late_write(x_fp8.view(torch.uint8), values_fp8.view(torch.uint8))  # the values written last
        product_after_values = triton_batch_gemm.scaled_fp8_linear(x_fp8, x_scale, w_fp8, w_scale, tile)
        torch.cuda.synchronize()
        assert torch.equal(product_after_values, ref_product)
        assert torch.equal(silu, ref_silu)
        assert torch.equal(quantized.view(torch.uint8), values_fp8.view(torch.uint8))
        assert torch.equal(scale, values_scale)
        assert torch.equal(product, ref_product)


@needs_pdl_gpu
def test_fused_quant_consumers_wait_for_a_late_writer():
    """The RMSNorm (+ residual) and SiLU-and-mul that write per-token fp8 (kernels/triton_fused_quant.py)
    each read what a late writer wrote last."""
    from nanovllm.kernels import triton_fused_quant
    from nanovllm.layers.quantization import fp8
    g = torch.Generator(device="cuda").manual_seed(7)
    rows, k = 40, 1024
    values, residual = (torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    norm_w = torch.randn(k, device="cuda", generator=g, dtype=torch.bfloat16)

    def norm(x, res):
        return triton_fused_quant.rms_norm_per_token_quant(x, norm_w, 1e-6, res, fp8.FP8_DTYPE, fp8.MIN_SCALE)

    def silu(x):
        return triton_fused_quant.silu_and_mul_per_token_quant(x, fp8.FP8_DTYPE, fp8.MIN_SCALE)

    def bits(outs):
        return [t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t for t in outs]
    ref_norm, ref_silu = bits(norm(values, residual)), bits(silu(values))
    for _ in range(3):
        x, res = torch.zeros_like(values), torch.zeros_like(residual)
        torch.cuda.synchronize()
        _late_write(res, residual)
        _late_write(x, values)
        normed = norm(x, res)
        _late_write(x, -values)
        _late_write(x, values)
        activated = silu(x)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(bits(normed), ref_norm))
        assert all(torch.equal(a, b) for a, b in zip(bits(activated), ref_silu))


@needs_pdl_gpu
@pytest.mark.parametrize("family,kv_cache_dtype,whole_row,quantization",
                         [("qwen3", "auto", True, None), ("qwen2", "auto", True, None), ("qwen3", "fp8", True, None),
                          ("qwen3", "auto", False, None),
                          # fp8 weights: the o and down products (K = 128) take triton_batch_gemm's tile, the
                          # tiny model's q/k/v and gate/up (K = hidden = 64) cuBLAS
                          ("qwen3", "fp8", True, "fp8")])
def test_outputs_identical_with_and_without_pdl(tiny_model, family, kv_cache_dtype, whole_row, quantization,
                                                monkeypatch):
    from nanovllm.kernels import triton_pdl, triton_skinny_gemm
    monkeypatch.setattr(triton_skinny_gemm, "WHOLE_ROW_MAX_BYTES", 1 << 30 if whole_row else 0)
    path, _ = tiny_model(family)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = random_prompts([7, 60, 700], seed=11)

    def run():
        llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", max_num_seqs=4,
                  num_kvcache_blocks=256, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        outs += [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    assert triton_pdl.enabled(torch.device("cuda"))
    with_pdl = run()
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert run() == with_pdl
