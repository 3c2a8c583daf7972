"""Tensor parallelism on two CUDA GPUs: NCCL ranks, one GPU each (skips with fewer than 2 GPUs).

- fp32 greedy ids with TP=2 equal TP=1's and HF transformers' on the GPU, for each family,
  with CUDA graphs (the all-reduces and the LM head's gather are captured) and eager.
- Rank 1 really runs on the second GPU: its KV cache takes that GPU's memory.
- Nothing is left behind: no worker process, no /dev/shm segment, no process group.
"""
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy, random_prompts
from tp_checks import assert_gone

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
              pytest.mark.exclusive_gpu]  # sizes its engines from the free memory

TP = 2
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
GPU_MEMORY_UTILIZATION = 0.3
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, device="cuda", max_model_len=256, max_num_seqs=16,
              gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
# An odd vocabulary for Llama, so that the 2-way split of the embedding and LM head pads it.
OVERRIDES = {"llama": dict(vocab_size=321)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 33, 64, 100], seed=3)


def _model(tiny_model, tmp_path_factory, family: str) -> str:
    if family not in OVERRIDES:
        return tiny_model(family)[0]
    path = str(tmp_path_factory.mktemp(f"tp-gpu-{family}"))
    build_tiny_model(family, path, **OVERRIDES[family])
    return path


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def _free_bytes(device: int) -> int:
    return torch.cuda.mem_get_info(device)[0]


def test_nccl_tp2_greedy_matches_tp1_and_hf(tiny_model, tmp_path_factory, family, prompts):
    path = _model(tiny_model, tmp_path_factory, family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf
    assert all(len(set(ref)) >= 6 for ref in refs)  # varied continuations, not one repeated token
    assert _run(path, prompts, tensor_parallel_size=1) == refs
    for eager in (True, False):
        assert _run(path, prompts, tensor_parallel_size=TP, enforce_eager=eager) == refs, f"enforce_eager={eager}"


def _run(path: str, prompts, **kwargs) -> list[list[int]]:
    """Greedy ids from a fresh engine, shut down and dropped on return (each engine sizes its
    KV cache from the free GPU memory, so none may outlive its run)."""
    free_before = _free_bytes(1)
    with LLM(path, **ENGINE, **kwargs) as llm:
        runner = llm.llm_engine.model_runner
        assert (runner.graph_runner is None) == kwargs.get("enforce_eager", False)
        ids = _generate(llm, prompts)
        if kwargs["tensor_parallel_size"] == 1:
            return ids
        group = runner.group
        pids, shm_name = group.pids, group._res.channel.shm.name
        # rank 1's KV cache (about GPU_MEMORY_UTILIZATION of the card) lives on GPU 1
        assert free_before - _free_bytes(1) > GPU_MEMORY_UTILIZATION / 2 * torch.cuda.mem_get_info(1)[1]
    assert_gone(pids, [shm_name])
    assert not dist.is_initialized()
    return ids

