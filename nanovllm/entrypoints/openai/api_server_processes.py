"""Several API server processes on one listening socket, sharing one engine process
(`nanovllm serve --api-server-count N`, vLLM's flag).

One server process does everything but the engine's steps: HTTP, JSON, chat templates and
tokenization of new requests, and a stream chunk for every step of every request. Under
many concurrent streams that one event loop is what the engine waits for between waves of
requests. With N > 1:

    parent (server 0)  --spawn-->  engine process (engine_core.py), one pipe pair a server
                       --spawn-->  servers 1 .. N-1 (this module's `run_api_server`)

- the parent binds the socket (the port is known before any server starts, 0 included),
  starts the engine process with N pipe pairs and waits until it is ready (a bad setting
  fails here, once), then spawns the other servers and hands each its socket, its pipe
  pair and its row of the shared metrics; every server accepts connections from the one
  socket, so the kernel spreads them over the servers;
- each server runs the same app as the single server (`api_server.build_app`) on
  `AsyncLLM.from_engine_process`; the engine sends a request's deltas to the server that
  added it; /metrics sums every server's counts (metrics.SharedMetricsRows);
- SIGTERM or Ctrl-C: the parent passes SIGTERM on to the other servers, each drains its
  own requests (up to --shutdown-timeout), and the engine process ends once every server
  has left. A server that exits on its own stops the whole group.
"""
import argparse
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

from nanovllm.engine.core_client import EngineProcess
from nanovllm.entrypoints.openai.metrics import SharedMetricsRows

logger = logging.getLogger("nanovllm")

# How long the parent waits for the other servers after their drain deadline, before SIGKILL.
SERVER_EXIT_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1   # <sys/prctl.h>


def serve_api_servers(args: argparse.Namespace, engine_kwargs: dict, build_server) -> None:
    """Run `args.api_server_count` servers (this process the first) on one engine process until
    SIGTERM/SIGINT. `build_server(args, async_llm, metrics_shared)` builds one server's uvicorn
    Server (api_server.build_uvicorn_server). Raises what the engine's start-up raised."""
    count = args.api_server_count
    sock = _bind_socket(args.host, args.port)
    # From here on a SIGTERM ends what runs (start-up included) through the `finally`: nothing is left
    # behind. uvicorn re-raises a SIGTERM it drained for once it is done, which would otherwise end this
    # process at once; here it ends `run`, so that the other servers and the engine are waited for first.
    signal.signal(signal.SIGTERM, _raise_terminated)
    engine, async_llm, servers, lost, terminated = None, None, [], [], False
    try:
        engine = EngineProcess(args.model, engine_kwargs, args.log_stats_interval, num_clients=count)
        uvicorn_server, async_llm = _start_servers(args, engine, sock, build_server, servers, lost)
        logger.info("%d API server processes share the engine process (pid %d)", count, engine.proc.pid)
        uvicorn_server.run(sockets=[sock])
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second SIGTERM: the servers are stopping already
        _stop_servers(servers, args.shutdown_timeout + SERVER_EXIT_GRACE_S)
        if async_llm is not None:
            async_llm.shutdown()
        if engine is not None:
            engine.stop()   # (closing every pipe end still here, so that no write of the engine's waits)
        sock.close()
    if lost:
        raise SystemExit(f"nanovllm serve: error: {lost[0]}")
    if terminated:   # end as uvicorn would have: by the signal
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _start_servers(args: argparse.Namespace, engine: EngineProcess, sock: socket.socket, build_server,
                   servers: list, lost: list[str]):
    """This process's server (not yet running) and its AsyncLLM, once the engine is ready; the other
    servers spawned into `servers`, watched (`lost` says which exited on its own)."""
    from nanovllm.engine.async_llm import AsyncLLM
    async_llm = AsyncLLM.from_engine_process(engine.client_ends[0], engine)   # waits for the engine, or raises
    rows = SharedMetricsRows(args.api_server_count)
    uvicorn_server = build_server(args, async_llm, (rows, 0))   # a bad setting fails before any spawn
    ctx = multiprocessing.get_context("spawn")
    for index in range(1, args.api_server_count):
        server = ctx.Process(target=run_api_server, name=f"nanovllm-api-server-{index}",
                             args=(args, sock, engine.client_ends[index], rows, index, args.log_level.upper(), os.getpid()))
        server.start()
        servers.append(server)
    for cmd_conn, out_conn in engine.client_ends[1:]:   # the servers' own now: their exit ends their pipes
        cmd_conn.close()
        out_conn.close()
    _say_where_once_listening(uvicorn_server, sock)
    _pass_exit_on(uvicorn_server, servers)
    threading.Thread(target=_watch_servers, args=(uvicorn_server, servers, lost), name="nanovllm-api-server-watch",
                     daemon=True).start()
    return uvicorn_server, async_llm


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn after its graceful shutdown."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def run_api_server(args: argparse.Namespace, sock, ends: tuple, rows: SharedMetricsRows, index: int,
                   log_level: str, parent_pid: int) -> None:
    """A spawned server's entry: one more app on the shared socket and engine process. It drains and
    exits when the parent dies (Linux: the parent-death signal), so that no server outlives it."""
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.entrypoints.openai.api_server import build_uvicorn_server
    _exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    async_llm = AsyncLLM.from_engine_process(ends)
    try:
        build_uvicorn_server(args, async_llm, (rows, index)).run(sockets=[sock])
    finally:
        async_llm.shutdown()


