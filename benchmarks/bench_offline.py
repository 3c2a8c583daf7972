"""B1: offline throughput, nano-vLLM's bench.py workload.

seed(0); 256 prompts of randint(0, 10000) ids with lengths randint(100, 1024);
max_tokens randint(100, 1024) each; temperature 0.6; ignore_eos; max_model_len 4096.
As a user meets it (nano-vLLM's bench.py): `LLM(...)`, one untimed one-prompt warm-up call,
then the FIRST timed `generate` after start-up, which is the B1 figure; then a second timed
call of the same workload with fresh token ids (the same lengths and max_tokens; it shares no
prefix with the first), for the first-to-later ratio. Model: the Qwen3-0.6B configuration with dummy (random)
weights; `--tokenizer DIR` puts a real tokenizer (tokenizer.json, tokenizer_config.json) in
the model directory, so outputs are detokenized as for a user. Also counts the Triton kernel
variants first met after start-up (engine/warmup.py: 0 expected). Prints tok/s, the fraction of the memory roofline
(bytes that must move over the copy bandwidth measured in the same run), the
per-step split of wall time into host work and waiting for the GPU, and a final
JSON line.

    python benchmarks/bench_offline.py                 # B1 on a GPU
    python benchmarks/bench_offline.py --small         # a tiny smoke run (CPU is fine)
"""
import argparse
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.warmup import VariantCounter  # noqa: E402
from nanovllm.kernels.kv_quant import resolve_kv_cache_dtype  # noqa: E402

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
    tie_word_embeddings=True, torch_dtype="bfloat16", hidden_act="silu", eos_token_id=151645)
SMALL = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=10240)  # > the ids, randint(0, 10000)
COPY_BYTES = 4 << 30  # device-to-device copy used to measure bandwidth
WARMUP_PROMPT_LEN, WARMUP_TOKENS = 16, 16  # the untimed one-prompt warm-up
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def workload(num_seqs: int, max_input_len: int, max_output_len: int, rng_seed: int = 0):
    seed(rng_seed)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def fresh_token_ids(prompts: list[list[int]], rng_seed: int) -> list[list[int]]:
    """Prompts of the same lengths with other token ids: the same workload again, with no
    prefix-cache hit on the first run's prompts (the later call that the first one is read against)."""
    seed(rng_seed)
    return [[randint(0, 10000) for _ in prompt] for prompt in prompts]


