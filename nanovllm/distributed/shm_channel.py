"""ShmChannel: rank 0 broadcasts commands to the worker ranks through shared memory.

Rank 0 pickles each command once into a SharedMemory segment and rings one
doorbell per worker; each worker waits on its own doorbell, then reads the
command. Segment layout: [u64 payload length][payload bytes].

A doorbell is a multiprocessing Semaphore used as a one-shot event (release =
set, acquire = wait and clear). Not a multiprocessing.Event: its `set()` waits
for sleeping waiters to wake, so it blocks forever once a waiter was killed;
releasing a semaphore never blocks.

The segment's name is chosen by the OS-backed `SharedMemory(create=True)` (random,
unique per engine), never fixed. A command larger than the segment moves the
channel to a bigger one first: rank 0 writes a small "reattach" command naming
the new segment into the old one, waits until every worker has switched, then
unlinks the old one. Nothing is ever truncated.

The channel itself never waits for workers to *finish* a command; the caller
(`RankGroup`) must hear back from every worker before it sends the next one,
since each command overwrites the last.
"""
import os
import pickle
import shutil
from multiprocessing import shared_memory
from typing import Callable

HEADER_BYTES = 8  # the payload length, little-endian u64
# A decode step of 256 sequences pickles to ~100 KB and an 8k-token prefill to
# ~50 KB, so 1 MiB rarely needs to grow; it grows by powers of two when it must.
INITIAL_BYTES = 1 << 20
SHM_DIR = "/dev/shm"  # where Linux keeps the segments; checked for room before growing
REATTACH = "_reattach"  # the command that moves workers to a bigger segment
WAIT_POLL_S = 1.0  # how often a waiting worker checks that rank 0 is still alive


class ShmChannel:
    def __init__(self, shm: shared_memory.SharedMemory, doorbells: list, owner: bool):
        self.shm = shm
        self.doorbells = doorbells  # rank 0: one per worker; a worker: [its own]
        self.owner = owner          # rank 0 created (and will unlink) the segment

    # ---- rank 0 ---------------------------------------------------------------

    @classmethod
    def create(cls, mp_context, num_workers: int, size: int | None = None) -> "ShmChannel":
        doorbells = [mp_context.Semaphore(0) for _ in range(num_workers)]
        return cls(_new_segment(size or INITIAL_BYTES), doorbells, owner=True)

    def worker_handle(self, worker: int) -> tuple[str, object]:
        """What worker `worker` (0-based among the workers) needs to attach: (segment name, its doorbell)."""
        return self.shm.name, self.doorbells[worker]

    def send(self, command: object, wait_for_workers: Callable[[], None]) -> None:
        """Broadcast `command` to every worker; grows the segment first if it does not fit."""
        data = pickle.dumps(command, pickle.HIGHEST_PROTOCOL)
        if HEADER_BYTES + len(data) > self.shm.size:
            self._grow(HEADER_BYTES + len(data), wait_for_workers)
        self._write(data)

    def _write(self, data: bytes) -> None:
        self.shm.buf[:HEADER_BYTES] = len(data).to_bytes(HEADER_BYTES, "little")
        self.shm.buf[HEADER_BYTES:HEADER_BYTES + len(data)] = data
        for doorbell in self.doorbells:
            doorbell.release()

    def _grow(self, needed: int, wait_for_workers: Callable[[], None]) -> None:
        new = _new_segment(1 << (needed - 1).bit_length())  # the next power of two
        try:
            self._write(pickle.dumps((REATTACH, (new.name,)), pickle.HIGHEST_PROTOCOL))
            wait_for_workers()
        except BaseException:  # the caller stops the group, which removes the old segment
            new.close()
            new.unlink()
            raise
        old, self.shm = self.shm, new
        old.close()
        old.unlink()

    # ---- a worker -------------------------------------------------------------

    @classmethod
    def attach(cls, name: str, doorbell) -> "ShmChannel":
        return cls(shared_memory.SharedMemory(name), [doorbell], owner=False)

    def receive(self, is_rank0_alive: Callable[[], bool]) -> tuple[str, tuple] | None:
        """Wait for the next (method, args) command; None if rank 0 is gone."""
        while not self.doorbells[0].acquire(timeout=WAIT_POLL_S):
            if not is_rank0_alive():
                return None
        n = int.from_bytes(self.shm.buf[:HEADER_BYTES], "little")
        return pickle.loads(self.shm.buf[HEADER_BYTES:HEADER_BYTES + n])

    def _reattach(self, name: str) -> None:
        old, self.shm = self.shm, shared_memory.SharedMemory(name)
        old.close()

    # ---- both -----------------------------------------------------------------

    def close(self) -> None:
        """Detach; rank 0 also removes the segment from /dev/shm. Safe to call twice."""
        if self.shm is None:
            return
        shm, self.shm = self.shm, None
        shm.close()
        if self.owner:
            shm.unlink()


def _new_segment(size: int) -> shared_memory.SharedMemory:
    if os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free < size:
        raise RuntimeError(f"a tensor-parallel command needs a {size}-byte shared-memory buffer, but "
                           f"{SHM_DIR} has only {shutil.disk_usage(SHM_DIR).free} bytes free")
    return shared_memory.SharedMemory(create=True, size=size)
