"""Server metrics in Prometheus' text exposition format (written by hand: no extra dependency).

`ServerMetrics.track` wraps the output stream of each engine request and records
time to first token, time per output token, end-to-end latency and token counts;
`ServerMetrics.render` adds the engine's live state (running and waiting
sequences, KV blocks used and free, prefix-cache hits) read at scrape time.
Metric names follow vLLM's, with the `nanovllm:` prefix.

With several API server processes (--api-server-count) each process counts its own
requests and publishes them to its row of a `SharedMetricsRows` (shared memory, one
writer a row), on every finished request and at most `PUBLISH_INTERVAL_S` apart while
its streams run; /metrics, whichever process answers it, renders the rows' sum.
"""
import math
import time
from typing import AsyncIterator

from nanovllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Bucket bounds in seconds, vLLM's: fine below 100 ms where a healthy server lives.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)
PREFIX = "nanovllm:"
FINISH_REASONS = ("stop", "length", "abort")   # the engine's (outputs.CompletionOutput.finish_reason)
PUBLISH_INTERVAL_S = 1.0   # the longest a process's running streams go unpublished to the shared rows


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)   # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return

    def values(self) -> list[float]:
        return [*self.counts, self.sum, self.count]

    def load(self, values: list[float]) -> None:
        """Set the counts and sum from a `values()` vector (a sum of several processes' vectors)."""
        *counts, self.sum, count = values
        self.counts, self.count = [int(n) for n in counts], int(count)

    def lines(self) -> list[str]:
        name = PREFIX + self.name
        out = [f"# HELP {name} {self.doc}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_num(self.sum)}",
                f"{name}_count {self.count}"]
        return out


class SharedMetricsRows:
    """One row of `ServerMetrics.values()` a server process, in shared memory: made by the parent
    before it spawns the other processes, passed to each (a `Process` argument) with its row."""

    def __init__(self, num_rows: int):
        import multiprocessing
        self.width = len(ServerMetrics().values())
        self.num_rows = num_rows
        self.array = multiprocessing.get_context("spawn").RawArray("d", num_rows * self.width)

    def write(self, row: int, values: list[float]) -> None:
        self.array[row * self.width:(row + 1) * self.width] = values

    def total(self) -> list[float]:
        flat = self.array[:]
        return [sum(flat[row * self.width + i] for row in range(self.num_rows)) for i in range(self.width)]


