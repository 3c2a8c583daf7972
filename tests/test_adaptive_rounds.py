"""Adaptive rounds (Config.adaptive_rounds; config.ARRIVAL_ROUND_STEPS says why).

With adaptive_rounds (off by default) an engine starts short decode rounds after each request it
adds while its batch has room, doubling each round up to num_scheduler_steps, so a request that
comes a little later joins within a few steps instead of waiting out a full round; and it ends a
round where one of its sequences reaches max_tokens. A full batch runs full-length rounds; by
default every round is full-length. The tiny Qwen3 model on the CPU, with explicit multi-step
rounds.
"""
import argparse

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from tiny_models import hf_greedy, random_prompts

STEPS = 16  # config.DEFAULT_GPU_SCHEDULER_STEPS: the GPU's rounds
PROMPTS = random_prompts([5, 17, 33, 9], seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
RAMP = [2, 4, 8, STEPS]  # the decode rounds after an arrival's prefill step


def _llm(path, adaptive_rounds=True, async_scheduling=False, max_num_seqs=8, num_scheduler_steps=STEPS) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=128,
               num_scheduler_steps=num_scheduler_steps, async_scheduling=async_scheduling,
               max_num_seqs=max_num_seqs, adaptive_rounds=adaptive_rounds)


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
def test_by_default_rounds_are_full_length(tiny_model, monkeypatch, async_scheduling):
    """LLM.generate with a batch that has room (4 prompts, max_num_seqs 8), adaptive rounds at
    their default (off): full-length rounds, the last one ending where every sequence reaches
    max_tokens (steps past every row's end would only be dropped)."""
    path, hf = tiny_model("qwen3")
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=128, num_scheduler_steps=STEPS,
              async_scheduling=async_scheduling, max_num_seqs=8)
    assert not llm.llm_engine.adaptive_rounds
    steps = _record_steps(monkeypatch, llm.llm_engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    full_rounds, last = divmod(GREEDY.max_tokens - 1, STEPS)  # decode tokens after the prefill step's
    assert steps == [1, *[STEPS] * full_rounds, *([last] if last else [])]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rounds_after_an_arrival_start_short_and_double(tiny_model, monkeypatch, async_scheduling):
    path, hf = tiny_model("qwen3")
    engine = _llm(path, async_scheduling=async_scheduling).llm_engine
    assert engine.adaptive_rounds
    steps = _record_steps(monkeypatch, engine)
    outputs = {}
    request = engine.add_request(None, PROMPTS[0], GREEDY)
    _drain(engine, outputs)
    # 60 tokens: the prefill step's, 2 + 4 + 8 + 16 + 16, and a last round that ends at max_tokens
    assert steps == [1, *RAMP, STEPS, GREEDY.max_tokens - 1 - sum(RAMP) - STEPS]
    assert outputs[request] == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_round_is_not_clipped_to_one_step(tiny_model, monkeypatch, async_scheduling):
    """One token left for one sequence at a round's start (config.MIN_CLIPPED_ROUND_STEPS): a
    full round for the other, whose rows past the first's max_tokens are dropped, not a one-step
    round the device would wait out. Where every sequence has one token left, one step: the
    rest would all be dropped."""
    path, hf = tiny_model("qwen3")
    max_tokens = 1 + sum(RAMP) + STEPS + 1   # the prefill step's token, the ramp, a full round, one more
    # the second sequence of the first pair runs one more full round, then its last token alone
    for lengths, expected in (([max_tokens, max_tokens + STEPS], [1, *RAMP, STEPS, STEPS, 1]),
                              ([max_tokens] * 2, [1, *RAMP, STEPS, 1])):
        engine = _llm(path, async_scheduling=async_scheduling).llm_engine
        steps = _record_steps(monkeypatch, engine)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
        ids = [engine.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
        outputs = {}
        _drain(engine, outputs)
        assert steps == expected
        for request_id, prompt, m in zip(ids, PROMPTS, lengths):
            assert outputs[request_id] == hf_greedy(hf, prompt, m)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_added_while_rounds_run_joins_sooner(tiny_model, async_scheduling):
    """The second request comes after the first one's first decode round: with the ramp it
    gets its first token a few of the first one's tokens later; with full-length rounds only
    after the first one's next full round (async scheduling: already launched when it comes)."""
    path, hf = tiny_model("qwen3")
    lead = {}
    for adaptive_rounds in (True, False):
        engine = _llm(path, adaptive_rounds, async_scheduling).llm_engine
        outputs = {}
        first = engine.add_request(None, PROMPTS[0], GREEDY)
        _step(engine, outputs)  # the prefill step
        _step(engine, outputs)  # the first decode round
        second = engine.add_request(None, PROMPTS[1], GREEDY)
        while second not in outputs:
            _step(engine, outputs)
        lead[adaptive_rounds] = len(outputs[first])
        _drain(engine, outputs)
        assert outputs[first] == hf_greedy(hf, PROMPTS[0], GREEDY.max_tokens)
        assert outputs[second] == hf_greedy(hf, PROMPTS[1], GREEDY.max_tokens)
    # the prefill step, the first round, the round launched before the second came (async
    # scheduling), and the step that prefills the second, in which the first decodes too
    chained = RAMP[1] if async_scheduling else 0
    assert lead[True] == 1 + RAMP[0] + chained + 1
    assert lead[False] == 1 + STEPS + (STEPS if async_scheduling else 0) + 1


def test_a_full_batch_runs_full_rounds_while_requests_arrive(tiny_model, monkeypatch):
    path, _ = tiny_model("qwen3")
    engine = _llm(path, max_num_seqs=2).llm_engine
    steps = _record_steps(monkeypatch, engine)
    for prompt in PROMPTS[:2]:
        engine.add_request(None, prompt, GREEDY)
    _drain(engine, {})
    assert steps[:3] == [1, STEPS, STEPS]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rounds_end_where_a_sequence_reaches_max_tokens(tiny_model, monkeypatch, async_scheduling):
    """With adaptive rounds no round runs past a sequence's max_tokens unless only one step was
    left (a round of one step is never clipped to); without them the last rounds overshoot."""
    path, hf = tiny_model("qwen3")
    max_tokens = [10, 23, 60]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    overshoots = {}
    for adaptive_rounds in (True, False):
        engine = _llm(path, adaptive_rounds, async_scheduling).llm_engine
        runner, launch, overshoot = engine.model_runner, engine.model_runner.launch_decode_round, []

        def recording_launch(seqs, num_steps, after=None, launch=launch, overshoot=overshoot):
            pending = 0 if after is None else 1
            left = min(s.sampling_params.max_tokens - s.num_completion_tokens - pending for s in seqs)
            overshoot.append(num_steps > left >= 2)
            return launch(seqs, num_steps, after=after)
        monkeypatch.setattr(runner, "launch_decode_round", recording_launch)
        ids = [engine.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
        outputs = {}
        _drain(engine, outputs)
        for request_id, prompt, m in zip(ids, PROMPTS, max_tokens):
            assert outputs[request_id] == hf_greedy(hf, prompt, m)
        overshoots[adaptive_rounds] = any(overshoot)
    assert overshoots == {True: False, False: True}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_waiting_request_takes_the_slot_a_clipped_round_frees(tiny_model, async_scheduling):
    """A full batch (max_num_seqs 2) with a third request waiting: the round ends where the
    first sequence reaches max_tokens, and the waiting request is prefilled in the step right
    after it, in which the other sequence decodes too. With async scheduling no round may be
    chained past that end (the outstanding token frees the slot)."""
    path, hf = tiny_model("qwen3")
    engine = _llm(path, async_scheduling=async_scheduling, max_num_seqs=2).llm_engine
    max_tokens = [40, 60, 20]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    first, other, waiting = [engine.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
    outputs = {}
    while waiting not in outputs:
        _step(engine, outputs)
    assert len(outputs[first]) == max_tokens[0]
    assert len(outputs[other]) == max_tokens[0] + 1
    _drain(engine, outputs)
    for request_id, prompt, m in zip((first, other, waiting), PROMPTS, max_tokens):
        assert outputs[request_id] == hf_greedy(hf, prompt, m)


def test_the_server_flag_turns_adaptive_rounds_on():
    from nanovllm.entrypoints.engine_args import engine_kwargs
    from nanovllm.entrypoints.openai.api_server import add_cli_args
    parse = lambda argv: add_cli_args(argparse.ArgumentParser()).parse_args(argv)  # noqa: E731
    assert engine_kwargs(parse(["m", "--adaptive-rounds"]))["adaptive_rounds"] is True
    assert "adaptive_rounds" not in engine_kwargs(parse(["m"]))  # Config's default: off


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_adaptive_rounds_is_checked(value):
    with pytest.raises(ValueError, match="adaptive_rounds"):
        Config(model="m", adaptive_rounds=value)


def test_adaptive_rounds_need_multi_step_rounds(tiny_model):
    path, _ = tiny_model("qwen3")
    with pytest.raises(ValueError, match="adaptive_rounds .*num_scheduler_steps > 1"):
        _llm(path, adaptive_rounds=True, num_scheduler_steps=1)
    assert not _llm(path, adaptive_rounds=False, num_scheduler_steps=1).llm_engine.adaptive_rounds
