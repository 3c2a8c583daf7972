"""Sampling: SamplingParams validation, each sampler transform against an independent
reference (HF's logits processors where they exist), sampled distributions, seeds,
logprobs against HF's log_softmax, and n > 1 sharing the prompt's KV blocks."""
import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper)

from nanovllm import LLM, RequestOutput, SamplingParams
from nanovllm.engine.sampling_metadata import SamplingMetadata
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import (TOP_P_CANDIDATES, Sampler, apply_logit_bias, apply_min_p, apply_penalties,
                                     apply_top_k, apply_top_p, inverse_cdf, top_p_by_sort)
from nanovllm.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS
from tiny_models import random_prompts

VOCAB = 50
# The sampler tests also run on a GPU when there is one (the GPU suite runs this file).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NUM_DRAWS = 20_000
# With N draws a frequency's standard deviation is at most sqrt(0.25 / N) = 0.0035;
# 0.015 is over 4 of them, so a correct sampler fails this bound about once in 10^4 runs.
FREQ_TOLERANCE = 0.015


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _seq(prompt, output=(), **params) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


# ---- SamplingParams ------------------------------------------------------------

def test_token_options_are_copied_at_construction():
    """Validation holds only for what was validated: editing the caller's dict or list later
    (an id past the vocabulary would be an out-of-bounds index in the sampler) changes nothing."""
    bias, allowed = {3: 1.0}, [3, 4]
    params = SamplingParams(logit_bias=bias, allowed_token_ids=allowed)
    bias[10 ** 9], allowed[0] = 1e9, -1
    assert params.logit_bias == {3: 1.0} and params.allowed_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(min_p=1.2), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(n=0), "n"),
    (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token id"), (dict(logit_bias={5: 100.5}), "logit_bias values"),
    (dict(logit_bias={5: float("nan")}), "logit_bias value"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"), (dict(allowed_token_ids=5), "allowed_token_ids"),
])
def test_out_of_range_values_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_top_p_message_names_the_value():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_defaults_and_normalization_follow_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1, 1.0, 1.0, 0, 0.0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


# ---- transforms against HF's logits processors ------------------------------------

def test_top_k_matches_hf_per_row():
    logits = _logits(4)
    ks = [1, 3, 17, VOCAB]  # VOCAB: off
    ours = apply_top_k(logits, torch.tensor(ks), max_top_k=17)
    for row, k in enumerate(ks):
        ref = TopKLogitsWarper(k)(None, logits[row:row + 1].clone())
        assert torch.equal(ours[row:row + 1], ref)


def test_top_p_matches_hf_per_row():
    logits = _logits(4)
    ps = [0.05, 0.5, 0.9, 1.0]
    ours = apply_top_p(logits, torch.tensor(ps))
    for row, p in enumerate(ps):
        ref = TopPLogitsWarper(p)(None, logits[row:row + 1].clone())
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref[0]))
        kept = ~torch.isinf(ref[0])
        torch.testing.assert_close(ours[row][kept], ref[0][kept])


def test_min_p_matches_hf_per_row():
    logits = _logits(3)
    mps = [0.0, 0.1, 0.6]
    ours = apply_min_p(logits, torch.tensor(mps))
    for row, mp in enumerate(mps):
        ref = MinPLogitsWarper(mp)(None, logits[row:row + 1].clone()) if mp > 0 else logits[row:row + 1]
        assert torch.equal(ours[row:row + 1], ref)


def test_penalties_match_hf_and_the_openai_formula():
    prompts = [[3, 4, 5, 5], [7, 8], [1, 2, 3]]
    outputs = [[5, 9, 9, 10], [8, 8, 8], []]
    params = [dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
              dict(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.0),
              dict()]  # no penalties: row unchanged
    seqs = [_seq(p, o, **kw) for p, o, kw in zip(prompts, outputs, params)]
    logits = _logits(3)
    metadata = SamplingMetadata.build(seqs, VOCAB, torch.device("cpu"))
    ours = apply_penalties(logits, metadata)
    for row, (prompt, output, kw) in enumerate(zip(prompts, outputs, params)):
        ids = torch.tensor([prompt + output])
        ref = RepetitionPenaltyLogitsProcessor(kw.get("repetition_penalty", 1.0))(ids, logits[row:row + 1].clone())[0]
        for token in set(output):  # OpenAI: logit -= count * frequency + (count > 0) * presence
            ref[token] -= output.count(token) * kw["frequency_penalty"] + kw["presence_penalty"]
        torch.testing.assert_close(ours[row], ref)


