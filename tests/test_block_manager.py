"""BlockManager unit tests with exact block ids (pure Python, no device).

In the style of vLLM's tests/v1/core/test_prefix_caching.py: every test drives
the block manager by hand (allocate, "compute", free) and checks the exact block
table, reference counts, free-list order and prefix-cache contents. The `bm`
fixture checks after every test that every block is free again.
"""
import pytest

from nanovllm.engine import block_manager as bm_module
from nanovllm.engine.block_manager import NO_HASH, BlockManager
from nanovllm.engine.sequence import Sequence

BLOCK_SIZE = 4   # small blocks keep the token lists in these tests readable
NUM_BLOCKS = 8


def assert_all_free(bm: BlockManager) -> None:
    """Every block has reference count 0 and sits in the free list."""
    assert [b.block_id for b in bm.blocks if b.ref_count] == []
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_block_ids) == list(range(bm.num_blocks))


@pytest.fixture
def make_bm():
    """make_bm(num_blocks, ...) -> BlockManager; each one is checked for leaks at teardown."""
    made = []

    def make(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, **kwargs) -> BlockManager:
        made.append(BlockManager(num_blocks, block_size, **kwargs))
        return made[-1]
    yield make
    for bm in made:
        assert_all_free(bm)


@pytest.fixture
def bm(make_bm):
    return make_bm()


def seq_of(token_ids: list[int]) -> Sequence:
    return Sequence(token_ids, block_size=BLOCK_SIZE)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler's postprocess does after a step computed `num_tokens` of `seq`."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` and compute its whole prompt (minus any cached prefix) in one step."""
    assert bm.allocate_slots(seq, seq.num_tokens - len(bm.find_cached_blocks(seq)) * bm.block_size)
    compute(bm, seq, seq.num_uncomputed_tokens)


def ref_counts(bm: BlockManager) -> list[int]:
    """Every block's reference count, by id (0 for blocks not handed out yet)."""
    return [b.ref_count for b in bm.blocks] + [0] * (bm.num_blocks - len(bm.blocks))


# ---- allocation and freeing --------------------------------------------------

def test_allocate_and_free(bm):
    seq = seq_of(list(range(10)))  # 3 blocks: 4 + 4 + 2 tokens
    assert bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert ref_counts(bm)[:4] == [1, 1, 1, 0]
    assert bm.num_free_blocks == NUM_BLOCKS - 3
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    # freed tail first, after the never-used blocks
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_a_huge_cache_costs_only_the_blocks_handed_out():
    """A tiny model on a large GPU gets millions of blocks: start-up must not build a
    record for each (5M took 9 s and 2 GB of host memory when it did)."""
    num_blocks = 10**12
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    a, b = seq_of(list(range(9))), seq_of(list(range(100, 105)))
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 5)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    assert len(bm.blocks) == 5 and bm.num_free_blocks == num_blocks - 5
    bm.free(a)
    c = seq_of(list(range(200, 204)))
    assert bm.allocate_slots(c, 4) and c.block_table == [5]  # untouched blocks before freed ones
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == num_blocks and len(bm.blocks) == 6


def test_allocation_failure_changes_nothing(make_bm):
    bm = make_bm(num_blocks=2)
    seq = seq_of(list(range(9)))  # needs 3 blocks
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.num_prefix_query_tokens == 0


def test_append_takes_a_block_only_when_the_last_is_full(bm):
    seq = seq_of(list(range(3)))
    assert bm.allocate_slots(seq, 3)
    compute(bm, seq, 3)
    seq.append_token(100)          # 4th token fits in block 0
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0]
    compute(bm, seq, 1)
    seq.append_token(101)          # 5th token needs block 1
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0, 1]
    bm.free(seq)


def test_chunks_allocate_blocks_as_needed(bm):
    seq = seq_of(list(range(10)))
    assert bm.allocate_slots(seq, 3)   # chunk of 3 tokens
    assert seq.block_table == [0]
    compute(bm, seq, 3)
    assert bm.allocate_slots(seq, 3)   # tokens 3..5
    assert seq.block_table == [0, 1]
    compute(bm, seq, 3)
    assert bm.allocate_slots(seq, 4)   # tokens 6..9
    assert seq.block_table == [0, 1, 2]
    bm.free(seq)


# ---- prefix caching ----------------------------------------------------------

def test_prefix_hit_across_requests(bm):
    a = seq_of(list(range(10)))
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].hash != NO_HASH for i in range(3)] == [True, True, False]  # block 2 is partial

    b = seq_of(list(range(8)) + [50, 51, 52])  # shares a's two full blocks
    assert bm.find_cached_blocks(b) == [0, 1]
    assert bm.allocate_slots(b, 3)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_prefix_hit_tokens == 8
    assert bm.num_prefix_query_tokens == 10 + 11
    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    bm.free(b)