def _exit_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent dies (Linux's PR_SET_PDEATHSIG); exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit(0)


def _bind_socket(host: str, port: int) -> socket.socket:
    """The servers' listening socket, bound (not yet listening: each server's uvicorn listens on it
    and then logs its "Uvicorn running on" line, which clients wait for). OSError if taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _say_where_once_listening(uvicorn_server, sock: socket.socket) -> None:
    """uvicorn's "Uvicorn running on" line, which it leaves out on sockets passed in, logged by the
    first server once it listens (clients and scripts wait for that line, as with one server)."""
    startup = uvicorn_server.startup

    async def startup_and_say_where(sockets=None):
        await startup(sockets=sockets)
        if uvicorn_server.started:
            host, port = sock.getsockname()[:2]
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    f"[{host}]" if ":" in host else host, port)
    uvicorn_server.startup = startup_and_say_where


def _pass_exit_on(uvicorn_server, servers: list) -> None:
    """The parent's SIGTERM/SIGINT also asks the other servers to drain and exit (Ctrl-C reaches
    them itself, through the process group; a SIGTERM sent to the parent does not)."""
    handle_exit = uvicorn_server.handle_exit

    def handle_exit_everywhere(sig, frame):
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)
        handle_exit(sig, frame)
    uvicorn_server.handle_exit = handle_exit_everywhere


def _watch_servers(uvicorn_server, servers: list, lost: list[str]) -> None:
    """Stop the parent's server (and so the group) when another server exits on its own; say
    which in `lost`."""
    from multiprocessing.connection import wait
    exited = wait([server.sentinel for server in servers])
    if not uvicorn_server.should_exit:
        server = next(server for server in servers if server.sentinel in exited)
        server.join()
        lost.append(f"API server process {server.name} exited (exit code {server.exitcode})")
        logger.error("%s: stopping the server", lost[0])
        uvicorn_server.should_exit = True


def _stop_servers(servers: list, timeout_s: float) -> None:
    """Ask the other servers to exit (SIGTERM: they drain), wait up to `timeout_s`, then kill."""
    for server in servers:
        if server.is_alive():
            os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for server in servers:
        server.join(max(0.0, deadline - time.monotonic()))
        if server.is_alive():
            logger.warning("API server process %s did not exit: killing it", server.name)
            server.kill()
            server.join()
