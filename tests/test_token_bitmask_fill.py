"""The step's token bitmask from its sequences' matchers (sampling_metadata.fill_token_bitmask).

Only the constrained rows are filled on the host (into uninitialised memory that xgrammar
overwrites word for word); the rows of free sequences, finished ones and grammars not
started yet allow every token, set where the bitmask lands. Each row must equal what its
own matcher fills alone.
"""
import pytest
import torch

from nanovllm import StructuredOutputsParams
from nanovllm.engine.sampling_metadata import fill_token_bitmask
from nanovllm.engine.sequence import Sequence
from nanovllm.structured_outputs.backend import BITS_PER_WORD
from nanovllm.structured_outputs.manager import StructuredOutputManager
from smollm2_tokenizer import smollm2_tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {"type": "array", "items": {"type": "string"}}
PAST_VOCAB = 40  # logits wider than the tokenizer, not a multiple of 32 words


@pytest.fixture(scope="module")
def manager():
    tokenizer = smollm2_tokenizer()
    manager = StructuredOutputManager(tokenizer, len(tokenizer) + PAST_VOCAB, {tokenizer.eos_token_id})
    yield manager
    manager.shutdown()


def _constrained(manager, text: str, start_after_token_id: int | None = None) -> Sequence:
    seq = Sequence([1])
    seq.grammar = manager.grammar_for(StructuredOutputsParams(json=SCHEMA, start_after_token_id=start_after_token_id),
                                      frozenset())
    seq.grammar.compiled.result()
    if text:
        assert seq.grammar.matcher.accept_string(text), text
    return seq


def test_each_row_is_its_own_matchers_fill_and_the_others_allow_every_token(manager):
    vocab = manager.compiler.vocab_size
    tokenizer = manager.compiler.tokenizer
    words = -(-vocab // BITS_PER_WORD)
    finished = _constrained(manager, '["a')
    finished.finish("abort")
    seqs = [Sequence([1]), _constrained(manager, ""), _constrained(manager, '["ab'), finished,
            _constrained(manager, "", start_after_token_id=tokenizer.eos_token_id),  # not started
            _constrained(manager, '["x", '), Sequence([2])]
    bitmask = fill_token_bitmask(seqs, vocab, torch.device("cpu"))
    assert bitmask.shape == (len(seqs), words) and bitmask.dtype == torch.int32
    for row, seq in enumerate(seqs):
        expected = torch.full((1, words), -1, dtype=torch.int32)
        if row in (1, 2, 5):
            seq.grammar.matcher.fill_next_token_bitmask(expected, 0)
            assert not torch.equal(expected[0], torch.full((words,), -1, dtype=torch.int32))  # a real mask
        assert torch.equal(bitmask[row], expected[0]), row


def test_a_batch_of_constrained_rows_only_and_none(manager):
    vocab = manager.compiler.vocab_size
    seqs = [_constrained(manager, '["ab'), _constrained(manager, "")]
    bitmask = fill_token_bitmask(seqs, vocab, torch.device("cpu"))
    for row, seq in enumerate(seqs):
        expected = torch.zeros((1, bitmask.shape[1]), dtype=torch.int32)
        seq.grammar.matcher.fill_next_token_bitmask(expected, 0)
        assert torch.equal(bitmask[row], expected[0])
    assert fill_token_bitmask([Sequence([1])], vocab, torch.device("cpu")) is None
