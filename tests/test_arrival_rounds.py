"""Rounds while requests arrive (Config.arrival_round_steps, config.DEFAULT_ARRIVAL_ROUND_STEPS).

An engine served online (`LLMEngine.serve_online`: AsyncLLM, the engine process) starts short
decode rounds after each request it adds while its batch has room, doubling each round up to
num_scheduler_steps, so a request that comes a little later joins within a few steps instead of
waiting out a full round. Offline inference (LLM.generate: everything queued before the first
step) and a full batch keep full-length rounds. The tiny Qwen3 model on the CPU, with explicit
multi-step rounds.
"""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from tiny_models import hf_greedy, random_prompts

STEPS = 16  # config.DEFAULT_GPU_SCHEDULER_STEPS: the GPU's rounds
PROMPTS = random_prompts([5, 17, 33, 9], seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
RAMP = [2, 4, 8, STEPS]  # the decode rounds after an arrival's prefill step, at the default (1)


def _llm(path, arrival_round_steps=None, async_scheduling=False, max_num_seqs=8) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=128, num_scheduler_steps=STEPS,
               async_scheduling=async_scheduling, max_num_seqs=max_num_seqs, arrival_round_steps=arrival_round_steps)


def _record_steps(monkeypatch, engine) -> list[int]:
    """The steps of every launch from now on: a round's num_steps, 1 for a plain step."""
    runner, steps = engine.model_runner, []
    launch, run = runner.launch_decode_round, runner.run

    def recording_launch(seqs, num_steps, after=None):
        steps.append(num_steps)
        return launch(seqs, num_steps, after=after)

    def recording_run(seqs):
        steps.append(1)
        return run(seqs)
    monkeypatch.setattr(runner, "launch_decode_round", recording_launch)
    monkeypatch.setattr(runner, "run", recording_run)
    return steps


def _drain(engine, outputs: dict) -> None:
    while engine.has_unfinished_requests():
        _step(engine, outputs)


def _step(engine, outputs: dict) -> None:
    for out in engine.step():
        outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offline_generate_runs_the_same_rounds(tiny_model, monkeypatch, async_scheduling):
    """LLM.generate with a batch that has room (4 prompts, max_num_seqs 8): nothing arrives
    while it runs, so its launches are those of the ramp turned off, full-length rounds."""
    path, hf = tiny_model("qwen3")
    launches = {}
    for arrival_round_steps in (None, STEPS):
        llm = _llm(path, arrival_round_steps, async_scheduling)
        steps = _record_steps(monkeypatch, llm.llm_engine)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        launches[arrival_round_steps] = steps
    assert launches[None] == launches[STEPS]
    assert launches[None][:2] == [1, STEPS]  # the prefill step, then a full round


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rounds_after_an_arrival_start_short_and_double(tiny_model, monkeypatch, async_scheduling):
    path, hf = tiny_model("qwen3")
    engine = _llm(path, async_scheduling=async_scheduling).llm_engine
    engine.serve_online(lambda: False)
    steps = _record_steps(monkeypatch, engine)
    outputs = {}
    request = engine.add_request(None, PROMPTS[0], GREEDY)
    _drain(engine, outputs)
    assert steps[:len(RAMP) + 2] == [1, *RAMP, STEPS]
    assert outputs[request] == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_added_while_rounds_run_joins_sooner(tiny_model, async_scheduling):
    """The second request comes after the first one's first decode round: with the ramp it
    gets its first token a few of the first one's tokens later; with full-length rounds only
    after the first one's next full round (async scheduling: already launched when it comes)."""
    path, hf = tiny_model("qwen3")
    lead = {}
    for arrival_round_steps in (None, STEPS):
        engine = _llm(path, arrival_round_steps, async_scheduling).llm_engine
        engine.serve_online(lambda: False)
        outputs = {}
        first = engine.add_request(None, PROMPTS[0], GREEDY)
        _step(engine, outputs)  # the prefill step
        _step(engine, outputs)  # the first decode round
        second = engine.add_request(None, PROMPTS[1], GREEDY)
        while second not in outputs:
            _step(engine, outputs)
        lead[arrival_round_steps] = len(outputs[first])
        _drain(engine, outputs)
        assert outputs[first] == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)
        assert outputs[second] == hf_greedy(hf, PROMPTS[1], GREEDY.max_tokens)
    # the prefill step, the first round, the round launched before the second came (async
    # scheduling), and the step that prefills the second, in which the first decodes too
    chained = RAMP[1] if async_scheduling else 0
    assert lead[None] == 1 + RAMP[0] + chained + 1
    assert lead[STEPS] == 1 + STEPS + (STEPS if async_scheduling else 0) + 1


def test_a_full_batch_runs_full_rounds_while_requests_arrive(tiny_model, monkeypatch):
    path, _ = tiny_model("qwen3")
    engine = _llm(path, max_num_seqs=2).llm_engine
    engine.serve_online(lambda: False)
    steps = _record_steps(monkeypatch, engine)
    for prompt in PROMPTS[:2]:
        engine.add_request(None, prompt, GREEDY)
    _drain(engine, {})
    assert steps[:3] == [1, STEPS, STEPS]


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "4"])
def test_arrival_round_steps_is_checked(value):
    with pytest.raises(ValueError, match="arrival_round_steps"):
        Config(model="m", arrival_round_steps=value)
