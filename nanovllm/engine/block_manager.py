"""BlockManager: the paged KV cache as numbered blocks, with prefix caching.

The cache holds `num_blocks` blocks of `block_size` token slots. A sequence's
`block_table` lists its blocks in order. Each full block is identified by a hash
chain (xxhash over the previous block's hash and this block's token ids), so two
prompts that start with the same tokens share the same physical blocks.

Rules:
- a block is free when its reference count is 0, even if it still holds a cached
  prefix; free blocks wait in least-recently-freed order and a cached one is
  evicted (its hash forgotten) only when it is handed out again;
- a hash hit is confirmed against the stored token ids and the block's parent
  (the cached block before it, by registration id), so a hash collision never
  shares wrong keys and values: not another block's tokens, nor the same tokens
  at another position or after another prefix;
- a sequence's blocks are freed tail first, so the tail of a prefix is evicted
  before its head;
- blocks never handed out yet are handed out first, in id order, and get their `Block`
  record then: start-up costs nothing however large the cache (a tiny model on a large
  GPU gets millions of blocks).
"""
from array import array
from collections import OrderedDict
from itertools import count

import xxhash

from nanovllm.engine.sequence import NO_PARENT, Sequence

NO_HASH = -1


def hash_block(token_ids: list[int], prev_hash: int) -> int:
    """Chain hash of one full block: depends on every token before it too."""
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    # the ids as one buffer of C ints (one update, not one a token); hashes live only in
    # this process, so the machine's byte order does not matter
    h.update(array("i", token_ids))
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH             # set while the block is registered in the prefix cache
        self.token_ids: list[int] = []  # the tokens behind `hash`, to confirm hits
        self.cache_id = NO_PARENT       # unique id of this registration (never reused)
        self.parent_cache_id = NO_PARENT  # cache_id of the cached block before it


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self.blocks: list[Block] = []  # blocks handed out at least once, by id; the rest are untouched
        self._freed: OrderedDict[int, None] = OrderedDict()  # touched and free, least recently freed first
        self.hash_to_block_id: dict[int, int] = {}
        self._cache_ids = count()
        self.num_prefix_hit_tokens = 0    # prompt tokens served from the cache, ever
        self.num_prefix_query_tokens = 0  # prompt tokens looked up, ever

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._freed) + self._num_blocks - len(self.blocks)

    @property
    def free_block_ids(self) -> list[int]:
        """Every free block id, in the order they will be handed out (O(num_blocks): for
        tests and inspection)."""
        return list(range(len(self.blocks), self._num_blocks)) + list(self._freed)

    # ---- prefix cache -------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Hash chain of the first `num_full_blocks` blocks of `seq`, reusing `seq.block_hashes`."""
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            prev = hashes[-1] if hashes else NO_HASH
            hashes.append(hash_block(seq.block(len(hashes)), prev))
        return hashes[:num_full_blocks]

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold a prefix of `seq` (no side effects).

        At least one token is always left to compute, so that the step yields logits.
        A request for prompt logprobs computes its whole prompt (it needs every position's logits).
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits, parent = [], NO_PARENT
        for i, h in enumerate(self.block_hashes(seq, max_blocks)):
            block = self._cached_block(h, seq.block(i), parent)
            if block is None:
                break
            hits.append(block.block_id)
            parent = block.cache_id
        return hits

    def _cached_block(self, h: int, token_ids: list[int], parent: int) -> Block | None:
        """The block cached under hash `h`, if it holds `token_ids` right after `parent`."""
        block_id = self.hash_to_block_id.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_cache_id != parent:
            return None  # a hash collision
        return block

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        first = seq.num_registered_blocks
        if num_full <= first:
            return  # no block became full since the last call: the common decode step
        seq.num_registered_blocks = num_full
        parent = seq.registered_parent  # the holder of block first - 1 (NO_PARENT for block 0)
        hashes = self.block_hashes(seq, num_full)
        for i in range(first, num_full):
            if parent is None:
                return  # the chain broke at an earlier block: nothing after it could be found
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH and hashes[i] not in self.hash_to_block_id:
                block.hash, block.token_ids, block.parent_cache_id = hashes[i], seq.block(i), parent
                block.cache_id = next(self._cache_ids)
                self.hash_to_block_id[hashes[i]] = block.block_id
            # the cached block holding these tokens: this one, or another with the same tokens
            # (None: a colliding block holds the hash)
            holder = block if block.hash != NO_HASH else self._cached_block(hashes[i], seq.block(i), parent)
            parent = seq.registered_parent = None if holder is None else holder.cache_id

    # ---- allocation ---------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make `seq.block_table` cover its computed tokens plus `num_new_tokens`.

        On a sequence's first allocation (and again after a preemption), cached prefix
        blocks are taken first and `seq.num_computed_tokens` advances past them;
        `seq.num_cached_tokens` records them at the very first admission only.
        Returns False, changing nothing, when too few blocks are free.
        """
        admitting = not seq.block_table
        hits = self.find_cached_blocks(seq) if admitting else []
        num_cached_tokens = len(hits) * self.block_size
        num_tokens = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - len(hits))
        num_revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        if admitting and self.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += num_cached_tokens
        for block_id in hits:
            self._take(block_id)
        seq.block_table.extend(hits)
        seq.num_computed_tokens += num_cached_tokens
        if admitting and not seq.admitted:  # as vLLM: prompt tokens the cache served at the first admission,
            seq.num_cached_tokens = num_cached_tokens  # not what a recomputation after preemption finds
            seq.admitted = True
        seq.block_table.extend(self._allocate_fresh() for _ in range(num_new_blocks))
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, tail first; cached ones stay findable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._freed[block_id] = None
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.registered_parent = NO_PARENT
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._freed[block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        if len(self.blocks) < self._num_blocks:  # an untouched block: nothing cached in it
            block = Block(len(self.blocks))
            self.blocks.append(block)
            block.ref_count = 1
            return block.block_id
        block_id, _ = self._freed.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != NO_HASH:  # evict the cached prefix it held
            del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = NO_HASH, []
            block.cache_id = block.parent_cache_id = NO_PARENT
        block.ref_count = 1
        return block_id
