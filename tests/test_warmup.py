"""The start-up kernel warm-up (engine/warmup.py) on the CPU: which steps it enumerates, and
that running them on a real runner works and leaves no trace (the engine's outputs after it,
greedy and unseeded random, are those of an engine that never ran it). On a GPU the engine
runs it at start-up; tests/test_warmup_gpu.py checks that nothing compiles afterwards."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.cuda_graph import capture_sizes
from nanovllm.engine.warmup import (GRAMMAR_PROFILES, MULTI_STEP_STEPS, SAMPLING_PROFILES, VariantCounter,
                                    compile_progress, log_startup_phase, warm_up_kernels, warmup_steps)
from tiny_models import random_prompts

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 24
CHUNK = 64
ENGINE = dict(device="cpu", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=CHUNK, num_kvcache_blocks=64, seed=3)


def _kinds(steps):
    return {step.name: step for step in steps}


def test_steps_cover_every_kind_of_step():
    steps = _kinds(warmup_steps(MAX_MODEL_LEN, CHUNK, MAX_NUM_SEQS, multi_step=True))
    decode_sizes = sorted(len(s.seqs) for name, s in steps.items() if name.startswith("decode, batch"))
    assert decode_sizes == sorted(set(capture_sizes(MAX_NUM_SEQS)) | {MAX_NUM_SEQS})
    profiles = {name.removeprefix("sampling: ") for name in steps if name.startswith("sampling: ")}
    assert profiles == set(SAMPLING_PROFILES)
    masked = {name.removeprefix("sampling under a grammar: ") for name, step in steps.items()
              if step.grammar_bitmask}
    assert masked == set(GRAMMAR_PROFILES) and masked <= set(SAMPLING_PROFILES)
    (mid,) = steps["prefill, a chunk ending mid-prompt"].seqs
    assert mid.computed + mid.scheduled < mid.total and mid.scheduled == CHUNK  # does not sample
    (whole,) = steps["prefill, one whole chunk"].seqs
    assert whole.scheduled == whole.total == CHUNK
    (prefix,) = steps["prefill over a long cached prefix"].seqs
    assert prefix.computed > CHUNK and 1 < prefix.scheduled <= CHUNK  # few queries, long context: split-KV
    decode, prefill = steps["mixed prefill and decode"].seqs
    assert decode.scheduled == 1 and prefill.scheduled > 1
    assert steps["multi-step rounds"].decode_round
    for step in steps.values():
        assert all(s.scheduled <= CHUNK for s in step.seqs)
        # a round and a chained one after the longest context stay inside max_model_len
        assert all(s.total + 2 * MULTI_STEP_STEPS <= MAX_MODEL_LEN for s in step.seqs), step.name
    assert not any(s.decode_round for s in warmup_steps(MAX_MODEL_LEN, CHUNK, MAX_NUM_SEQS, multi_step=False))


def test_steps_prefill_each_product_tile_bound(monkeypatch):
    """A batch of each row bound of the fp8 product table that a prefill chunk can hold: the tile
    of batches between the CUDA-graph sizes is compiled too."""
    bg = pytest.importorskip("nanovllm.kernels.triton_batch_gemm")
    tile = (64, 32, 128, 4, 5)
    monkeypatch.setattr(bg, "FP8_TILES", ((16, tile), (40, None), (48, tile), (CHUNK + 1, tile)))
    monkeypatch.setattr(bg, "FP8_TILES_BY_SHAPE", ())
    steps = _kinds(warmup_steps(MAX_MODEL_LEN, CHUNK, MAX_NUM_SEQS, multi_step=True))
    bounds = [step.seqs[0].scheduled for name, step in steps.items() if name.endswith("(a product tile's bound)")]
    assert bounds == [16, 48]  # no tile at 40; CHUNK + 1 tokens fit no step of CHUNK


def test_steps_reach_a_tile_bound_beyond_one_prompt_with_several(monkeypatch):
    """Where a step holds more tokens than one prompt can (max_num_batched_tokens above the longest
    prompt), a bound beyond one prompt is reached by several prompts in one step, as the scheduler
    would batch them; a bound that would need more prompts than max_num_seqs is not a step."""
    bg = pytest.importorskip("nanovllm.kernels.triton_batch_gemm")
    tile = (64, 32, 128, 4, 5)
    monkeypatch.setattr(bg, "FP8_TILES", ((16, tile), (100, tile), (400, tile)))
    monkeypatch.setattr(bg, "FP8_TILES_BY_SHAPE", ())
    max_model_len, batched, seqs = 64, 512, 4
    steps = _kinds(warmup_steps(max_model_len, batched, seqs, multi_step=False))
    bound_steps = {name: step for name, step in steps.items() if name.endswith("(a product tile's bound)")}
    longest = max_model_len - 2 * MULTI_STEP_STEPS - 1  # the longest prompt a warm-up step takes
    totals = sorted(sum(s.scheduled for s in step.seqs) for step in bound_steps.values())
    assert totals == [16, 100]  # 400 tokens would need 7 prompts of at most 59
    for step in bound_steps.values():
        assert all(2 <= s.scheduled == s.total <= longest for s in step.seqs)
    assert len(bound_steps["prefill, 100 tokens (a product tile's bound)"].seqs) > 1


def test_tiny_limits_still_fit():
    for step in warmup_steps(12, 4, 1, multi_step=True):
        assert all(1 <= s.scheduled <= max(4, 2) and s.total + 2 * MULTI_STEP_STEPS <= 12 for s in step.seqs)


def _outputs(llm):
    prompts = random_prompts([5, 40, 70], seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    random = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # unseeded: the global RNG
    outs = llm.generate(prompts + prompts, [greedy] * 3 + [random] * 3, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3")[0]


def test_warm_up_runs_every_step_and_leaves_no_trace(model_path):
    expected = _outputs(LLM(model_path, **ENGINE))
    llm = LLM(model_path, **ENGINE)
    engine = llm.llm_engine
    lines = []
    assert warm_up_kernels(engine.model_runner, log=lines.append) == 0  # the CPU path launches no Triton
    steps = warmup_steps(MAX_MODEL_LEN, CHUNK, MAX_NUM_SEQS, multi_step=True)
    assert lines[-1].startswith(f"kernel warm-up: {len(steps)} steps")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert _outputs(llm) == expected


def test_warm_up_runs_a_bound_step_of_several_prompts(model_path, monkeypatch):
    """A tile bound beyond one prompt (max_model_len 64, 128 tokens a step) runs as one step of
    several prefills on a real runner, and leaves the cache as it found it."""
    bg = pytest.importorskip("nanovllm.kernels.triton_batch_gemm")
    monkeypatch.setattr(bg, "FP8_TILES", ((100, (64, 32, 128, 4, 5)),))
    monkeypatch.setattr(bg, "FP8_TILES_BY_SHAPE", ())
    limits = dict(max_model_len=64, max_num_batched_tokens=128, max_num_seqs=4)
    llm = LLM(model_path, **{**ENGINE, **limits})
    engine = llm.llm_engine
    steps = _kinds(warmup_steps(**limits, multi_step=True))
    assert len(steps["prefill, 100 tokens (a product tile's bound)"].seqs) == 2
    lines = []
    assert warm_up_kernels(engine.model_runner, log=lines.append) == 0
    assert lines[-1].startswith(f"kernel warm-up: {len(steps)} steps")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_variant_counter_chains_and_restores_the_hook():
    knobs = pytest.importorskip("triton").knobs.runtime
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["repr"])
        return False
    saved, knobs.jit_cache_hook = knobs.jit_cache_hook, previous
    try:
        with VariantCounter() as counter:
            assert knobs.jit_cache_hook(repr="kernel[sig]", fn=None) is False  # Triton goes on to compile
        assert counter.names == ["kernel[sig]"] and seen == ["kernel[sig]"]
        assert knobs.jit_cache_hook is previous
    finally:
        knobs.jit_cache_hook = saved


def test_compile_progress_names_each_new_variant(capsys):
    knobs = pytest.importorskip("triton").knobs.runtime
    kernel = type("Info", (), {"name": "_some_kernel"})()
    with compile_progress(rank=0) as counter:
        knobs.jit_cache_hook(repr="_some_kernel[sig]", fn=kernel)
    with compile_progress(rank=1):  # other ranks stay quiet
        knobs.jit_cache_hook(repr="_some_kernel[sig]", fn=kernel)
    err = capsys.readouterr().err.splitlines()
    assert counter.names == ["_some_kernel[sig]"]
    assert len(err) == 1 and err[0].startswith("nanovllm: compiling kernels: 1 so far") and "_some_kernel" in err[0]


def test_start_up_says_how_many_cache_blocks_it_sized(model_path, capsys):
    capsys.readouterr()
    engine = LLM(model_path, **ENGINE).llm_engine
    lines = [line for line in capsys.readouterr().err.splitlines() if "start-up:" in line]
    assert len(lines) == 1  # the CPU has no graphs to capture
    assert lines[0].startswith(f"nanovllm: start-up: KV cache of {engine.block_manager.num_blocks} blocks sized in ")
    assert lines[0].endswith(" s")


def test_start_up_says_when_the_tokenizer_loaded_beside_the_model_runner(capsys):
    from smollm2_tokenizer import smollm2_tokenizer, tiny_model_with_smollm2_tokenizer
    path = tiny_model_with_smollm2_tokenizer()
    capsys.readouterr()
    engine = LLM(path, **{**ENGINE, "skip_tokenizer_init": False}).llm_engine
    lines = [line for line in capsys.readouterr().err.splitlines() if "start-up:" in line]
    text = "The capital of France is Paris."
    assert engine.tokenizer.encode(text) == smollm2_tokenizer().encode(text)
    assert any(line.startswith("nanovllm: start-up: tokenizer loaded beside the model runner in ") for line in lines)
    assert len(lines) == 2


def test_start_up_phases_are_told_by_rank_zero_only(capsys):
    log_startup_phase(1, "decode graphs captured", 0.0)
    assert capsys.readouterr().err == ""
    log_startup_phase(0, "decode graphs captured", 0.0)
    assert capsys.readouterr().err.startswith("nanovllm: start-up: decode graphs captured in ")
