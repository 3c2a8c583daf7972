"""A burst of arrivals at an idle engine joins one prefill step (engine_core.ARRIVAL_GAP_S).

`next_command` on a plain queue: without a burst it never waits; within one it waits up to the gap
for the next command, never past the burst's end. Through AsyncLLM in thread mode with a tiny
random Qwen3 model: three requests sent 0.2 s apart reach an idle engine; with the gap widened to
a second the first step prefills all three, with no gap (the engine as before) it prefills the first
alone. The gap is widened so that the test does not race the machine's scheduler.
"""
import asyncio
import queue
import threading
import time

import pytest

from nanovllm.engine import async_llm, engine_core
from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.engine.engine_core import next_command
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

SPACING_S = 0.2   # between the test's requests
WIDE_GAP_S = 1.0  # the gap the burst test widens ARRIVAL_GAP_S to: five times the spacing


def test_no_burst_takes_only_what_is_queued():
    commands = queue.Queue()
    commands.put("a")
    assert next_command(commands, None) == "a"
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        next_command(commands, None)
    assert time.monotonic() - start < engine_core.ARRIVAL_GAP_S


def test_a_burst_waits_for_the_next_command_within_the_gap(monkeypatch):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", WIDE_GAP_S)
    commands = queue.Queue()
    threading.Timer(SPACING_S, commands.put, args=("late",)).start()
    assert next_command(commands, time.monotonic() + 10 * WIDE_GAP_S) == "late"


def test_a_burst_ends_at_the_gap_or_at_its_end(monkeypatch):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", SPACING_S)
    commands = queue.Queue()
    start = time.monotonic()
    with pytest.raises(queue.Empty):   # nothing within the gap
        next_command(commands, start + 10 * WIDE_GAP_S)
    assert SPACING_S * 0.9 <= time.monotonic() - start < WIDE_GAP_S
    start = time.monotonic()
    with pytest.raises(queue.Empty):   # the burst is over: no wait at all
        next_command(commands, start - 1.0)
    assert time.monotonic() - start < SPACING_S / 2


@pytest.mark.parametrize("gap_s, first_prefill_rows", [(WIDE_GAP_S, 3), (0.0, 1)])
def test_an_idle_engine_prefills_a_burst_in_one_step(tiny_model, monkeypatch, gap_s, first_prefill_rows):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", gap_s)
    monkeypatch.setattr(async_llm, "ARRIVAL_WINDOW_S", 10 * WIDE_GAP_S)
    path, _ = tiny_model("qwen3")
    engine = LLMEngine(path, skip_tokenizer_init=True, max_model_len=128, num_kvcache_blocks=32)
    step_rows: list[int] = []
    run = engine.model_runner.run
    monkeypatch.setattr(engine.model_runner, "run", lambda seqs, *a, **k: step_rows.append(len(seqs)) or run(seqs, *a, **k))
    llm = AsyncLLM.from_engine(engine, log_stats_interval=0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def one(i: int) -> int:
        await asyncio.sleep(i * SPACING_S)
        num_tokens = 0
        async for out in llm.generate([5 + i, 6, 7, 8], params, f"burst-{i}"):
            num_tokens += len(out.outputs[0].token_ids)   # streamed: each output holds the new tokens
        return num_tokens

    async def burst() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(3)))
    try:
        assert asyncio.run(burst()) == [4, 4, 4]
    finally:
        llm.shutdown()
    assert step_rows[0] == first_prefill_rows
