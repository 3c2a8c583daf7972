"""RankGroup: rank 0's handle on the worker processes (ranks 1..N-1) of one engine.

Start-up: rank 0 serves a TCP store on a port the OS picks, creates a ShmChannel
(unique segment name) and starts one process per worker rank: spawned by default, or
forked from one warm server process with NANOVLLM_WORKER_MULTIPROC_METHOD=forkserver
(`start_context`); never forked from rank 0 itself. Each
worker says hello, joins the process group, builds its object (a `ModelRunner`)
with `factory(*args, rank=r)` and says it is ready; rank 0 builds its own in
between. Then every worker waits in `_serve` for commands.

A call: rank 0 broadcasts (method, args) through the channel, runs the method on
its own object (the collectives inside it meet the workers'), then waits for one
reply per worker on its pipe: "ok", or the worker's traceback. A worker that
raises reports and exits; a dead worker shows as end-of-file on its pipe. Either
way rank 0 stops the whole group and raises `TensorParallelError` naming the rank,
instead of waiting forever (gloo also fails rank 0's pending collective at once
when a peer's sockets close).

Shut-down (`shutdown()`, garbage collection, or interpreter exit through a
multiprocessing finalizer): an "exit" command, a bounded join, then terminate/kill for
any straggler; every rank's object is shut down (`shutdown()`, where it has one) before
the process group is destroyed; the segment is unlinked. Workers also leave on their
own when rank 0's process disappears.
"""
import logging
import multiprocessing as mp
import os
import signal
import sys
import traceback
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.util import Finalize, _exit_function as run_process_finalizers
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from nanovllm.distributed.shm_channel import REATTACH, ShmChannel
from nanovllm.utils.parallel import STORE_HOST, destroy_distributed, init_distributed

logger = logging.getLogger("nanovllm")

EXIT = "_exit"
OK = ("ok", None)
# Bounds a worker that is alive but silent; a dead one is noticed at once (its pipe
# closes). Generous because start-up replies wait for a worker's model load.
REPLY_TIMEOUT_S = 600.0
FAILURE_GRACE_S = 5.0   # after rank 0's own call fails: time for a worker's report to arrive
EXIT_TIMEOUT_S = 10.0   # how long a worker gets to leave after "exit" before it is terminated
KILL_TIMEOUT_S = 5.0    # ... and after SIGTERM before SIGKILL
FINALIZER_PRIORITY = 10  # any value >= 0 runs before multiprocessing joins children at exit
START_METHOD_ENV = "NANOVLLM_WORKER_MULTIPROC_METHOD"
START_METHODS = ("spawn", "forkserver")
# imported once by the fork server, so that a rank forked from it starts with them loaded
FORKSERVER_PRELOAD = ["nanovllm.distributed.rank_group", "nanovllm.engine.model_runner"]


class TensorParallelError(RuntimeError):
    """A worker rank raised or died; the group has been stopped."""


