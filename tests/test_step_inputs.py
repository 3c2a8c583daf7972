"""engine/step_inputs.py: a decode-only step of a few sequences, built from Python lists
(`_few_decode_rows`), gives the arrays the numpy path gives; a mixed step keeps the numpy path."""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from nanovllm.engine import step_inputs

BLOCK_SIZE = 16


def _seq(rng: random.Random, scheduled: int = 1) -> SimpleNamespace:
    """The fields build_step_inputs reads, for a sequence of 1-100 tokens with `scheduled` to compute."""
    num_tokens = rng.randint(scheduled, 100)
    computed = num_tokens - scheduled
    blocks = rng.sample(range(1000), -(-(num_tokens + 2) // BLOCK_SIZE))
    return SimpleNamespace(num_tokens=num_tokens, num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                           token_ids=[rng.randrange(50000) for _ in range(num_tokens)], block_table=blocks)


def _fields(inputs: step_inputs.StepInputs) -> dict:
    return {name: (value.dtype, value.tolist()) if isinstance(value, np.ndarray) else value
            for name, value in vars(inputs).items()}


@pytest.mark.parametrize("num_pending", [0, 1])
@pytest.mark.parametrize("num_seqs", [1, 3, step_inputs.LIST_PATH_MAX_SEQS])
def test_few_decode_rows_same_arrays(monkeypatch, num_seqs, num_pending):
    rng = random.Random(num_seqs * 10 + num_pending)
    for _ in range(20):
        seqs = [_seq(rng) for _ in range(num_seqs)]
        lists = step_inputs.build_step_inputs(seqs, BLOCK_SIZE, num_pending)
        with monkeypatch.context() as m:
            m.setattr(step_inputs, "LIST_PATH_MAX_SEQS", 0)
            arrays = step_inputs.build_step_inputs(seqs, BLOCK_SIZE, num_pending)
        assert _fields(lists) == _fields(arrays)
        assert lists.is_decode_only and lists.logits_indices.tolist() == arrays.logits_indices.tolist()


def test_mixed_step_takes_the_numpy_path(monkeypatch):
    calls = []
    monkeypatch.setattr(step_inputs, "_few_decode_rows", lambda *a: calls.append(a))
    rng = random.Random(0)
    inputs = step_inputs.build_step_inputs([_seq(rng), _seq(rng, scheduled=5)], BLOCK_SIZE)
    assert calls == [] and inputs.max_seqlen_q == 5
