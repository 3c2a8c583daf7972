"""The engine loop, in its own process: what `AsyncLLM(multiprocess_mode=True)` runs in its child.

vLLM V1 splits serving the same way (its `EngineCoreProc`): the frontend process keeps the
event loop, HTTP, chat templates and the request streams; this process owns the `LLMEngine`
and runs its step loop, so the two stop sharing one GIL. Data flow:

    frontend (AsyncLLM + core_client.MPClient)            this process (EngineCoreProc)
      add / abort / call, batched per loop turn  --pipe-->   reader thread -> command queue
                                                             main thread: commands, then step()
      streams <- one message per step (all deltas) <--pipe-- detokenized deltas + EngineStats

Validation and detokenization stay in the engine (`LLMEngine.add_request` raises the
ValueError the frontend turns into a 400; stop strings need the text where the engine
stops): the frontend is the busier side in serving, so it gets the lighter share.
A delta crosses the pipe as a tuple without its prompt (`encode_outputs`; the frontend
keeps each request's prompt from its acceptance): pickling dataclasses cost ~8x more.

Several frontends (the server's --api-server-count, vLLM's name) each get their own pair of
pipes: a request's deltas go back to the frontend that added it, a fault to all of them. A
frontend that goes away has its requests aborted; the loop stops when the last one has gone.
"""
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from nanovllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("nanovllm")

# An idle engine loop wakes this often to write the throughput line.
IDLE_POLL_S = 0.5
# A burst of arrivals at an idle engine joins one prefill step: once a command (a request, most often)
# reaches an idle engine, its loop keeps taking commands while they come less than ARRIVAL_GAP_S apart,
# for at most ARRIVAL_WINDOW_S (also when the engine has failed: its refusals then wait as long). On the
# GPU, when a prefill step of a few short prompts took ~30-40 ms (eager), a wave of 64 requests split
# over two prefill steps lost ~30 ms a wave in B3 (benchmarks/RESULTS.md, "Twenty-seventh session");
# with the window every wave took one step ("Twenty-eighth session", where such steps became CUDA
# graphs of ~10 ms). A lone request waits ARRIVAL_GAP_S more.
ARRIVAL_GAP_S = 0.001
ARRIVAL_WINDOW_S = 0.02
# How often a burst's loop looks at the queue. A blocking get() woke the engine's thread at every
# command, and in thread mode each wake-up takes the GIL from the event loop that is still queueing
# the burst's other requests. On an H200's 16-core host (B3, seven runs on one machine) the blocking
# form split 4 of 12 bursts into two prefill steps and the polled one 1 of 16; TTFT median 30-41
# against 40-51 ms, output 28,962-30,039 against 27,928-29,308 tok/s (benchmarks/RESULTS.md,
# "Thirty-second session").
BURST_POLL_S = 0.0005
STOP = ("stop",)   # the command that ends the loop
GONE = ("gone",)   # queued by a frontend's reader thread when its pipe ends (the loop stops after the last)


class EngineDeadError(RuntimeError):
    """The engine loop failed (or was shut down); no request can run any more."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's live state that the server's /metrics and its tests read."""
    running: int
    waiting: int
    num_blocks: int
    num_free_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int


def engine_stats(engine) -> EngineStats:
    """Read `engine`'s state now (plain ints and lengths)."""
    bm, sched = engine.block_manager, engine.scheduler
    return EngineStats(len(sched.running), len(sched.waiting), bm.num_blocks, bm.num_free_blocks,
                       getattr(bm, "num_prefix_query_tokens", 0), getattr(bm, "num_prefix_hit_tokens", 0))


@dataclass(frozen=True)
class StartupInfo:
    """What the frontend needs of the engine it started: its own tokenizer copy and settings."""
    tokenizer: object
    config: object
    generation_defaults: dict
    max_model_len: int
    stats: EngineStats
    pid: int   # the engine process's


# ---- the wire format of one step's deltas ------------------------------------------------------

def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """Deltas as plain tuples, without the prompt (the frontend has it)."""
    return [(o.request_id, o.finished, o.num_cached_tokens, o.prompt_logprobs,
             [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
              for c in o.outputs]) for o in outputs]


def decode_output(encoded: tuple, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    request_id, finished, num_cached_tokens, prompt_logprobs, completions = encoded
    return RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(*c) for c in completions],
                         finished, num_cached_tokens, prompt_logprobs)


def burst_deadline(idle: bool) -> float | None:
    """When a burst of arrivals at an idle engine stops being waited for (a time.monotonic() value),
    taken as its first command arrives; None for a busy engine, which waits for nothing."""
    return time.monotonic() + ARRIVAL_WINDOW_S if idle else None


def next_command(commands: queue.Queue, burst_ends: float | None) -> object:
    """The next queued command: one already there, or, while an idle engine's burst of arrivals
    lasts (until `burst_ends`, from `burst_deadline`; None: no burst), one within ARRIVAL_GAP_S.
    Within a burst the queue is polled every BURST_POLL_S rather than waited on, so that the
    engine's thread wakes once per poll, not once per command. Raises queue.Empty."""
    gap_ends = None if burst_ends is None else min(time.monotonic() + ARRIVAL_GAP_S, burst_ends)
    while True:
        try:
            return commands.get_nowait()
        except queue.Empty:
            now = time.monotonic()
            if gap_ends is None or now >= gap_ends:
                raise
        time.sleep(min(BURST_POLL_S, gap_ends - now))