def test_partial_last_block_is_not_cached(bm):
    a = seq_of(list(range(6)))  # block 1 holds 2 of 4 tokens
    prefill(bm, a)
    b = seq_of(list(range(6)) + [7, 8, 9])
    assert bm.find_cached_blocks(b) == [0]
    # once the block fills up and is computed, it is cached
    a.append_token(6)
    assert bm.allocate_slots(a, 1)
    compute(bm, a, 1)
    assert bm.find_cached_blocks(b) == [0]   # a's block 1 = [4, 5, 6] still partial
    a.append_token(7)
    assert bm.allocate_slots(a, 1)
    compute(bm, a, 1)
    c = seq_of(list(range(8)) + [9])
    assert bm.find_cached_blocks(c) == [0, 1]
    assert bm.find_cached_blocks(b) == [0]   # b's block 1 is [4, 5, 7, 8]: differs
    bm.free(a)


def test_uncomputed_blocks_are_not_cached(bm):
    a = seq_of(list(range(12)))
    assert bm.allocate_slots(a, 12)
    compute(bm, a, 5)   # only block 0 is full and computed
    assert bm.find_cached_blocks(seq_of(list(range(13)))) == [0]
    bm.free(a)


def test_full_prompt_hit_leaves_one_token_to_compute(bm):
    a = seq_of(list(range(8)))
    prefill(bm, a)
    b = seq_of(list(range(8)))  # identical prompt: the last block must be recomputed for logits
    assert bm.find_cached_blocks(b) == [0]
    assert bm.allocate_slots(b, 4)
    assert b.block_table == [0, 2] and b.num_computed_tokens == 4
    bm.free(a)
    bm.free(b)


def test_hit_revives_a_freed_block(bm):
    a = seq_of(list(range(9)))
    prefill(bm, a)
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = seq_of(list(range(8)) + [40, 41])
    assert bm.allocate_slots(b, 2)
    assert b.block_table == [0, 1, 3]   # the cached blocks leave the free list
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    bm.free(b)


def test_num_cached_tokens_counts_the_first_admission_only(bm):
    """After a preemption the sequence finds its own blocks again; that is not a cache hit to report."""
    a = seq_of(list(range(9)))
    prefill(bm, a)
    a.append_token(9)
    bm.free(a)                          # preempted: recomputed later
    assert bm.allocate_slots(a, 2)
    assert a.block_table == [0, 1, 3] and a.num_computed_tokens == 8
    assert a.num_cached_tokens == 0
    assert bm.num_prefix_hit_tokens == 8
    bm.free(a)


def test_revived_blocks_count_against_free_blocks(make_bm):
    bm = make_bm(num_blocks=3)
    a = seq_of(list(range(8)))
    prefill(bm, a)
    bm.free(a)                      # blocks 0, 1 cached and free; block 2 free
    b = seq_of(list(range(8)) + list(range(50, 59)))  # 2 cached + 3 new blocks > 3
    assert not bm.allocate_slots(b, 9)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.find_cached_blocks(b) == [0, 1]  # the failed attempt evicted nothing


def test_identical_prompts_in_one_step_share_later(bm):
    """Two sequences computed in the same step: the first one's blocks are registered."""
    a, b = seq_of(list(range(9))), seq_of(list(range(9)))
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    compute(bm, a, 9)
    compute(bm, b, 9)
    assert bm.hash_to_block_id == {bm.blocks[0].hash: 0, bm.blocks[1].hash: 1}
    c = seq_of(list(range(9)))
    assert bm.find_cached_blocks(c) == [0, 1]
    for s in (a, b):
        bm.free(s)


def test_chain_continues_through_a_duplicate_block(bm):
    """b's first block duplicates a's (not registered); b's second block still becomes findable."""
    a = seq_of([1, 2, 3, 4, 9, 9, 9, 9, 0])
    b = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)
    compute(bm, a, 9)
    compute(bm, b, 9)
    assert bm.blocks[b.block_table[0]].hash == NO_HASH
    c = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert bm.find_cached_blocks(c) == [a.block_table[0], b.block_table[1]]
    bm.free(a)
    bm.free(b)


def test_prefix_caching_disabled(make_bm):
    bm = make_bm(enable_prefix_caching=False)
    a = seq_of(list(range(9)))
    prefill(bm, a)
    b = seq_of(list(range(9)))
    assert bm.find_cached_blocks(b) == []
    assert bm.allocate_slots(b, 9)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    assert bm.hash_to_block_id == {} and bm.num_prefix_query_tokens == 0
    bm.free(a)
    bm.free(b)


# ---- hash collisions -----------------------------------------------------------

