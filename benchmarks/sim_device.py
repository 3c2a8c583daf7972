"""A simulated device for measuring the host's share of serving on any machine.

On an H200 a decode step of the Qwen3-0.6B shape takes ~2.5 ms, so what the host does per
step and per token (scheduling, detokenizing, the event loop's streams, SSE, HTTP, the GIL
shared by the engine thread and the event loop) decides how close serving comes to offline
throughput. This module replaces the engine's model runner with one that keeps a device
timeline instead of computing: each step takes `step_ms + token_us * tokens` (and `prefill_ms`
more when it prefills) of simulated device time, the host waits for it with the GIL released
(as `torch.cuda.Event.synchronize` does), and sampled tokens are random ordinary token ids (so
detokenization is real work). Multi-step decode rounds queue their steps back to back on the
timeline, and a round chained by async scheduling starts when the previous one ends, as on the
GPU. Everything else (LLMEngine, scheduler, block manager, output processing, AsyncLLM, the
server) is the real code. Only for benchmarks: the text is random.

    python benchmarks/sim_device.py --step-ms 2.5 -- MODEL_DIR --load-format dummy ...
        (the OpenAI server, `api_server`'s flags after `--`)

With --real-device nothing is simulated: the same events are timed on the GPU (a server in thread
mode), to read a real run's batching next to the simulated one's.

The engine still resolves its device as the CPU, where multi-step rounds are off by default: give
`--num-scheduler-steps 16 --async-scheduling` (the GPU's defaults) to simulate the GPU's rounds.

The timeline counts what the device ran (`DeviceStats`: steps, rows, rounds, busy seconds, the
gaps where it waited for the host; decode steps by their number of rows): a deterministic view of
batching that the wall clock of a shared machine blurs. It also times the engine's events: each
launch (rows, steps), each request added (`LLMEngine.add_request`), each step that finished
requests, and, in thread mode, each command the event loop queued (`EngineThread._submit`), by
wrapping those methods. With NANOVLLM_SIM_STATS set to a path, the engine writes it all there as
JSON when it shuts down (bench_serving reads the server's; its --sim-timeline keeps the events).

`install(step_ms, token_us)` does the same in-process (bench_serving's offline baseline). It also
sets NANOVLLM_SIM_DEVICE, so the server's engine process (`--enable-frontend-multiprocessing`,
spawned from this script, which multiprocessing re-runs in the child as `__mp_main__`) installs
the same device before it builds its engine.
"""
import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

from nanovllm.engine.sampling_metadata import ModelRunnerOutput

DEFAULT_STEP_MS = 2.5       # an H200 decode step of 64 sequences, Qwen3-0.6B (RESULTS, B3 call 3: TPOT)
DEFAULT_TOKEN_US = 2.0      # per scheduled token: a 1,600-token prefill step takes ~5.7 ms
DEFAULT_PREFILL_MS = 0.0    # more for a step that prefills (a GPU step of 64 short prompts: ~10 ms, 30-40 eager)
DEFAULT_NUM_BLOCKS = 8192
SAMPLED_ID_RANGE = (1000, 100000)  # ordinary BPE tokens of the Qwen3 / Llama vocabularies
ENV_VAR = "NANOVLLM_SIM_DEVICE"     # "step_ms,token_us,prefill_ms" for a spawned engine process
STATS_ENV_VAR = "NANOVLLM_SIM_STATS"  # a path: write the DeviceStats there as JSON at shutdown


@dataclass
class DeviceStats:
    """What the simulated device ran: steps, their rows (scheduled sequences), multi-step rounds,
    busy seconds, and the decode steps by number of rows."""
    steps: int = 0
    rows: int = 0
    rounds: int = 0
    busy_s: float = 0.0
    decode_steps_by_rows: dict[int, int] = field(default_factory=dict)
    launches: list[tuple[float, int, int]] = field(default_factory=list)  # (time, rows, steps) per launch
    arrivals: list[float] = field(default_factory=list)  # when each request was added to the engine
    submits: list[float] = field(default_factory=list)   # when the event loop queued each command
    finishes: list[tuple[float, int]] = field(default_factory=list)  # (time, requests) a step finished
    delivers: list[tuple[float, int]] = field(default_factory=list)  # (time, finished) the event loop took outputs
    stream_ends: list[float] = field(default_factory=list)  # when the event loop sent a stream's last bytes
    receives: list[float] = field(default_factory=list)  # when a generation route took a POST (before parsing)
    idle: list[tuple[float, float]] = field(default_factory=list)  # (from, seconds) the device waited

    def launch(self, num_rows: int, num_steps: int) -> None:
        self.rounds += 1
        self.launches.append((round(time.perf_counter(), 4), num_rows, num_steps))

    def record(self, num_rows: int, seconds: float, decode: bool) -> None:
        self.steps += 1
        self.rows += num_rows
        self.busy_s += seconds
        if decode:
            self.decode_steps_by_rows[num_rows] = self.decode_steps_by_rows.get(num_rows, 0) + 1

    def summary(self) -> dict:
        return {"steps": self.steps, "rounds": self.rounds, "rows_per_step": round(self.rows / max(self.steps, 1), 2),
                "busy_s": round(self.busy_s, 3), "idle_s": round(sum(gap for _, gap in self.idle), 3),
                "decode_steps_by_rows": dict(sorted(self.decode_steps_by_rows.items())),
                "launches": self.launches, "arrivals": self.arrivals, "submits": self.submits,
                "finishes": self.finishes, "delivers": self.delivers, "stream_ends": self.stream_ends,
                "receives": self.receives, "idle": self.idle}