def model_dir(cfg: dict, tokenizer: str | None = None) -> str:
    path = tempfile.mkdtemp(prefix="nanovllm-b1-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in TOKENIZER_FILES if tokenizer else ():
        shutil.copy(os.path.join(tokenizer, name), path)
    return path


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); dst.copy_(src); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * COPY_BYTES / sorted(times[2:])[len(times[2:]) // 2]


def roofline_bytes(cfg: dict, prompts, params, dtype_bytes: int = 2, kv_bytes: int | None = None) -> int:
    """Bytes a decode-only schedule must move: weights once per step (all sequences run
    together, so steps = the longest max_tokens), every context's K/V read at every
    step, every new token's K/V written once. `kv_bytes`: a K/V element's size (default
    `dtype_bytes`; 1 for an fp8 cache)."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * cfg["head_dim"]
    weights = (L * layer_params + h * cfg["vocab_size"] + h) * dtype_bytes
    kv_per_token = 2 * L * kv * (dtype_bytes if kv_bytes is None else kv_bytes)
    steps = max(p.max_tokens for p in params)
    reads = sum(m * len(pr) + m * (m - 1) // 2 for pr, m in zip(prompts, (p.max_tokens for p in params)))
    writes = sum(len(pr) + p.max_tokens for pr, p in zip(prompts, params))
    return steps * weights + (reads + writes) * kv_per_token


class StepTimer:
    """Wraps ModelRunner pieces to split wall time: `prepare` (host, building tensors),
    GPU time from the first forward launch of a `run` / `launch_decode_round` call to its
    last sampled ids (CUDA events recorded in the stream: rounds launched ahead of time
    start their bracket when the GPU reaches them), time in the runner (launching, waiting
    for tokens), and the rest (scheduling, postprocessing, outputs: host time, which in a
    multi-step round partly overlaps the GPU). `steps` counts decode steps (a multi-step
    round counts each)."""

    def __init__(self, runner):
        self.steps, self.run_s, self.prepare_s, self.gpu_events, self._pending = 0, 0.0, 0.0, [], None
        self._late = False
        self.cuda = runner.device.type == "cuda"
        driver = getattr(runner, "driver", runner)  # rank 0's ModelRunner under tensor parallelism
        self._prepare, self._forward = driver.prepare, driver._forward
        driver.prepare, driver._forward = self._timed_prepare, self._timed_forward
        self._run = runner.run
        runner.run = self._timed_run
        if hasattr(runner, "launch_decode_round"):  # one rank only
            self._launch = runner.launch_decode_round
            runner.launch_decode_round = self._timed_launch

    def _timed_prepare(self, *args):
        start = time.perf_counter()
        out = self._prepare(*args)
        self.prepare_s += time.perf_counter() - start
        return out

    def _timed_forward(self, *args):
        if self.cuda and self._pending is None:
            # late: the GPU had finished the previous bracket before this one was queued
            self._late = bool(self.gpu_events) and self.gpu_events[-1][1].query()
            self._pending = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._pending[0].record()
        return self._forward(*args)

    def _timed_run(self, seqs):
        start = time.perf_counter()
        out = self._run(seqs)  # host values: the GPU is done
        self.run_s += time.perf_counter() - start
        self.steps += 1
        self._end_bracket("step", len(seqs))
        return out

    def _timed_launch(self, seqs, num_steps, after=None):
        start = time.perf_counter()
        decode_round = self._launch(seqs, num_steps, after=after)
        self._end_bracket("round" if after is None else "chained round", len(seqs))  # after its last step
        self.run_s += time.perf_counter() - start
        self.steps += num_steps
        decode_round.outputs = self._timed_outputs(decode_round.outputs)
        return decode_round

    def _timed_outputs(self, outputs):
        """Time spent waiting for a round's tokens is the runner's; the caller's
        postprocessing between steps is host time (overlapping the GPU)."""
        def timed(*args, **kwargs):
            steps = outputs(*args, **kwargs)
            while True:
                start = time.perf_counter()
                output = next(steps, None)
                self.run_s += time.perf_counter() - start
                if output is None:
                    return
                yield output
        return timed

    def _end_bracket(self, kind: str, num_seqs: int) -> None:
        if self._pending is not None:
            self._pending[1].record()
            self.gpu_events.append((*self._pending, kind, num_seqs, self._late))
            self._pending = None

    def gpu_s(self) -> float:
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b, *_ in self.gpu_events) / 1e3

    def gpu_gaps(self) -> dict[str, list]:
        """Stream time between consecutive brackets (the GPU idle, or running the little that
        is recorded outside them: input copies), by the kinds of the two brackets and the
        second one's batch size rounded up to a power of two:
        {"step -> round, <=256 seqs": [count, total ms, count queued late], ...}; late: the
        GPU had finished the first bracket when the host queued the second."""
        torch.cuda.synchronize()
        gaps: dict[str, list] = {}
        for (_, end, before, *_), (start, _, after, num_seqs, late) in zip(self.gpu_events, self.gpu_events[1:]):
            gap = gaps.setdefault(f"{before} -> {after}, <={1 << (num_seqs - 1).bit_length()} seqs", [0, 0.0, 0])
            gap[0] += 1
            gap[1] += end.elapsed_time(start)
            gap[2] += late
        return {key: [count, round(ms, 3), late] for key, (count, ms, late) in sorted(gaps.items())}


class GCPauses:
    """Python's garbage-collector pauses while it is alive, by generation."""

    def __init__(self):
        self._pauses: dict[int, list] = {}  # generation -> [count, total ms, longest ms]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._start) * 1e3
        pause = self._pauses.setdefault(info["generation"], [0, 0.0, 0.0])
        pause[0] += 1
        pause[1] += ms
        pause[2] = max(pause[2], ms)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, list]:
        """{"gen<N>": [count, total ms, longest ms]}"""
        return {f"gen{g}": [count, round(total, 3), round(longest, 3)]
                for g, (count, total, longest) in sorted(self._pauses.items())}


