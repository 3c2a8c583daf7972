"""Programmatic dependent launch (`kernels/triton_pdl.py`) changes no output.

With it, a kernel of a decode step starts while the one ahead of it still runs and waits inside
for that one's results; a kernel that read or wrote anything before its wait would race, and
tokens or logprobs would move. An engine with PDL on and the same engine with it off must give
the same ids and logprobs bit for bit: one sequence at a time (one-row steps: the skinny
products, which load their weights before the wait, and split-KV decodes) and batched. Needs a
GPU with PDL (sm_90 or later); elsewhere the kernels never launch with it and the test skips.
"""
import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tiny_models import random_prompts

HAS_PDL_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_enabled_only_on_pdl_gpus():
    from nanovllm.kernels import triton_pdl
    assert not triton_pdl.enabled(torch.device("cpu"))
    assert triton_pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    if HAS_PDL_GPU:
        assert triton_pdl.launch_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}


@pytest.mark.skipif(not HAS_PDL_GPU, reason="needs a GPU with programmatic dependent launch (sm_90+)")
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_outputs_identical_with_and_without_pdl(tiny_model, family, monkeypatch):
    from nanovllm.kernels import triton_pdl
    path, _ = tiny_model(family)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = random_prompts([7, 60, 700], seed=11)

    def run():
        llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", max_num_seqs=4,
                  num_kvcache_blocks=256)
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        outs += [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    with_pdl = run()
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert run() == with_pdl
