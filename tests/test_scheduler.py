"""Scheduler unit tests (pure Python): token budget, chunked prefill, mixed steps,
prefix skipping, preemption and resumption, stop checks, aborts.

A fake model stands in for the ModelRunner. It keeps a fake KV cache keyed by
slot: computing position p of a sequence writes the whole token prefix
`token_ids[:p + 1]` there (real keys and values depend on every earlier token),
and before it "samples" it checks that every slot the block table points at holds
exactly the sequence's own prefix. So any wrong block id, a stale cached block or
a block shared at the wrong position fails the test, not only wrong counts.
"""
import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.step_inputs import build_step_inputs
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
FAKE_VOCAB = 97   # fake tokens are 3 + (a hash of the context) % FAKE_VOCAB
MAX_STEPS = 500   # a bound on every driving loop: a hang fails instead of looping


class FakeModel:
    """Computes scheduled tokens into a fake paged KV cache and samples deterministically."""

    def __init__(self, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.kv: dict[int, tuple[int, ...]] = {}

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, seqs: list[Sequence]) -> list[int | None]:
        tokens = []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            assert 0 < seq.num_scheduled_tokens and end <= seq.num_tokens
            assert len(seq.block_table) * self.block_size >= end, "no slot for a scheduled token"
            for p in range(start, end):
                self.kv[self.slot(seq, p)] = tuple(seq.token_ids[:p + 1])
            for p in range(end):  # the context this step attends to
                assert self.kv.get(self.slot(seq, p)) == tuple(seq.token_ids[:p + 1]), \
                    f"seq {seq.seq_id}: wrong KV at position {p}"
            tokens.append(next_token(seq.token_ids) if end == seq.num_tokens else None)
        return tokens


def next_token(token_ids: list[int]) -> int:
    return 3 + (sum((i + 1) * t for i, t in enumerate(token_ids)) + len(token_ids)) % FAKE_VOCAB


def stop_at_max_tokens(seq: Sequence) -> str | None:
    return "length" if seq.num_completion_tokens >= seq.sampling_params.max_tokens else None


