"""The server's event-loop CPU per chat request and per streamed token, requests one at a time.

B3's closed loop of equal requests pays the event loop's work per request at every wave
boundary (benchmarks/RESULTS.md, "Ninth session: serving overhead"), and its work per
streamed chunk all along. This measures both apart from the wall clock, which a shared
machine makes noisy: it starts the server on the simulated device (sim_device.py), sends
--requests streaming chat requests one after another on one keep-alive connection, each
of --max-tokens tokens (ignore_eos, with usage), and reads the CPU time of the server's
threads from /proc: the main thread (the event loop: HTTP, templates, streams) and the
others (the engine thread). Run it with --max-tokens 2 for the per-request cost, and with
a long output (256) to see the per-token one; the JSON line has both per request and per
token, and the chunks (JSON events) per request.

    PYTHONPATH=. python benchmarks/bench_frontend.py --model DIR --requests 300 --max-tokens 2
"""
import argparse
import asyncio
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import QUESTIONS, process_cpu_s, request_body, start_server  # noqa: E402
from sse_client import SSEConnection  # noqa: E402

WARMUP_REQUESTS = 20


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds so far of process `pid`'s main thread and of all its other threads."""
    total, main = process_cpu_s(pid), process_cpu_s(pid, pid)
    return main, total - main


async def run_requests(url: str, num: int, max_tokens: int) -> tuple[int, int]:
    """Send `num` streaming chat requests one at a time; returns (chunks, tokens) over them."""
    conn = SSEConnection.of_url(url)
    reads = tokens = 0
    try:
        for i in range(num):
            status, lines = await conn.post("/v1/chat/completions", request_body(QUESTIONS[i % len(QUESTIONS)],
                                                                                max_tokens))
            async for line in lines:
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    reads += 1
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            if status != 200:
                raise SystemExit(f"HTTP {status}")
    finally:
        await conn.close()
    return reads, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory with a tokenizer (weights not read)")
    parser.add_argument("--server-args", default="--load-format dummy --max-model-len 4096 "
                        "--num-scheduler-steps 8 --async-scheduling --disable-uvicorn-access-log")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--simulate-step-ms", type=float, default=2.5)
    args = parser.parse_args()
    args.show_server_log = False
    args.simulate_prefill_ms = 0.0  # start_server's: a prefill's device time adds no CPU to what this reads
    args.simulate_token_us = None   # start_server's: sim_device's default
    proc, url = start_server(args)
    try:
        asyncio.run(run_requests(url, WARMUP_REQUESTS, args.max_tokens))
        start = thread_cpu_s(proc.pid)
        events, tokens = asyncio.run(run_requests(url, args.requests, args.max_tokens))
        end = thread_cpu_s(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    loop_s, engine_s = end[0] - start[0], end[1] - start[1]
    n = args.requests
    summary = {"bench": "frontend", "requests": n, "max_tokens": args.max_tokens, "server_args": args.server_args,
               "event_loop_ms_per_request": round(loop_s * 1e3 / n, 3),
               "engine_thread_ms_per_request": round(engine_s * 1e3 / n, 3),
               "event_loop_us_per_token": round(loop_s * 1e6 / tokens, 2),
               "chunks_per_request": round(events / n, 2), "load_average": os.getloadavg()[0]}
    print(f"event loop {summary['event_loop_ms_per_request']} ms a request "
          f"({summary['event_loop_us_per_token']} us a token), engine thread "
          f"{summary['engine_thread_ms_per_request']} ms; {summary['chunks_per_request']} chunks a request")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
