"""CPU decode attention of one layer: milliseconds a call, per context length.

The shapes of the embedded SmolLM2 (9 query heads, 3 KV heads, head_dim 64, 16-token
blocks, fp32) and B2's batch (64 sequences); each sequence's context is the given length
plus a spread of +-16 tokens (B2's prompts differ in length), its blocks scattered over a
cache of `--num-blocks`. Every layer of an engine step shares one plan (kernels/step_memo.py),
so each call here reuses it, as layers 2-30 of a step do. A timing is `--steps` decode steps
in a row, each context one token longer than the step before, reported per step. Where a C++
compiler is found this times the C++ paged decode kernel (kernels/cpu_paged_decode.py);
without one, the torch-only path, whose decode mirror (kernels/cpu_decode_mirror.py) is
built at the first step and grown after.
Times are the thread's CPU time (`time.thread_time`), one thread by default.

`--baseline PATH` times a second copy of kernels/cpu_attn.py (e.g. `git show
main:nanovllm/kernels/cpu_attn.py > /tmp/old.py`) in the same process, on a contiguous
cache if it has no `new_kv_cache`: the two alternate, medians of `--repeats` rounds.

    python benchmarks/bench_cpu_attn.py --contexts 48,128,176,256
    python benchmarks/bench_cpu_attn.py --baseline /tmp/old.py --threads 1

Prints one line per context and a final JSON line.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import cpu_attn  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
LENGTH_SPREAD = 16


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("cpu_attn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_case(backend, num_seqs: int, context: int, num_blocks: int, dtype: torch.dtype, steps: int, seed: int = 0):
    """Arguments of a first decode call: q, k/v caches in the backend's layout, seq_lens_k, and block
    tables that hold `steps` more tokens of each sequence."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, context - LENGTH_SPREAD), context + LENGTH_SPREAD + 1, (num_seqs,), generator=gen)
    widths = (lens + steps + BLOCK_SIZE - 1) // BLOCK_SIZE
    if int(widths.sum()) > num_blocks:
        raise ValueError(f"--num-blocks {num_blocks} cannot hold {num_seqs} contexts of ~{context} tokens")
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((num_seqs, int(widths.max())), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(widths.tolist()):
        tables[i, :n] = order[start:start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    new_kv_cache = getattr(backend, "new_kv_cache", None)
    caches = new_kv_cache(shape, dtype, torch.device("cpu")) if new_kv_cache else (torch.empty(shape, dtype=dtype),
                                                                                    torch.empty(shape, dtype=dtype))
    for cache in caches:
        cache.copy_(torch.randn(shape, generator=gen))
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, *caches, lens.to(torch.int32), tables


def run_steps(backend, case, steps: int) -> torch.Tensor:
    """`steps` decode calls, each context one longer than the last (new tensors each step, as the
    engine's); returns the last step's output."""
    q, k_cache, v_cache, lens, tables = case
    for step in range(steps):
        step_lens = lens + step
        out = backend.decode_attention(q, k_cache, v_cache, step_lens, tables, HEAD_DIM ** -0.5, int(step_lens.max()))
    return out


def time_steps(backend, case, steps: int) -> float:
    """Milliseconds a decode call over `steps` calls, in this thread's CPU time (on a machine
    shared with other jobs, wall time also counts the time the thread waited for a core)."""
    start = time.thread_time()
    run_steps(backend, case, steps)
    return (time.thread_time() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="48,128,176,256", help="comma list of context lengths")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds; medians are reported")
    ap.add_argument("--steps", type=int, default=64, help="decode steps in a row per timing")
    ap.add_argument("--baseline", help="path of another cpu_attn.py to time beside this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    backends = {"ours": cpu_attn}
    if args.baseline:
        backends["baseline"] = load_module(args.baseline)
    rows = []
    with torch.inference_mode():
        for context in map(int, args.contexts.split(",")):
            cases = {name: decode_case(b, args.num_seqs, context, args.num_blocks, dtype, args.steps)
                     for name, b in backends.items()}
            outs = {name: run_steps(b, cases[name], args.steps) for name, b in backends.items()}
            for out in outs.values():  # the same values in both layouts: the same outputs
                torch.testing.assert_close(out, outs["ours"], rtol=1e-4, atol=1e-4)
            times = {name: [] for name in backends}
            for _ in range(args.repeats):
                for name, backend in backends.items():
                    times[name].append(time_steps(backend, cases[name], args.steps))
            row = {"context": context, "last_step_longest": int(cases["ours"][3].max()) + args.steps - 1,
                   **{f"{name}_ms": round(statistics.median(t), 3) for name, t in times.items()}}
            print(row, flush=True)
            rows.append(row)
    print(json.dumps({"num_seqs": args.num_seqs, "dtype": args.dtype, "threads": args.threads, "steps": args.steps,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