class RankGroup:
    def __init__(self, world_size: int, device: torch.device, factory: Callable[..., Any], *args):
        """Spawn ranks 1..world_size-1 and build rank 0's object (`self.driver`) here.

        Every rank r builds `factory(*args, rank=r)` after joining the process group.
        """
        _check_can_start(world_size, device)
        self.world_size = world_size
        self._error: str | None = None
        ctx = start_context()
        store = dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False)
        self._res = _Resources(ShmChannel.create(ctx, world_size - 1), store)
        # runs on shutdown(), on garbage collection, or at interpreter exit before multiprocessing
        # joins its children (a priority >= 0 finalizer; a plain atexit hook could run too late)
        self._finalizer = Finalize(self, self._res.stop, exitpriority=FINALIZER_PRIORITY)
        try:
            self._res.share_cpu_cores(device)
            for rank in range(1, world_size):
                self._spawn(ctx, rank, store.port, device, factory, args)
            self._wait_replies("start-up")  # hello: every worker is about to join
            init_distributed(0, world_size, store.port, device)
            self._res.joined = True
            self._res.driver = factory(*args, rank=0)
            self._wait_replies("start-up")  # ready: every worker built its object
        except BaseException as exc:
            self._raise_failure("start-up", exc)

    def _spawn(self, ctx, rank: int, port: int, device: torch.device, factory, args) -> None:
        parent_end, child_end = ctx.Pipe(duplex=False)
        handle = self._res.channel.worker_handle(rank - 1)
        process = ctx.Process(target=_worker_main, name=f"nanovllm-tp-rank{rank}", args=(
            rank, self.world_size, port, device, torch.get_num_threads(), handle, child_end, factory, args))
        process.start()
        child_end.close()  # so that the worker's death reads as end-of-file here
        self._res.processes.append(process)
        self._res.conns.append(parent_end)

    @property
    def driver(self) -> Any:
        """Rank 0's object."""
        return self._res.driver

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._res.processes]

    # ---- calls ----------------------------------------------------------------

    def call(self, method: str, args: tuple = (), worker_args: tuple | None = None) -> Any:
        """Run `method` on every rank; returns rank 0's result.

        Workers get `worker_args` when given (e.g. a lighter copy of `args`), else `args`.
        """
        self._check_usable()
        try:
            self._res.channel.send((method, args if worker_args is None else worker_args),
                                   lambda: self._wait_replies(method))
            result = getattr(self.driver, method)(*args)
            self._wait_replies(method)
        except BaseException as exc:  # whatever it was (Ctrl-C too), the ranks are out of step now
            self._raise_failure(method, exc)
        return result

    def _check_usable(self) -> None:
        if self._error is not None:
            raise TensorParallelError(f"the tensor-parallel group has stopped: {self._error}")
        if not self._finalizer.still_active():
            raise TensorParallelError("this engine has been shut down")

    def _wait_replies(self, what: str) -> None:
        """One "ok" from every worker, or stop the group and raise TensorParallelError."""
        pending = list(self._res.conns)
        while pending:
            ready = wait_for_ready(pending, REPLY_TIMEOUT_S)
            if not ready:
                ranks = [self._res.conns.index(c) + 1 for c in pending]
                raise self._stopped(f"rank(s) {ranks} did not answer {what!r} within {REPLY_TIMEOUT_S:.0f} s")
            for conn in ready:
                problem = self._reply_problem(conn, what)
                if problem is not None:
                    raise self._stopped(problem)
                pending.remove(conn)

    def _reply_problem(self, conn, what: str) -> str | None:
        """None for an "ok" reply; else what went wrong with that worker."""
        rank = self._res.conns.index(conn) + 1
        process = self._res.processes[rank - 1]
        try:
            kind, detail = conn.recv()
        except (EOFError, OSError):
            process.join(KILL_TIMEOUT_S)
            return (f"tensor-parallel rank {rank} (pid {process.pid}) died during {what!r} "
                    f"(exit code {process.exitcode})")
        if kind == "ok":
            return None
        return f"tensor-parallel rank {rank} (pid {process.pid}) raised during {what!r}:\n{detail}"

    def _raise_failure(self, what: str, exc: BaseException) -> NoReturn:
        error = self._fail(what, exc)
        if error is exc:
            raise exc
        raise error from exc

    def _fail(self, what: str, exc: BaseException) -> BaseException:
        """A call failed: stop the group; blame a worker if one failed too.

        A RuntimeError on rank 0 is how a collective reports a lost peer, so then a
        worker's report (arriving within FAILURE_GRACE_S) is the real cause. Other
        errors (e.g. a ValueError every rank raises alike) are rank 0's own.
        """
        if isinstance(exc, TensorParallelError):
            return exc
        if isinstance(exc, RuntimeError):
            for conn in wait_for_ready(self._res.conns, FAILURE_GRACE_S):
                problem = self._reply_problem(conn, what)
                if problem is not None:
                    return self._stopped(problem)
        return self._stopped(f"rank 0 raised {exc!r} during {what!r}", exc)

    def _stopped(self, reason: str, exc: BaseException | None = None) -> BaseException:
        """Record why the group stopped, stop it at once, and return the exception to raise."""
        self._error = self._error or reason
        self._res.graceful = False
        self._finalizer()
        return exc if exc is not None else TensorParallelError(reason)

    # ---- shut-down ------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker, destroy the process group, unlink the segment. Idempotent."""
        self._finalizer()


