"""/metrics for every replica: each replica pushes its own exposition text to a board, the
ingress merges them under a `replica` label.

Every `PUSH_INTERVAL_S` each engine replica sends the board (a small named Ray actor,
`MetricsBoard`) its whole `ServerMetrics` text (the single server's metrics:
requests, tokens, latencies, KV blocks, prefix-cache hits) and its pid. The ingress's
/metrics asks the board for the latest text of each replica and writes one metric
family at a time, each sample labelled `replica="<id>"`. A replica that stops pushing
(dead, being replaced) drops out after `STALE_AFTER_S`. Whole snapshots, not deltas:
a board that is lost (its owner died) is full again after one interval.
"""
import re
import time

PUSH_INTERVAL_S = 0.5
STALE_AFTER_S = 5.0
BOARD_NAME_PREFIX = "nanovllm-metrics-"
BOARD_NAMESPACE = "serve"     # Serve's own namespace, where the ingress and the replicas run
SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


class MetricsBoardImpl:
    """The board's state: replica id -> (time pushed, pid, healthy, exposition text)."""

    def __init__(self):
        self.replicas: dict[str, tuple[float, int, bool, str]] = {}

    def push(self, replica_id: str, pid: int, healthy: bool, text: str) -> None:
        self.replicas[replica_id] = (time.monotonic(), pid, healthy, text)

    def live(self) -> dict[str, dict]:
        """The replicas heard from in the last STALE_AFTER_S: id -> {"pid", "healthy", "text"}."""
        now = time.monotonic()
        self.replicas = {k: v for k, v in self.replicas.items() if now - v[0] <= STALE_AFTER_S}
        return {k: {"pid": pid, "healthy": healthy, "text": text} for k, (_, pid, healthy, text) in self.replicas.items()}


def metrics_board(app_name: str):
    """The app's board actor, created on first use (by the ingress or a replica, whichever comes first).
    Detached, so that no replica's death or dropped handle takes it down; `delete_board` ends it."""
    import ray
    board_cls = ray.remote(num_cpus=0)(MetricsBoardImpl)
    return board_cls.options(name=BOARD_NAME_PREFIX + app_name, namespace=BOARD_NAMESPACE, get_if_exists=True,
                             lifetime="detached", max_restarts=-1).remote()


def delete_board(app_name: str) -> None:
    """End the app's board (when the app is deleted); nothing if there is none."""
    import ray
    try:
        ray.kill(ray.get_actor(BOARD_NAME_PREFIX + app_name, namespace=BOARD_NAMESPACE))
    except ValueError:   # no such actor
        pass


def merge_replica_metrics(replicas: dict[str, dict]) -> str:
    """One exposition text of several replicas' texts, each sample labelled with its replica."""
    families: dict[str, list[str]] = {}     # family name -> HELP/TYPE lines, then samples
    order: list[str] = []
    for replica_id in sorted(replicas):
        family = None
        for line in replicas[replica_id]["text"].splitlines():
            if line.startswith("# "):
                family = line.split(" ", 3)[2]
                if family not in families:
                    families[family] = []
                    order.append(family)
                if len(families[family]) < 2:
                    families[family].append(line)
                continue
            match = SAMPLE.match(line)
            if match and family is not None:
                families[family].append(_labelled(match, replica_id))
    return "".join(line + "\n" for name in order for line in families[name])


def _labelled(match: re.Match, replica_id: str) -> str:
    labels = f'replica="{replica_id}"' + (f",{match['labels']}" if match["labels"] else "")
    return f"{match['name']}{{{labels}}} {match['value']}"
