"""Nothing compiles after start-up (engine/warmup.py), on a CUDA GPU (skips without one).

After `LLM(...)` returns, a workload of every kind of step and every sampling path (prefill,
chunked prefill, prefix-cache hits, mixed steps, decodes at many batch sizes, long contexts
that split the KV range, multi-step rounds; greedy, temperature, seeds, top-k/top-p/min-p,
penalties, logit bias, min_tokens, allowed tokens, logprobs, prompt logprobs, n > 1) must meet
no Triton kernel variant that the process has not met before: Triton's `jit_cache_hook` fires
for every variant compiled or loaded from its disk cache, and is counted from the end of
start-up. With CUDA graphs, and eager.
"""
import json
import os
from dataclasses import replace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.warmup import VariantCounter
from tiny_models import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16
CHUNK = 256          # max_num_batched_tokens: long prompts prefill in chunks
KV_BLOCKS = 1024     # fixed, so the test may run beside others (benchmarks/pytest_shards.py)
T = 0.8
PROFILES = [
    SamplingParams(temperature=0.0), SamplingParams(temperature=T), SamplingParams(temperature=T, seed=7),
    SamplingParams(temperature=T, top_k=4), SamplingParams(temperature=T, top_p=0.8),
    SamplingParams(temperature=T, min_p=0.2), SamplingParams(temperature=T, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=T, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=T, logit_bias={5: 3.0}),
    SamplingParams(temperature=0.0, logit_bias={5: -50.0}), SamplingParams(temperature=T, min_tokens=3),
    SamplingParams(temperature=T, allowed_token_ids=[3, 4, 5, 6]), SamplingParams(temperature=T, logprobs=3),
    SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=T, prompt_logprobs=2),
    SamplingParams(temperature=T, n=3, seed=1),
]


def _workload(llm):
    short = random_prompts([3, 20, 50, 120], seed=5)
    long = random_prompts([MAX_MODEL_LEN - 40, 700], seed=6)
    prefix = random_prompts([300], seed=7)[0]
    # each profile alone (a batch's options pick its sampler path), then all of them together
    for params in PROFILES:
        llm.generate(short[:2], replace(params, max_tokens=5), use_tqdm=False)
    mixed = [replace(p, max_tokens=4 + 3 * i) for i, p in enumerate(PROFILES)]
    llm.generate([short[i % len(short)] for i in range(len(mixed))], mixed, use_tqdm=False)
    # long contexts (chunked prefill, split-KV decodes) beside short ones: mixed steps
    llm.generate(long + short, [SamplingParams(temperature=T, max_tokens=24, ignore_eos=True)] * 6, use_tqdm=False)
    # prefix-cache hits: a shared 300-token prefix, fresh tails
    tails = random_prompts([1, 17, 40, 90], seed=8)
    llm.generate([prefix + t for t in tails], SamplingParams(temperature=T, max_tokens=12), use_tqdm=False)
    llm.generate([prefix + t for t in tails], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    # every batch size from 1 to MAX_NUM_SEQS + 4 (more than fit: some wait), finishing one by one
    many = random_prompts([10 + 7 * i for i in range(MAX_NUM_SEQS + 4)], seed=9)
    llm.generate(many, [SamplingParams(temperature=T, max_tokens=2 + 3 * i, ignore_eos=True)
                        for i in range(len(many))], use_tqdm=False)


def _tables_by_shape(path: str) -> tuple:
    """triton_batch_gemm.FP8_TILES_BY_SHAPE entries for the tiny model's o and down products: other
    tiles and row bounds than FP8_TILES (one bucket on cuBLAS, one bound beyond a CUDA-graph size)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    hidden, inner = cfg["hidden_size"], cfg["num_attention_heads"] * cfg.get("head_dim", 0)
    inner = inner or hidden
    small, large = (64, 32, 128, 4, 5), (64, 64, 128, 4, 4)
    o_table = ((hidden, inner), ((16, small), (64, None), (200, large)))
    down_table = ((hidden, cfg["intermediate_size"]), ((32, large), (CHUNK, small)))
    return (o_table,) if down_table[0] == o_table[0] else (o_table, down_table)  # one table a shape


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8-by-shape"], ids=["bf16", "fp8-weights", "fp8-by-shape"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_nothing_compiles_after_start_up(tiny_model, enforce_eager, quantization, monkeypatch):
    """fp8 weights: the tiny model's o and down products (K = 128) take triton_batch_gemm's tiles,
    whose tile changes with the batch's rows; the workload's 120-token prompts and 300-token
    prefixes prefill batches between the CUDA-graph sizes and a whole chunk. "fp8-by-shape": the
    same with tile tables of the model's own weight shapes (FP8_TILES_BY_SHAPE)."""
    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need an fp8 GPU (sm_89 or later)")
    path = tiny_model("qwen3")[0]
    if quantization == "fp8-by-shape":
        from nanovllm.kernels import triton_batch_gemm
        monkeypatch.setattr(triton_batch_gemm, "FP8_TILES_BY_SHAPE", _tables_by_shape(path))
        quantization = "fp8"
    counter = VariantCounter()
    if not counter.available:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook")
    llm = LLM(path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=CHUNK, num_kvcache_blocks=KV_BLOCKS,
              enforce_eager=enforce_eager, quantization=quantization)
    with counter:
        _workload(llm)
    assert counter.names == [], f"kernel variants first met after start-up: {counter.names}"
