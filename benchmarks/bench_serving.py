"""B3 serving benchmark: N concurrent streaming chat clients against the OpenAI server.

Starts `python -m nanovllm.entrypoints.openai.api_server` (the embedded SmolLM2
model unless --model is given) on a free loopback port, or uses a running server
(--url). Each of --concurrency clients sends streaming chat requests back to back
until --num-prompts requests have been sent; each request asks for exactly
--max-tokens tokens (ignore_eos), so runs are comparable. With --request-rate the
requests arrive at Poisson times instead (an open loop, as vLLM's `bench serve
--request-rate R --max-concurrency N`), at most --concurrency of them in flight.

Per request: time to first token (TTFT: from sending the request to the first
chunk with content), time per output token (TPOT: (last token time - first token
time) / (tokens - 1)), errors. Reports median and p99 of both, requests/s and
output tokens/s over the timed run, and prints a final JSON line. With
--offline-baseline it also runs the same requests through `LLM.generate` in-process
(after the server has stopped), so the server's overhead can be read off a shared,
noisy machine as a ratio. The server's CPU time per output token (all its threads) and the
baseline's are printed too: steadier than wall time on a shared machine. --simulate-step-ms
runs both on a simulated device (sim_device.py), which leaves only the host's work, and prints
what that device ran for each (steps, rounds, rows a step, busy and idle seconds, decode steps by
their number of rows: a deterministic view of batching that the wall clock blurs).

    PYTHONPATH=. python benchmarks/bench_serving.py --concurrency 16 --num-prompts 64 --max-tokens 64
"""
import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_client import SSEConnection  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
STARTUP_TIMEOUT_S = 600     # loading and dequantizing the GGUF on a busy 2-core machine
REQUEST_TIMEOUT_S = 600
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a haiku about the sea.", "Give me three tips for learning Python.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers?", "How does a bicycle stay upright?",
    "Describe a cat to someone who has never seen one.", "What is the difference between weather and climate?",
    "List the planets of the solar system.", "How do vaccines work?",
    "What makes a good cup of coffee?", "Explain what a neural network is.",
    "Why do leaves change color in autumn?", "What is the Pythagorean theorem?",
]


def times_device_events(args) -> bool:
    """Whether the started server runs through sim_device.py: on the simulated device, or on the real
    one with its events timed (--sim-timeline alone)."""
    return args.simulate_step_ms is not None or args.sim_timeline is not None


def start_server(args) -> tuple[subprocess.Popen, str]:
    server = ["-m", "nanovllm.entrypoints.openai.api_server"]
    if args.simulate_step_ms is not None:   # the real server and engine on a simulated device (sim_device.py)
        server = [os.path.join(REPO, "benchmarks", "sim_device.py"), "--step-ms", str(args.simulate_step_ms),
                  "--prefill-ms", str(args.simulate_prefill_ms),
                  *(["--token-us", str(args.simulate_token_us)] if args.simulate_token_us is not None else []), "--"]
    elif args.sim_timeline:   # the real device, its events timed as the simulated device's are
        server = [os.path.join(REPO, "benchmarks", "sim_device.py"), "--real-device", "--"]
    cmd = [sys.executable, *server, *([args.model] if args.model else []),
           "--port", "0", "--log-stats-interval", "10", *args.server_args.split()]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if times_device_events(args):   # what the device ran, written at the server's exit
        env["NANOVLLM_SIM_STATS"] = sim_stats_path()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port: list[int] = []
    ready = threading.Event()

    def read_log():
        for line in proc.stderr:
            if args.show_server_log:
                sys.stderr.write(line)
            match = READY_LINE.search(line)
            if match:
                port.append(int(match.group(1)))
                ready.set()
        ready.set()
    threading.Thread(target=read_log, daemon=True).start()
    if not ready.wait(STARTUP_TIMEOUT_S) or not port:
        proc.kill()
        raise SystemExit("the server did not start (rerun with --show-server-log)")
    return proc, f"http://127.0.0.1:{port[0]}"