class _Resources:
    """What a RankGroup must release, kept apart from it so a finalizer can hold it."""

    def __init__(self, channel: ShmChannel, store):
        self.channel, self.store = channel, store  # the store lives as long as the group
        self.processes: list = []
        self.conns: list = []
        self.joined = False    # rank 0 joined the process group
        self.graceful = True   # workers are idle and will obey "exit"
        self.saved_num_threads: int | None = None  # rank 0's torch thread count before the group
        self.driver = None     # rank 0's object, shut down (if it has a shutdown) before the group

    def share_cpu_cores(self, device: torch.device) -> None:
        """On CPU every rank computes at once: give each its share of the cores (rank 0
        included, until shut-down), or their spinning OpenMP threads starve each other."""
        if device.type != "cpu":
            return
        self.saved_num_threads = torch.get_num_threads()
        world_size = len(self.channel.doorbells) + 1
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))

    def stop(self) -> None:
        """Workers gone (asked, else terminated, else killed), group destroyed, segment unlinked."""
        _shut_down(self.driver)  # first: the workers destroy their side of the group on "exit"
        if self.graceful and all(p.is_alive() for p in self.processes):
            try:
                self.channel.send((EXIT, ()), lambda: None)
            except Exception:  # they are terminated below instead
                self.graceful = False
        timeout = EXIT_TIMEOUT_S if self.graceful else 0
        for process in self.processes:
            process.join(timeout)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(KILL_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        if self.joined:
            destroy_distributed()
        self.channel.close()
        if self.saved_num_threads is not None:
            torch.set_num_threads(self.saved_num_threads)


def start_context():
    """How worker ranks are started, from NANOVLLM_WORKER_MULTIPROC_METHOD (vLLM's
    VLLM_WORKER_MULTIPROC_METHOD, without "fork": rank 0 may hold threads and a CUDA context):

    - "spawn" (the default): a fresh interpreter per rank, which imports torch and nano-vLLM
      again (seconds on a small CPU machine) at every engine start;
    - "forkserver": multiprocessing's fork server, started at the first tensor-parallel engine,
      imports torch and nano-vLLM once (FORKSERVER_PRELOAD; it never touches a GPU) and forks
      each rank from that state: later engines of this process start their ranks in well under
      a second. Each rank still runs the main module as with "spawn" (hence the `__main__`
      guard). The server is one more process for as long as this one runs.

    Anything else is a ValueError naming the variable.
    """
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use one of {', '.join(START_METHODS)}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _check_can_start(world_size: int, device: torch.device) -> None:
    if dist.is_initialized():
        raise ValueError("this process already hosts rank 0 of a tensor-parallel engine: run one "
                         "tensor_parallel_size > 1 engine per process at a time (shut the other one down)")
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs one GPU per rank, "
                         f"but torch sees {torch.cuda.device_count()}")


# ---- worker ranks -------------------------------------------------------------

def _worker_main(rank: int, world_size: int, port: int, device: torch.device, num_threads: int,
                 channel_handle: tuple, conn, factory: Callable[..., Any], args: tuple) -> None:
    """Body of worker process `rank`: join, build the runner, serve commands until "exit"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    os.environ["TQDM_DISABLE"] = "1"  # progress bars (weight loading) from rank 0 only
    torch.set_num_threads(num_threads)  # as many as rank 0 (see _Resources.share_cpu_cores)
    channel = ShmChannel.attach(*channel_handle)
    try:
        conn.send(OK)  # hello
        init_distributed(rank, world_size, port, device)
        runner = factory(*args, rank=rank)
        conn.send(OK)  # ready
        code = _serve(runner, channel, conn)
    except BaseException:
        _report(conn, ("error", traceback.format_exc()))
        code = 1
    channel.close()
    if code == 0:
        destroy_distributed()
    run_process_finalizers()  # as a returning process would (e.g. unlinks named semaphores)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # all this process owns is released above; skip ~1 s of interpreter teardown


def _shut_down(obj: Any) -> None:
    """`obj.shutdown()` where it has one, before the process group goes (see
    ModelRunner.shutdown). What it raises is logged: the group is stopped regardless."""
    if not hasattr(obj, "shutdown"):
        return
    try:
        obj.shutdown()
    except Exception:
        logger.exception("shutting down a tensor-parallel rank's %s failed", type(obj).__name__)


def _report(conn, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:  # rank 0 is gone: nobody to tell
        pass


def _serve(runner: Any, channel: ShmChannel, conn) -> int:
    """Run commands from rank 0 until "exit" (0) or rank 0's disappearance (1); raises on error."""
    rank0 = mp.parent_process()
    while True:
        command = channel.receive(rank0.is_alive)
        if command is None:
            return 1
        method, args = command
        if method == EXIT:
            _shut_down(runner)
            return 0
        target = channel if method == REATTACH else runner
        getattr(target, method)(*args)
        conn.send(OK)
