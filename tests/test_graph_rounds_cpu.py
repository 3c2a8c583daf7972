"""Decode rounds through CUDAGraphRunner.run / run_next_step, on the CPU: a stand-in graph
runner whose "replay" runs the model eagerly over the static buffers, so the in-place
advance of the buffers (kernels/triton_ops.py::advance_decode_, under Triton's interpreter)
is checked end to end against rounds that advance with torch ops (ModelRunner._advance_decode).
"""
import pytest
import torch

from eager_graph import EagerGraph
from triton_interpreter import HAS_TRITON, RUN_HERE, rerun_under_interpreter
from nanovllm import LLM, SamplingParams
from tiny_models import random_prompts

CHILD_TIMEOUT_S = 600
PROMPTS = random_prompts([5, 17, 33, 9, 3], seed=4)
# On a GPU, test_multi_step's rounds replay real graphs (and are compared with plain steps).
needs_kernels = pytest.mark.skipif(not RUN_HERE or torch.cuda.is_available(),
                                   reason="CPU only, in the interpreter child")


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON or torch.cuda.is_available(), reason="the kernel runs in this process")
def test_graph_rounds_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _install_fake_graphs(llm):
    from nanovllm.engine.cuda_graph import CUDAGraphRunner
    mr = llm.llm_engine.model_runner
    orig = CUDAGraphRunner._capture_all

    def capture(self, model):
        self.graphs = {bs: EagerGraph(self, model, bs) for bs in self.sizes}
    CUDAGraphRunner._capture_all = capture
    try:
        mr.graph_runner = CUDAGraphRunner(mr.model, mr.config.max_num_seqs, mr._max_blocks_per_seq(),
                                          mr.max_model_len, mr.model_config.hidden_size, mr.dtype, mr.device)
    finally:
        CUDAGraphRunner._capture_all = orig
    runner = mr.graph_runner
    runner.next_steps = 0
    run_next_step = runner.run_next_step

    def counted(*args, **kwargs):
        runner.next_steps += 1
        return run_next_step(*args, **kwargs)
    runner.run_next_step = counted
    return runner


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3")[0]


def _make(path, steps, async_scheduling, max_num_seqs=8, graphs=False):
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=128, kvcache_block_size=16,
              num_scheduler_steps=steps, max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    return llm, (_install_fake_graphs(llm) if graphs else None)


@needs_kernels
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_rounds_equal_torch_rounds(model_path, async_scheduling):
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=37 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    greedy = [SamplingParams(temperature=0, max_tokens=29 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    ref, _ = _make(model_path, 6, async_scheduling)
    llm, runner = _make(model_path, 6, async_scheduling, graphs=True)
    for p in (params, greedy):
        a = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, p, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
        assert a == b
    assert runner.next_steps > 0 and sum(g.replays for g in runner.graphs.values()) > runner.next_steps
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@needs_kernels
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lazy_graph_rounds_equal_torch_rounds(model_path, async_scheduling):
    """Rounds whose sampling follows their own tokens (penalties, min_tokens: the lazy rounds of
    engine/decode_round.py) queue each step's sampling between the graph's in-place advances:
    the same ids as torch rounds."""
    params = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=21 + 2 * i, ignore_eos=True,
                             presence_penalty=0.5 if i % 2 else 0.0, min_tokens=0 if i % 2 else 9)
              for i in range(len(PROMPTS))]
    ref, _ = _make(model_path, 6, async_scheduling)
    llm, runner = _make(model_path, 6, async_scheduling, graphs=True)
    a = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert a == b
    assert runner.next_steps > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
