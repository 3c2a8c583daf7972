"""A test's server in a process of its own: its log, its port, its child processes, and that they are gone."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
STARTUP_TIMEOUT_S = 180   # a loaded 2-core CI machine imports torch slowly


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def child_pids(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return children


def assert_gone(pid: int, timeout: float = 10) -> None:
    """The process has exited and been reaped (its parent waited for it), not left running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} is still there")


class ServerProcess:
    """`python -m nanovllm.entrypoints.openai.api_server MODEL --port 0 ARGS...` in its own process group
    (as a shell's foreground job), its log read as it comes. Ready once the port is announced and
    `is_ready(log)` holds; then `url`, `children` (its child processes) and `spawned` (those started by
    multiprocessing's spawn: the engine process, other API servers) are set."""

    def __init__(self, model_dir: str, *args: str, is_ready=lambda log: True):
        cmd = [sys.executable, "-m", "nanovllm.entrypoints.openai.api_server", model_dir, "--port", "0", *args]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.log: list[str] = []
        self.port: int | None = None
        self._is_ready = is_ready
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        started = self._ready.wait(STARTUP_TIMEOUT_S) and self.port is not None and self._is_ready(self.log)
        if not started or self.proc.poll() is not None:   # (the log ends, and so sets _ready, when it exits)
            self._kill_group()
            pytest.fail("the server did not start:\n" + self.tail())
        self.url = f"http://127.0.0.1:{self.port}"
        self.children = child_pids(self.proc.pid)
        self.spawned = [pid for pid in self.children if b"spawn_main" in cmdline(pid)]

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            announced = READY_LINE.search(line) if self.port is None else None
            if announced:
                self.port = int(announced.group(1))
            if self.port is not None and self._is_ready(self.log):
                self._ready.set()
        self._ready.set()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (it drains), then its exit code; its whole group killed if it has not exited within
        `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            raise

    def _kill_group(self) -> None:
        """SIGKILL to the server and every process of its group (the engine process, other servers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:   # the group is gone already
            pass
        self.proc.wait()

    def tail(self) -> str:
        return "".join(self.log[-40:])

    def wait_for_log_end(self, timeout: float) -> None:
        """Once the server has exited: every line of its log read."""
        self._reader.join(timeout)

    def assert_all_gone(self) -> None:
        """The server and every child it had are gone (a test that failed kills the whole group first)."""
        if self.proc.poll() is None:
            self._kill_group()
        for pid in self.children:
            assert_gone(pid)