class DeviceTimeline:
    """When the simulated device finishes each queued step (one stream, in launch order)."""

    def __init__(self, step_s: float, token_s: float, prefill_s: float = 0.0):
        self.step_s, self.token_s, self.prefill_s = step_s, token_s, prefill_s
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.stats = DeviceStats()

    def queue(self, num_tokens: int, num_rows: int | None = None) -> float:
        """Queue one step of `num_tokens` tokens over `num_rows` sequences (None: one token each,
        a decode step); returns the time it ends."""
        decode = num_rows is None or num_rows == num_tokens
        seconds = self.step_s + self.token_s * num_tokens + (0.0 if decode else self.prefill_s)
        with self.lock:
            now = time.perf_counter()
            if self.free_at and now > self.free_at:   # the device ran dry: it waited for the host
                self.stats.idle.append((round(self.free_at, 4), round(now - self.free_at, 4)))
            self.free_at = max(now, self.free_at) + seconds
            self.stats.record(num_tokens if num_rows is None else num_rows, seconds, decode)
            return self.free_at

    @staticmethod
    def wait(until: float) -> None:
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the GIL is free meanwhile, as in a CUDA event wait


@dataclass
class SimulatedRound:
    """A multi-step decode round on the timeline; the engine's `DecodeRound` interface."""
    seqs: list
    num_steps: int
    ends: list[float] = field(default_factory=list)

    def outputs(self, on_last_step=None):
        for step, end in enumerate(self.ends):
            if step == self.num_steps - 1 and step > 0 and on_last_step is not None:
                on_last_step()
            DeviceTimeline.wait(end)
            yield ModelRunnerOutput([random.randrange(*SAMPLED_ID_RANGE) for _ in self.seqs])


class SimulatedModelRunner:
    """What LLMEngine needs of a model runner, with no model: see the module docstring."""

    def __init__(self, config, timeline: DeviceTimeline):
        self.num_kvcache_blocks = config.num_kvcache_blocks or DEFAULT_NUM_BLOCKS
        self.timeline = timeline

    def run(self, seqs) -> ModelRunnerOutput:
        self.timeline.stats.launch(len(seqs), 1)
        end = self.timeline.queue(sum(seq.num_scheduled_tokens for seq in seqs), len(seqs))
        DeviceTimeline.wait(end)
        # a sequence samples once this step reaches the end of its tokens (not mid-prompt)
        return ModelRunnerOutput([random.randrange(*SAMPLED_ID_RANGE)
                                  if seq.num_computed_tokens + seq.num_scheduled_tokens >= seq.num_tokens else None
                                  for seq in seqs])

    def launch_decode_round(self, seqs, num_steps: int, after=None) -> SimulatedRound:
        self.timeline.stats.launch(len(seqs), num_steps)
        return SimulatedRound(list(seqs), num_steps, [self.timeline.queue(len(seqs)) for _ in range(num_steps)])

    def shutdown(self) -> None:
        """The engine's end (the server's shutdown, in either frontend mode): write the stats."""
        if os.environ.get(STATS_ENV_VAR):
            _write_stats(self.timeline.stats, os.environ[STATS_ENV_VAR])


class RecordingModelRunner:
    """The real model runner with its launches timed (--real-device): the same events as on the
    simulated device, on the real one; steps and rows are counted, busy and idle time are not."""

    def __init__(self, runner, stats: DeviceStats):
        self.runner, self.stats = runner, stats

    def __getattr__(self, name: str):
        if name == "runner":   # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    def run(self, seqs) -> ModelRunnerOutput:
        self.stats.launch(len(seqs), 1)
        self.stats.record(len(seqs), 0.0, decode=all(seq.num_scheduled_tokens == 1 for seq in seqs))
        return self.runner.run(seqs)

    def launch_decode_round(self, seqs, num_steps: int, after=None):
        self.stats.launch(len(seqs), num_steps)
        for _ in range(num_steps):
            self.stats.record(len(seqs), 0.0, decode=True)
        return self.runner.launch_decode_round(seqs, num_steps, after)

    def shutdown(self) -> None:
        try:
            self.runner.shutdown()
        finally:
            if os.environ.get(STATS_ENV_VAR):
                _write_stats(self.stats, os.environ[STATS_ENV_VAR])


