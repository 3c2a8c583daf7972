"""MPClient: the frontend's side of an engine running in its own process (engine_core.py).

`AsyncLLM(multiprocess_mode=True)` talks to its engine through this (vLLM V1's `MPClient`):
`EngineProcess` spawns the engine process; the client waits for its start-up report (the
tokenizer copy, the settings), and then, on the event loop only,

- sends commands (add, abort, call), collected over one turn of the loop into one message;
- reads the engine's messages with `loop.add_reader` on the pipe, so no thread of this
  process competes with the event loop for the GIL: one message per engine step carries
  every request's delta, which it hands to `AsyncLLM` with the prompts put back;
- turns the pipe's end (the process killed or crashed) into `EngineDeadError` for every
  waiting caller and stream.

Two one-way pipes (`multiprocessing.Pipe`, pickled messages): no ports or paths. A reader
thread in the engine process drains the command pipe, so a write here never waits for a
step; the engine writes its outputs from its loop and this side drains them every turn.
`shutdown` stops the process (also run at exit and when the process object is collected):
a stop command, then SIGKILL.

Several frontend processes may share one engine process (the server's --api-server-count):
each has its own pair of pipes and its own client, which leaves on `shutdown` instead.
"""
import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import weakref
from typing import Callable

from nanovllm.engine.engine_core import (STOP, EngineDeadError, EngineStats, StartupInfo, decode_output,
                                         run_engine_core)
from nanovllm.outputs import RequestOutput

logger = logging.getLogger("nanovllm")

STARTUP_POLL_S = 0.5      # how often start-up checks that the engine process still lives
SHUTDOWN_JOIN_S = 30.0    # how long `shutdown` lets the engine finish its step and stop


class EngineProcess:
    """The spawned engine process and the frontends' ends of its pipes (`client_ends`: one
    (command, output) pair a frontend). `stop` (also run at exit) ends it: a stop command, then
    SIGKILL.

    Args:
        model, engine_kwargs: what `LLMEngine(model, **engine_kwargs)` gets in the child.
        log_stats_interval: seconds between the child's throughput lines (0: never).
        num_clients: frontends that will talk to it (the server's --api-server-count).
    """

    def __init__(self, model: str | None, engine_kwargs: dict, log_stats_interval: float, num_clients: int = 1):
        ctx = multiprocessing.get_context("spawn")
        child_ends, self.client_ends = [], []
        for _ in range(num_clients):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            out_recv, out_send = ctx.Pipe(duplex=False)
            child_ends.append((cmd_recv, out_send))
            self.client_ends.append((cmd_send, out_recv))
        self.proc = ctx.Process(target=run_engine_core, name="nanovllm-engine-core",
                                args=(child_ends, model, engine_kwargs, log_stats_interval, _log_setup()))
        self.proc.start()
        for cmd_recv, out_send in child_ends:   # the child's ends: a pipe ends (EOF) when the child does
            cmd_recv.close()
            out_send.close()
        # registered now, after multiprocessing's own exit hook (which would wait for the child)
        atexit.register(_stop_process, self.proc, self.client_ends)
        weakref.finalize(self, _stop_process, self.proc, self.client_ends)

    def stop(self) -> None:
        """Stop the engine process and wait for it; idempotent."""
        _stop_process(self.proc, self.client_ends)


