"""How long a causal prefill chunk's attention programs take to run, per grid order, as list scheduling.

The unified attention kernel's large prefill tile holds one program a multiprocessor, and a GPU starts
a grid's programs in order, each on the first multiprocessor that frees. A causal chunk's query tiles
cost from one to its length in KV tiles (plus the cached prefix's), so the order decides how even the
last wave is. This models it: each program costs its KV tiles, programs start in grid order on
`--sms` multiprocessors, and the makespan is printed against the mean load (the sum over the
multiprocessors, or the longest program where that is more). Orders:

- head_by_head: the default grid (query tiles, KV heads x splits, sequences), heaviest tile first within
  each KV head, the heads one after another;
- across_heads: `triton_attn.QUERY_TILES_OUTER`'s grid (KV heads x splits, query tiles, sequences), the
  heaviest tiles of every head first.

A model, not a measurement: it leaves out the masked diagonal tiles' extra work, memory contention and
the tail of the kernel ahead. It does not time anything.

    python benchmarks/sim_prefill_grid.py [--chunk 8192] [--cached 0,8192,16384,23808] [--sms 132]
"""
import argparse
import heapq


def makespan(costs: list[int], sms: int) -> int:
    """When the last program ends, programs starting in list order on the first free multiprocessor."""
    free_at = [0] * sms
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def program_costs(chunk: int, cached: int, block_q: int, block_n: int, kv_heads: int, across_heads: bool) -> list[int]:
    """KV tiles of each program, in grid order: query tile i (heaviest first) sees the cached prefix
    and its own chunk up to its last token."""
    tiles = -(-chunk // block_q)
    cost = [-(-(cached + min(chunk, (i + 1) * block_q)) // block_n) for i in reversed(range(tiles))]
    if across_heads:
        return [c for c in cost for _ in range(kv_heads)]
    return [c for _ in range(kv_heads) for c in cost]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=8192, help="query tokens of the chunk")
    ap.add_argument("--cached", default="0,8192,16384,23808", help="cached prefix lengths, one chunk each")
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors (an H200's 132)")
    ap.add_argument("--kv-heads", type=int, default=8, help="Qwen3-0.6B's 8")
    ap.add_argument("--block-q", type=int, default=128, help="query tokens a tile: 256 rows / 2 heads a KV head")
    ap.add_argument("--block-n", type=int, default=64, help="keys a KV tile")
    args = ap.parse_args()
    for cached in (int(c) for c in args.cached.split(",")):
        row = {}
        for order in ("head_by_head", "across_heads"):
            costs = program_costs(args.chunk, cached, args.block_q, args.block_n, args.kv_heads,
                                  order == "across_heads")
            mean = max(sum(costs) / args.sms, max(costs))
            row[order] = makespan(costs, args.sms) / mean
        print(f"chunk {args.chunk} over {cached} cached: makespan / mean load, head by head "
              f"{row['head_by_head']:.3f}, across heads {row['across_heads']:.3f}")


if __name__ == "__main__":
    main()