def record_real_device() -> None:
    """Time the engine's events on the real device (no simulation) for every LLMEngine built after
    this call; install.timeline.stats holds them."""
    from nanovllm.engine import llm_engine
    make_model_runner = llm_engine.make_model_runner
    install.timeline = DeviceTimeline(0.0, 0.0)   # only its stats are used
    llm_engine.make_model_runner = lambda *args: RecordingModelRunner(make_model_runner(*args), install.timeline.stats)
    _time_engine_events()


def install(step_ms: float = DEFAULT_STEP_MS, token_us: float = DEFAULT_TOKEN_US,
            prefill_ms: float = DEFAULT_PREFILL_MS) -> None:
    """Make every LLMEngine built after this call run on the simulated device."""
    from nanovllm.engine import llm_engine
    timeline = DeviceTimeline(step_ms / 1e3, token_us / 1e6, prefill_ms / 1e3)
    llm_engine.make_model_runner = lambda config, *args: SimulatedModelRunner(config, timeline)
    install.timeline = timeline
    _time_engine_events()
    os.environ[ENV_VAR] = f"{step_ms},{token_us},{prefill_ms}"   # inherited by the engine process


def _time_engine_events() -> None:
    """Wrap (once) the methods whose calls the stats time: requests added, steps that finished
    requests, commands the event loop queued in thread mode, finished outputs it took from the
    engine, streams it ended, and POSTs its generation routes took."""
    from nanovllm.engine import async_llm, llm_engine
    from nanovllm.entrypoints.openai import asgi_routes
    if getattr(llm_engine.LLMEngine.add_request, "timed", False):
        return
    add_request, step = llm_engine.LLMEngine.add_request, llm_engine.LLMEngine.step
    submit, deliver = async_llm.EngineThread._submit, async_llm.AsyncLLM._deliver
    stream_events, serve_generation = asgi_routes.stream_events, asgi_routes.serve_generation

    def timed_add_request(engine, *args, **kwargs):
        install.timeline.stats.arrivals.append(round(time.perf_counter(), 4))
        return add_request(engine, *args, **kwargs)

    def timed_step(engine):
        outputs = step(engine)
        finished = sum(out.finished for out in outputs)
        if finished:
            install.timeline.stats.finishes.append((round(time.perf_counter(), 4), finished))
        return outputs

    def timed_submit(core, command):
        install.timeline.stats.submits.append(round(time.perf_counter(), 4))
        return submit(core, command)

    def timed_deliver(llm, outputs):
        finished = sum(out.finished for out in outputs)
        if finished:
            install.timeline.stats.delivers.append((round(time.perf_counter(), 4), finished))
        return deliver(llm, outputs)

    async def timed_stream_events(send, stream):
        try:
            await stream_events(send, stream)
        finally:
            install.timeline.stats.stream_ends.append(round(time.perf_counter(), 4))

    async def timed_serve_generation(*args):
        install.timeline.stats.receives.append(round(time.perf_counter(), 4))
        await serve_generation(*args)
    timed_add_request.timed = True
    llm_engine.LLMEngine.add_request, llm_engine.LLMEngine.step = timed_add_request, timed_step
    async_llm.EngineThread._submit = timed_submit
    async_llm.AsyncLLM._deliver = timed_deliver
    asgi_routes.stream_events = timed_stream_events
    asgi_routes.serve_generation = timed_serve_generation


def _write_stats(stats: DeviceStats, path: str) -> None:
    with open(path, "w") as f:
        json.dump(stats.summary(), f)


def main() -> None:
    parser = argparse.ArgumentParser(description="the OpenAI server on a simulated device")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS)
    parser.add_argument("--token-us", type=float, default=DEFAULT_TOKEN_US)
    parser.add_argument("--prefill-ms", type=float, default=DEFAULT_PREFILL_MS)
    parser.add_argument("--real-device", action="store_true",
                        help="no simulation: time the same events on the engine's real device (thread mode only)")
    args, server_argv = parser.parse_known_args()
    if server_argv[:1] == ["--"]:
        server_argv = server_argv[1:]
    from nanovllm.entrypoints.openai import api_server
    server_args = api_server.add_cli_args(argparse.ArgumentParser(prog="sim_device.py")).parse_args(server_argv)
    if args.real_device:
        if server_args.multiprocess_mode or server_args.api_server_count != 1:
            parser.error("--real-device times the engine in the server's process: thread mode only")
        if {"--step-ms", "--token-us", "--prefill-ms"} & {arg.split("=")[0] for arg in sys.argv}:
            parser.error("--real-device simulates nothing: --step-ms, --token-us and --prefill-ms do not apply")
        server_args.multiprocess_mode = False   # (the default of a CPU engine on several threads is a process)
        record_real_device()
    else:
        install(args.step_ms, args.token_us, args.prefill_ms)
    api_server.main(server_args)


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__" and os.environ.get(ENV_VAR):   # the server's engine process
    install(*map(float, os.environ[ENV_VAR].split(",")))