# sim_device's timed events, and the client's (when it sent each request and read its stream's end)
TIMELINE_LOGS = ("launches", "arrivals", "submits", "finishes", "delivers", "stream_ends", "receives", "idle",
                 "client_sends", "client_ends")


def sim_stats_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"bench_serving_sim_stats_{os.getpid()}.json")


def read_sim_stats(args) -> dict | None:
    """The DeviceStats the started server's sim_device.py wrote, or None where it ran none."""
    if not times_device_events(args) or args.url:
        return None
    try:
        with open(sim_stats_path()) as f:
            stats = json.load(f)
        os.unlink(sim_stats_path())
        return stats
    except OSError:
        return None


def request_body(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "stream_options": {"include_usage": True}}


class Timing:
    """One request's chunk times and usage, from its SSE lines."""

    def __init__(self):
        self.start = time.perf_counter()
        self.token_times: list[float] = []
        self.usage: dict | None = None
        self.error: str | None = None

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            self.error = chunk["error"]["message"]
        elif chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            self.token_times.append(time.perf_counter())

    def result(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        tokens = self.usage["completion_tokens"] if self.usage else len(self.token_times)
        if not self.token_times:
            return {"error": "no tokens"}
        tpot = (self.token_times[-1] - self.token_times[0]) / (tokens - 1) if tokens > 1 else None
        return {"ttft": self.token_times[0] - self.start, "tpot": tpot, "tokens": tokens,
                "sent": self.start, "ended": time.perf_counter()}   # (perf_counter: the server's clock too)


async def one_request_httpx(http, question: str, max_tokens: int) -> dict:
    timing = Timing()
    async with http.stream("POST", "/v1/chat/completions", json=request_body(question, max_tokens)) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            timing.line(line)
    return timing.result()


async def one_request_stdlib(conn: SSEConnection, question: str, max_tokens: int) -> dict:
    timing = Timing()
    status, lines = await conn.post("/v1/chat/completions", request_body(question, max_tokens))
    body = [line async for line in lines] if status != 200 else None
    if body is not None:
        return {"error": f"HTTP {status}: {chr(10).join(body)[:200]!r}"}
    async for line in lines:
        timing.line(line)
    return timing.result()


async def run_clients(url: str, args) -> tuple[list[dict], float]:
    """--concurrency clients, each on its own keep-alive connection, sending requests back to back;
    with a finite --request-rate, requests sent at Poisson arrival times over those connections."""
    results: list[dict] = []
    counter = iter(range(args.num_prompts))
    if args.client == "httpx":
        import httpx
        http = httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=args.concurrency + 2),
                                 timeout=REQUEST_TIMEOUT_S)
        send, errors, conns = (lambda _, q, n: one_request_httpx(http, q, n)), httpx.HTTPError, [None] * args.concurrency
    else:
        send, errors = one_request_stdlib, (OSError, asyncio.IncompleteReadError, ValueError)
        conns = [SSEConnection.of_url(url) for _ in range(args.concurrency)]

    async def request(conn, i: int) -> None:
        try:
            results.append(await asyncio.wait_for(send(conn, QUESTIONS[i % len(QUESTIONS)], args.max_tokens),
                                                  REQUEST_TIMEOUT_S))
        except (errors, asyncio.TimeoutError) as e:
            results.append({"error": repr(e)})
            if conn is not None:
                await conn.close()

    async def client(conn):
        for i in counter:
            await request(conn, i)

    async def open_loop():
        """Requests sent at Poisson arrival times (--request-rate), each on a free connection: at
        most --concurrency in flight, a later arrival waits for one (its TTFT counts from its send)."""
        free: asyncio.Queue = asyncio.Queue()
        for conn in conns:
            free.put_nowait(conn)

        async def arrival(i: int) -> None:
            conn = await free.get()
            try:
                await request(conn, i)
            finally:
                free.put_nowait(conn)
        rng, due, tasks = random.Random(args.seed), time.perf_counter(), []
        for i in range(args.num_prompts):   # the first at once, the others an exponential gap apart
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(arrival(i)))
            due += rng.expovariate(args.request_rate)
        await asyncio.gather(*tasks)
    try:
        await send(conns[0], "Hello!", 4)   # warm-up: first-call costs stay out of the figures
        if args.client == "stdlib":   # every client's connection open before the clock starts, as conns[0]'s is
            await asyncio.gather(*(conn.connect() for conn in conns))
        start = time.perf_counter()
        if math.isinf(args.request_rate):
            await asyncio.gather(*(client(conn) for conn in conns))
        else:
            await open_loop()
        return results, time.perf_counter() - start
    finally:
        if args.client == "httpx":
            await http.aclose()
        for conn in conns:
            if conn is not None:
                await conn.close()


