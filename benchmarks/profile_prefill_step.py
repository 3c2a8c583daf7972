"""Where a short prefill step's time goes: host against device, through the public API.

Run eagerly on an H200, a prefill step of 1-64 prompts of 32 tokens took 24-30 ms in the
model runner for 1.2-4.6 ms of device work: its kernel launches, the fixed cost every short
request paid in TTFT until such steps replayed CUDA graphs (engine/prefill_graph.py;
benchmarks/RESULTS.md, "Twenty-eighth session"; `--eager-prefill` times them without).
This times `LLM.generate` of `rows` fresh prompts of `--prompt-tokens` tokens with
max_tokens=1 (one prefill step, nothing else: the sequences finish at the token the prefill
samples) and the model runner's `run` inside it (the rest is the engine's own work), then
profiles one such call with torch.profiler and prints the device's busy time (kernels and
copies) and the host's CPU ops by their own time: a `run` much longer than the device's busy
time is a step bound by its launches. The Chrome traces
(`trace_gaps.py` reads them) go under --out.

    python benchmarks/profile_prefill_step.py [--rows 1,14,64] [--prompt-tokens 32] [--eager-prefill] [--out DIR]
"""
import argparse
import os
import statistics
import sys
import time
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import QWEN3_0_6B, SMALL, model_dir  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

VOCAB_IDS = 10_000     # prompt ids drawn below this (both shapes' vocabularies are larger)
TOP_HOST_OPS = 15


def prompts(rows: int, num_tokens: int) -> list[list[int]]:
    """Fresh prompts: no prefix-cache hit on an earlier call's."""
    return [[randint(0, VOCAB_IDS - 1) for _ in range(num_tokens)] for _ in range(rows)]


def timed_calls(llm: LLM, rows: int, num_tokens: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each `generate` call, and of the model runner's `run` inside it (the step's forward
    and sampling until its tokens reach the host; the rest is the engine's own work)."""
    params = SamplingParams(max_tokens=1, temperature=0)
    runner = llm.llm_engine.model_runner
    run, run_times = runner.run, []

    def timed_run(seqs):
        start = time.perf_counter()
        try:
            return run(seqs)
        finally:
            run_times.append(time.perf_counter() - start)
    runner.run = timed_run
    times = []
    try:
        for _ in range(repeats):
            batch = prompts(rows, num_tokens)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
    finally:
        del runner.run   # the class's method again
    return times, run_times


def device_busy_ms(prof) -> float:
    """Milliseconds of device activity (kernels, copies, memsets) in the profile, overlaps merged."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,14,64", help="prompts in one step, a comma-separated list")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a two-layer model instead of the Qwen3-0.6B shape")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="no CUDA graphs for prefill steps (decode steps keep theirs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the Chrome traces go")
    args = ap.parse_args()
    seed(0)
    llm = LLM(model_dir(SMALL if args.small else QWEN3_0_6B), load_format="dummy", skip_tokenizer_init=True,
              **({"max_prefill_graph_tokens": 0} if args.eager_prefill else {}))
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for rows in map(int, args.rows.split(",")):
        timed_calls(llm, rows, args.prompt_tokens, 1)   # warm-up: a first shape's costs stay out of the figures
        times, run_times = timed_calls(llm, rows, args.prompt_tokens, args.repeats)
        with profile(activities=activities) as prof:
            timed_calls(llm, rows, args.prompt_tokens, 1)
        trace = os.path.join(args.out, f"prefill_step_rows{rows}.json")
        prof.export_chrome_trace(trace)
        print(f"rows {rows} x {args.prompt_tokens} tokens: generate median {statistics.median(times) * 1e3:.2f} ms "
              f"(runs {', '.join(f'{t * 1e3:.1f}' for t in times)}), of it ModelRunner.run median "
              f"{statistics.median(run_times) * 1e3:.2f} ms; profiled call: device busy "
              f"{device_busy_ms(prof) if on_gpu else 0.0:.2f} ms; trace {trace}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_HOST_OPS))
    llm.shutdown()


if __name__ == "__main__":
    main()
