"""Streaming (DELTA outputs from step(), LLM.stream), abort, and chat.

Tiny random llama with the real SmolLM2 tokenizer. Where a test needs known output
text, the runner's sampled tokens are replaced by a script (the tokens of a known
string): the forward pass still runs, and everything after sampling is the engine's.
"""
import pytest

from nanovllm import LLM, RequestOutput, SamplingParams
from smollm2_tokenizer import tiny_model_with_smollm2_tokenizer
from tiny_models import random_prompts

NUM_BLOCKS = 48
TEXT = "Hi 你好，世界！🎉🚀 naïve café — the end"


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_with_smollm2_tokenizer(), dtype="float32", max_model_len=256,
               num_kvcache_blocks=NUM_BLOCKS)


@pytest.fixture
def scripted(llm, monkeypatch):
    """scripted(token_ids): from now on every sequence samples these tokens, in order."""
    runner = llm.llm_engine.model_runner
    real_run = runner.run

    def install(script: list[int]):
        def run(seqs):
            output = real_run(seqs)
            output.sampled_token_ids = [None if t is None else script[seq.num_completion_tokens]
                                        for seq, t in zip(seqs, output.sampled_token_ids)]
            return output
        monkeypatch.setattr(runner, "run", run)
    return install


def _fold(deltas: list[RequestOutput]) -> dict[str, RequestOutput]:
    final = {}
    for d in deltas:
        if d.request_id in final:
            final[d.request_id].add(d)
        else:
            final[d.request_id] = RequestOutput.fold(d)
    return final


def test_multibyte_text_streams_whole_characters(llm, scripted):
    tok = llm.get_tokenizer()
    script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    scripted(script)
    deltas = list(llm.stream("Say:", SamplingParams(max_tokens=len(script))))
    texts = [d.outputs[0].text for d in deltas]
    assert not any("\ufffd" in t for t in texts)
    assert "".join(texts) == TEXT
    assert [t for d in deltas for t in d.outputs[0].token_ids] == script  # one new token per delta
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", None)  # EOS: no stop_reason, as vLLM
    final = llm.generate("Say:", SamplingParams(max_tokens=len(script)), use_tqdm=False)[0]
    assert final.outputs[0].text == TEXT and final.outputs[0].token_ids == script


def test_stop_string_is_never_streamed(llm, scripted):
    tok = llm.get_tokenizer()
    script = tok.encode("Hello there, general Kenobi. More text follows here", add_special_tokens=False)
    scripted(script)
    deltas = list(llm.stream("Say:", SamplingParams(max_tokens=len(script), stop=["general Ken"])))
    streamed = "".join(d.outputs[0].text for d in deltas)
    assert streamed == "Hello there, "
    assert (deltas[-1].outputs[0].finish_reason, deltas[-1].outputs[0].stop_reason) == ("stop", "general Ken")


def test_stream_folds_to_generate(llm):
    prompts = ["The weather today", "In a distant galaxy", "Numbers: 1, 2, 3"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, ignore_eos=True)]
    deltas = list(llm.generate(prompts, params, stream=True))
    final = llm.generate(prompts, params, use_tqdm=False)
    folded = _fold(deltas)
    assert len(folded) == 3
    by_order = [folded[k] for k in sorted(folded, key=int)]  # auto ids count up in prompt order
    for streamed, whole in zip(by_order, final):
        assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in streamed.outputs] == \
               [(c.index, c.text, c.token_ids, c.finish_reason) for c in whole.outputs]
    assert [len(o.outputs) for o in final] == [1, 1, 3]
    assert len(final[1].outputs[0].logprobs) == 9
    assert all(len(c.token_ids) <= 1 for d in deltas for c in d.outputs)  # deltas: one token per step


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS
    prompts = random_prompts([40, 33, 20], vocab_size=1000, seed=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = NUM_BLOCKS - bm.num_free_blocks
    assert used >= 3 + 3 + 2
    engine.abort("a0")
    assert NUM_BLOCKS - bm.num_free_blocks == used - 3  # a0's 3 blocks came back right away
    engine.abort("no-such-request")  # ignored
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a1", "a2"}
    engine.abort("a1")
    engine.abort("a2")
    assert bm.num_free_blocks == NUM_BLOCKS and not engine.has_unfinished_requests()
    assert engine.step() == []


def test_closing_a_stream_aborts_its_requests(llm):
    stream = llm.stream(["A long story", "Another one"], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        next(stream)
    assert llm.llm_engine.block_manager.num_free_blocks < NUM_BLOCKS
    stream.close()
    assert llm.llm_engine.block_manager.num_free_blocks == NUM_BLOCKS
    assert not llm.llm_engine.has_unfinished_requests()


def test_request_ids(llm):
    engine = llm.llm_engine
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request(7, "hello", SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert llm.llm_engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_bad_request_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(["fine", []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# ---- chat ------------------------------------------------------------------------------

def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert len(out) == 1 and out[0].prompt == text
    assert out[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_chat_batch_and_template_kwargs(llm, monkeypatch):
    tok = llm.get_tokenizer()
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                              "{% endfor %}{% if think %}[think]{% endif %}")
    batch = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]
    outs = llm.chat(batch, SamplingParams(max_tokens=2), use_tqdm=False, chat_template_kwargs={"think": True})
    assert [o.prompt for o in outs] == ["<user>one[think]", "<user>two[think]"]
    outs = llm.chat(batch[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.prompt for o in outs] == ["<user>one"]


@pytest.mark.parametrize("messages", [[], [[]], "hi", [{"content": "no role"}]])
def test_chat_rejects_malformed_messages(llm, messages):
    with pytest.raises(ValueError):
        llm.chat(messages, use_tqdm=False)
