"""Sequence: one request's tokens, status and KV block table.

A sequence owns its prompt and generated token ids, the list of KV-cache blocks
that hold them (`block_table`), how many leading tokens already have their keys
and values in the cache (`num_computed_tokens`, of which `num_cached_tokens`
came from the prefix cache), and how many tokens the scheduler gave it this step.
It never touches a device.
"""
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

NO_PARENT = -1  # parent cache id of a sequence's first block (see BlockManager)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 16, seq_id: int | None = None):
        assert token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.block_size = block_size
        self.sampling_params = sampling_params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None   # "stop", "length" or "abort"
        self.token_ids = copy(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of full blocks, filled lazily
        self.num_registered_blocks = 0      # leading full blocks already offered to the prefix cache
        # cache id of the block holding the last registered one (the next one's parent);
        # NO_PARENT before the first, None once a hash collision broke the chain
        self.registered_parent: int | None = NO_PARENT
        self.num_computed_tokens = 0    # tokens whose K/V are in the cache
        self.num_cached_tokens = 0      # of those, taken from the prefix cache at the first admission
        self.admitted = False           # True once the sequence first got KV blocks
        self.num_scheduled_tokens = 0   # tokens computed in the current step
        self.grammar = None             # structured outputs: a SequenceGrammar, set by the engine

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until every prompt token (and any token to recompute) is in the cache."""
        return self.num_uncomputed_tokens > 1 or self.num_completion_tokens == 0

    @property
    def waiting_for_grammar(self) -> bool:
        """True while this sequence's structured-output grammar is still compiling."""
        return self.grammar is not None and not self.grammar.is_ready

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