def run_timed(url: str, args,
              server_pid: int | None) -> tuple[list[dict], float, tuple[float, float, float, int, int] | None]:
    """The clients' results, the timed run's seconds and the server's CPU seconds in it: its own
    process's, its child processes' (the engine process in multiprocess mode) and its main
    thread's (the event loop), then the event loop's context switches, voluntary and forced
    (`context_switches`); None: not started here. The CPU time counts the warm-up request too."""
    cpu_start = server_cpu_s(server_pid) if server_pid else None
    loop_start = process_cpu_s(server_pid, server_pid) if server_pid else None
    switches_start = context_switches(server_pid, server_pid) if server_pid else None
    results, elapsed = asyncio.run(run_clients(url, args))
    if not server_pid:
        return results, elapsed, None
    cpu_end = server_cpu_s(server_pid)
    loop_end = process_cpu_s(server_pid, server_pid)
    switches_end = context_switches(server_pid, server_pid)
    return results, elapsed, (cpu_end[0] - cpu_start[0], cpu_end[1] - cpu_start[1], loop_end - loop_start,
                              switches_end[0] - switches_start[0], switches_end[1] - switches_start[1])


def context_switches(pid: int, tid: int) -> tuple[int, int]:
    """Thread `tid` of process `pid`'s context switches so far (Linux /proc): voluntary (it blocked:
    waiting for I/O, or for the GIL another thread holds) and forced (taken off its core, e.g. for a
    thread it woke when it let go of the GIL, where no other core was free)."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        fields = dict(line.split(":") for line in f if "ctxt_switches" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def server_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds so far of process `pid` and of its live descendants (Linux /proc)."""
    return process_cpu_s(pid), sum(process_cpu_s(c) + server_cpu_s(c)[1] for c in child_pids(pid))


