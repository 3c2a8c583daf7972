"""Prefill steps through PrefillGraphRunner.run, on the CPU: a stand-in graph whose "replay" runs
the model eagerly over the runner's static buffers for the captured size, so the padding a
graph replays with (tokens that write no KV, sequence rows with no queries, the attention grid
sized for the bound) is checked end to end against plain steps. Both engines attend with the
GPU's attention kernels (kernels/triton_attn.py) under Triton's interpreter.
"""
import pytest
import torch

from eager_graph import EagerGraph
from triton_interpreter import HAS_TRITON, RUN_HERE, rerun_under_interpreter
from nanovllm import LLM, SamplingParams
from nanovllm.config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS, Config
from nanovllm.engine.prefill_graph import SIZE_STEP, prefill_capture_sizes
from tiny_models import random_prompts

CHILD_TIMEOUT_S = 600
needs_kernels = pytest.mark.skipif(not RUN_HERE or torch.cuda.is_available(),
                                   reason="CPU only, in the interpreter child")


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON or torch.cuda.is_available(), reason="the kernel runs in this process")
def test_prefill_graphs_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def test_capture_sizes_cover_every_step_up_to_the_cap():
    sizes = prefill_capture_sizes(8192, DEFAULT_MAX_PREFILL_GRAPH_TOKENS)
    assert sizes[0] == 16 and sizes[-1] == DEFAULT_MAX_PREFILL_GRAPH_TOKENS and sizes == sorted(set(sizes))
    # above the small sizes, a step pads fewer than SIZE_STEP tokens
    assert all(b - a <= SIZE_STEP for a, b in zip(sizes, sizes[1:]))
    assert prefill_capture_sizes(100, DEFAULT_MAX_PREFILL_GRAPH_TOKENS) == [16, 32, 64, 100]
    assert prefill_capture_sizes(8192, 700) == [16, 32, 64, 128, 256, 512, 700]
    assert prefill_capture_sizes(8, DEFAULT_MAX_PREFILL_GRAPH_TOKENS) == [8]


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_max_prefill_graph_tokens_is_an_int_of_zero_or_more(value):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        Config("m", max_prefill_graph_tokens=value)
    assert Config("m", max_prefill_graph_tokens=0).max_prefill_graph_tokens == 0


def _make(path, graphs: bool, monkeypatch, max_num_seqs=6, **kwargs):
    from nanovllm.engine.prefill_graph import PrefillGraphRunner
    from nanovllm.kernels import triton_attn
    from nanovllm.layers.attention import Attention
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=96, kvcache_block_size=16,
              max_num_seqs=max_num_seqs, max_model_len=256, enforce_eager=True, **kwargs)
    # a class attribute, for every engine of this process until the test ends
    monkeypatch.setattr(Attention, "backend", triton_attn)
    mr = llm.llm_engine.model_runner
    if not graphs:
        return llm, None
    orig = PrefillGraphRunner._capture_all

    def capture(self, model):
        self.graphs = {size: EagerGraph(self, model, size) for size in self.sizes}
    PrefillGraphRunner._capture_all = capture
    try:
        sizes = prefill_capture_sizes(mr.config.max_num_batched_tokens, mr.config.max_prefill_graph_tokens)
        mr.prefill_graph_runner = PrefillGraphRunner(
            mr.model, sizes, mr.config.max_num_seqs,
            mr._max_blocks_per_seq(), mr.max_model_len, mr.model_config.hidden_size, mr.dtype,
            mr.device)
    finally:
        PrefillGraphRunner._capture_all = orig
    return llm, mr.prefill_graph_runner


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3")[0]


def _generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_kernels
@pytest.mark.parametrize("max_num_batched_tokens", [48, 512])
def test_prefill_graphs_equal_plain_steps(model_path, max_num_batched_tokens, monkeypatch):
    """Prompts of 3-90 tokens, then prompts that share their first blocks (prefix-cache hits: a
    context longer than the step's queries); at 48 tokens a step, long prompts prefill in chunks
    beside decoding sequences (mixed steps). Every prefill step goes through a graph's size."""
    prompts = random_prompts([3, 17, 90, 33, 9, 61], seed=11)
    shared = [p[:40] + q for p, q in zip(prompts[2:5], random_prompts([5, 12, 2], seed=12))]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=4, ignore_eos=True) for i in range(len(prompts))]
    ref, _ = _make(model_path, False, monkeypatch, max_num_batched_tokens=max_num_batched_tokens)
    llm, runner = _make(model_path, True, monkeypatch, max_num_batched_tokens=max_num_batched_tokens)
    for batch, params in ((prompts, greedy), (shared, greedy), (prompts, sampled)):
        assert _generate(llm, batch, params) == _generate(ref, batch, params)
    replayed = {size: g.replays for size, g in runner.graphs.items() if g.replays}
    assert replayed and max(replayed) <= min(max_num_batched_tokens, DEFAULT_MAX_PREFILL_GRAPH_TOKENS)
    if max_num_batched_tokens == 48:  # full steps of 48 tokens: chunks, beside decodes once some run
        assert 48 in replayed
    else:  # whole prompts, then only what the prefix cache does not hold: steps of several sizes
        assert len(replayed) > 1
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@needs_kernels
def test_prompt_logprobs_through_prefill_graphs(model_path, monkeypatch):
    """Prompt logprobs read the hidden state of every prompt token: the graph's rows past the
    step's tokens must not shift them."""
    prompts = random_prompts([7, 29, 12], seed=13)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    ref, _ = _make(model_path, False, monkeypatch, max_num_batched_tokens=512)
    llm, runner = _make(model_path, True, monkeypatch, max_num_batched_tokens=512)
    a, b = ref.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs)
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert px.keys() == py.keys()
            assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
    assert sum(g.replays for g in runner.graphs.values()) > 0


@needs_kernels
def test_steps_of_more_sequences_than_rows_run_eager(model_path, monkeypatch):
    """The warm-up runs a mixed step of two sequences whatever max_num_seqs is: with one row a
    graph, such a step is left to the eager forward, and a one-sequence step is not."""
    from nanovllm.utils.context import Context
    _, runner = _make(model_path, True, monkeypatch, max_num_seqs=1, max_num_batched_tokens=64)

    def context(num_seqs: int) -> Context:
        return Context(slot_mapping=torch.zeros(20, dtype=torch.int64),
                       cu_seqlens_q=torch.tensor([0, 19, 20][:num_seqs] + [20], dtype=torch.int32),
                       seq_lens_k=torch.full((num_seqs,), 20, dtype=torch.int32),
                       block_tables=torch.zeros(num_seqs, 2, dtype=torch.int32), max_seqlen_q=20 - num_seqs + 1,
                       max_seqlen_k=20)
    assert runner.can_run(context(1), 20) and not runner.can_run(context(2), 20)
    assert not runner.can_run(context(1), 65)  # beyond the largest size
