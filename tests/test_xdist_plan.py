"""The suite's plan for pytest-xdist workers (tests/xdist_plan.py), which the README's command
(`python -m pytest -q -n 2`) runs under: every test's group is its file, or the one
Triton-interpreter group; the longest groups come first, each keeping its tests' order; the
longest groups named there are files that exist; xdist's default distribution gets the plan's
scheduler, any other `--dist` keeps xdist's own."""
import os
from types import SimpleNamespace

import pytest

import xdist_plan
from xdist_plan import INTERPRETER_GROUP, LONGEST_FIRST, group_of, longest_first

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_test_is_grouped_by_its_file_or_as_an_interpreter_test():
    assert group_of("tests/test_tp.py::test_tp2_matches_tp1_and_hf[qwen3]") == "test_tp.py"
    assert group_of("tests/test_triton_attn.py::test_attention_under_triton_interpreter") == INTERPRETER_GROUP
    assert group_of("tests/test_triton_attn.py::test_attention_matches_torch[decode]") == "test_triton_attn.py"


def test_the_longest_groups_come_first_in_their_own_order():
    ids = ["tests/test_a.py::x", "tests/test_tp.py::a", "tests/test_ray.py::b", "tests/test_a.py::y",
           "tests/test_k.py::k_under_triton_interpreter", "tests/test_tp.py::c"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    longest_first(items)
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    assert rank["test_ray.py"] < rank[INTERPRETER_GROUP] < rank["test_tp.py"]
    assert [i.nodeid for i in items] == ["tests/test_ray.py::b", "tests/test_k.py::k_under_triton_interpreter",
                                         "tests/test_tp.py::a", "tests/test_tp.py::c",
                                         "tests/test_a.py::x", "tests/test_a.py::y"]


def test_the_longest_groups_named_are_files_of_the_suite():
    missing = [g for g in LONGEST_FIRST if g != INTERPRETER_GROUP and not os.path.exists(os.path.join(TESTS, g))]
    assert missing == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


class FakeNode:
    """A worker as xdist's scheduler sees it: what it was asked to run, by index in its collection."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def _config(dist: str, workers: int = 2):
    values = {"dist": dist, "tx": [f"{workers}*popen"]}
    return SimpleNamespace(getvalue=values.__getitem__, option=SimpleNamespace(loadscopereorder=True))


@pytest.mark.parametrize("dist", ["loadscope", "loadfile", "each", "no"])
def test_another_distribution_keeps_xdists_scheduler(dist):
    assert xdist_plan.make_scheduler(_config(dist), log=None) is None


@pytest.mark.parametrize("dist", ["load", "loadgroup"])
def test_two_workers_get_whole_groups_the_longest_first(dist):
    """Collection order as longest_first leaves it; each worker starts with two groups (xdist's
    rule), in that order, and a group's tests all go to one worker."""
    pytest.importorskip("xdist")
    collection = ["tests/test_ray.py::a", "tests/test_ray.py::b", "tests/test_k.py::k_under_triton_interpreter",
                  "tests/test_j.py::j_under_triton_interpreter", "tests/test_tp.py::t", "tests/test_z.py::z1",
                  "tests/test_z.py::z2", "tests/test_y.py::y"]  # test_z has the most tests, but comes later
    scheduler = xdist_plan.make_scheduler(_config(dist), log=None)
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    sent = [[collection[i] for i in node.sent] for node in nodes]
    assert sent == [["tests/test_ray.py::a", "tests/test_ray.py::b", "tests/test_tp.py::t"],
                    ["tests/test_k.py::k_under_triton_interpreter", "tests/test_j.py::j_under_triton_interpreter",
                     "tests/test_z.py::z1", "tests/test_z.py::z2"]]
    assert list(scheduler.workqueue) == ["test_y.py"]  # handed out as workers finish