class MPClient:
    """One frontend's side of the engine process; see the module docstring.

    Args:
        ends: this frontend's (command, output) pipe ends, one of `EngineProcess.client_ends`.
        process: the engine process where this process started it (errors then give its exit
            code), else None.
        shares_engine: other frontends share the engine: `shutdown` only leaves (the engine
            aborts this client's requests, and stops once the last frontend has left); else
            this client owns `process` and `shutdown` stops it.
    Raises what the engine's start-up raised (ValueError for bad settings), or
    EngineDeadError if the process died before it was ready.
    """

    def __init__(self, ends: tuple, process: EngineProcess | None = None, shares_engine: bool = False):
        assert shares_engine or process is not None, "a client that owns the engine process holds it"
        self._cmd_conn, self._out_conn = ends
        self._process = process
        self.shares_engine = shares_engine
        self.dead_error: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[list[RequestOutput]], None] | None = None
        self._fail: Callable[[BaseException], None] | None = None
        self._pending: list[tuple] = []          # commands of this loop turn
        self._flush_scheduled = False
        self._accepting: dict[str, asyncio.Future] = {}
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}   # live requests' prompts
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        try:
            info = self._wait_ready()
        except BaseException:
            self._leave()
            raise
        self.pid = info.pid
        self.tokenizer = info.tokenizer
        self.config = info.config
        self.generation_defaults = info.generation_defaults
        self.max_model_len = info.max_model_len
        self._stats = info.stats

    @classmethod
    def start(cls, model: str | None, engine_kwargs: dict, log_stats_interval: float) -> "MPClient":
        """Spawn an engine process for this client alone."""
        process = EngineProcess(model, engine_kwargs, log_stats_interval)
        return cls(process.client_ends[0], process)

    def _wait_ready(self) -> StartupInfo:
        while True:
            if self._out_conn.poll(STARTUP_POLL_S):
                try:
                    kind, value = self._out_conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    return value
                raise value   # the engine's own start-up error
            if self._process is not None and not self._process.proc.is_alive():
                break
        raise EngineDeadError(f"the engine process exited during start-up{self._exit_code()}")

    def _exit_code(self) -> str:
        """' (exit code N)' when this client owns the process (after waiting a little for it), else ''."""
        if self._process is None:
            return ""
        self._process.proc.join(STARTUP_POLL_S)
        return f" (exit code {self._process.proc.exitcode})"

    # ---- what AsyncLLM calls (on its event loop) --------------------------------------------

    def is_alive(self) -> bool:
        if self._process is not None:
            return self._process.proc.is_alive()
        return not self._out_conn.closed   # closed when the engine's pipe ended

    def stats(self) -> EngineStats:
        """The engine's state as of its last message (each step and command batch sends it)."""
        return self._stats

    def bind(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[RequestOutput]], None],
             fail: Callable[[BaseException], None]) -> None:
        """Read the engine's messages on `loop` from now on (AsyncLLM serves one loop at a time)."""
        self._deliver, self._fail = deliver, fail
        if self._loop is loop:
            return
        self._remove_reader()
        self._loop = loop
        if not self._out_conn.closed:
            loop.add_reader(self._out_conn.fileno(), self._on_readable)

    async def add_request(self, request_id: str, prompt, params) -> None:
        """Queue a request; returns once the engine accepted it, raises what it refused it with."""
        accepted = self._loop.create_future()
        self._accepting[request_id] = accepted
        self._send(("add", request_id, prompt, params))
        try:
            await accepted
        finally:
            self._accepting.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._send(("abort", request_id))

    def run_in_engine(self, fn: Callable) -> concurrent.futures.Future:
        """Run `fn(engine)` in the engine process between steps. `fn` and its result must pickle
        (a module-level function); the reply is read by the bound event loop."""
        pickle.dumps(fn)   # a lambda fails here, not later inside the loop's flush
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = done
        self._send(("call", call_id, fn))
        return done

    def shutdown(self) -> None:
        """Stop the engine process and wait for it, or, sharing it, leave it; idempotent."""
        self._flush()
        self._remove_reader()
        self._leave()

    def _leave(self) -> None:
        if not self.shares_engine:
            self._process.stop()
        self._cmd_conn.close()
        self._out_conn.close()

    # ---- sending ---------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        if self._cmd_conn.closed:
            return
        self._pending.append(command)
        if self._flush_scheduled:
            return
        if self._loop is not None and _running_loop() is self._loop:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if not batch or self._cmd_conn.closed:
            return
        try:
            self._cmd_conn.send(batch)
        except OSError:   # the engine process is gone; its pipe's EOF reports it
            pass

    # ---- receiving -------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            while self._out_conn.poll():
                self._handle(self._out_conn.recv())
        except (EOFError, OSError):
            self._on_engine_exit()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, encoded, self._stats = message
            self._deliver_outputs(encoded)
        elif kind == "accepted":
            _, accepted, self._stats = message
            for request_id, error, prompt, prompt_token_ids in accepted:
                future = self._accepting.pop(request_id, None)
                if future is None or future.done():
                    continue   # the caller went away; its abort follows the add
                if error is not None:
                    future.set_exception(error)
                else:
                    self._prompts[request_id] = (prompt, prompt_token_ids)
                    future.set_result(None)
        elif kind == "reply":
            _, call_id, ok, value = message
            done = self._calls.pop(call_id)
            done.set_result(value) if ok else done.set_exception(value)
        elif kind == "dead":
            _, error, self._stats = message
            self._set_dead(EngineDeadError(error))
        else:
            raise AssertionError(f"unknown engine message {kind!r}")

    def _deliver_outputs(self, encoded: list[tuple]) -> None:
        outputs = []
        for delta in encoded:
            request_id, finished = delta[0], delta[1]
            prompt = self._prompts.pop(request_id, None) if finished else self._prompts.get(request_id)
            if prompt is not None:   # None: aborted while its step ran
                outputs.append(decode_output(delta, *prompt))
        if outputs:
            self._deliver(outputs)

    def _on_engine_exit(self) -> None:
        self._remove_reader()
        self._out_conn.close()
        message = f"the engine process exited{self._exit_code()}"
        if self.dead_error is None:
            logger.error("%s", message)
        self._set_dead(EngineDeadError(message))
        calls, self._calls = self._calls, {}
        for done in calls.values():
            done.set_exception(self.dead_error)

    def _set_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is None:
            self.dead_error = error
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(self.dead_error)
        self._accepting.clear()
        self._prompts.clear()
        if self._fail is not None:
            self._fail(self.dead_error)

    def _remove_reader(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed() and not self._out_conn.closed:
            try:
                loop.remove_reader(self._out_conn.fileno())
            except (RuntimeError, ValueError, OSError):
                pass


def _stop_process(proc, client_ends: list[tuple]) -> None:
    """Stop the engine process: a stop command (through any frontend's pipe still open), then
    SIGKILL; close the pipes."""
    if proc.is_alive():
        for cmd_conn, _ in client_ends:
            try:
                cmd_conn.send([STOP])
                break
            except OSError:   # closed (a frontend left) or broken
                continue
        proc.join(SHUTDOWN_JOIN_S)
    if proc.is_alive():   # (it ignores SIGTERM: see engine_core.run_engine_core)
        proc.kill()
        proc.join()
    for cmd_conn, out_conn in client_ends:
        cmd_conn.close()
        out_conn.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _log_setup() -> tuple[int, str | None]:
    """The nanovllm logger's level and the root handler's format, for the child's logging."""
    handlers = logging.getLogger().handlers
    formatter = handlers[0].formatter if handlers else None
    return logging.getLogger("nanovllm").getEffectiveLevel(), getattr(formatter, "_fmt", None)
