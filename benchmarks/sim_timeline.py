"""Print the simulated device's timeline that `bench_serving.py --sim-timeline PATH` wrote.

One line per event, in milliseconds from the first launch: each launch (rows, steps), each step
that finished requests, the gaps where the device waited for the host, and runs of requests
queued by the event loop (thread mode) and added to the engine, folded into one line per run.
For reading a wave boundary of B3: when the streams ended, when their successors were queued,
when the engine took them, and what the device ran meanwhile (benchmarks/RESULTS.md "B3: rounds
while requests arrive").

    python benchmarks/sim_timeline.py PATH [--from-ms 500 --to-ms 800] [--offline]
    python benchmarks/sim_timeline.py PATH --waves

--waves folds each wave boundary into one line instead: from the moment the event loop took a
step's finished outputs (a wave's end, at least --wave-size of them) to the last of those streams
ended, to when the client read the last end and sent its first and last next request (where
bench_serving recorded them), to the first and last POST the server's routes took, to the first
and last command the event loop queued after them and the engine took, and to the engine's next
launch of more than one row (the next wave's prefill); then the mean of each over the waves.
"""
import argparse
import json
import statistics


# events of one request each, folded into one line per run of them
FOLDED = ("add", "submit", "stream end", "received", "client sent", "client read end")


def events(timeline: dict) -> list[tuple[float, str]]:
    return sorted([(t, f"launch rows {rows:3d} steps {steps:2d}") for t, rows, steps in timeline["launches"]]
                  + [(t, "add") for t in timeline["arrivals"]]
                  + [(t, "submit") for t in timeline["submits"]]
                  + [(t, f"finished {n}") for t, n in timeline["finishes"]]
                  + [(t, f"delivered {n} finished") for t, n in timeline.get("delivers", ())]
                  + [(t, "stream end") for t in timeline.get("stream_ends", ())]
                  + [(t, "received") for t in timeline.get("receives", ())]
                  + [(t, "client sent") for t in timeline.get("client_sends", ())]
                  + [(t, "client read end") for t in timeline.get("client_ends", ())]
                  + [(t, f"idle {gap * 1e3:.1f} ms") for t, gap in timeline["idle"]])


def _first_and_last(what: str, times: list[float]) -> list[tuple[str, float]]:
    """Marks for the first and last of `times` (none where it is empty)."""
    return [(f"first {what}", min(times)), (f"last {what}", max(times))] if times else []


def wave_turnarounds(timeline: dict, wave_size: int) -> list[dict[str, float]]:
    """Per wave boundary, ms from the delivery of its finished outputs to each later event (see --waves)."""
    waves = []
    for delivered, finished in timeline["delivers"]:
        launches = [t for t, rows, _ in timeline["launches"] if t > delivered and rows > 1]
        if finished < wave_size or not launches:
            continue
        nxt = launches[0]
        def between(log):
            return [t for t in timeline.get(log, ()) if delivered <= t < nxt]
        ends, submits = between("stream_ends"), between("submits")
        if not ends or not submits:
            continue
        marks = [("streams ended", max(ends))]
        client_ends, client_sends = between("client_ends"), between("client_sends")
        if client_ends:   # the client's side, where bench_serving recorded it
            marks += [("client read last end", max(client_ends)), ("client first send", min(client_sends)),
                      ("client last send", max(client_sends))]
        marks += (_first_and_last("received", between("receives")) + _first_and_last("submit", submits)
                  + _first_and_last("add", between("arrivals")))   # adds: the engine thread's
        marks.append(("next launch", nxt))
        waves.append({name: round((t - delivered) * 1e3, 2) for name, t in marks})
    return waves


def print_waves(timeline: dict, wave_size: int) -> None:
    waves = wave_turnarounds(timeline, wave_size)
    if not waves:
        raise SystemExit(f"no wave of {wave_size} finished requests followed by a launch (timed events "
                         "come from a thread-mode server)")
    for wave in waves:
        print("  ".join(f"{name} {ms:6.2f}" for name, ms in wave.items()))
    names = list(dict.fromkeys(name for wave in waves for name in wave))   # a wave may lack the client's side
    print("mean " + "  ".join(f"{name} {statistics.mean(w[name] for w in waves if name in w):6.2f}"
                              for name in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--from-ms", type=float, default=0.0)
    parser.add_argument("--to-ms", type=float, default=float("inf"))
    parser.add_argument("--offline", action="store_true", help="the offline baseline's timeline, not the server's")
    parser.add_argument("--waves", action="store_true", help="one line per wave boundary (see above)")
    parser.add_argument("--wave-size", type=int, default=64, help="finished requests that make a wave's end")
    args = parser.parse_args()
    with open(args.path) as f:
        timeline = json.load(f)["offline_sim_device" if args.offline else "sim_device"]
    if args.waves:
        return print_waves(timeline, args.wave_size)
    start = timeline["launches"][0][0]
    runs: list[list] = []   # [first ms, last ms, what, count]
    for t, what in events(timeline):
        ms = (t - start) * 1e3
        if not args.from_ms <= ms <= args.to_ms:
            continue
        if runs and what in FOLDED and runs[-1][2] == what:
            runs[-1][1], runs[-1][3] = ms, runs[-1][3] + 1
        else:
            runs.append([ms, ms, what, 1])
    for first, last, what, count in runs:
        span = f"{first:8.1f}" + (f" - {last:8.1f}" if count > 1 else " " * 11)
        print(f"{span}  {what}" + (f" x{count}" if count > 1 else ""))


if __name__ == "__main__":
    main()
