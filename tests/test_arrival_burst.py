"""A burst of arrivals at an idle engine joins one prefill step (engine_core.ARRIVAL_GAP_S).

`next_command` on a plain queue: without a burst it never waits; within one it waits up to the gap
for the next command (polling: a command that comes is taken at once, not at the gap's end), and
never past the burst's end. Both serving loops (the engine thread's and the
engine process's, on stand-ins for their engines): idle, they take a command that comes 0.2 s after the
first into the same batch; busy, they wait for nothing; a stop that comes within a burst stops them at
once. Through AsyncLLM in thread mode with a tiny random Qwen3 model: three requests sent 0.5 s apart
reach an idle engine; with the gap widened the first step prefills all three, with no gap (the engine as
before) it prefills the first alone. The gap is widened to two seconds throughout, and the bounds on
waits are loose, so that the tests do not race a loaded machine's scheduler.
"""
import asyncio
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from nanovllm.engine import engine_core
from nanovllm.engine.async_llm import AsyncLLM, EngineThread
from nanovllm.engine.engine_core import STOP, EngineCoreProc, next_command
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

SPACING_S = 0.2          # between the tests' commands
REQUEST_SPACING_S = 0.5  # between the requests sent through AsyncLLM (each may start a step)
WIDE_GAP_S = 2.0         # what the tests widen ARRIVAL_GAP_S to: four times the longer spacing
WIDE_WINDOW_S = 10 * WIDE_GAP_S


@pytest.fixture
def wide_gap(monkeypatch):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", WIDE_GAP_S)
    monkeypatch.setattr(engine_core, "ARRIVAL_WINDOW_S", WIDE_WINDOW_S)


def _put_later(commands: queue.Queue, item) -> None:
    threading.Timer(SPACING_S, commands.put, args=(item,)).start()


# ---- next_command ------------------------------------------------------------------------------

def test_no_burst_takes_only_what_is_queued(wide_gap):
    commands = queue.Queue()
    commands.put("a")
    assert next_command(commands, None) == "a"
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        next_command(commands, None)
    assert time.monotonic() - start < WIDE_GAP_S / 2


def test_a_burst_waits_for_the_next_command_within_the_gap(wide_gap):
    commands = queue.Queue()
    _put_later(commands, "late")
    start = time.monotonic()
    assert next_command(commands, time.monotonic() + WIDE_WINDOW_S) == "late"
    assert time.monotonic() - start < WIDE_GAP_S / 2   # taken at the next poll, not at the gap's end


def test_a_burst_ends_at_the_gap(monkeypatch):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", SPACING_S)
    start = time.monotonic()
    with pytest.raises(queue.Empty):   # nothing within the gap
        next_command(queue.Queue(), start + WIDE_WINDOW_S)
    assert SPACING_S * 0.9 <= time.monotonic() - start < WIDE_GAP_S


def test_a_burst_ends_at_its_end(wide_gap):
    start = time.monotonic()
    with pytest.raises(queue.Empty):   # the burst ends before the gap would
        next_command(queue.Queue(), start + SPACING_S)
    assert SPACING_S * 0.9 <= time.monotonic() - start < WIDE_GAP_S * 0.8
    start = time.monotonic()
    with pytest.raises(queue.Empty):   # over already: no wait at all
        next_command(queue.Queue(), start - 1.0)
    assert time.monotonic() - start < WIDE_GAP_S / 2


# ---- the two serving loops, on stand-ins for their engines --------------------------------------

def _engine_thread() -> tuple[EngineThread, list[str]]:
    """An EngineThread's command loop alone: commands are plain callables that record their names."""
    loop = EngineThread.__new__(EngineThread)
    loop._commands, loop._replies = queue.Queue(), []
    loop._call_in_loop = lambda fn, *args: None
    return loop, []


def _thread_command(ran: list[str], name: str):
    return lambda: ran.append(name)


def _engine_process() -> tuple[EngineCoreProc, list[str]]:
    """An EngineCoreProc's command loop alone: "call" commands, whose replies it records."""
    loop = EngineCoreProc.__new__(EngineCoreProc)
    loop.commands, loop.connected, loop.owners, loop.dead_error = queue.Queue(), {0}, {}, None
    loop.engine = SimpleNamespace(block_manager=SimpleNamespace(num_blocks=1, num_free_blocks=1),
                                  scheduler=SimpleNamespace(running=[], waiting=[]))   # what engine_stats reads
    ran: list[str] = []
    loop.send = lambda client, message: ran.append(message[3])   # ("reply", call id, ok, value)
    return loop, ran


def _process_command(ran: list[str], name: str):
    return 0, [("call", 0, lambda engine: name)]   # (frontend, its batch of commands)


LOOPS = {"thread": (_engine_thread, _thread_command, lambda loop: loop._commands, None),
         "process": (_engine_process, _process_command, lambda loop: loop.commands, (0, [STOP]))}


@pytest.mark.parametrize("mode", sorted(LOOPS))
def test_an_idle_loop_takes_a_burst_in_one_batch(mode, wide_gap):
    make, command, commands, _ = LOOPS[mode]
    loop, ran = make()
    commands(loop).put(command(ran, "first"))
    _put_later(commands(loop), command(ran, "second"))
    assert loop._run_commands(block=True)
    assert ran == ["first", "second"]


@pytest.mark.parametrize("mode", sorted(LOOPS))
def test_a_busy_loop_waits_for_nothing(mode, wide_gap):
    make, command, commands, _ = LOOPS[mode]
    loop, ran = make()
    commands(loop).put(command(ran, "first"))
    start = time.monotonic()
    assert loop._run_commands(block=False)
    assert ran == ["first"] and time.monotonic() - start < WIDE_GAP_S / 2


@pytest.mark.parametrize("mode", sorted(LOOPS))
def test_a_stop_within_a_burst_stops_at_once(mode, wide_gap):
    make, command, commands, stop = LOOPS[mode]
    loop, ran = make()
    commands(loop).put(command(ran, "first"))
    _put_later(commands(loop), stop)
    start = time.monotonic()
    assert not loop._run_commands(block=True)
    assert time.monotonic() - start < SPACING_S + WIDE_GAP_S / 2


# ---- through AsyncLLM ----------------------------------------------------------------------------

@pytest.mark.parametrize("gap_s, first_prefill_rows", [(WIDE_GAP_S, 3), (0.0, 1)])
def test_an_idle_engine_prefills_a_burst_in_one_step(tiny_model, monkeypatch, gap_s, first_prefill_rows):
    monkeypatch.setattr(engine_core, "ARRIVAL_GAP_S", gap_s)
    monkeypatch.setattr(engine_core, "ARRIVAL_WINDOW_S", WIDE_WINDOW_S)
    path, _ = tiny_model("qwen3")
    engine = LLMEngine(path, skip_tokenizer_init=True, max_model_len=128, num_kvcache_blocks=32)
    step_rows: list[int] = []
    run = engine.model_runner.run

    def counted_run(seqs, *args, **kwargs):
        step_rows.append(len(seqs))
        return run(seqs, *args, **kwargs)
    monkeypatch.setattr(engine.model_runner, "run", counted_run)
    llm = AsyncLLM.from_engine(engine, log_stats_interval=0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def one(i: int) -> int:
        await asyncio.sleep(i * REQUEST_SPACING_S)
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
