"""Multi-step decode rounds (Config.num_scheduler_steps): the same results as plain steps.

A round runs several decode steps on the device with no host sync between them;
tokens past a sequence's end are dropped. Greedy ids must equal HF's, seeded
sampling must draw the same tokens as single steps, EOS and max_tokens must stop a
sequence inside a round, and every block must be free afterwards.
"""
import pytest

from nanovllm import LLM, SamplingParams
from tiny_models import hf_greedy, random_prompts

STEPS = 4
PROMPTS = random_prompts([5, 17, 33, 9], seed=3)


@pytest.fixture(scope="module")
def engines(tiny_model):
    path, hf = tiny_model("qwen3")
    make = lambda steps: LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=128,  # noqa: E731
                             num_scheduler_steps=steps, max_num_seqs=len(PROMPTS))
    return make(1), make(STEPS), hf


def _run(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0] for o in outs]


def test_greedy_matches_hf_with_rounds_ending_mid_round(engines):
    _, multi, hf = engines
    max_tokens = [5, 13, 32, 7]  # not multiples of STEPS: rounds overshoot and drop tokens
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for prompt, m, out in zip(PROMPTS, max_tokens, _run(multi, params)):
        assert out.token_ids == hf_greedy(hf, prompt, m)
        assert out.finish_reason == "length"


def test_seeded_sampling_and_logprobs_equal_single_steps(engines):
    single, multi, _ = engines
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    for a, b in zip(_run(single, params), _run(multi, params)):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        assert [next(iter(d)) for d in b.logprobs] == b.token_ids
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)


def test_eos_stops_inside_a_round(engines):
    single, multi, _ = engines
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=60)  # eos ids 1, 2 are in the vocabulary
    plain, rounds = _run(single, params), _run(multi, params)
    assert [o.token_ids for o in rounds] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in rounds] == [o.finish_reason for o in plain]
    stopped = [o for o in rounds if o.finish_reason == "stop"]
    assert all(o.token_ids[-1] in (1, 2) for o in stopped)
