"""Structured outputs in multi-step decode rounds (engine/decode_round.py's lazy rounds), and
under tensor parallelism.

A round with grammar rows queues each step's sampling once the engine has postprocessed
the step before (its matchers have accepted the tokens), so with num_scheduler_steps > 1
(forced here: the CPU default is 1), plain rounds and async-chained ones, constrained and
free requests in one batch must give exactly the token ids of one-step runs, greedy and
seeded; a grammar that completes mid-round stops there; preemption and an abort between
rounds change nothing for the others and leak no block. TP=2 runs one-step rounds (multi-
step needs TP=1) and must equal TP=1. The model is a tiny random llama with SmolLM2's
vocabulary: only the masks make its outputs valid.
"""
import functools
import json
import re

import jsonschema
import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from smollm2_tokenizer import tiny_model_with_smollm2_tokenizer

pytest.importorskip("xgrammar")

loads = functools.partial(json.loads, strict=False)  # xgrammar's strings admit control characters
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}}}
CONSTRAINT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
STEPS = 4
PROMPTS = ["Hello", "Hi there", "Tell me about it", "Free text", "one more", "and the last"]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=len(PROMPTS))
MODES = ("rounds", "async")
START_AT = 6  # a constraint's start token at this output position: inside the second round
MIN_TOKENS = 7  # EOS allowed from the middle of the second round on


def _params(temperature: float, seed: int | None = None) -> list[SamplingParams]:
    """Constrained and free requests alternating; the free ones run to max_tokens."""
    return [SamplingParams(temperature=temperature, seed=None if seed is None else seed + i, max_tokens=96,
                           structured_outputs=CONSTRAINT) if i % 2 == 0 else
            SamplingParams(temperature=temperature, seed=None if seed is None else seed + i, max_tokens=21,
                           ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def engines():
    path = tiny_model_with_smollm2_tokenizer()
    made = {"single": LLM(path, num_kvcache_blocks=64, num_scheduler_steps=1, **ENGINE),
            "rounds": LLM(path, num_kvcache_blocks=64, num_scheduler_steps=STEPS, async_scheduling=False, **ENGINE),
            "async": LLM(path, num_kvcache_blocks=64, num_scheduler_steps=STEPS, async_scheduling=True, **ENGINE)}
    yield made
    for llm in made.values():
        llm.shutdown()


def _run(llm, params, prompts=PROMPTS):
    outs = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outs


def _record_rounds(monkeypatch, engine) -> list[tuple[list, int, list[int], bool]]:
    """Every round `engine` launches: (its sequences, its steps, the index of each one's first
    token in the round, whether it was chained onto the round before)."""
    launch, rounds = engine.model_runner.launch_decode_round, []

    def recording(seqs, num_steps, after=None):
        pending = 0 if after is None else 1
        rounds.append((list(seqs), num_steps, [s.num_completion_tokens + pending for s in seqs], after is not None))
        return launch(seqs, num_steps, after=after)
    monkeypatch.setattr(engine.model_runner, "launch_decode_round", recording)
    return rounds


def _assert_valid(outs):
    for out in outs[0::2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(loads(out.text), SCHEMA)  # nothing after the JSON: loads refuses extra data
    for out in outs[1::2]:
        assert out.finish_reason == "length" and len(out.token_ids) == 21


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 40)], ids=["greedy", "seeded"])
def test_constrained_and_free_rows_in_rounds_equal_one_step_runs(engines, monkeypatch, mode, temperature, seed):
    rounds = _record_rounds(monkeypatch, engines[mode].llm_engine)
    params = _params(temperature, seed)
    single, multi = _run(engines["single"], params), _run(engines[mode], params)
    assert [o.token_ids for o in multi] == [o.token_ids for o in single]
    _assert_valid(multi)
    constrained = [chained for seqs, num_steps, _, chained in rounds
                   if num_steps > 1 and any(s.grammar is not None for s in seqs)]
    assert constrained, "no multi-step round carried a constrained row"
    assert any(constrained) == (mode == "async")  # async scheduling chains those rounds too


@pytest.mark.parametrize("mode", MODES)
def test_a_grammar_that_completes_mid_round_stops_there(engines, monkeypatch, mode):
    """Some constrained sequence ends at a step of a round that has steps after it: its
    output ends with the grammar (the same ids as one-step runs), and the later rows of the
    round (and of a round chained before the host saw the end) are dropped."""
    rounds = _record_rounds(monkeypatch, engines[mode].llm_engine)
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=96, structured_outputs=CONSTRAINT)
              for i in range(len(PROMPTS))]
    multi = _run(engines[mode], params)
    single = _run(engines["single"], params)
    assert [o.token_ids for o in multi] == [o.token_ids for o in single]
    ends = {}
    for seqs, num_steps, starts, _ in rounds:
        for seq, start in zip(seqs, starts):
            if start < seq.num_completion_tokens < start + num_steps:  # it ended inside this round
                ends[seq.seq_id] = seq
    assert ends, "no grammar completed mid-round: pick other seeds"
    for out in multi:
        assert out.finish_reason == "stop"
        jsonschema.validate(loads(out.text), SCHEMA)