def step_engine(engine, throughput: "ThroughputLog") -> list[RequestOutput]:
    """One `engine.step()` of a serving loop (the engine thread's or the engine process's), the
    throughput line told. Raises what the step raises."""
    outputs = engine.step()
    throughput.record(engine, outputs)
    return outputs


# ---- the throughput line (written by whichever thread or process runs the loop) -------------------

class ThroughputLog:
    """The periodic throughput line: prompt and generation tokens/s, queue and cache state."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.last_log = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def record(self, engine, outputs: list[RequestOutput]) -> None:
        stats = getattr(engine, "last_step_stats", None)
        self.num_prompt_tokens += stats[0] if stats else 0
        self.num_generation_tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def maybe_log(self, engine) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log
        if self.interval_s == 0 or elapsed < self.interval_s:
            return
        if self.num_prompt_tokens or self.num_generation_tokens or engine.has_unfinished_requests():
            logger.info("%s", throughput_line(engine, self.num_prompt_tokens / elapsed,
                                              self.num_generation_tokens / elapsed))
        self.last_log, self.num_prompt_tokens, self.num_generation_tokens = now, 0, 0


def throughput_line(engine, prompt_tps: float, generation_tps: float) -> str:
    bm, sched = engine.block_manager, engine.scheduler
    usage = 1 - bm.num_free_blocks / bm.num_blocks
    queries = getattr(bm, "num_prefix_query_tokens", 0)
    hit_rate = getattr(bm, "num_prefix_hit_tokens", 0) / queries if queries else 0.0
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {len(sched.running)} reqs, Waiting: {len(sched.waiting)} reqs, "
            f"KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}")


# ---- the child process -------------------------------------------------------------------------

def run_engine_core(conns: list[tuple], model: str | None, engine_kwargs: dict, log_stats_interval: float,
                    log_setup: tuple[int, str | None]) -> None:
    """The child's entry: build the engine, report ready (or the start-up error) to every frontend
    (`conns`: one (command, output) pipe pair each), run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the frontend decides
    level, fmt = log_setup
    logging.basicConfig(level=level, **({"format": fmt} if fmt else {}))
    logger.setLevel(level)
    try:
        from nanovllm.engine.llm_engine import LLMEngine
        engine = LLMEngine(model, **engine_kwargs) if model is not None else LLMEngine(**engine_kwargs)
        info = StartupInfo(engine.tokenizer, engine.config, engine.generation_defaults, engine.max_model_len,
                           engine_stats(engine), os.getpid())
    except BaseException as e:
        for _, out_conn in conns:
            out_conn.send(("startup_error", _picklable(e)))
        return
    core = EngineCoreProc(engine, conns, log_stats_interval)
    # SIGTERM sent to the whole process group (systemd's default) must let the servers drain: the loop
    # ends on the stop command or when the last frontend has left, as SIGINT's (ignored above)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core.send_ready(info)
    core.run()


