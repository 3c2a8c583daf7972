"""AsyncLLM: the engine loop beside an asyncio event loop, for servers and other asyncio code.

The engine runs its step loop in a background thread of this process, or, with
`multiprocess_mode=True`, in a process of its own (engine/engine_core.py, reached
through engine/core_client.py), so that the event loop and the engine's steps do not
share one GIL. Either way it adds and aborts requests and runs `step()` while any
request is unfinished, so every live request, whenever it arrived, joins the same
continuous batch. Callers live on one asyncio event loop:

    stream = await llm.add_request("req-1", "Hello", SamplingParams(max_tokens=8))
    async for out in stream:          # each step's new tokens (vLLM's DELTA outputs)
        print(out.outputs[0].text, end="")

or `async for out in llm.generate(prompt, params, "req-2")`. Leaving the loop early (a
client that disconnects, a cancelled task) aborts the request, which frees its KV
blocks at the engine's next loop turn, at most one step later.

Threading rule (thread mode): only the engine thread touches the engine, its tokenizer
included. The event loop sends it commands (plain callables) through a queue and gets
each step's outputs back through `loop.call_soon_threadsafe`. The event loop has its own
copy of the tokenizer (`AsyncLLM.tokenizer`): HF fast tokenizers raise "Already
borrowed" when one thread encodes while another decodes with the same object.

Faults: an exception inside `step()` fails every in-flight request with
`EngineDeadError`, aborts them (freeing their blocks where the engine's state still
allows it) and marks the engine dead: `is_healthy` turns False, new requests are
refused with `EngineDeadError`. In process mode the engine process exiting (killed,
crashed) does the same.
"""
import asyncio
import concurrent.futures
import copy
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from nanovllm.engine.engine_core import (IDLE_POLL_S, EngineDeadError, EngineStats, ThroughputLog, burst_deadline,
                                         engine_stats, next_command, step_engine)
from nanovllm.engine.llm_engine import LLMEngine, PromptType
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")

# As vLLM: often enough to watch a server work, rarely enough not to flood its log.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
# How long `shutdown` waits for the engine thread to finish its current step.
SHUTDOWN_JOIN_S = 30.0
# The engine loop in a thread unless asked otherwise (see the README's serving section).
DEFAULT_MULTIPROCESS_MODE = False


