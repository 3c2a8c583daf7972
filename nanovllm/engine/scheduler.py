"""Scheduler: which sequences run this step, and how many tokens each.

Design choice: one step may mix decodes (one token each) and prefill chunks, as
vLLM v1 does, instead of Nano-vLLM's separate prefill and decode steps. A mixed
step keeps running sequences decoding while a long prompt is prefilled in
chunks (no decode stall, steadier inter-token latency), and the unified paged
attention kernel serves both kinds of query in one launch, so mixing costs
nothing extra. Every sequence is simply "compute my uncomputed tokens", capped by
the step's token budget: a decode has one, a prompt has many.

Each step fills a budget of `max_num_batched_tokens` tokens and `max_num_seqs`
sequences: running sequences first (oldest first), then waiting ones in arrival
order. When the KV cache runs out, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue, to be
recomputed (cheaply, through the prefix cache) later. A waiting sequence whose
structured-output grammar is still compiling is skipped (vLLM's WAITING_FOR_FSM): the
ones behind it may go first; it keeps its place in the queue.
"""
from collections import deque
from typing import Callable

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus

# Decides whether a sequence that just got a token is finished: returns the
# finish reason ("stop", "length") or None. Built by the output processing.
StopChecker = Callable[[Sequence], str | None]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._prefill_parents: dict[int, Sequence] = {}  # seq_id -> sibling whose prompt it waits for

    def add(self, seq: Sequence, prefill_parent: Sequence | None = None) -> None:
        """Queue `seq`; ValueError if it could not fit in the whole KV cache even alone.

        `prefill_parent` (n > 1): a sibling with the same prompt; `seq` is admitted only once
        that prompt is computed, so it takes the prompt's blocks from the prefix cache.
        """
        needed = -(-self._max_kv_tokens(seq) // self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"sequence of {seq.num_tokens} prompt tokens and max_tokens="
                             f"{seq.sampling_params.max_tokens} needs {needed} KV blocks, "
                             f"but the cache has only {self.block_manager.num_blocks}")
        if prefill_parent is not None and self.block_manager.enable_prefix_caching:
            self._prefill_parents[seq.seq_id] = prefill_parent
        self.waiting.append(seq)

    @staticmethod
    def _max_kv_tokens(seq: Sequence) -> int:
        """Most tokens `seq` will ever hold in the KV cache (the last sampled one is never computed)."""
        return seq.num_tokens + max((seq.sampling_params.max_tokens or 1) - 1, 0)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def can_admit(self, num_leaving: int = 0) -> bool:
        """Whether a waiting sequence could join the batch at the next step: one waits and the
        batch has room for it (max_num_seqs) once `num_leaving` running sequences have ended;
        KV room is found out only by trying."""
        return bool(self.waiting) and len(self.running) - num_leaving < self.max_num_seqs

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling -----------------------------------------------------------

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set each one's `num_scheduled_tokens`."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        num_preemptions = self.num_preemptions
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if self._allocate_or_preempt(seq, num_tokens):
                budget -= self._schedule(seq, num_tokens, scheduled)
        if self.num_preemptions == num_preemptions:  # no room was short: admit newcomers
            self._admit_waiting(budget, scheduled)
        if not scheduled and not self.is_finished() and not any(s.waiting_for_grammar for s in self.waiting):
            raise RuntimeError(f"no sequence fits in the KV cache ({self.block_manager.num_free_blocks} of "
                               f"{self.block_manager.num_blocks} blocks free): leaked blocks?")
        return scheduled

    def extend_decode(self, seqs: list[Sequence], max_steps: int, max_model_len: int,
                      num_pending: int = 0) -> int:
        """How many decode steps the scheduled `seqs` may run back to back (multi-step).

        Only a step of pure decodes that no waiting sequence could join is extended
        (newcomers are admitted at step boundaries; a full batch, at max_num_seqs, admits
        nobody before one of its sequences ends, so it runs rounds too). Each sequence
        gets KV slots for every step; none may pass `max_model_len`. A sequence that finishes early wastes the
        rest of its steps, whose tokens are dropped. Returns 1 when not extended.
        `num_pending`: tokens each sequence has sampled on the device beyond what the
        host has seen (a round chained onto a running one); the steps come after them.
        """
        if max_steps == 1 or self.can_admit() or any(s.num_uncomputed_tokens != 1 for s in seqs):
            return 1
        steps = min(max_steps, min(max_model_len - s.num_tokens - num_pending + 1 for s in seqs))
        if steps <= 1 or self._num_new_blocks(seqs, num_pending + steps) > self.block_manager.num_free_blocks:
            return 1  # all or nothing: no sequence keeps blocks for a round that does not run
        for seq in seqs:
            allocated = self.block_manager.allocate_slots(seq, num_pending + steps)
            assert allocated, "the blocks counted above must suffice"
        return steps

    def _num_new_blocks(self, seqs: list[Sequence], num_tokens: int) -> int:
        """Blocks that running `seqs` need to compute `num_tokens` more tokens each."""
        bs = self.block_manager.block_size
        return sum(max(0, -(-(s.num_computed_tokens + num_tokens) // bs) - len(s.block_table)) for s in seqs)

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Find blocks for `seq`, preempting newer running sequences; False if `seq` itself went."""
        while not self.block_manager.allocate_slots(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                if not self.running:
                    raise RuntimeError(f"sequence {seq.seq_id} cannot fit in an empty KV cache")
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[Sequence]) -> None:
        compiling: list[Sequence] = []  # skipped, and put back in front in their order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.waiting_for_grammar:
                compiling.append(self.waiting.popleft())
                continue
            if not self._parent_prefilled(seq):
                break  # its sibling's prompt is still being computed
            num_new = seq.num_uncomputed_tokens - self._cached_tokens(seq)
            num_tokens = min(num_new, budget)
            if not self.block_manager.allocate_slots(seq, num_tokens):
                break  # first come, first served: nobody jumps the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule(seq, num_tokens, scheduled)
        self.waiting.extendleft(reversed(compiling))

    def _parent_prefilled(self, seq: Sequence) -> bool:
        parent = self._prefill_parents.get(seq.seq_id)
        if parent is not None and not (parent.is_finished or parent.num_completion_tokens > 0):
            return False
        self._prefill_parents.pop(seq.seq_id, None)
        return True

    def _cached_tokens(self, seq: Sequence) -> int:
        return len(self.block_manager.find_cached_blocks(seq)) * self.block_manager.block_size

    @staticmethod
    def _schedule(seq: Sequence, num_tokens: int, scheduled: list[Sequence]) -> int:
        seq.num_scheduled_tokens = num_tokens
        scheduled.append(seq)
        return num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the forward pass -----------------------------------------------

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None],
                    check_stop: StopChecker) -> list[Sequence]:
        """Record a step's results; returns the sequences that finished.

        `token_ids[i]` is the token sampled for `seqs[i]`, or None when that
        sequence only computed part of its prompt this step.
        """
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.cache_full_blocks(seq)
            if token_id is None:
                continue
            seq.append_token(token_id)
            reason = check_stop(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` (stopped, out of length, or aborted) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._prefill_parents.pop(seq.seq_id, None)
        seq.finish(reason)
