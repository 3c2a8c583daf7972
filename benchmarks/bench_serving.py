"""B3 serving benchmark: N concurrent streaming chat clients against the OpenAI server.

Starts `python -m nanovllm.entrypoints.openai.api_server` (the embedded SmolLM2
model unless --model is given) on a free loopback port, or uses a running server
(--url). Each of --concurrency clients sends streaming chat requests back to back
until --num-prompts requests have been sent; each request asks for exactly
--max-tokens tokens (ignore_eos), so runs are comparable.

Per request: time to first token (TTFT: from sending the request to the first
chunk with content), time per output token (TPOT: (last token time - first token
time) / (tokens - 1)), errors. Reports median and p99 of both, requests/s and
output tokens/s over the timed run, and prints a final JSON line. With
--offline-baseline it also runs the same requests through `LLM.generate` in-process
(after the server has stopped), so the server's overhead can be read off a shared,
noisy machine as a ratio.

    PYTHONPATH=. python benchmarks/bench_serving.py --concurrency 16 --num-prompts 64 --max-tokens 64
"""
import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

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


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.openai.api_server", *([args.model] if args.model else []),
           "--port", "0", "--log-stats-interval", "10", *args.server_args.split()]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
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


async def one_request(http: httpx.AsyncClient, question: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times, usage = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(token_times)
    if not token_times:
        return {"error": "no tokens"}
    tpot = (token_times[-1] - token_times[0]) / (tokens - 1) if tokens > 1 else None
    return {"ttft": token_times[0] - start, "tpot": tpot, "tokens": tokens}


async def run_clients(url: str, concurrency: int, num_prompts: int, max_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) as http:
        await one_request(http, "Hello!", 4)   # warm-up: first-call costs stay out of the figures
        counter = iter(range(num_prompts))
        results: list[dict] = []

        async def client():
            for i in counter:
                try:
                    results.append(await one_request(http, QUESTIONS[i % len(QUESTIONS)], max_tokens))
                except httpx.HTTPError as e:
                    results.append({"error": repr(e)})
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(results: list[dict], elapsed: float, args) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"bench": "B3", "concurrency": args.concurrency, "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "completed": len(ok), "errors": len(errors),
            "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(ok) / elapsed, 3),
            "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "ttft_median_ms": round(statistics.median(ttft) * 1e3, 1) if ttft else None,
            "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1) if ttft else None,
            "tpot_median_ms": round(statistics.median(tpot) * 1e3, 2) if tpot else None,
            "tpot_p99_ms": round(percentile(tpot, 99) * 1e3, 2) if tpot else None,
            "first_errors": errors[:3]}


def offline_tokens_per_s(args) -> float:
    """The same requests through `LLM.generate` in this process, `--concurrency` at a time: the
    engine's own speed on this machine now, to read the server's figures against."""
    from nanovllm import LLM, SamplingParams
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
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server; default: start one")
    parser.add_argument("--model", default=None, help="model for the started server (default: embedded)")
    parser.add_argument("--server-args", default="", help="extra flags for the started server, one string")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--show-server-log", action="store_true")
    parser.add_argument("--offline-baseline", action="store_true",
                        help="also time the same requests through LLM.generate, after the server stops")
    parser.add_argument("--offline-engine-kwargs", default="{}", help="JSON engine kwargs for the baseline")
    args = parser.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        results, elapsed = asyncio.run(run_clients(url, args.concurrency, args.num_prompts, args.max_tokens))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    summary = summarize(results, elapsed, args)
    if args.offline_baseline:
        offline = offline_tokens_per_s(args)
        summary["offline_output_tokens_per_s"] = round(offline, 1)
        summary["serving_over_offline"] = round(summary["output_tokens_per_s"] / offline, 3)
    print(f"B3 serving: {summary['completed']}/{args.num_prompts} requests ok, {summary['errors']} errors, "
          f"concurrency {args.concurrency}, {args.max_tokens} tokens each")
    print(f"  requests/s {summary['requests_per_s']}, output tokens/s {summary['output_tokens_per_s']}")
    print(f"  TTFT median {summary['ttft_median_ms']} ms, p99 {summary['ttft_p99_ms']} ms")
    print(f"  TPOT median {summary['tpot_median_ms']} ms, p99 {summary['tpot_p99_ms']} ms")
    if args.offline_baseline:
        print(f"  offline LLM.generate, same requests: {summary['offline_output_tokens_per_s']} output tokens/s "
              f"(serving / offline = {summary['serving_over_offline']})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
