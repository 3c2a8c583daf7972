"""How the suite splits over pytest-xdist workers (`python -m pytest -q -n 2`, the README's command).

- Whole files go to one worker: their module fixtures (servers, the Ray cluster, spawned
  engine processes, the HF model from the GGUF) are built once, as in a serial run.
- Every kernel file's interpreter test goes to one worker: the first of them runs one
  Triton-interpreter child for all the files (triton_interpreter.py), the others read its report.
- The longest groups are handed out first, so that no long file starts last and runs alone.

Used only where xdist distributes with its default (`-n` without `--dist`, which xdist calls
"load") or `--dist loadgroup`; any other `--dist` keeps xdist's own scheduler.
"""
import os

INTERPRETER_GROUP = "triton-interpreter"
INTERPRETER_TEST_SUFFIX = "_under_triton_interpreter"
# The groups measured the longest, longest first (item times summed from `--durations=0` of a
# `-n 2` run on the 2-core AVX512 VM, twelfth session: test_ray 124 s, test_parity 77 s, the
# interpreter child 58 s, test_tp 45 s, test_server 38 s, then 17-28 s each); every other file
# follows in collection order.
LONGEST_FIRST = ("test_ray.py", "test_parity.py", INTERPRETER_GROUP, "test_tp.py", "test_server.py", "test_cli.py",
                 "test_cpu_compile.py", "test_fp8_kv.py", "test_gguf.py", "test_structured_outputs.py",
                 "test_structured_rounds.py", "test_engine_process.py")
SCHEDULED_DISTS = ("load", "loadgroup")


def is_worker() -> bool:
    """True in an xdist worker process (xdist sets PYTEST_XDIST_WORKER there)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def group_of(nodeid: str) -> str:
    """'tests/test_x.py::test_y[p]' -> the file name 'test_x.py', or INTERPRETER_GROUP."""
    path, _, name = nodeid.partition("::")
    return INTERPRETER_GROUP if name.endswith(INTERPRETER_TEST_SUFFIX) else os.path.basename(path)


def longest_first(items: list) -> None:
    """Reorder a worker's collected items in place: LONGEST_FIRST's groups first, each test's
    order within its group kept. Every worker reorders alike (xdist checks that they agree)."""
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))


def make_scheduler(config, log):
    """The scheduler for pytest_xdist_make_scheduler: xdist's scope scheduler over group_of's
    groups in collection order; None (xdist's own) for any other `--dist`."""
    if config.getvalue("dist") not in SCHEDULED_DISTS:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def schedule(self) -> None:
            # the groups in collection order (longest_first's), not sorted by their test counts
            saved, self.config.option.loadscopereorder = self.config.option.loadscopereorder, False
            try:
                super().schedule()
            finally:
                self.config.option.loadscopereorder = saved
    return FileGroupScheduling(config, log)
