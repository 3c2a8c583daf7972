"""HF parity: tiny random models of every family, fp32 on CPU.

- Greedy ids equal HF's over GEN_LEN new tokens for a batch of prompts of
  different lengths, in four engine modes: plain, prefix-cache hits, chunked
  prefill (a 16-token budget) and preemption (a tiny KV cache).
- Near ties: where our greedy ids and HF's differ, we apply vLLM's
  `check_logprobs_close` rule: the ids before the first divergence must match,
  and at the divergence each side's token must be in the other side's top-5
  (`TOP_LOGPROBS`; our side's logprobs come from the same engine, in the same
  mode); nothing after it is compared, since the two contexts differ. vLLM's
  rule is made for bf16 on GPUs; in fp32 our logprobs differ from HF's by
  ~1e-5, so a divergence can only come from a real tie, and top-5 membership
  alone would excuse a bug that moves a logit by less than the gap to the 5th
  token. We therefore also require HF's logprobs of the two tokens to differ by
  at most NEAR_TIE_GAP. The teacher-forced logprob tests below still compare
  every position.
- Teacher-forced logprobs: HF and our model see the same token sequences; the
  full log-softmax rows agree within LOGPROB_ATOL (fp32), whether the sequence
  is computed in one step, in chunks, or over a prefix taken from the cache.
- EOS: every id in config.json and generation_config.json ends a sequence
  unless ignore_eos.
- RoPE scaling: `compute_inv_freq` equals transformers' ROPE_INIT_FUNCTIONS.

One LLM per (family, mode) is built lazily and shared by the whole module;
after every test each of them must have every KV block free.
"""
import copy
import json
import math
import os
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention
from nanovllm.layers.rotary_embedding import compute_inv_freq
from nanovllm.model_config import ModelConfig
from nanovllm.utils.context import set_context
from tiny_models import TINY, hf_greedy, random_prompts

GEN_LEN = 32
# lengths around the 16-token block size: a 1-token prompt, exact blocks, block + 1
PROMPT_LENS = [1, 5, 16, 17, 23, 32, 40, 57]
TOP_LOGPROBS = 5          # vLLM's check_logprobs_close uses the top-5 of each side
LOGPROB_ATOL = 1e-4       # fp32: measured max |diff| is 3e-6 .. 2e-5 on these models
NEAR_TIE_GAP = 10 * LOGPROB_ATOL  # two tokens closer than this may swap by rounding alone
MIN_DISTINCT = 6          # a reference continuation that tests something is varied
NUM_BLOCKS = 256          # plenty for 8 prompts of <= 57 + 32 tokens at max_model_len 1024
TINY_BUDGET = 16          # forces chunked prefill: every prompt above 16 tokens is split
PREEMPT_MAX_MODEL_LEN = 128
PREEMPT_NUM_BLOCKS = 10   # 8 blocks hold one 128-token sequence; the batch needs ~40

MODES = {
    "plain": dict(num_kvcache_blocks=NUM_BLOCKS),
    "nocache": dict(num_kvcache_blocks=NUM_BLOCKS, enable_prefix_caching=False),
    "chunked": dict(num_kvcache_blocks=NUM_BLOCKS, max_num_batched_tokens=TINY_BUDGET),
    "preempt": dict(num_kvcache_blocks=PREEMPT_NUM_BLOCKS, max_model_len=PREEMPT_MAX_MODEL_LEN),
}
GREEDY = SamplingParams(temperature=0, max_tokens=GEN_LEN, ignore_eos=True)


# ---- fixtures ------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_model):
    """engines(family, mode) -> LLM, built once per module."""
    built = {}

    def get(family: str, mode: str) -> LLM:
        if (family, mode) not in built:
            path, _ = tiny_model(family)
            built[family, mode] = LLM(path, dtype="float32", skip_tokenizer_init=True, **MODES[mode])
        return built[family, mode]
    get.built = built
    return get


