"""CPU dense products by oneDNN-packed weights (kernels/cpu_gemm.py, kernels/cpu_linear.py).

- The packed product equals the fp64 product to fp32 rounding, with and without bias, for
  one row (the column-major `F.linear` path), a few rows and a prefill-sized batch; a layer
  that kept only its packed copy runs it for one row as well.
- A CPU engine gives every dense fp32 linear layer and its LM head a packed copy, and its
  greedy ids equal those of the same engine with packing off, or part only at a near-tie
  (each side's token in the other's top-5).
"""
import pytest
import torch

from nanovllm.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.can_pack(), reason="this torch build has no oneDNN fp32 packing")

TOP_K_CLOSE = 5


@pytest.mark.parametrize("rows", [1, cpu_gemm.PACKED_MIN_ROWS, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_matches_fp64(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    y = cpu_gemm.dense_linear(x, w, bias, cpu_gemm.pack(w))
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 64])
def test_packed_copy_alone_serves_every_row_count(rows):
    """A layer that kept only its packed copy (weight None) runs it for one row too."""
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen), torch.randn(96, generator=gen)
    y = cpu_gemm.dense_linear(x, None, bias, cpu_gemm.pack(w))
    torch.testing.assert_close(y.double(), x.double() @ w.double().t() + bias.double(), rtol=1e-5, atol=1e-4)


def test_bf16_input_takes_the_plain_product():
    w = torch.randn(32, 48)
    x = torch.randn(8, 48).bfloat16()
    y = cpu_gemm.dense_linear(x, w.bfloat16(), None, cpu_gemm.pack(w))
    assert y.dtype == torch.bfloat16


def _ids_and_tops(llm, prompts):
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP_K_CLOSE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def test_engine_packs_dense_layers_and_keeps_greedy_ids(tiny_model, monkeypatch):
    from nanovllm import LLM
    from nanovllm.layers.linear import LinearBase
    path, _ = tiny_model("llama")
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_kvcache_blocks=32, skip_tokenizer_init=True)
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(getattr(m, "packed_weight", None) is not None for m in linears)
    assert getattr(model.lm_head, "packed_weight", None) is not None
    prompts = [[5 + i, 17, 3 * i + 2, 9] for i in range(6)]  # 6 rows a decode step: past PACKED_MIN_ROWS
    packed = _ids_and_tops(llm, prompts)
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS", 1 << 30)
    plain = _ids_and_tops(llm, prompts)
    for (ours, our_tops), (ref, ref_tops) in zip(packed, plain):
        if ours != ref:  # fp32 rounding may flip a near-tie: both must rank the other's token top-5
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            assert ref[i] in our_tops[i] and ours[i] in ref_tops[i], (i, ours, ref)


bf16_packs = pytest.mark.skipif(not cpu_gemm.packs(torch.bfloat16),
                                reason="bf16 weights are packed only where the CPU multiplies bf16 fast")
# bf16 output (8 bits of mantissa) of 160-term sums of N(0, 1) products (|y| ~ 13): a relative
# step of 2^-8 (4e-3), so up to ~0.05 off where |y| is large; a wrong weight is off by ~10
BF16_RTOL, BF16_ATOL = 1e-2, 0.1


@bf16_packs
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_packed_bf16_product_matches_fp64(rows):
    """bf16 weights and activations through the packed copy: the fp64 product of the same bf16
    values, to bf16 rounding of the output; the dense weight dropped, for one row too."""
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 160, generator=gen).bfloat16(), torch.randn(rows, 160, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    for weight in (w, None):
        y = cpu_gemm.dense_linear(x, weight, bias, cpu_gemm.pack(w))
        assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=BF16_RTOL, atol=BF16_ATOL)


@bf16_packs
def test_bf16_engine_packs_dense_layers_and_keeps_greedy_ids(tiny_model, monkeypatch):
    """A bf16 engine packs every dense layer and its LM head; its greedy ids equal those of the
    same engine's plain `F.linear` products (dense weights kept by a huge PACKED_MIN_ROWS_BF16 at
    load, then the packed product switched on and off), or part only at a near-tie."""
    from nanovllm import LLM
    from nanovllm.layers.linear import LinearBase
    path, _ = tiny_model("llama")
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS_BF16", 1 << 30)  # keep the dense weights beside
    llm = LLM(path, device="cpu", dtype="bfloat16", max_model_len=64, num_kvcache_blocks=32, skip_tokenizer_init=True)
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)] + [model.lm_head]
    assert all(m.weight is not None and m.packed_weight.dtype == torch.bfloat16 for m in linears)
    prompts = [[5 + i, 17, 3 * i + 2, 9] for i in range(6)]
    plain = _ids_and_tops(llm, prompts)
    monkeypatch.setattr(cpu_gemm, "PACKED_MIN_ROWS_BF16", 1)
    packed = _ids_and_tops(llm, prompts)
    for (ours, our_tops), (ref, ref_tops) in zip(packed, plain):
        if ours != ref:  # bf16 rounding may flip a near-tie: both must rank the other's token top-5
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            assert ref[i] in our_tops[i] and ours[i] in ref_tops[i], (i, ours, ref)