def test_min_tokens_bans_stop_tokens_until_reached():
    params = dict(min_tokens=3, stop_token_ids=[7], temperature=0)
    seqs = [_seq([1, 2], [4, 4], **params), _seq([1, 2], [4, 4, 4], **params)]
    for seq in seqs:
        seq.sampling_params.set_eos_token_ids({9})
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = logits[:, 9] = 10.0  # the stop tokens are the most likely
    out = Sampler()(logits, SamplingMetadata.build(seqs, VOCAB, torch.device("cpu")))
    assert out.token_ids[0].item() not in (7, 9)  # 2 of 3 tokens so far: banned
    assert out.token_ids[1].item() in (7, 9)      # 3 tokens: allowed again


# ---- distributions and seeds ------------------------------------------------------------

def _reference_probs(logits: torch.Tensor, temperature: float, min_p: float, top_k: int, top_p: float):
    """The filtered softmax, computed in float64 by a different route than the sampler's."""
    z = logits.double() / temperature
    probs = torch.softmax(z, -1)
    keep = probs >= min_p * probs.max()
    keep &= z >= torch.sort(z, descending=True).values[min(top_k, len(z)) - 1]
    p = torch.where(keep, probs, 0.0)
    p /= p.sum()
    order = torch.argsort(p, descending=True)
    before = torch.cumsum(p[order], 0) - p[order]  # mass of the more likely tokens
    keep_sorted = before < top_p
    final = torch.zeros_like(p)
    final[order[keep_sorted]] = p[order[keep_sorted]]
    return final / final.sum()