class EngineCoreProc:
    """The engine loop of the child: commands from the frontends between steps, one message a step
    to each frontend with deltas in it.

    A reader thread a frontend moves each command message from its pipe into one queue, so the
    frontends' writes never wait for a step to end, and `LLMEngine.requests_arriving` sees what is
    queued (no round is chained past it). Faults: an exception in `step()` aborts every live request
    (freeing their blocks), sends "dead" with the message to every frontend, and refuses new
    requests; the loop still answers calls until the frontends stop it.
    """

    def __init__(self, engine, conns: list[tuple], log_stats_interval: float):
        self.engine = engine
        self.out_conns = [out_conn for _, out_conn in conns]
        self.connected = set(range(len(conns)))     # the frontends still there
        self.send_locks = [threading.Lock() for _ in conns]   # one writer a pipe at a time
        self.commands: queue.Queue = queue.Queue()  # (frontend, command message)
        self.owners: dict[str, int] = {}            # live request -> the frontend that added it
        self.dead_error: str | None = None
        self.throughput = ThroughputLog(log_stats_interval)
        engine.serve_online(lambda: not self.commands.empty())
        for client, (cmd_conn, _) in enumerate(conns):
            threading.Thread(target=self._read_commands, args=(client, cmd_conn), name=f"nanovllm-engine-input-{client}",
                             daemon=True).start()

    def _read_commands(self, client: int, cmd_conn) -> None:
        try:
            while True:
                self.commands.put((client, cmd_conn.recv()))
        except (EOFError, OSError):   # the frontend closed its end or exited
            self.commands.put((client, [GONE]))

    def run(self) -> None:
        try:
            while self._run_commands(block=not self._busy()):
                if self._busy():
                    self._step()
                self.throughput.maybe_log(self.engine)
        finally:
            self._abort(list(self.owners))
            try:
                self.engine.shutdown()   # tensor-parallel worker processes, if any
            except Exception:
                logger.exception("engine shutdown failed")

    def _busy(self) -> bool:
        return self.dead_error is None and self.engine.has_unfinished_requests()

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command message; False on stop. `block` (the engine is idle): wait a little
        for the first, and take a burst of arrivals whole (`next_command`)."""
        try:
            client, batch = self.commands.get(timeout=IDLE_POLL_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        burst_ends = burst_deadline(idle=block)
        accepted: dict[int, list] = {}   # frontend -> its accepted adds (and the changed ones: [])
        replies: list[tuple[int, tuple]] = []
        while True:
            for command in batch:
                if command == STOP:
                    return False
                self._run_command(client, command, accepted, replies)
            if not self.connected:
                return False
            try:
                client, batch = next_command(self.commands, burst_ends)
            except queue.Empty:
                break
        stats = engine_stats(self.engine)
        for target, adds in accepted.items():
            self.send(target, ("accepted", adds, stats))
        for target, reply in replies:   # after the stats: a caller that got its reply has them too
            self.send(target, reply)
        return True

    def _run_command(self, client: int, command: tuple, accepted: dict[int, list], replies: list) -> None:
        """Run one command of `client`; a change to its requests marks it in `accepted`."""
        kind = command[0]
        if kind == "add":
            accepted.setdefault(client, []).append(self._add(client, *command[1:]))
        elif kind == "abort":
            if self.owners.get(command[1]) == client:   # a live request of this frontend's
                self._abort([command[1]])
                logger.info("aborted request %s", command[1])
                accepted.setdefault(client, [])
        elif kind == "call":
            replies.append((client, self._call(*command[1:])))
        elif kind == "gone":
            self.connected.discard(client)
            orphans = [request_id for request_id, owner in self.owners.items() if owner == client]
            if orphans and self.connected:
                logger.warning("a frontend went away: aborting its %d request(s)", len(orphans))
            self._abort(orphans)
        else:
            raise AssertionError(f"unknown engine command {kind!r}")

    def _add(self, client: int, request_id: str, prompt, params) -> tuple:
        """(request_id, error or None, prompt text, prompt token ids) for the frontend."""
        if self.dead_error is not None:
            return request_id, EngineDeadError(self.dead_error), None, None
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:   # ValueError for bad input, passed on as it is
            return request_id, _picklable(e), None, None
        self.owners[request_id] = client
        state = self.engine.output_processor.requests[request_id]
        return request_id, None, state.prompt, state.prompt_token_ids

    def _call(self, call_id: int, fn: Callable) -> tuple:
        try:
            return "reply", call_id, True, fn(self.engine)
        except Exception as e:
            return "reply", call_id, False, _picklable(e)

    def _step(self) -> None:
        try:
            outputs = step_engine(self.engine, self.throughput)
        except Exception as e:
            self._die(e)
            return
        if not outputs:
            return
        stats = engine_stats(self.engine)
        by_client: dict[int, list[RequestOutput]] = {}
        for output in outputs:
            owner = (self.owners.pop if output.finished else self.owners.get)(output.request_id, None)
            if owner is not None:   # None: aborted (its frontend gone) while an earlier step was in flight
                by_client.setdefault(owner, []).append(output)
        for client, its_outputs in by_client.items():
            self.send(client, ("outputs", encode_outputs(its_outputs), stats))

    def _die(self, error: Exception) -> None:
        logger.exception("engine step failed; failing %d in-flight request(s)", len(self.owners))
        self.dead_error = f"the engine failed: {type(error).__name__}: {error}"
        self._abort(list(self.owners))
        stats = engine_stats(self.engine)
        for client in range(len(self.out_conns)):
            self.send(client, ("dead", self.dead_error, stats))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.owners.pop(request_id, None)
            try:
                self.engine.abort(request_id)
            except Exception:   # the engine's state may be broken after a fault
                logger.exception("could not abort request %s", request_id)

    def send_ready(self, info: StartupInfo) -> None:
        """The start-up report to every frontend, each from a thread of its own: the report (the
        tokenizer) is larger than a pipe holds, and a frontend still starting must not hold up the
        others or the loop. A frontend's later messages wait for its report (its lock)."""
        for client, lock in enumerate(self.send_locks):
            lock.acquire()
            threading.Thread(target=self._send_locked, args=(client, ("ready", info)), daemon=True,
                             name=f"nanovllm-engine-ready-{client}").start()

    def _send_locked(self, client: int, message: tuple) -> None:
        """`send`'s write, the lock of `client` already held (released here)."""
        try:
            self.out_conns[client].send(message)
        except (BrokenPipeError, OSError):   # the frontend is gone; its reader thread reports it
            pass
        finally:
            self.send_locks[client].release()

    def send(self, client: int, message: tuple) -> None:
        """Send `message` to frontend `client`, unless it has gone."""
        self.send_locks[client].acquire()
        self._send_locked(client, message)


def _picklable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe as it is, else a RuntimeError with its type and message."""
    import pickle
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