def host_alloc_count() -> int:
    """Pinned host blocks torch has allocated so far (cudaHostAlloc calls); 0 without the stats."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return stats.get("num_host_alloc", 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and workload (smoke test)")
    ap.add_argument("--tokenizer", metavar="DIR", help="a directory with the model's " + " and ".join(TOKENIZER_FILES)
                    + " (default: none, skip_tokenizer_init)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype (auto, fp8, ...)")
    ap.add_argument("--kvcache-block-size", type=int, default=None, help="the engine's cache page size")
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                    help="the engine's max_prefill_graph_tokens (0: prefill steps eager)")
    ap.add_argument("--attn-constants", metavar="JSON", default="{}",
                    help="kernels/triton_attn.py tile constants to set first, e.g. "
                         "'{\"DECODE_FP8_BLOCK_N\": 64}' (an A/B of a tile against the default)")
    ap.add_argument("--num-scheduler-steps", type=int, default=None,
                    help="decode steps per scheduling round (default: the engine's)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="chain decode rounds ahead of the host (default: the engine's)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed run, profile a second run and print GPU time by kernel")
    ap.add_argument("--trace", metavar="PREFIX",
                    help="after the timed run, trace windows of TRACE_STEPS engine steps of a second run "
                         "into PREFIX.<step>.json.gz (chrome traces) and print where the GPU waited in each")
    ap.add_argument("--trace-steps", type=int, default=4, help="engine steps per traced window")
    ap.add_argument("--trace-skip", type=int, default=30, help="engine steps between traced windows")
    ap.add_argument("--trace-windows", type=int, default=3)
    ap.add_argument("--trace-host", action="store_true", help="also record host-side torch ops (slower host)")
    args = ap.parse_args()
    set_kernel_constants(json.loads(args.attn_constants))
    cfg = SMALL if args.small else QWEN3_0_6B
    num_seqs, max_len = (8, 128) if args.small else (args.num_seqs, 1024)
    prompts, params = workload(num_seqs, max_len, max_len)
    # the later call: B1's lengths and max_tokens again, fresh ids (until the twenty-first session it was
    # another draw of lengths, rng_seed 1, whose length mix alone moved its tok/s by a few percent)
    later_prompts, later_params = fresh_token_ids(prompts, rng_seed=1), params
    t0 = time.perf_counter()
    llm = LLM(model_dir(cfg, args.tokenizer), load_format="dummy", skip_tokenizer_init=not args.tokenizer,
              max_model_len=4096,
              enforce_eager=args.enforce_eager, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, num_scheduler_steps=args.num_scheduler_steps,
              async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
              **({} if args.kvcache_block_size is None else {"kvcache_block_size": args.kvcache_block_size}),
              **({} if args.max_prefill_graph_tokens is None
                 else {"max_prefill_graph_tokens": args.max_prefill_graph_tokens}))
    load_s = time.perf_counter() - t0
    # what the engine holds once started: weights, KV cache, the CUDA graphs' pool, workspaces
    reserved_gib = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    # bench.py's warm-up: one short prompt (fresh ids, no prefix shared with the workload)
    variants = VariantCounter().__enter__()
    warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=WARMUP_TOKENS)
    llm.generate([[randint(0, 9999) for _ in range(WARMUP_PROMPT_LEN)]], warm, use_tqdm=False)
    timer = StepTimer(llm.llm_engine.model_runner)
    gc_pauses = GCPauses()
    host_allocs = host_alloc_count()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    gc_pauses.stop()
    host_allocs = host_alloc_count() - host_allocs
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), "ignore_eos: every request runs to max_tokens"
    per_step = lambda seconds: round(seconds / timer.steps * 1e3, 3)  # noqa: E731
    gpu_s = timer.gpu_s() if timer.cuda else 0.0
    result = {"bench": "B1", "output_tokens": tokens, "seconds": round(elapsed, 3),
              "tok_per_s": round(tokens / elapsed, 1), "load_s": round(load_s, 2),
              "reserved_gib_at_start": round(reserved_gib, 3), "steps": timer.steps,
              "tokenizer": bool(args.tokenizer),
              "num_scheduler_steps": llm.llm_engine.num_scheduler_steps,
              "async_scheduling": llm.llm_engine.async_scheduling,
              "ms_per_step": per_step(elapsed), "gpu_ms_per_step": per_step(gpu_s),
              "prepare_ms_per_step": per_step(timer.prepare_s),
              "other_host_ms_per_step": per_step(elapsed - timer.run_s),
              "tensor_parallel_size": args.tensor_parallel_size, "kv_cache_dtype": args.kv_cache_dtype,
              "kvcache_block_size": llm.llm_engine.config.kvcache_block_size,
              "max_prefill_graph_tokens": llm.llm_engine.config.max_prefill_graph_tokens,
              "attn_constants": json.loads(args.attn_constants),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()  # rank 0's; retries mean cudaFree + re-malloc (a device sync)
        result.update(alloc_retries=stats["num_alloc_retries"], device_mallocs=stats["num_device_alloc"],
                      pinned_host_allocs=host_allocs, gc_pauses=gc_pauses.summary(), gpu_gap_ms=timer.gpu_gaps())
        result.update(_later_call(llm, later_prompts, later_params, tokens / elapsed, variants))
        bandwidth = copy_bandwidth()
        # each of the tensor-parallel GPUs moves its share of the bytes, at the same time
        kv_bytes = resolve_kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16).itemsize  # the model is bf16
        floor_s = roofline_bytes(cfg, prompts, params, kv_bytes=kv_bytes) / bandwidth / args.tensor_parallel_size
        result.update(copy_tb_per_s=round(bandwidth / 1e12, 3), roofline_s=round(floor_s, 3),
                      roofline_tok_per_s=round(tokens / floor_s, 1),
                      roofline_fraction=round(floor_s / elapsed, 3))
    if "later_tok_per_s" not in result:
        result.update(_later_call(llm, later_prompts, later_params, tokens / elapsed, variants))
    print(f"start-up {load_s:.1f} s; first call: {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tok/s"
          + (f" ({result['roofline_fraction']:.0%} of the memory roofline, {result['roofline_s']} s)"
             if "roofline_s" in result else ""))
    print(f"later call on fresh prompts: {result['later_tok_per_s']:.0f} tok/s (first / later {result['first_to_later']}); "
          f"kernel variants first met after start-up: {result['kernel_variants_after_startup']}")
    print(f"per step (first call): {result['ms_per_step']} ms wall; GPU {result['gpu_ms_per_step']} ms (forward launch to "
          f"sampled ids); host: prepare {result['prepare_ms_per_step']} ms, schedule + postprocess + outputs "
          f"{result['other_host_ms_per_step']} ms")
    print(json.dumps(result))
    if args.profile:
        profile(llm, prompts, params)
    if args.trace:
        trace(llm, prompts, params, args.trace, args.trace_skip, args.trace_steps, args.trace_windows,
              args.trace_host)


def kernel_constant(key: str) -> tuple[object, str]:
    """(module, name) of a kernel constant: a plain name is kernels/triton_attn.py's, "module.NAME"
    another kernels module's (e.g. "triton_pdl.ENABLED"), "nanovllm.package.module.NAME" any
    module's (e.g. "nanovllm.layers.quantization.fp8.FAST_ACCUM")."""
    module_name, _, name = key.rpartition(".")
    if not module_name.startswith("nanovllm."):
        module_name = f"nanovllm.kernels.{module_name or 'triton_attn'}"
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"{module.__name__} has no constant {name!r}")
    return module, name