def _draw_frequencies(logits: torch.Tensor, params: SamplingParams, device: str) -> torch.Tensor:
    """logits: [vocab] -> the frequency of each token over NUM_DRAWS rows drawn with `params`."""
    vocab = logits.shape[0]
    seqs = [Sequence([1], params) for _ in range(NUM_DRAWS)]
    metadata = SamplingMetadata.build(seqs, vocab, torch.device(device))
    tokens = Sampler()(logits.expand(NUM_DRAWS, vocab).to(device), metadata).token_ids.cpu()
    return torch.bincount(tokens, minlength=vocab).double() / NUM_DRAWS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", [
    dict(temperature=1.0, min_p=0.0, top_k=VOCAB, top_p=1.0),
    dict(temperature=0.7, min_p=0.0, top_k=6, top_p=1.0),
    dict(temperature=1.3, min_p=0.0, top_k=VOCAB, top_p=0.6),
    dict(temperature=0.9, min_p=0.05, top_k=8, top_p=0.8),
])
def test_sampled_frequencies_match_the_filtered_softmax(opts, device):
    vocab = 12
    logits = _logits(1, vocab, seed=3)[0]
    expected = _reference_probs(logits, **opts)
    params = SamplingParams(temperature=opts["temperature"], min_p=opts["min_p"],
                            top_k=opts["top_k"] if opts["top_k"] < vocab else 0, top_p=opts["top_p"])
    freq = _draw_frequencies(logits, params, device)
    assert (freq[expected == 0] == 0).all()  # filtered tokens are never drawn
    assert (freq - expected).abs().max().item() < FREQ_TOLERANCE
    assert (expected > 0).sum() >= 2  # a real distribution, not a forced choice


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_is_greedy(device):
    logits = _logits(64, seed=5)
    seqs = [Sequence([1], SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]
    tokens = Sampler()(logits.to(device), SamplingMetadata.build(seqs, VOCAB, torch.device(device))).token_ids
    assert torch.equal(tokens.cpu(), logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_the_argmax():
    logits = _logits(8, seed=6)
    seqs = [Sequence([1], SamplingParams(temperature=0 if i % 2 else 1.0, top_p=0.9)) for i in range(8)]
    tokens = Sampler()(logits, SamplingMetadata.build(seqs, VOCAB, torch.device("cpu"))).token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


def _draw(rows: list[tuple[torch.Tensor, SamplingParams, int]], device: str = "cpu") -> list[int]:
    """Sample one step for rows of (logits, params, position); returns the tokens."""
    seqs = [Sequence(list(range(1, position + 1)), params) for _, params, position in rows]
    logits = torch.stack([r[0] for r in rows]).to(device)
    return Sampler()(logits, SamplingMetadata.build(seqs, VOCAB, torch.device(device))).token_ids.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_are_reproducible_and_independent_of_batch_mates(device):
    logits = _logits(16, seed=7) * 0.2  # flat: many tokens likely, so draws really vary
    seeded = [(logits[i], SamplingParams(seed=100 + i, top_p=0.95), 5 + i) for i in range(16)]
    alone = [_draw([row], device)[0] for row in seeded]
    assert len(set(alone)) > 4  # the seeds make different draws
    others = [(l, SamplingParams(temperature=t, top_k=k), 3) for l, t, k in
              zip(_logits(6, seed=8), [0, 0.5, 1.0, 2.0, 0, 0.3], [0, 2, 0, 5, 0, 0])]
    mixed = others[:3] + seeded[::-1] + others[3:]
    batch = _draw(mixed, device)[3:3 + 16][::-1]
    assert batch == alone
    assert _draw(seeded, device) == alone  # and a rerun gives the same tokens


def test_seeded_draws_change_with_position():
    logits = _logits(1, seed=9)[0] * 0.2
    draws = [_draw([(logits, SamplingParams(seed=1), pos)])[0] for pos in range(1, 30)]
    assert len(set(draws)) > 4


# ---- engine level: logprobs against HF, seeds, n > 1 ------------------------------------

def test_logit_bias_matches_hf_sequence_bias_per_row():
    biases = [{3: 2.5, 7: -100.0}, {}, {0: -0.5, 49: 100.0}]
    seqs = [_seq([1, 2], logit_bias=b or None) for b in biases]
    logits = _logits(3)
    metadata = SamplingMetadata.build(seqs, VOCAB, torch.device("cpu"))
    ours = apply_logit_bias(logits, *metadata.logit_bias)
    for row, bias in enumerate(biases):
        ref = logits[row:row + 1].clone()
        if bias:
            ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2]]), ref)
        torch.testing.assert_close(ours[row], ref[0])