def process_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) process `pid` has used so far, every thread or only thread
    `tid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except OSError:   # the thread ended meanwhile
            pass
    return children


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(results: list[dict], elapsed: float, server_cpu: tuple[float, float, float, int, int] | None,
              args) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"bench": "B3", "server_args": args.server_args, "client": args.client, "concurrency": args.concurrency,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,  # None: closed loop
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "completed": len(ok), "errors": len(errors),
            "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(ok) / elapsed, 3),
            "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "ttft_median_ms": round(statistics.median(ttft) * 1e3, 1) if ttft else None,
            "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1) if ttft else None,
            "tpot_median_ms": round(statistics.median(tpot) * 1e3, 2) if tpot else None,
            "tpot_p99_ms": round(percentile(tpot, 99) * 1e3, 2) if tpot else None,
            "server_cpu_ms_per_token": per_token_ms(sum(server_cpu[:2]), out_tokens) if server_cpu else None,
            # the split: the server's own process (event loop; + engine thread in thread mode) and
            # its children (the engine process in multiprocess mode)
            "frontend_cpu_ms_per_token": per_token_ms(server_cpu[0], out_tokens) if server_cpu else None,
            "engine_process_cpu_ms_per_token": per_token_ms(server_cpu[1], out_tokens) if server_cpu else None,
            # of the server's own process, its main thread: the event loop (HTTP, templates, streams)
            "event_loop_cpu_ms_per_token": per_token_ms(server_cpu[2], out_tokens) if server_cpu else None,
            # how often the event loop blocked (I/O waits, the GIL) and was forced off its core
            "event_loop_voluntary_switches_per_request": per_request(server_cpu[3], len(ok)) if server_cpu else None,
            "event_loop_forced_switches_per_request": per_request(server_cpu[4], len(ok)) if server_cpu else None,
            "first_errors": errors[:3]}


def per_token_ms(cpu_s: float, out_tokens: int) -> float | None:
    return round(cpu_s * 1e3 / out_tokens, 4) if out_tokens else None


def per_request(count: int, num_requests: int) -> float | None:
    return round(count / num_requests, 2) if num_requests else None


def offline_tokens_per_s(args) -> tuple[float, float, dict | None]:
    """The same requests through `LLM.generate` in this process, `--concurrency` at a time: the
    engine's own speed on this machine now, to read the server's figures against. Returns
    output tokens/s, this process's CPU ms per output token, and what the simulated device ran
    in the timed run (None when not simulated)."""
    from nanovllm import LLM, SamplingParams
    if args.simulate_step_ms is not None:
        sys.path.insert(0, os.path.join(REPO, "benchmarks"))
        import sim_device
        token_us = sim_device.DEFAULT_TOKEN_US if args.simulate_token_us is None else args.simulate_token_us
        sim_device.install(args.simulate_step_ms, token_us, args.simulate_prefill_ms)
    llm = LLM(args.model, max_num_seqs=args.concurrency, **json.loads(args.offline_engine_kwargs))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             tokenize=False, add_generation_prompt=True)
               for i in range(args.num_prompts)]
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.7)
    result = []

    def run():   # in a worker thread, as the server's engine loop (torch's CPU threading differs by thread)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
        if args.simulate_step_ms is not None:
            sim_device.install.timeline.stats = sim_device.DeviceStats()
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result.extend([num_tokens / elapsed, cpu * 1e3 / num_tokens])
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    stats = sim_device.install.timeline.stats.summary() if args.simulate_step_ms is not None else None
    return result[0], result[1], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server; default: start one")
    parser.add_argument("--model", default=None, help="model for the started server (default: embedded)")
    parser.add_argument("--server-args", default="", help="extra flags for the started server, one string")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests a second, sent at Poisson arrival times with at most --concurrency in "
                             "flight (vLLM's bench serve --request-rate with --max-concurrency); default inf: "
                             "--concurrency clients sending back to back (closed loop)")
    parser.add_argument("--seed", type=int, default=0, help="the arrival times' random seed (--request-rate)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client", choices=("stdlib", "httpx"), default="stdlib",
                        help="the clients' HTTP library: stdlib (sse_client.py: asyncio streams, the lighter "
                             "one) or httpx (the client of runs before 2026-12-01)")
    parser.add_argument("--show-server-log", action="store_true")
    parser.add_argument("--offline-baseline", action="store_true",
                        help="also time the same requests through LLM.generate, after the server stops")
    parser.add_argument("--offline-engine-kwargs", default="{}", help="JSON engine kwargs for the baseline")
    parser.add_argument("--simulate-step-ms", type=float, default=None,
                        help="run server and baseline on a simulated device whose decode step takes this long "
                             "(benchmarks/sim_device.py): the host's share of serving, on any machine")
    parser.add_argument("--simulate-prefill-ms", type=float, default=0.0,
                        help="with --simulate-step-ms: more for each step that prefills (a GPU prefill step of a "
                             "few short prompts took ~30-40 ms in B3 eager, ~10 ms from a CUDA graph)")
    parser.add_argument("--simulate-token-us", type=float, default=None,
                        help="with --simulate-step-ms: more for each token a step schedules (default: "
                             "sim_device's DEFAULT_TOKEN_US)")
    parser.add_argument("--sim-timeline", metavar="PATH", default=None,
                        help="write the device's timed events (launches, requests added, submitted and finished, "
                             "and on the simulated device its idle gaps) there as JSON (sim_timeline.py prints it); "
                             "without --simulate-step-ms they are timed on the real device")
    args = parser.parse_args()
    if args.sim_timeline and args.url:
        parser.error("--sim-timeline needs a server started here (no --url)")
    if (args.simulate_prefill_ms or args.simulate_token_us is not None) and args.simulate_step_ms is None:
        parser.error("--simulate-prefill-ms and --simulate-token-us need --simulate-step-ms")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        results, elapsed, server_cpu = run_timed(url, args, proc.pid if proc is not None else None)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    summary = summarize(results, elapsed, server_cpu, args)
    sim_stats = read_sim_stats(args)
    if sim_stats is not None:   # the warm-up request's steps included
        summary["sim_device"] = sim_stats
        ok = [r for r in results if "error" not in r]
        sim_stats["client_sends"] = sorted(round(r["sent"], 4) for r in ok)
        sim_stats["client_ends"] = sorted(round(r["ended"], 4) for r in ok)
        if args.simulate_step_ms is not None:   # (the real device's busy time is not known)
            sim_stats["busy_fraction"] = round(sim_stats["busy_s"] / elapsed, 3)
    if args.offline_baseline:
        offline, offline_cpu_ms, offline_sim = offline_tokens_per_s(args)
        if offline_sim is not None:
            summary["offline_sim_device"] = offline_sim
        summary["offline_output_tokens_per_s"] = round(offline, 1)
        summary["offline_cpu_ms_per_token"] = round(offline_cpu_ms, 4)
        summary["serving_over_offline"] = round(summary["output_tokens_per_s"] / offline, 3)
    arrivals = "" if math.isinf(args.request_rate) else f" (at most), {args.request_rate} requests/s (Poisson)"
    print(f"B3 serving: {summary['completed']}/{args.num_prompts} requests ok, {summary['errors']} errors, "
          f"concurrency {args.concurrency}{arrivals}, {args.max_tokens} tokens each")
    print(f"  requests/s {summary['requests_per_s']}, output tokens/s {summary['output_tokens_per_s']}")
    print(f"  TTFT median {summary['ttft_median_ms']} ms, p99 {summary['ttft_p99_ms']} ms")
    print(f"  TPOT median {summary['tpot_median_ms']} ms, p99 {summary['tpot_p99_ms']} ms")
    if summary["server_cpu_ms_per_token"] is not None:
        print(f"  server CPU time {summary['server_cpu_ms_per_token']} ms per output token (its own process "
              f"{summary['frontend_cpu_ms_per_token']}, of it the event loop {summary['event_loop_cpu_ms_per_token']}; "
              f"child processes {summary['engine_process_cpu_ms_per_token']}); the event loop's context "
              f"switches a request: {summary['event_loop_voluntary_switches_per_request']} voluntary, "
              f"{summary['event_loop_forced_switches_per_request']} forced")
    if args.offline_baseline:
        print(f"  offline LLM.generate, same requests: {summary['offline_output_tokens_per_s']} output tokens/s "
              f"(serving / offline = {summary['serving_over_offline']}); "
              f"CPU time {summary['offline_cpu_ms_per_token']} ms per output token")
    for key in ("sim_device", "offline_sim_device"):
        if key in summary:
            stats = summary[key]
            busy = ""   # (none of it timed on the real device)
            if args.simulate_step_ms is not None:
                of_run = f" ({stats['busy_fraction']} of the run)" if "busy_fraction" in stats else ""
                busy = f", busy {stats['busy_s']} s{of_run}, idle {stats['idle_s']} s"
            print(f"  {key}: {stats['steps']} steps in {stats['rounds']} rounds, {stats['rows_per_step']} rows a "
                  f"step{busy}; decode steps by rows {stats['decode_steps_by_rows']}")
    if args.sim_timeline:
        with open(args.sim_timeline, "w") as f:
            json.dump({k: {log: summary[k][log] for log in TIMELINE_LOGS if log in summary[k]}
                       for k in ("sim_device", "offline_sim_device") if k in summary}, f)
    for key in ("sim_device", "offline_sim_device"):
        for log in TIMELINE_LOGS:
            summary.get(key, {}).pop(log, None)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
