"""Print the simulated device's timeline that `bench_serving.py --sim-timeline PATH` wrote.

One line per event, in milliseconds from the first launch: each launch (rows, steps), each step
that finished requests, the gaps where the device waited for the host, and runs of requests
queued by the event loop (thread mode) and added to the engine, folded into one line per run.
For reading a wave boundary of B3: when the streams ended, when their successors were queued,
when the engine took them, and what the device ran meanwhile (benchmarks/RESULTS.md "B3: rounds
while requests arrive").

    python benchmarks/sim_timeline.py PATH [--from-ms 500 --to-ms 800] [--offline]
"""
import argparse
import json


def events(timeline: dict) -> list[tuple[float, str]]:
    return sorted([(t, f"launch rows {rows:3d} steps {steps:2d}") for t, rows, steps in timeline["launches"]]
                  + [(t, "add") for t in timeline["arrivals"]]
                  + [(t, "submit") for t in timeline["submits"]]
                  + [(t, f"finished {n}") for t, n in timeline["finishes"]]
                  + [(t, f"delivered {n} finished") for t, n in timeline.get("delivers", ())]
                  + [(t, "stream end") for t in timeline.get("stream_ends", ())]
                  + [(t, f"idle {gap * 1e3:.1f} ms") for t, gap in timeline["idle"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--from-ms", type=float, default=0.0)
    parser.add_argument("--to-ms", type=float, default=float("inf"))
    parser.add_argument("--offline", action="store_true", help="the offline baseline's timeline, not the server's")
    args = parser.parse_args()
    with open(args.path) as f:
        timeline = json.load(f)["offline_sim_device" if args.offline else "sim_device"]
    start = timeline["launches"][0][0]
    runs: list[list] = []   # [first ms, last ms, what, count]
    for t, what in events(timeline):
        ms = (t - start) * 1e3
        if not args.from_ms <= ms <= args.to_ms:
            continue
        if runs and what in ("add", "submit", "stream end") and runs[-1][2] == what:
            runs[-1][1], runs[-1][3] = ms, runs[-1][3] + 1
        else:
            runs.append([ms, ms, what, 1])
    for first, last, what, count in runs:
        span = f"{first:8.1f}" + (f" - {last:8.1f}" if count > 1 else " " * 11)
        print(f"{span}  {what}" + (f" x{count}" if count > 1 else ""))


if __name__ == "__main__":
    main()
