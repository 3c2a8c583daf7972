"""Micro-batch overlap, measured before it is built: can a decode step hide its products under
its attention by running two halves of the batch side by side?

A B1 decode step on an H200 is ~70% attention, which is bound by DRAM bandwidth, and ~30%
products and small kernels, which are bound by their launch latency and the tensor cores.
Run as one batch, the two kinds take turns. Split into two micro-batches on two CUDA streams
(NanoFlow's and SGLang's two-batch overlap), one half's products could run while the other
half's attention streams K/V, if the GPU schedules the two streams' kernels side by side.

This script builds a real engine (`LLM(...)`, dummy weights), fills a decode batch of B1-like
context lengths over its KV cache, and times, as CUDA graphs of one decode forward pass plus
the LM head, each form of the same rows:

- `one`: the batch as one micro-batch (what the engine runs today);
- `seq`: the micro-batches one after the other on one stream (what halving alone costs);
- `overlap`: the micro-batches on their own streams, joined at the end;
- `overlap_hi`: the same, the second stream at a higher priority.

    python benchmarks/bench_microbatch_overlap.py [--shape 0.6b|8b] [--kv-cache-dtype fp8]
        [--quantization fp8] [--rows 256] [--parts 2] [--sweep-rows 1,64,128,256 | --kernel-times]
"""
import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_fp8 import QWEN3_8B  # noqa: E402
from bench_offline import QWEN3_0_6B, model_dir  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.utils.context import Context, set_context  # noqa: E402

SHAPES = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B}
MAX_MODEL_LEN = 4096
REPLAYS = 30


class MicroBatch:
    """Static decode inputs of a run of rows: contexts `ctx_lens`, blocks from `first_block` on."""

    def __init__(self, ctx_lens: list[int], first_block: int, block_size: int, device: torch.device):
        n = len(ctx_lens)
        blocks = [-(-c // block_size) for c in ctx_lens]
        width = -(-MAX_MODEL_LEN // block_size)
        table = torch.zeros(n, width, dtype=torch.int32)
        slots, start = [], first_block
        for i, (c, b) in enumerate(zip(ctx_lens, blocks)):
            table[i, :b] = torch.arange(start, start + b, dtype=torch.int32)
            slots.append((start + (c - 1) // block_size) * block_size + (c - 1) % block_size)
            start += b
        self.next_block = start
        self.input_ids = torch.randint(0, 10000, (n,), device=device)
        self.positions = torch.tensor([c - 1 for c in ctx_lens], device=device)
        self.context = Context(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens_k=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device), max_seqlen_q=1, max_seqlen_k=MAX_MODEL_LEN, is_decode_only=True)

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        with set_context(self.context):
            return model.compute_logits(model(self.input_ids, self.positions))


def micro_batches(ctx_lens: list[int], parts: int, block_size: int, device: torch.device) -> list[MicroBatch]:
    """`ctx_lens` dealt round-robin, longest first, into `parts` micro-batches of equal work."""
    order = sorted(ctx_lens, reverse=True)
    batches, first = [], 0
    for p in range(parts):
        mb = MicroBatch(order[p::parts], first, block_size, device)
        batches.append(mb)
        first = mb.next_block
    return batches


def capture(model, batches: list[MicroBatch], streams: list[torch.cuda.Stream] | None, pool):
    """One graph of the micro-batches' forwards: on one stream in turn (streams None), or each on its own."""
    for mb in batches:  # warm-up outside the graph
        mb.forward(model)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        if streams is None:
            for mb in batches:
                mb.forward(model)
        else:
            main = torch.cuda.current_stream()
            for mb, stream in zip(batches, streams):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    mb.forward(model)
            for stream in streams:
                main.wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Median milliseconds of one replay."""
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def sweep_rows(model, ctx_lens: list[int], rows: str, block_size: int, device: torch.device) -> dict:
    """Replay milliseconds of the one-batch form at each row count: the first N of `ctx_lens`."""
    out, pool = {}, None
    for n in (int(r) for r in rows.split(",")):
        graph = capture(model, micro_batches(ctx_lens[:n], 1, block_size, device), None, pool)
        pool = graph.pool() if pool is None else pool
        out[n] = round(min(replay_ms(graph) for _ in range(3)), 4)
    return out


def kernel_times(graph: torch.cuda.CUDAGraph) -> dict:
    """A replay's milliseconds, its kernels' summed milliseconds and their count (CUPTI sees a graph's
    kernels), and the ten kernels with the most time."""
    from torch.profiler import ProfilerActivity, profile
    wall = min(replay_ms(graph) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.device_time / 1e3 / REPLAYS
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return dict(replay_ms=round(wall, 4), kernels_per_replay=len(kernels) / REPLAYS,
                kernel_ms=round(sum(by_name.values()), 4), top_ms={k: round(v, 4) for k, v in top})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--mean-context", type=int, default=900,
                    help="contexts uniform in [100, 2 * this - 100] (B1 mid-run: ~560-token prompts, ~560 tokens out)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the forms")
    ap.add_argument("--kernel-times", action="store_true",
                    help="instead: the one-batch form's kernels under torch.profiler: their summed time against the "
                         "replay's, and the kernels a replay runs (with PDL a kernel's time includes its wait on the "
                         "one before, so the sum can exceed the replay)")
    ap.add_argument("--sweep-rows", metavar="N,N,...",
                    help="instead: time the one-batch form at these row counts (the same context mix), to read a "
                         "step's fixed cost off a line through them")
    args = ap.parse_args()
    llm = LLM(model_dir(SHAPES[args.shape]), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=MAX_MODEL_LEN, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    runner = llm.llm_engine.model_runner
    model, device = runner.model, torch.device("cuda")
    rng = random.Random(0)
    ctx_lens = [rng.randint(100, 2 * args.mean_context - 100) for _ in range(args.rows)]
    needed = sum(-(-c // runner.block_size) for c in ctx_lens)
    assert needed <= runner.num_kvcache_blocks, f"{needed} blocks needed, {runner.num_kvcache_blocks} in the cache"
    if args.kernel_times:
        with torch.inference_mode():
            graph = capture(model, micro_batches(ctx_lens, 1, runner.block_size, device), None, None)
        print(json.dumps(dict(vars(args), device=torch.cuda.get_device_name(), **kernel_times(graph))))
        return
    if args.sweep_rows:
        print(json.dumps(dict(vars(args), device=torch.cuda.get_device_name(),
                              ms_by_rows=sweep_rows(model, ctx_lens, args.sweep_rows, runner.block_size, device))))
        return
    with torch.inference_mode():
        one = micro_batches(ctx_lens, 1, runner.block_size, device)
        parts = micro_batches(ctx_lens, args.parts, runner.block_size, device)
        low = [torch.cuda.Stream() for _ in parts]
        high = [torch.cuda.Stream()] + [torch.cuda.Stream(priority=-1) for _ in parts[1:]]
        graphs = {"one": capture(model, one, None, None)}
        pool = graphs["one"].pool()
        graphs["seq"] = capture(model, parts, None, pool)
        graphs["overlap"] = capture(model, parts, low, pool)
        graphs["overlap_hi"] = capture(model, parts, high, pool)
        times = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(round(replay_ms(graph), 4))
    best = {name: min(t) for name, t in times.items()}
    result = dict(vars(args), device=torch.cuda.get_device_name(), ms=times,
                  vs_one={name: round(best[name] / best["one"], 3) for name in best})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
