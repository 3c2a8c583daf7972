"""A decode step's q/k norm + RoPE and K/V store inside the decode attention kernel
(`triton_attn.DECODE_FUSED_ROPE`): the same tokens and logprob bits as the separate RoPE kernel,
through the engine, with CUDA graphs and eager, one sequence (the one-row layers) and a batch
(skips without a GPU).
"""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import triton_attn
from tiny_models import build_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KV_BLOCKS = 256  # fixed, so the test may run beside others (benchmarks/pytest_shards.py)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _run(path: str, prompts, fused: bool, monkeypatch, **kwargs):
    monkeypatch.setattr(triton_attn, "DECODE_FUSED_ROPE", fused)  # before the engine compiles its kernels
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, num_kvcache_blocks=KV_BLOCKS, max_model_len=512,
              max_num_seqs=8, **kwargs)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])  # with the q/k norm and without
def test_fused_rope_same_bits_through_the_engine(tmp_path, monkeypatch, family, enforce_eager):
    build_tiny_model(family, str(tmp_path))
    for prompts in (random_prompts([37]), random_prompts([5, 17, 40, 100, 3])):
        unfused = _run(str(tmp_path), prompts, False, monkeypatch, enforce_eager=enforce_eager)
        fused = _run(str(tmp_path), prompts, True, monkeypatch, enforce_eager=enforce_eager)
        assert fused == unfused