class ServerMetrics:
    """This process's request metrics; with `shared` (rows, this process's row), /metrics renders
    the sum over every process's row (see the module docstring)."""

    def __init__(self, shared: tuple[SharedMetricsRows, int] | None = None):
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished: dict[str, int] = {}   # finish reason -> completions
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.shared = shared
        self.published_at = 0.0   # `time.monotonic()` of the last publish to the shared row

    def values(self) -> list[float]:
        """Every count and sum as one vector (the shared rows' layout)."""
        assert set(self.finished) <= set(FINISH_REASONS), f"unknown finish reasons {set(self.finished)}"
        return [self.num_prompt_tokens, self.num_generation_tokens,
                *(self.finished.get(reason, 0) for reason in FINISH_REASONS),
                *self.ttft.values(), *self.tpot.values(), *self.e2e.values()]

    def load(self, values: list[float]) -> None:
        """Set every count and sum from a `values()` vector."""
        self.num_prompt_tokens, self.num_generation_tokens = int(values[0]), int(values[1])
        at = 2 + len(FINISH_REASONS)
        self.finished = {reason: int(n) for reason, n in zip(FINISH_REASONS, values[2:at]) if n}
        for hist in (self.ttft, self.tpot, self.e2e):
            width = len(hist.values())
            hist.load(values[at:at + width])
            at += width

    def publish(self, now: float) -> None:
        """Write this process's counts to its shared row (`now`: `time.monotonic()`)."""
        rows, row = self.shared
        rows.write(row, self.values())
        self.published_at = now

    async def track(self, outputs: AsyncIterator[RequestOutput], arrival: float) -> AsyncIterator[RequestOutput]:
        """Yield `outputs` unchanged, timing them from `arrival` (a `time.monotonic()` value)."""
        timer = RequestTimer(self, arrival)
        try:
            async for output in outputs:
                timer.observe(output)
                yield output
        finally:   # a stream left early (a client gone) counts in the shared rows too (a handler may
            # stop reading at the finished output and leave this to the collector: `observe` publishes that)
            if self.shared is not None:
                self.publish(time.monotonic())

    def render(self, engine: dict) -> str:
        """The exposition text; `engine` is `engine_snapshot(...)`."""
        if self.shared is not None:   # every process's counts: this one's published first
            self.publish(time.monotonic())
            total = ServerMetrics()
            total.load(self.shared[0].total())
            return total.render(engine)
        lines = []
        gauges = (("num_requests_running", "Sequences in the running batch.", engine["running"]),
                  ("num_requests_waiting", "Sequences waiting to be scheduled.", engine["waiting"]),
                  ("kv_cache_blocks_total", "KV cache blocks.", engine["blocks_total"]),
                  ("kv_cache_blocks_free", "Free KV cache blocks (cached prefixes included).", engine["blocks_free"]),
                  ("kv_cache_blocks_used", "KV cache blocks held by sequences.",
                   engine["blocks_total"] - engine["blocks_free"]),
                  ("engine_healthy", "1 while the engine loop runs, 0 after a fault.", int(engine["healthy"])))
        for name, doc, value in gauges:
            lines += _sample(name, "gauge", doc, value)
        counters = (("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                     engine["prefix_queries"]),
                    ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", engine["prefix_hits"]),
                    ("prompt_tokens_total", "Prompt tokens of requests that produced a token.",
                     self.num_prompt_tokens),
                    ("generation_tokens_total", "Generated tokens.", self.num_generation_tokens))
        for name, doc, value in counters:
            lines += _sample(name, "counter", doc, value)
        lines += _finished_lines(self.finished)
        for hist in (self.ttft, self.tpot, self.e2e):
            lines += hist.lines()
        return "\n".join(lines) + "\n"


class RequestTimer:
    """One engine request's timing into `ServerMetrics`, one call per output (a streamed delta)."""
    __slots__ = ("metrics", "arrival", "last_token_time")

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival   # arrival: a `time.monotonic()` value
        self.last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        m = self.metrics
        now = time.monotonic()
        num_new = 0   # the most new tokens of one completion (one pass: this runs per streamed delta)
        for c in output.outputs:
            n = len(c.token_ids)
            m.num_generation_tokens += n
            num_new = n if n > num_new else num_new
            if c.finish_reason is not None:
                m.finished[c.finish_reason] = m.finished.get(c.finish_reason, 0) + 1
        if num_new and self.last_token_time is None:
            m.ttft.observe(now - self.arrival)
            m.num_prompt_tokens += len(output.prompt_token_ids)
        elif num_new:
            m.tpot.observe((now - self.last_token_time) / num_new)
        if num_new:
            self.last_token_time = now
        if output.finished:
            m.e2e.observe(now - self.arrival)
        if m.shared is not None and (output.finished or now - m.published_at > PUBLISH_INTERVAL_S):
            m.publish(now)


def engine_snapshot(async_llm, stats=None) -> dict:
    """The engine's state: `stats` (an `EngineStats` just read) or as `AsyncLLM.engine_stats` has it
    (live in thread mode, as of the engine's last message in process mode)."""
    stats = stats if stats is not None else async_llm.engine_stats
    return {"running": stats.running, "waiting": stats.waiting, "blocks_total": stats.num_blocks,
            "blocks_free": stats.num_free_blocks, "prefix_queries": stats.prefix_query_tokens,
            "prefix_hits": stats.prefix_hit_tokens, "healthy": async_llm.is_healthy}


def _sample(name: str, kind: str, doc: str, value: float) -> list[str]:
    name = PREFIX + name
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]


def _finished_lines(finished: dict[str, int]) -> list[str]:
    name = PREFIX + "request_success_total"
    lines = [f"# HELP {name} Finished completions by finish reason.", f"# TYPE {name} counter"]
    return lines + [f'{name}{{finished_reason="{reason}"}} {n}' for reason, n in sorted(finished.items())]


def _num(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return repr(value) if isinstance(value, float) else str(value)