@pytest.fixture(autouse=True)
def no_block_leaked(request):
    """After every test, every engine built so far has every block free and nothing queued."""
    yield
    if "engines" not in request.fixturenames:
        return
    for (family, mode), llm in request.getfixturevalue("engines").built.items():
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests(), (family, mode)
        bm = engine.block_manager
        assert [b.block_id for b in bm.blocks if b.ref_count] == [], (family, mode)
        assert bm.num_free_blocks == bm.num_blocks, (family, mode)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """reference(family, prompt) -> HF's greedy continuation of GEN_LEN tokens (memoized)."""
    cache = {}

    def get(family: str, prompt: list[int]) -> list[int]:
        key = family, tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(tiny_model(family)[1], prompt, GEN_LEN)
        return cache[key]
    return get


# ---- helpers -------------------------------------------------------------------

@torch.inference_mode()
def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax rows for every position of `token_ids`.  # [len, vocab]"""
    return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@torch.inference_mode()
def engine_logprobs(llm: LLM, sequences: list[list[int]], chunk: int) -> list[tuple[int, torch.Tensor]]:
    """Teacher-forced log-softmax rows from our model, all sequences batched in each step.

    Each step computes up to `chunk` more tokens of every sequence through the
    engine's ModelRunner (the paged KV cache, the same kernels as generate).
    Returns, per sequence, (num_cached, rows [len - num_cached, vocab]): positions
    taken from the prefix cache have no rows.
    """
    engine = llm.llm_engine
    bm, runner = engine.block_manager, engine.model_runner
    seqs = [Sequence(t, GREEDY, engine.config.kvcache_block_size) for t in sequences]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    try:
        while active := [s for s in seqs if s.num_uncomputed_tokens]:
            for s in active:
                cached = 0 if s.block_table else len(bm.find_cached_blocks(s)) * bm.block_size
                s.num_scheduled_tokens = min(chunk, s.num_uncomputed_tokens - cached)
                assert bm.allocate_slots(s, s.num_scheduled_tokens)
            input_ids, positions, context, _ = runner.prepare(active)
            context = replace(context, logits_indices=torch.arange(len(input_ids)))
            with set_context(context):
                logits = runner.model.compute_logits(runner.model(input_ids, positions))
            for s, part in zip(active, logits.float().log_softmax(-1).split(
                    [s.num_scheduled_tokens for s in active])):
                rows[seqs.index(s)].append(part)
                s.num_computed_tokens += s.num_scheduled_tokens
                s.num_scheduled_tokens = 0
                bm.cache_full_blocks(s)
    finally:
        for s in seqs:
            bm.free(s)
    return [(s.num_cached_tokens, torch.cat(r)) for s, r in zip(seqs, rows)]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [o.outputs[0].token_ids for o in outs]


def near_tie_error(hf_row: torch.Tensor, our_row: torch.Tensor, our_token: int, hf_token: int) -> str | None:
    """Why a divergence (ours picked `our_token`, HF `hf_token`) is not a near tie; None if it is.

    hf_row, our_row: [vocab] logprobs of the two models after the same context.
    """
    hf_top = hf_row.topk(TOP_LOGPROBS).indices.tolist()
    our_top = our_row.topk(TOP_LOGPROBS).indices.tolist()
    if our_token not in hf_top or hf_token not in our_top:
        return f"ours {our_token} (HF top-5 {hf_top}), HF {hf_token} (our top-5 {our_top})"
    gap = (hf_row[hf_token] - hf_row[our_token]).item()
    if gap > NEAR_TIE_GAP:
        return f"HF prefers {hf_token} over our {our_token} by {gap:.2e} > {NEAR_TIE_GAP:.0e}"
    return None