def set_kernel_constants(constants: dict) -> None:
    """Set kernel module constants (`kernel_constant`'s keys) in this process (tensor parallelism 1)."""
    for key, value in constants.items():
        setattr(*kernel_constant(key), value)


def _later_call(llm, prompts, params, first_tok_per_s: float, variants: VariantCounter) -> dict:
    """A second timed call on fresh prompts (after the first call's timers were read)."""
    start = time.perf_counter()
    tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    tok_per_s = tokens / (time.perf_counter() - start)
    variants.__exit__()
    return {"later_tok_per_s": round(tok_per_s, 1), "first_to_later": round(first_tok_per_s / tok_per_s, 3),
            "kernel_variants_after_startup": variants.names if variants.available else None}


def profile(llm, prompts, params, top: int = 30) -> None:
    """GPU time by kernel over a whole run (host timings inside the profiler are inflated)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def trace(llm, prompts, params, prefix: str, skip: int, steps: int, windows: int, host: bool) -> None:
    """Chrome traces of `windows` windows of `steps` engine steps, `skip` steps apart, each
    followed by its gap report (trace_gaps.py)."""
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile
    from trace_gaps import report

    def on_trace_ready(prof):
        path = f"{prefix}.{prof.step_num}.json.gz"
        prof.export_chrome_trace(path)
        print(f"--- window ending at engine step {prof.step_num}, {len(engine.scheduler.running)} running")
        print(report(path))

    engine = llm.llm_engine
    for prompt, p in zip(prompts, params):
        engine.add_request(None, prompt, p)
    cuda = torch.cuda.is_available()
    activities = ([ProfilerActivity.CUDA] if cuda else []) + ([ProfilerActivity.CPU] if host or not cuda else [])
    with torch_profile(activities=activities, on_trace_ready=on_trace_ready,
                       schedule=schedule(wait=skip, warmup=1, active=steps, repeat=windows)) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            prof.step()


if __name__ == "__main__":
    main()