def test_collision_with_other_tokens_is_rejected(bm, monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda token_ids, prev_hash: 42)
    a = seq_of([1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.hash_to_block_id == {42: 0}
    b = seq_of([9, 9, 9, 9, 5])     # same hash, different tokens
    assert bm.find_cached_blocks(b) == []
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [2, 3] and b.num_cached_tokens == 0
    compute(bm, b, 5)
    assert bm.hash_to_block_id == {42: 0}   # the colliding block is not registered
    bm.free(a)
    bm.free(b)


def test_collision_with_same_tokens_at_another_position_is_rejected(bm, monkeypatch):
    """Same tokens but another position: the stored token check alone would accept it."""
    monkeypatch.setattr(bm_module, "hash_block", lambda token_ids, prev_hash: 42)
    x = [5, 6, 7, 8]
    a = seq_of(x + x + [1])
    prefill(bm, a)
    b = seq_of(x + x + [2])
    hits = bm.find_cached_blocks(b)
    assert hits == [0]                       # never [0, 0]: block 0 holds positions 0..3
    assert bm.allocate_slots(b, 5)
    assert len(set(b.block_table)) == len(b.block_table)
    bm.free(a)
    bm.free(b)


def test_collision_after_another_prefix_is_rejected(bm, monkeypatch):
    """A hash that forgets the chain: same block tokens after a different prefix is a miss."""
    monkeypatch.setattr(bm_module, "hash_block", lambda token_ids, prev_hash: hash(tuple(token_ids)))
    p, q, x = [1, 1, 1, 1], [2, 2, 2, 2], [5, 6, 7, 8]
    a = seq_of(p + x + [0])
    prefill(bm, a)
    assert bm.find_cached_blocks(seq_of(x + [0])) == []        # x cached at position 1, not 0
    assert bm.find_cached_blocks(seq_of(q + x + [0])) == []    # q never cached
    assert bm.find_cached_blocks(seq_of(p + x + [0])) == [0, 1]
    bm.free(a)


# ---- eviction ------------------------------------------------------------------

def test_eviction_least_recently_freed_first(make_bm):
    bm = make_bm(num_blocks=6)
    a = seq_of(list(range(0, 8)) + [99])        # blocks 0, 1 cached, 2 partial
    b = seq_of(list(range(100, 108)) + [99])    # blocks 3, 4 cached, 5 partial
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids) == [2, 1, 0, 5, 4, 3]
    c = seq_of(list(range(200, 209)))           # 3 fresh blocks: a's, tail first
    assert bm.allocate_slots(c, 9)
    assert c.block_table == [2, 1, 0]
    assert bm.find_cached_blocks(seq_of(list(range(0, 8)) + [99])) == []   # a's prefix evicted
    assert bm.find_cached_blocks(seq_of(list(range(100, 108)) + [99])) == [3, 4]
    bm.free(c)


def test_eviction_takes_the_tail_of_a_prefix_before_its_head(make_bm):
    bm = make_bm(num_blocks=4)
    a = seq_of(list(range(12)) + [99])          # cached blocks 0, 1, 2; block 3 partial
    prefill(bm, a)
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = seq_of([50, 51, 52, 53, 54])            # needs 2 fresh blocks: 3 (uncached), then 2
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 2]
    assert bm.find_cached_blocks(seq_of(list(range(12)) + [99])) == [0, 1]  # head survives
    bm.free(b)


def test_hit_blocks_move_to_the_back_when_freed_again(make_bm):
    bm = make_bm(num_blocks=5)
    a = seq_of(list(range(8)) + [99])
    prefill(bm, a)                               # 0, 1 cached, 2 partial
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 4, 2, 1, 0]
    b = seq_of(list(range(4)) + [77])            # hits block 0, new block 3
    prefill(bm, b)
    bm.free(b)
    assert list(bm.free_block_ids) == [4, 2, 1, 3, 0]  # 0 is now the most recently freed


# ---- reference counts ----------------------------------------------------------

def test_ref_counts_with_shared_prefixes(bm):
    prefix = list(range(8))
    seqs = [seq_of(prefix + [100 + i]) for i in range(3)]
    for s in seqs:
        prefill(bm, s)
    assert [s.block_table for s in seqs] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert ref_counts(bm)[:5] == [3, 3, 1, 1, 1]
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 8]
    bm.free(seqs[1])
    assert ref_counts(bm)[:5] == [2, 2, 1, 0, 1]
    assert list(bm.free_block_ids) == [5, 6, 7, 3]   # shared blocks are not free yet
    bm.free(seqs[0])
    assert ref_counts(bm)[:5] == [1, 1, 0, 0, 1]
    bm.free(seqs[2])
    assert list(bm.free_block_ids) == [5, 6, 7, 3, 2, 4, 1, 0]


def test_double_free_is_caught(bm):
    a = seq_of([1, 2, 3])
    assert bm.allocate_slots(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table   # a stale table: freeing it again must not corrupt the counts
    with pytest.raises(AssertionError, match="double free"):
        bm.free(a)
    a.block_table = []
