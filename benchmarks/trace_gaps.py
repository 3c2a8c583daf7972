"""Where a GPU waits: idle gaps and host-side CUDA calls in a torch.profiler chrome trace.

Reads a trace written by `prof.export_chrome_trace` (plain or .gz) and prints:
- GPU busy time (kernels, copies, memsets merged) against the traced span;
- idle time grouped by the kernel that ended the wait (what the GPU was waiting to get);
- the longest gaps, with the kernels on either side;
- host CUDA runtime calls by total time (synchronizations and cudaMalloc/cudaFree show here).

    python benchmarks/trace_gaps.py trace.json.gz [--min-gap-us 20]
"""
import argparse
import gzip
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_WIDTH = 70


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def gpu_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU activity, by start."""
    spans = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") in GPU_CATEGORIES]
    return sorted(spans)


def gaps(intervals: list[tuple[float, float, str]]) -> tuple[float, list[tuple[float, str, str]]]:
    """Busy time (us, overlaps merged) and every idle gap as (length us, kernel before, kernel after)."""
    busy, found = 0.0, []
    end, last = None, ""
    for start, stop, name in intervals:
        if end is None or start > end:
            if end is not None:
                found.append((start - end, last, name))
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    return busy, found


def report(path: str, min_gap_us: float = 20.0, top: int = 15) -> str:
    events = load_events(path)
    intervals = gpu_intervals(events)
    if not intervals:
        return f"{path}: no GPU activity in the trace"
    busy, found = gaps(intervals)
    span = intervals[-1][1] - intervals[0][0]
    lines = [f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({busy / span:.0%}), "
             f"idle {(span - busy) / 1e3:.2f} ms in {len(found)} gaps"]
    by_next = defaultdict(lambda: [0.0, 0])
    for length, _, after in found:
        if length >= min_gap_us:
            by_next[after][0] += length
            by_next[after][1] += 1
    lines.append(f"idle before each kernel (gaps >= {min_gap_us:.0f} us), total ms / count:")
    for name, (total, n) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {total / 1e3:8.2f} {n:6d}  {name[:NAME_WIDTH]}")
    lines.append("longest gaps (us: before -> after):")
    for length, before, after in sorted(found, reverse=True)[:top]:
        lines.append(f"  {length:8.1f}  {before[:40]} -> {after[:NAME_WIDTH]}")
    runtime = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]][0] += e.get("dur", 0)
            runtime[e["name"]][1] += 1
    lines.append("host CUDA calls, total ms / count:")
    for name, (total, n) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {total / 1e3:8.2f} {n:6d}  {name}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    args = ap.parse_args()
    print(report(args.trace, args.min_gap_us))


if __name__ == "__main__":
    main()