def test_allowed_tokens_bias_and_penalties_apply_in_vllms_order():
    """allowed_token_ids masks first, logit_bias is added before the penalties (vLLM's order),
    and raw logprobs stay those of the model's logits."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 9] = -1.0, 5.0
    seq = _seq([4], temperature=0, logprobs=1, repetition_penalty=2.0, logit_bias={4: 3.0},
               allowed_token_ids=[4, 6])
    out = Sampler()(logits, SamplingMetadata.build([seq], VOCAB, torch.device("cpu")))
    # token 9 (5.0) is not allowed; token 4, (-1 + 3) / 2 = 1.0, beats token 6's 0.0
    assert out.token_ids.tolist() == [4]
    torch.testing.assert_close(out.logprobs.logprobs[0, 0], torch.log_softmax(logits[0], -1)[4])
    seq = _seq([4], temperature=0, repetition_penalty=2.0, logit_bias={4: 1.5}, allowed_token_ids=[4, 6])
    # bias first: (-1 + 1.5) / 2 = 0.25 > 0 (token 6) -> 4; penalty first: -2 + 1.5 = -0.5 -> 6
    assert Sampler()(logits, SamplingMetadata.build([seq], VOCAB, torch.device("cpu"))).token_ids.tolist() == [4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_token_constraints_stay_in_their_rows(device, dtype):
    """One batch mixing rows with and without allowed_token_ids / logit_bias, greedy and random
    (on a GPU, random rows with no top-k/top-p/min-p take the fused path): each row gets only its
    own options; duplicate allowed ids are harmless; a bias never revives an excluded token."""
    logits = _logits(4, seed=5).to(dtype)
    raw = logits.float()
    seqs = [_seq([1], temperature=0, allowed_token_ids=[4, 4, 6], logit_bias={9: 100.0}),
            _seq([1], temperature=0),
            _seq([1], temperature=1.0, allowed_token_ids=[9]),
            _seq([1], temperature=1.0, logit_bias={17: 100.0})]
    metadata = SamplingMetadata.build(seqs, VOCAB, torch.device(device))
    tokens = Sampler()(logits.to(device), metadata).token_ids.tolist()
    assert tokens == [[4, 6][int(raw[0, 6] > raw[0, 4])], int(raw[1].argmax()), 9, 17]


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_with_allowed_tokens_and_logit_bias(device):
    """Draws follow softmax((logits + bias) / T) over the allowed tokens: the GPU's fused
    sampling path too (no top-k/top-p/min-p)."""
    vocab = 12
    logits = _logits(1, vocab, seed=11)[0]
    allowed, bias, temperature = [0, 2, 3, 5, 8, 11], {2: 1.5, 5: -1.0, 7: 50.0}, 0.8
    z = logits.double().clone()
    for t, b in bias.items():
        z[t] += b
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[allowed] = torch.softmax(z[allowed] / temperature, -1)
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed, logit_bias=bias)
    freq = _draw_frequencies(logits, params, device)
    assert (freq[expected == 0] == 0).all()  # token 7 (+50) is not allowed: never drawn
    assert (freq - expected).abs().max().item() < FREQ_TOLERANCE


@pytest.fixture(scope="module")
def llama(tiny_model):
    path, hf = tiny_model("llama")
    return LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=64), hf


def test_logprobs_and_prompt_logprobs_match_hf_log_softmax(tiny_model, family):
    """Every family: the sampled tokens' and the prompt's logprobs (two paths to the logits)."""
    path, hf = tiny_model(family)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=64)
    prompt = random_prompts([21], seed=4)[0]
    k = 5
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    tokens = prompt + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)  # [len, vocab]
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for i, token in enumerate(completion.token_ids):
        _check_position(completion.logprobs[i], ref[len(prompt) - 1 + i], token, k)
    assert math.isclose(completion.cumulative_logprob,
                        sum(ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)),
                        abs_tol=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        _check_position(out.prompt_logprobs[p], ref[p - 1], prompt[p], k)


def _check_position(entry: dict, ref: torch.Tensor, token: int, k: int) -> None:
    top = torch.topk(ref, k)
    assert set(entry) == set(top.indices.tolist()) | {token}
    assert entry[token].rank == int((ref > ref[token]).sum()) + 1
    for t, lp in entry.items():
        assert abs(lp.logprob - ref[t].item()) < 1e-4


def test_seeded_request_reruns_identically(llama):
    llm, _ = llama
    prompts = random_prompts([9, 14], seed=5)
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    other_seed = llm.generate(prompts, SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] != [o.outputs[0].token_ids for o in other_seed]


def test_n_samples_share_the_prompt_blocks(llama):
    llm, _ = llama
    engine = llm.llm_engine
    bm = engine.block_manager
    free_at_start = bm.num_free_blocks
    prompt = random_prompts([40], seed=6)[0]  # 2 full blocks of 16 + 8 tokens
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    seqs = [s.seq for s in engine.output_processor.requests["n4"].seqs]
    outputs = []
    while not all(len(s.block_table) for s in seqs):
        outputs += engine.step()
    assert len({tuple(s.block_table[:2]) for s in seqs}) == 1  # the two full prompt blocks are shared
    assert len({s.block_table[2] for s in seqs}) == 4          # each sample has its own last block
    assert free_at_start - bm.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = RequestOutput.fold(outputs[0])
    for delta in outputs[1:]:
        final.add(delta)
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # seeds 0..3 give different samples
    assert bm.num_free_blocks == free_at_start


def test_allowed_token_ids_greedy_is_the_argmax_over_them_of_hf_logits(llama):
    llm, hf = llama
    prompt, allowed = random_prompts([9], seed=12)[0], [5, 17, 40, 41, 300]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed,
                            logit_bias={40: 0.5})
    generated = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1].float()  # [10, vocab]
        logits[:, 40] += 0.5
    assert generated == [allowed[i] for i in logits[:, allowed].argmax(-1).tolist()]
    assert len(set(generated)) > 1  # the choice moves between the allowed tokens


def test_engine_rejects_bad_requests(llama):
    llm, _ = llama
    with pytest.raises(ValueError, match="n must be <= max_n"):
        llm.generate([[5, 6]], SamplingParams(n=65), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids: token id 10000 is outside"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10_000]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias: token id 10000 is outside"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 320 is outside"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[5, 320]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"allowed_token_ids: every allowed token \(\[5, 9\]\) is EOS or a stop"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[9, 5], stop_token_ids=[5, 9], min_tokens=1),
                     use_tqdm=False)
    eos = sorted(llm.llm_engine.eos_token_ids)
    with pytest.raises(ValueError, match="min_tokens=2 cannot be reached"):
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=eos, min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], SamplingParams(allowed_token_ids=eos, min_tokens=2, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 3 and set(out) <= set(eos)  # with ignore_eos, EOS does not end it: no conflict


# ---- the random draw: inverse CDF ---------------------------------------------------------

@pytest.mark.parametrize("vocab", [4096, 1000])  # four chunks of 1,024 / one chunk (no chunk size divides it)
def test_inverse_cdf_picks_the_first_token_past_the_target_mass(vocab):
    """Each row's token is where the float64 running sum of the whole row first exceeds U x total,
    zeros (filtered tokens) included; every draw is a token of positive probability."""
    gen = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 3, -1)
    probs[probs < 1e-4] = 0  # filtered tokens, in every chunk
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    uniforms[:3] = torch.tensor([0.0, 0.5, 1 - 2 ** -53], dtype=torch.float64)  # the edges of [0, 1)
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    tokens = inverse_cdf(probs, uniforms)
    assert (probs.gather(1, tokens.unsqueeze(1)) > 0).all()
    assert torch.equal(tokens, expected)


def test_inverse_cdf_never_draws_a_zero_probability_token_at_the_top_of_the_range():
    """U just below 1 on a row whose last tokens (and last chunks) are all filtered out."""
    probs = torch.zeros(2, 4096)
    probs[0, :5] = 0.2
    probs[1, 1500] = 1.0
    tokens = inverse_cdf(probs, torch.full((2,), 1 - 2 ** -53, dtype=torch.float64))
    assert tokens.tolist() == [4, 1500]


def test_top_p_among_the_candidates_equals_the_sort():
    """A large vocabulary (the CPU looks among the TOP_P_CANDIDATES most likely tokens first): peaked
    rows (settled by the candidates), flat rows (whose set reaches past them: sorted), top_p = 1 rows
    and a -inf token, in one batch: the same tokens kept, with the same logits, as sorting every row."""
    vocab = 8 * TOP_P_CANDIDATES
    gen = torch.Generator().manual_seed(12)
    peaked = torch.randn(4, vocab, generator=gen) * 4
    flat = torch.randn(4, vocab, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])[torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])]
    logits[0, 7] = float("-inf")
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.3, 1.0, 1.0, 0.99, 0.7])
    ours, expected = apply_top_p(logits, top_p), top_p_by_sort(logits, top_p)
    assert torch.equal(ours.isinf(), expected.isinf())
    assert torch.equal(ours[~ours.isinf()], expected[~expected.isinf()])
    kept = (~ours.isinf()).sum(-1)
    assert (kept[[1, 3]] > TOP_P_CANDIDATES).all() and (kept[[0, 2]] < TOP_P_CANDIDATES).all()  # both paths ran
