"""What a stopped tensor-parallel group must not leave behind, for the CPU and GPU TP tests;
a stand-in rank object (importable by spawned workers) that records its shut-down."""
import os

import torch.distributed as dist

SHM_DIR = "/dev/shm"


def assert_gone(pids: list[int], shm_names: list[str]) -> None:
    """No worker process still running (a zombie awaiting its reap is gone), no segment left."""
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"worker {pid} is still running"
    for name in shm_names:
        assert not os.path.exists(os.path.join(SHM_DIR, name)), f"segment {name} left in {SHM_DIR}"


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


class ShutdownRecorder:
    """A rank's object for a bare RankGroup: `shutdown()` writes, in a file named after the
    rank, whether the process group was still there."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, str(rank))

    def shutdown(self) -> None:
        with open(self.path, "w") as f:
            f.write(str(dist.is_initialized()))