def assert_no_leak(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert sched.is_finished()
    assert [b.block_id for b in bm.blocks if b.ref_count] == []
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture
def make_sched():
    """make_sched(num_blocks, max_num_seqs, budget) -> Scheduler, checked for leaks at teardown."""
    made = []

    def make(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True):
        bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        made.append(Scheduler(bm, max_num_seqs, max_num_batched_tokens))
        return made[-1]
    yield make
    for sched in made:
        assert_no_leak(sched)


def seq_of(token_ids: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(token_ids, SamplingParams(temperature=0, max_tokens=max_tokens), BLOCK_SIZE)


def step(sched: Scheduler, model: FakeModel, check_stop=stop_at_max_tokens) -> list[tuple[int, int]]:
    """One engine step; returns [(seq_id, num_scheduled_tokens)] and checks the step's limits."""
    seqs = sched.schedule()
    plan = [(s.seq_id, s.num_scheduled_tokens) for s in seqs]
    assert sum(n for _, n in plan) <= sched.max_num_batched_tokens
    assert len(seqs) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
    assert len({s.seq_id for s in seqs}) == len(seqs)
    sched.postprocess(seqs, model.run(seqs), check_stop)
    return plan


def run_all(sched: Scheduler, model: FakeModel | None = None, check_stop=stop_at_max_tokens):
    """Step until every sequence is finished; returns the per-step plans."""
    model = model or FakeModel()
    plans = []
    while not sched.is_finished():
        assert len(plans) < MAX_STEPS, "the scheduler made no progress"
        plans.append(step(sched, model, check_stop))
    return plans


def reference_completion(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prompts_with_shared_prefixes(n: int) -> list[list[int]]:
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    return [(shared[:(i % 3) * 4] if i % 2 else []) + [20 + i] * (3 + 5 * i % 11) for i in range(n)]


# ---- add: the impossible sequence -------------------------------------------------

def test_add_rejects_a_prompt_larger_than_the_cache(make_sched):
    sched = make_sched(num_blocks=4)   # 16 token slots
    with pytest.raises(ValueError, match="needs 5 KV blocks, but the cache has only 4"):
        sched.add(seq_of(list(range(17)), max_tokens=1))
    assert sched.is_finished()


def test_add_rejects_prompt_plus_max_tokens_larger_than_the_cache(make_sched):
    sched = make_sched(num_blocks=4)
    with pytest.raises(ValueError, match="max_tokens=8 needs 5 KV blocks"):
        sched.add(seq_of(list(range(10)), max_tokens=8))   # 10 + 8 - 1 = 17 slots
    fits = seq_of(list(range(10)), max_tokens=7)            # 16 slots: exactly the cache
    sched.add(fits)
    run_all(sched)
    assert fits.completion_token_ids == reference_completion(list(range(10)), 7)


def test_outgrowing_the_cache_raises_instead_of_hanging(make_sched):
    """A stop checker that ignores max_tokens lets a sequence outgrow the cache: an error."""
    sched = make_sched(num_blocks=3)
    seq = seq_of([5, 6, 7], max_tokens=1)
    sched.add(seq)
    with pytest.raises(RuntimeError, match="cannot fit in an empty KV cache"):
        run_all(sched, check_stop=lambda s: None)
    sched.finish(seq, "abort")


def test_leaked_blocks_raise_instead_of_hanging(make_sched):
    sched = make_sched(num_blocks=4)
    rogue = seq_of(list(range(12)))
    assert sched.block_manager.allocate_slots(rogue, 12)   # 3 blocks held by nobody the scheduler knows
    sched.add(seq_of(list(range(100, 108))))              # needs 2 blocks, 1 is free
    with pytest.raises(RuntimeError, match="no sequence fits"):
        sched.schedule()
    sched.block_manager.free(rogue)
    run_all(sched)


# ---- budget, chunked prefill, mixed steps ------------------------------------------

def test_chunked_prefill_respects_the_budget_and_max_num_seqs(make_sched):
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=8)
    a, b, c = seq_of(list(range(20)), 3), seq_of(list(range(30, 35)), 3), seq_of([40, 41, 42], 3)
    for s in (a, b, c):
        sched.add(s)
    A, B, C = a.seq_id, b.seq_id, c.seq_id
    assert run_all(sched) == [
        [(A, 8)],              # A's prompt in chunks of the budget
        [(A, 8)],
        [(A, 4), (B, 4)],      # A's last chunk, and B starts in the same step
        [(A, 1), (B, 1)],      # A decodes while B finishes its prompt; C waits (max_num_seqs=2)
        [(A, 1), (B, 1)],      # A's 3rd token: finished
        [(B, 1), (C, 3)],      # B decodes and C is prefilled in one step
        [(C, 1)],
        [(C, 1)],
    ]
    for s in (a, b, c):
        assert s.completion_token_ids == reference_completion(s.prompt_token_ids, 3)
        assert s.finish_reason == "length"


def test_running_decodes_come_first_and_can_fill_the_budget(make_sched):
    sched = make_sched(max_num_batched_tokens=2)
    a, b, c = seq_of([1, 2], 3), seq_of([3, 4], 3), seq_of([5, 6], 1)
    for s in (a, b, c):
        sched.add(s)
    A, B, C = a.seq_id, b.seq_id, c.seq_id
    assert run_all(sched) == [
        [(A, 2)],
        [(A, 1), (B, 1)],          # a decode and the first token of B's prompt
        [(A, 1), (B, 1)],          # budget full: C waits
        [(B, 1), (C, 1)],          # A finished
        [(B, 1), (C, 1)],
    ]


def test_prefill_chunks_stop_mid_block(make_sched):
    sched = make_sched(max_num_batched_tokens=3)
    a = seq_of(list(range(10)), 1)
    sched.add(a)
    model = FakeModel()
    assert step(sched, model) == [(a.seq_id, 3)]
    assert a.block_table == [0] and a.num_computed_tokens == 3 and a.num_tokens == 10
    assert step(sched, model) == [(a.seq_id, 3)]
    assert a.block_table == [0, 1] and a.num_computed_tokens == 6
    assert sched.block_manager.blocks[0].hash != -1    # block 0 became full: cached mid-prefill
    run_all(sched, model)
    assert a.completion_token_ids == reference_completion(list(range(10)), 1)


# ---- prefix caching through the scheduler ----------------------------------------------

def test_cached_prefix_is_skipped_and_costs_no_budget(make_sched):
    sched = make_sched(max_num_batched_tokens=4)
    model = FakeModel()
    first = seq_of(list(range(10)), 1)
    sched.add(first)
    run_all(sched, model)
    again = seq_of(list(range(8)) + [50, 51, 52], 2)   # 8 cached tokens + 3 new
    other = seq_of([60, 61, 62], 2)
    sched.add(again)
    sched.add(other)
    assert step(sched, model) == [(again.seq_id, 3), (other.seq_id, 1)]
    assert again.num_cached_tokens == 8 and again.block_table[:2] == [0, 1]
    assert other.num_cached_tokens == 0
    run_all(sched, model)
    assert again.completion_token_ids == reference_completion(again.prompt_token_ids, 2)
    assert sched.block_manager.num_prefix_hit_tokens == 8


# ---- preemption ------------------------------------------------------------------------

def test_newest_running_is_preempted_to_the_front_of_waiting(make_sched):
    sched = make_sched(num_blocks=6)
    model = FakeModel()
    a, b, c = (seq_of(list(range(k, k + 8)), 3) for k in (0, 100, 200))
    for s in (a, b, c):
        sched.add(s)
    step(sched, model)                          # 3 prompts of 2 full blocks: the cache is full
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [2, 3], [4, 5]]
    d = seq_of([300, 301], 2)
    sched.add(d)
    plan = step(sched, model)                   # a and b need a 3rd block each: c goes
    assert plan == [(a.seq_id, 1), (b.seq_id, 1)]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [c, d]        # front of the queue, before the newer d
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert a.block_table == [0, 1, 5] and b.block_table == [2, 3, 4]   # c's blocks, tail first
    run_all(sched, model)
    for s in (a, b, c, d):
        assert s.completion_token_ids == reference_completion(s.prompt_token_ids, s.sampling_params.max_tokens)


def test_newest_sequence_preempts_itself_not_an_older_one(make_sched):
    sched = make_sched(num_blocks=5)
    model = FakeModel()
    a, b = seq_of(list(range(8)), 3), seq_of(list(range(100, 108)), 3)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    assert step(sched, model) == [(a.seq_id, 1)]   # a took the last block; b had none left
    assert list(sched.waiting) == [b] and sched.running == [a]
    run_all(sched, model)
    for s in (a, b):
        assert s.completion_token_ids == reference_completion(s.prompt_token_ids, 3)


def test_preempted_sequence_resumes_through_its_cached_prefix(make_sched):
    sched = make_sched(num_blocks=7)
    model = FakeModel()
    a, b = seq_of(list(range(11)), 6), seq_of(list(range(100, 111)), 6)
    sched.add(a)
    sched.add(b)
    run_all(sched, model)
    assert sched.num_preemptions >= 1
    assert sched.block_manager.num_prefix_hit_tokens > 0   # its earlier blocks were found again
    assert b.num_cached_tokens == 0     # but the first admission found nothing: that is what it reports
    for s in (a, b):
        assert s.completion_token_ids == reference_completion(s.prompt_token_ids, 6)


@pytest.mark.parametrize("num_blocks,budget,max_num_seqs,caching", [
    (64, 64, 8, True),     # no pressure
    (64, 5, 3, True),      # chunked prefill
    (9, 64, 8, True),      # preemption
    (9, 6, 4, True),       # both
    (9, 6, 4, False),      # both, without prefix caching
])
def test_final_tokens_do_not_depend_on_scheduling(make_sched, num_blocks, budget, max_num_seqs, caching):
    sched = make_sched(num_blocks, max_num_seqs, budget, caching)
    seqs = [seq_of(p, max_tokens=3 + i % 5) for i, p in enumerate(prompts_with_shared_prefixes(10))]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    for s in seqs:
        assert s.completion_token_ids == reference_completion(s.prompt_token_ids, s.sampling_params.max_tokens)
        assert s.is_finished
    if num_blocks < 64:
        assert sched.num_preemptions > 0


# ---- postprocess, finish and abort --------------------------------------------------------

def test_postprocess_appends_tokens_and_frees_finished(make_sched):
    sched = make_sched(max_num_batched_tokens=8)
    a, b = seq_of([1, 2, 3]), seq_of(list(range(10, 22)))
    sched.add(a)
    sched.add(b)
    seqs = sched.schedule()
    assert [(s.seq_id, s.num_scheduled_tokens) for s in seqs] == [(a.seq_id, 3), (b.seq_id, 5)]
    finished = sched.postprocess(seqs, [7, None], lambda s: "stop" if s.last_token == 7 else None)
    assert finished == [a]
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == "stop"
    assert a.token_ids == [1, 2, 3, 7] and a.block_table == []
    assert b.token_ids == list(range(10, 22)) and b.num_computed_tokens == 5 and b.num_scheduled_tokens == 0
    assert sched.running == [b]
    assert sched.block_manager.blocks[b.block_table[0]].hash != -1   # b's full, computed block is cached
    sched.finish(b, "abort")


def test_stop_checker_sees_each_new_token(make_sched):
    sched = make_sched()
    seen = []

    def check(seq):
        seen.append(seq.last_token)
        return "stop" if len(seen) == 3 else None
    a = seq_of([1, 2, 3], max_tokens=10)
    sched.add(a)
    run_all(sched, check_stop=check)
    assert a.completion_token_ids == seen == reference_completion([1, 2, 3], 3)
    assert a.finish_reason == "stop"


def test_abort_frees_running_and_waiting_sequences(make_sched):
    sched = make_sched(max_num_seqs=1)
    model = FakeModel()
    a, b = seq_of(list(range(9))), seq_of([5, 6])
    sched.add(a)
    sched.add(b)
    step(sched, model)
    assert a.status == SequenceStatus.RUNNING and len(a.block_table) == 3
    sched.finish(a, "abort")
    assert a.finish_reason == "abort" and a.block_table == [] and sched.running == []
    sched.finish(b, "abort")
    assert b.is_finished and list(sched.waiting) == []


def test_abort_a_preempted_sequence(make_sched):
    sched = make_sched(num_blocks=4)
    model = FakeModel()
    a, b = seq_of(list(range(8)), 3), seq_of(list(range(100, 108)), 3)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    step(sched, model)
    assert list(sched.waiting) == [b] and b.block_table == []
    sched.finish(b, "abort")
    run_all(sched, model)
    assert a.completion_token_ids == reference_completion(a.prompt_token_ids, 3)


# ---- multi-step decode rounds ------------------------------------------------------------

def decoding_pair(sched: Scheduler, model: FakeModel) -> tuple[Sequence, Sequence]:
    """Two sequences of 7 tokens (2 blocks each), both past their prompt and decoding."""
    a, b = seq_of(list(range(6)), 5), seq_of(list(range(100, 106)), 5)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    assert sched.schedule() == [a, b]
    return a, b


def test_extend_decode_is_all_or_nothing(make_sched):
    sched = make_sched(num_blocks=5)
    a, b = decoding_pair(sched, FakeModel())
    assert [a.block_table, b.block_table] == [[0, 1], [2, 3]]
    # 4 steps: tokens 6..9 -> both need a 3rd block, only one is free
    assert sched.extend_decode([a, b], 4, max_model_len=64) == 1
    assert [a.block_table, b.block_table] == [[0, 1], [2, 3]]   # nobody kept a block
    assert sched.extend_decode([a, b], 2, max_model_len=64) == 2  # tokens 6, 7: no new block
    for s in (a, b):
        sched.finish(s, "abort")


def test_extend_decode_allocates_every_step_and_respects_max_model_len(make_sched):
    sched = make_sched(num_blocks=8)
    a, b = decoding_pair(sched, FakeModel())
    assert sched.extend_decode([a, b], 8, max_model_len=10) == 4    # 7 tokens + 4 steps - 1 = max_model_len
    assert [len(a.block_table), len(b.block_table)] == [3, 3]       # slots for positions 6..9
    sched.add(seq_of([1, 2]))
    assert sched.extend_decode([a, b], 8, max_model_len=64) == 1    # someone waits: plain steps
    sched.finish(sched.waiting[0], "abort")
    for s in (a, b):
        sched.finish(s, "abort")


def test_a_full_batch_runs_rounds_while_others_wait(make_sched):
    """At max_num_seqs nobody waiting can join before a running sequence ends: rounds go on."""
    sched = make_sched(num_blocks=16, max_num_seqs=2)
    a, b = decoding_pair(sched, FakeModel())
    sched.add(seq_of([1, 2]))
    assert not sched.can_admit()
    assert sched.can_admit(num_leaving=1)  # one of them ends with a token not seen yet
    assert sched.extend_decode([a, b], 4, max_model_len=64) == 4
    sched.finish(a, "abort")  # a slot opens: the waiting sequence could join, plain steps again
    assert sched.can_admit()
    assert sched.extend_decode([b], 4, max_model_len=64) == 1
    for s in (b, sched.waiting[0]):
        sched.finish(s, "abort")


def test_extend_decode_after_pending_tokens(make_sched):
    """A round chained onto a running one starts one token later (async scheduling)."""
    sched = make_sched(num_blocks=8)
    a, b = decoding_pair(sched, FakeModel())  # 7 tokens, token 6 not computed yet
    # pending token 7 (position 7), then steps at positions 7..9: max_model_len 10 allows 3
    assert sched.extend_decode([a, b], 8, max_model_len=10, num_pending=1) == 3
    assert [len(a.block_table), len(b.block_table)] == [3, 3]  # 6 computed + 1 pending + 3 steps
    for s in (a, b):
        s.num_scheduled_tokens = 1
    inputs = build_step_inputs([a, b], BLOCK_SIZE, num_pending=1)
    assert inputs.positions.tolist() == [7, 7] and inputs.seq_lens_k.tolist() == [8, 8]
    assert inputs.input_ids.tolist() == [0, 0]  # filled in on the device
    assert inputs.slot_mapping.tolist() == [a.block_table[1] * BLOCK_SIZE + 3, b.block_table[1] * BLOCK_SIZE + 3]
    assert inputs.sampling == [0, 1]
    for s in (a, b):
        sched.finish(s, "abort")