@pytest.mark.parametrize("mode", MODES)
def test_penalties_and_min_tokens_rows_run_in_lazy_rounds_too(engines, monkeypatch, mode):
    """Rows whose sampling counts their own tokens (penalties) or bans EOS until min_tokens
    (made likely here by a logit bias) join rounds as well: the same ids as one-step runs."""
    rounds = _record_rounds(monkeypatch, engines[mode].llm_engine)
    eos = engines["single"].get_tokenizer().eos_token_id
    params = [SamplingParams(temperature=1.0, seed=20, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=2.0),
              SamplingParams(temperature=1.0, seed=21, max_tokens=24, min_tokens=MIN_TOKENS, logit_bias={eos: 30.0}),
              SamplingParams(temperature=1.0, seed=22, max_tokens=24, ignore_eos=True)]  # no grammar in the batch
    single, multi = _run(engines["single"], params, PROMPTS[:4]), _run(engines[mode], params, PROMPTS[:4])
    assert [o.token_ids for o in multi] == [o.token_ids for o in single]
    stopped = multi[2]
    assert stopped.finish_reason == "stop" and MIN_TOKENS < len(stopped.token_ids) < 24, stopped.token_ids
    in_rounds = {s.seq_id for seqs, num_steps, starts, _ in rounds if num_steps > 1
                 for s, start in zip(seqs, starts)
                 if s.sampling_params.has_penalties or start < s.sampling_params.min_tokens}
    assert len(in_rounds) == 3, "the penalties and min_tokens rows did not run in rounds"


@pytest.mark.parametrize("mode", MODES)
def test_a_constraint_that_starts_mid_round(engines, mode):
    """start_after_token_id (a reasoning model's end of thinking) comes mid-round: the masks
    of the round's later steps follow it. The start token is the one a free run draws at
    position START_AT, so the output is free until there, then the regex."""
    free = SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    drawn = _run(engines["single"], free, ["x"])[0].token_ids
    start = drawn[START_AT]
    assert start not in drawn[:START_AT], "the start token comes earlier: pick another seed"
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=24, structured_outputs=StructuredOutputsParams(
        regex=r"\d{3}", start_after_token_id=start))
    single, multi = _run(engines["single"], params, ["x"])[0], _run(engines[mode], params, ["x"])[0]
    assert multi.token_ids == single.token_ids and multi.token_ids[:START_AT + 1] == drawn[:START_AT + 1]
    tokenizer = engines[mode].get_tokenizer()
    assert re.fullmatch(r"\d{3}", tokenizer.decode(multi.token_ids[START_AT + 1:], skip_special_tokens=True))
    assert multi.finish_reason == "stop"


def test_preemption_between_rounds_gives_the_same_tokens(engines):
    """8 blocks of 16 tokens for six ~60-token requests: they preempt each other between rounds,
    and get the tokens of one-step runs with room to spare."""
    path = tiny_model_with_smollm2_tokenizer()
    params = [SamplingParams(temperature=0, max_tokens=96, structured_outputs=CONSTRAINT),
              SamplingParams(temperature=1.0, seed=5, max_tokens=96, structured_outputs=CONSTRAINT),
              SamplingParams(temperature=1.0, seed=6, max_tokens=40, ignore_eos=True)] * 2
    prompts = ["one " * 20, "two " * 21, "three " * 19, "four " * 22, "five " * 18, "six " * 20]
    with LLM(path, num_kvcache_blocks=8, num_scheduler_steps=STEPS, async_scheduling=True,
             **{**ENGINE, "max_model_len": 128}) as llm:
        preempted = [c.token_ids for c in _run(llm, params, prompts)]
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert preempted == [c.token_ids for c in _run(engines["single"], params, prompts)]


def test_an_abort_while_a_chained_round_is_outstanding_frees_its_blocks(engines):
    """A constrained request aborted while the round chained after its own is outstanding: its
    rows there are computed and dropped (no mask asked of it), its blocks are free at once, and
    the others get exactly what they get without it."""
    engine = engines["async"].llm_engine
    params = _params(1.0, 60)
    seqs = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"abort-{i}", prompt, p)
        seqs[f"abort-{i}"] = engine.scheduler.waiting[-1]
    outputs = {rid: [] for rid in seqs}
    victim = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.outputs[0].token_ids
        if victim is None and engine._next_round is not None:
            victim = next(rid for rid, seq in seqs.items() if seq.grammar is not None
                          and seq in engine._next_round.seqs and not seq.is_finished)
            engine.abort(victim)
            assert seqs[victim].is_finished and not seqs[victim].block_table
    assert victim is not None, "no round was chained"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    single = dict(zip(seqs, (o.token_ids for o in _run(engines["single"], params))))
    for rid, token_ids in outputs.items():
        if rid == victim:
            assert token_ids == single[rid][:len(token_ids)] and len(token_ids) < len(single[rid])
        else:
            assert token_ids == single[rid]


def test_tensor_parallel_constrained_outputs_equal_tp1():
    """TP=2 on the CPU (one-step rounds: multi-step needs TP=1): the same ids as TP=1, valid."""
    path = tiny_model_with_smollm2_tokenizer()
    params = _params(0.0)[:2] + _params(1.0, 80)[:2]
    prompts = PROMPTS[:4]
    runs = []
    for tp in (1, 2):
        with LLM(path, device="cpu", tensor_parallel_size=tp, num_kvcache_blocks=64, **ENGINE) as llm:
            runs.append(_run(llm, params, prompts))
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    _assert_valid(runs[1])