class RequestStream:
    """The outputs of one request, as an async iterator of `RequestOutput` deltas.

    Iteration ends after the output with `finished=True`; an engine fault raises
    `EngineDeadError` from the iterator. A consumer slower than the engine gets the
    deltas that piled up folded into one, so it catches up instead of lagging
    further behind. `abort()` (also called when an `AsyncLLM.generate` loop is
    left early) stops the request if it is still running.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.request_id = request_id
        self.finished = False
        self._abort = abort
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future | None = None   # the consumer's, while it waits for an item

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():   # done: the consumer was cancelled
            waiter.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if self._items and isinstance(self._items[0], RequestOutput):
            item = RequestOutput.fold(item)
            while self._items and isinstance(self._items[0], RequestOutput):
                item.add(self._items.popleft())
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call twice."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLM:
    """An `LLMEngine` driven by a background thread or process; see the module docstring.

    Args:
        model: an HF directory or a .gguf file; None for the engine's default model.
        multiprocess_mode: run the engine loop in a spawned process of its own (vLLM V1's
            EngineCoreProc) instead of a thread of this one. The engine is then reached
            only through this object: `engine` exists in thread mode only.
        log_stats_interval: seconds between throughput lines in the log (0: never).
        **engine_kwargs: `LLMEngine` settings (`max_model_len`, `max_num_seqs`, ...).
    """

    def __init__(self, model: str | None = None, *, multiprocess_mode: bool = DEFAULT_MULTIPROCESS_MODE,
                 log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL_S, **engine_kwargs):
        _check_interval(log_stats_interval)
        if multiprocess_mode:
            from nanovllm.engine.core_client import MPClient
            self._start(MPClient.start(model, engine_kwargs, log_stats_interval))
            return
        engine = LLMEngine(model, **engine_kwargs) if model is not None else LLMEngine(**engine_kwargs)
        self._start(EngineThread(engine, log_stats_interval))

    @classmethod
    def from_engine(cls, engine: LLMEngine,
                    log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL_S) -> "AsyncLLM":
        """Wrap an engine built elsewhere (thread mode); the caller must not touch it afterwards."""
        _check_interval(log_stats_interval)
        self = cls.__new__(cls)
        self._start(EngineThread(engine, log_stats_interval))
        return self

    @classmethod
    def from_engine_process(cls, ends: tuple, process=None) -> "AsyncLLM":
        """A frontend of an engine process that other frontends share (process mode):
        `ends` is this frontend's pair of `EngineProcess.client_ends`; `process`, the
        `EngineProcess` where this process started it (its errors then give the engine's exit
        code). Its `shutdown` leaves the engine (which aborts this frontend's requests) rather
        than stopping it."""
        from nanovllm.engine.core_client import MPClient
        self = cls.__new__(cls)
        self._start(MPClient(ends, process, shares_engine=True))
        return self

    def _start(self, core) -> None:
        self._core = core
        self.multiprocess_mode = not isinstance(core, EngineThread)
        if not self.multiprocess_mode:
            self.engine = core.engine
        self.started_at = time.time()
        self.tokenizer = core.tokenizer   # the event loop's own copy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}

    # ---- what the server reads -------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._core.dead_error

    @property
    def is_healthy(self) -> bool:
        return self._core.dead_error is None and self._core.is_alive()

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def engine_pid(self) -> int:
        """The process that runs the engine loop (this one in thread mode)."""
        return self._core.pid

    @property
    def config(self):
        """The engine's `Config`."""
        return self._core.config

    @property
    def generation_defaults(self) -> dict:
        """Sampling defaults from the model's generation_config.json."""
        return self._core.generation_defaults

    @property
    def engine_stats(self) -> EngineStats:
        """The engine's state: live in thread mode, as of the engine's last message in process mode."""
        return self._core.stats()

    async def get_engine_stats(self) -> EngineStats:
        """The engine's state read by the engine loop after every command sent before this call."""
        self._bind_loop()
        return await asyncio.wrap_future(self._core.run_in_engine(engine_stats))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams) -> RequestStream:
        """Queue a request in the engine and return its stream.

        Raises ValueError (nothing queued) for a bad prompt or settings, and
        EngineDeadError once the engine has failed or shut down.
        """
        self._check_alive()
        self._bind_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        try:
            await self._core.add_request(request_id, prompt, sampling_params)
        except BaseException:  # refused, or the caller was cancelled while waiting
            self._streams.pop(request_id, None)
            self._core.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); never blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        self._core.abort(request_id)

    def run_in_engine(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine loop between steps; returns its future. In process
        mode `fn` must pickle (a module-level function) and its reply is read by the event loop
        this is called from (or, called outside one, by the next one that uses this AsyncLLM)."""
        if _running_loop() is not None:
            self._bind_loop()
        return self._core.run_in_engine(fn)

    def shutdown(self) -> None:
        """Abort every request, stop the engine loop (and the engine's workers) and wait for it; or,
        an engine process shared with other frontends (`from_engine_process`), leave it."""
        if self._core.dead_error is None:
            self._core.dead_error = EngineDeadError("the engine is shutting down")
        num_aborted = len(self._streams)
        self._fail_streams(self._core.dead_error)
        self._core.shutdown()
        what = "left the shared engine process" if getattr(self._core, "shares_engine", False) else "engine stopped"
        logger.info("%s; %d unfinished request(s) aborted", what, num_aborted)

    def _check_alive(self) -> None:
        if self._core.dead_error is not None:
            raise self._core.dead_error
        if not self._core.is_alive():
            raise EngineDeadError("the engine loop is not running")

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._streams:
                raise RuntimeError("AsyncLLM serves one event loop at a time")
            self._loop = loop
            self._core.bind(loop, self._deliver, self._fail_streams)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while its step ran
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)


class EngineThread:
    """The engine loop in a background thread of this process (AsyncLLM's thread mode)."""

    def __init__(self, engine: LLMEngine, log_stats_interval: float):
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the event loop's own copy
        self.config = engine.config
        self.generation_defaults = engine.generation_defaults
        self.max_model_len = engine.max_model_len
        self.dead_error: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable | None = None
        self._fail: Callable | None = None
        self._live_ids: set[str] = set()                  # engine-thread side
        self._replies: list[tuple[asyncio.Future, BaseException | None]] = []  # acceptances not yet sent
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # requests and aborts queued here join at the next round boundary, not one round later
        engine.serve_online(lambda: not self._commands.empty())
        self._throughput = ThroughputLog(log_stats_interval)
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run_engine_loop, name="nanovllm-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side --------------------------------------------------------

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        return engine_stats(self.engine)   # plain ints and lengths: safe to read from the event loop

    def bind(self, loop: asyncio.AbstractEventLoop, deliver: Callable, fail: Callable) -> None:
        self._loop, self._deliver, self._fail = loop, deliver, fail

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        # an event-loop future, settled from the engine thread by one call per batch of commands
        # (a concurrent Future + wrap_future cost a lock, a condition and a loop wake-up each)
        accepted = self._loop.create_future()
        self._submit(lambda: self._add_in_engine(request_id, prompt, params, accepted))
        await accepted

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort_in_engine(request_id))

    def run_in_engine(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: _complete(done, fn, self.engine))
        return done

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(SHUTDOWN_JOIN_S)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    # ---- engine-thread side -----------------------------------------------------

    def _add_in_engine(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       accepted: asyncio.Future) -> None:
        if accepted.cancelled():
            return  # the caller went away while waiting; its abort command follows (also if it goes now)
        if self.dead_error is not None:
            self._replies.append((accepted, self.dead_error))
            return
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # ValueError for bad input; passed on as it is
            self._replies.append((accepted, e))
            return
        self._live_ids.add(request_id)
        self._replies.append((accepted, None))

    def _abort_in_engine(self, request_id: str) -> None:
        if request_id in self._live_ids:
            self._live_ids.discard(request_id)
            self.engine.abort(request_id)
            logger.info("aborted request %s", request_id)

    def _run_engine_loop(self) -> None:
        while True:
            busy = self.dead_error is None and self.engine.has_unfinished_requests()
            if not self._run_commands(block=not busy):
                break
            if self.dead_error is None and self.engine.has_unfinished_requests():
                self._step()
            self._throughput.maybe_log(self.engine)
        self._abort_all_in_engine()
        try:
            self.engine.shutdown()   # tensor-parallel worker processes, if any
        except Exception:
            logger.exception("engine shutdown failed")

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands; False on stop. `block` (the engine is idle): wait a little for the
        first, and take a burst of arrivals whole (`next_command`)."""
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        burst_ends = burst_deadline(idle=block)
        try:
            while command is not None:
                _run_logged(command)
                try:
                    command = next_command(self._commands, burst_ends)
                except queue.Empty:
                    return True
            return False
        finally:
            if self._replies:   # the batch's acceptances, in one call on the event loop
                replies, self._replies = self._replies, []
                self._call_in_loop(_settle_all, replies)

    def _step(self) -> None:
        try:
            outputs = step_engine(self.engine, self._throughput)
        except Exception as e:
            self._die(e)
            return
        self._live_ids.difference_update(output.request_id for output in outputs if output.finished)
        if outputs:
            self._call_in_loop(self._deliver, outputs)

    def _die(self, error: Exception) -> None:
        logger.exception("engine step failed; failing %d in-flight request(s)", len(self._live_ids))
        self.dead_error = EngineDeadError(f"the engine failed: {type(error).__name__}: {error}")
        self._abort_all_in_engine()
        self._call_in_loop(self._fail, self.dead_error)

    def _abort_all_in_engine(self) -> None:
        for request_id in list(self._live_ids):
            try:
                self._abort_in_engine(request_id)
            except Exception:  # the engine's state may be broken after a fault
                logger.exception("could not abort request %s", request_id)

    def _call_in_loop(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _check_interval(log_stats_interval: float) -> None:
    if log_stats_interval < 0:
        raise ValueError(f"log_stats_interval must be >= 0, got {log_stats_interval}")


def _run_logged(command: Callable[[], None]) -> None:
    """Run one command; a failing command is logged and never stops the engine thread."""
    try:
        command()
    except Exception:
        logger.exception("engine command failed")


def _settle_all(replies: list[tuple[asyncio.Future, BaseException | None]]) -> None:
    """On the event loop: settle add_request futures (None: accepted); a cancelled one stays so."""
    for future, error in replies:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _complete(future: concurrent.futures.Future, fn: Callable, *args) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except Exception as e:
        future.set_exception(e)