def assert_greedy_close(hf, llm: LLM, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    """Equal ids, or a near tie at the first divergence (see the module docstring)."""
    assert len(set(ref)) >= MIN_DISTINCT, "the reference continuation is too repetitive to test anything"
    assert len(ours) == len(ref) == GEN_LEN
    if ours == ref:
        return
    i = next(k for k in range(GEN_LEN) if ours[k] != ref[k])
    context = prompt + ref[:i]
    (_, our_rows), = engine_logprobs(llm, [context], chunk=llm.llm_engine.config.max_num_batched_tokens)
    error = near_tie_error(hf_logprobs(hf, context)[-1], our_rows[-1], ours[i], ref[i])
    assert error is None, f"greedy ids diverge at new token {i}: {error}"


def check_batch(family, tiny_model, reference, llm, prompts) -> None:
    hf = tiny_model(family)[1]
    for prompt, ours in zip(prompts, generate(llm, prompts)):
        assert_greedy_close(hf, llm, prompt, ours, reference(family, prompt))


# ---- greedy parity in four modes ---------------------------------------------------

def test_greedy_matches_hf(family, tiny_model, engines, reference):
    llm = engines(family, "plain")
    check_batch(family, tiny_model, reference, llm, random_prompts(PROMPT_LENS, seed=1))


def test_layers_share_one_rope_table(family, engines):
    """Every layer rotates by one cos/sin table (one copy in memory, one lookup a step on the
    CPU); the greedy test above checks the rotation itself against HF."""
    model = engines(family, "plain").llm_engine.model_runner.model
    tables = {layer.self_attn.rotary_emb.cos_sin_cache.data_ptr() for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1


def test_greedy_matches_hf_with_chunked_prefill(family, tiny_model, engines, reference, monkeypatch):
    llm = engines(family, "chunked")
    scheduler = llm.llm_engine.scheduler
    steps = []   # per step: [(num_scheduled_tokens, is a decode)]

    def recording_schedule(schedule=scheduler.schedule):
        seqs = schedule()
        steps.append([(s.num_scheduled_tokens, s.num_completion_tokens > 0) for s in seqs])
        return seqs
    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    check_batch(family, tiny_model, reference, llm, random_prompts(PROMPT_LENS, seed=1))
    assert all(sum(n for n, _ in step) <= TINY_BUDGET for step in steps)
    assert any(n > 1 for step in steps for n, decode in step if not decode), "no prefill chunk"
    assert any(decode for step in steps for _, decode in step), "no decode"
    mixed = [step for step in steps if any(d for _, d in step) and any(not d for _, d in step)]
    assert mixed, "no step mixed decodes with a prefill chunk"


def test_greedy_matches_hf_with_preemption(family, tiny_model, engines, reference):
    llm = engines(family, "preempt")
    before = llm.llm_engine.scheduler.num_preemptions
    prompts = random_prompts(PROMPT_LENS, seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > before
    hf = tiny_model(family)[1]
    for prompt, out in zip(prompts, outs):
        assert_greedy_close(hf, llm, prompt, out.outputs[0].token_ids, reference(family, prompt))
    # no prompt shares a block with another: nothing was served from the cache at admission,
    # whatever the recomputation after a preemption found there (vLLM counts the first admission)
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)


def test_greedy_matches_hf_with_a_poisoned_kv_cache(family, tiny_model, engines, reference):
    """Slots a sequence does not own (the rest of its last block, other blocks) may hold
    anything, NaN included (the cache is allocated with torch.empty): they must not count.
    The module's engine without prefix caching (no block's content is ever reused, so the
    poison cannot be read as a cached prefix), left poisoned for the later tests that use it."""
    llm = engines(family, "nocache")
    for module in llm.llm_engine.model_runner.model.modules():
        if isinstance(module, Attention):
            module.k_cache.fill_(math.nan)
            module.v_cache.fill_(math.nan)
    check_batch(family, tiny_model, reference, llm, random_prompts(PROMPT_LENS, seed=1))


def test_greedy_matches_hf_with_prefix_cache_hits(family, tiny_model, engines, reference):
    llm = engines(family, "plain")
    bm = llm.llm_engine.block_manager
    bs = bm.block_size
    first = random_prompts([48, 40, 33, 20], seed=2)
    generate(llm, first)
    # each new prompt shares `k` leading tokens with one of the first ones, then differs
    shared = [(0, 48), (0, 32), (1, 17), (2, 33), (3, 20), (0, 5), (1, 40), (2, 16)]
    tails = random_prompts([7, 9, 1, 4, 12, 30, 3, 2], seed=3)
    prompts = [first[j][:k] + tail for (j, k), tail in zip(shared, tails)]
    expected = [min(k // bs, (len(p) - 1) // bs) * bs for (_, k), p in zip(shared, prompts)]
    assert sum(expected) >= 5 * bs  # the test exercises real hits
    hits_before = bm.num_prefix_hit_tokens
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == expected
    assert bm.num_prefix_hit_tokens - hits_before == sum(expected)
    for prompt, out in zip(prompts, outs):
        assert_greedy_close(tiny_model(family)[1], llm, prompt, out.outputs[0].token_ids,
                            reference(family, prompt))


def test_repeated_prompts_hit_the_cache_and_match_hf(family, tiny_model, engines, reference):
    llm = engines(family, "plain")
    prompts = random_prompts([33, 47], seed=4)
    generate(llm, prompts)
    outs = llm.generate(prompts + prompts, GREEDY, use_tqdm=False)
    bs = llm.llm_engine.block_manager.block_size
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // bs * bs for p in prompts + prompts]
    for prompt, out in zip(prompts + prompts, outs):
        assert out.outputs[0].token_ids == reference(family, prompt)


def test_near_tie_rule():
    hf_row = torch.tensor([-0.5, -0.50005, -2.0, -3.0, -4.0, -5.0, -9.0]).log_softmax(-1)
    our_row = torch.tensor([-0.50005, -0.5, -2.0, -3.0, -4.0, -5.0, -9.0]).log_softmax(-1)
    assert near_tie_error(hf_row, our_row, our_token=1, hf_token=0) is None
    assert "by 1.50e+00" in near_tie_error(hf_row, hf_row, our_token=2, hf_token=0)   # in top-5, no tie
    assert "HF top-5" in near_tie_error(hf_row, hf_row, our_token=6, hf_token=0)      # not in top-5
    assert "our top-5" in near_tie_error(hf_row, -hf_row, our_token=1, hf_token=0)


def test_a_real_divergence_fails_the_comparison(tiny_model, engines, reference):
    family, i = "qwen3", 10
    prompt = random_prompts([9], seed=9)[0]
    ref = reference(family, prompt)
    hf = tiny_model(family)[1]
    ranked = hf_logprobs(hf, prompt + ref[:i])[-1].sort(descending=True)
    assert ranked.indices[0] == ref[i] and ranked.values[0] - ranked.values[1] > NEAR_TIE_GAP
    second_best = ref[:i] + [int(ranked.indices[1])] + ref[i + 1:]
    with pytest.raises(AssertionError, match=f"diverge at new token {i}"):
        assert_greedy_close(hf, engines(family, "plain"), prompt, second_best, ref)


# ---- teacher-forced logprobs ---------------------------------------------------------

@pytest.mark.parametrize("chunk", [1024, 5])
def test_teacher_forced_logprobs_match_hf(family, tiny_model, engines, chunk):
    """All positions of several sequences, in one step or in 5-token chunks (crossing blocks)."""
    hf = tiny_model(family)[1]
    sequences = random_prompts([3, 16, 29, 70, 300], seed=5)  # 300: past the rope scalings' original lengths
    results = engine_logprobs(engines(family, "nocache"), sequences, chunk)
    for tokens, (num_cached, rows) in zip(sequences, results):
        assert num_cached == 0
        diff = (rows - hf_logprobs(hf, tokens)).abs().max().item()
        assert diff < LOGPROB_ATOL, f"max |logprob diff| {diff:.2e} for a {len(tokens)}-token sequence"


def test_teacher_forced_logprobs_over_a_cached_prefix(family, tiny_model, engines):
    """The second sequence reads 32 cached tokens written by the first one."""
    hf = tiny_model(family)[1]
    base = random_prompts([40], seed=6)[0]
    other = base[:35] + random_prompts([20], seed=7)[0]
    llm = engines(family, "plain")
    engine_logprobs(llm, [base], chunk=1024)
    (num_cached, rows), = engine_logprobs(llm, [other], chunk=7)
    assert num_cached == 32
    diff = (rows - hf_logprobs(hf, other)[num_cached:]).abs().max().item()
    assert diff < LOGPROB_ATOL, f"max |logprob diff| {diff:.2e}"


# ---- EOS ids ------------------------------------------------------------------------------

def first_stop(ref: list[int], eos: set[int]) -> int | None:
    return next((i for i, t in enumerate(ref) if t in eos), None)


def pick_eos_ids(refs: list[list[int]], want: int) -> list[int]:
    """`want` token ids such that each one is the first EOS hit of at least one continuation."""
    for start in range(GEN_LEN - 1):
        chosen = []
        for ref in refs:
            t = ref[start]
            if t not in chosen and len(chosen) < want:
                chosen.append(t)
        stops = {ref[i] for ref in refs if (i := first_stop(ref, set(chosen))) is not None}
        if len(chosen) == want and stops == set(chosen):
            return chosen
    raise AssertionError("no EOS ids end the continuations in the way this test needs")


@pytest.mark.parametrize("eos_family", ["qwen3", "llama"])
def test_every_eos_id_ends_a_sequence(eos_family, tiny_model, reference, tmp_path):
    """config.json's EOS ids and generation_config.json's extra ones all stop, unless ignore_eos."""
    src, _ = tiny_model(eos_family)
    prompts = random_prompts([4, 9, 15, 21, 26, 33, 38, 44], seed=8)
    refs = [reference(eos_family, p) for p in prompts]
    config_eos, generation_eos = (ids := pick_eos_ids(refs, 3))[:2], ids[1:]
    path = str(tmp_path / "model")
    shutil.copytree(src, path)
    rewrite_json(os.path.join(path, "config.json"), eos_token_id=config_eos)
    rewrite_json(os.path.join(path, "generation_config.json"), eos_token_id=generation_eos)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=NUM_BLOCKS)

    outs = llm.generate(prompts, replace(GREEDY, ignore_eos=False), use_tqdm=False)
    stopped_by = set()
    for ref, out in zip(refs, outs):
        i = first_stop(ref, set(ids))
        completion = out.outputs[0]
        if i is None:
            assert (completion.token_ids, completion.finish_reason) == (ref, "length")
        else:
            assert (completion.token_ids, completion.finish_reason) == (ref[:i + 1], "stop")
            stopped_by.add(ref[i])
    assert stopped_by == set(ids)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == [(r, "length") for r in refs]
    assert llm.llm_engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_tiny_qwen3_has_two_eos_ids(tiny_model):
    llm_config = ModelConfig.from_hf(read_json(os.path.join(tiny_model("qwen3")[0], "config.json")))
    assert llm_config.eos_token_ids == (1, 2)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def rewrite_json(path: str, **updates) -> None:
    data = read_json(path) if os.path.exists(path) else {}
    with open(path, "w") as f:
        json.dump({**data, **updates}, f)


# ---- RoPE scaling against transformers ----------------------------------------------------

ROPE_CASES = [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "linear", "factor": 8.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
     "attention_factor": 1.3, "truncate": False},
]


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0), (32, 1e6)])
@pytest.mark.parametrize("scaling", ROPE_CASES, ids=lambda s: s["rope_type"])
def test_rope_inv_freq_matches_transformers(scaling, head_dim, theta):
    hf_config = LlamaConfig(**{**TINY, "num_attention_heads": 2, "head_dim": head_dim,
                               "hidden_size": 2 * head_dim, "max_position_embeddings": 131072},
                            rope_parameters={"rope_theta": theta, **scaling})
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = ModelConfig.from_hf(hf_config.to_dict())   # the path a config.json takes
    inv_freq, factor = compute_inv_freq(head_dim, ours.rope_theta, ours.rope_scaling,
                                        ours.max_position_embeddings)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-6)


def test_legacy_rope_scaling_fields_are_read():
    """Old config.json files: `rope_scaling` with "type", and `rope_theta` at the top level."""
    legacy = {**TINY, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
              "rope_scaling": {"type": "linear", "factor": 4.0}}
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    inv_freq, _ = compute_inv_freq(16, cfg.rope_theta, cfg.rope_scaling, 1024)
    plain, _ = compute_inv_freq(16, cfg.rope_theta, None, 1024)
    torch.testing.assert_close(inv_freq, plain / 4.0)


def test_yarn_without_original_length_scales_from_max_position_embeddings():
    """transformers fills original_max_position_embeddings from the config; so must we, not
    from the engine's max_model_len (the RoPE table length)."""
    raw = {**TINY, "architectures": ["LlamaForCausalLM"], "num_attention_heads": 2, "head_dim": 32,
           "max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    hf_config = LlamaConfig(**copy.deepcopy(raw))  # transformers fills in the dict it is given
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    cfg = ModelConfig.from_hf(raw)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    inv_freq, factor = compute_inv_freq(32, cfg.rope_theta, cfg.rope_scaling, 64)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor)
