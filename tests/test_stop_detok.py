"""Incremental detokenization and stop conditions, with the real SmolLM2 tokenizer.

The detokenizer is fed real token ids of known text (multi-byte characters split
across tokens, stop strings spanning tokens); the engine tests take a greedy run
without stops as the reference and check that each stop condition cuts it exactly.
"""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from smollm2_tokenizer import smollm2_tokenizer, tiny_model_with_smollm2_tokenizer

MULTIBYTE = "Hi 你好，世界！🎉🚀 naïve café — ok"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(params=[True, False], ids=["decode_stream", "window"])
def use_decode_stream(request):
    return request.param


def _run(tok, text: str, use_decode_stream: bool,
         **kwargs) -> tuple[IncrementalDetokenizer, list[str], str | None, int]:
    """Feed `text`'s tokens one by one; returns the detokenizer, streamed deltas, the stop
    string found (if any) and how many tokens were fed."""
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), use_decode_stream=use_decode_stream, **kwargs)
    assert (detok._stream is not None) == use_decode_stream
    ids = tok.encode(text, add_special_tokens=False)
    deltas, stop = [], None
    for n, token_id in enumerate(ids, 1):
        stop = detok.add_token(token_id)
        if stop is not None:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop, n


def test_multibyte_characters_are_never_split(tok, use_decode_stream):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters do span tokens
    detok, deltas, stop, _ = _run(tok, MULTIBYTE, use_decode_stream)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == MULTIBYTE
    assert sum(1 for d in deltas if d) > 5  # it really streamed, in pieces


def test_stop_string_across_tokens_cuts_the_text_before_it(tok, use_decode_stream):
    text = "The answer is forty-two. END of story"
    stop = "forty-two"  # tokens ' forty', '-', 'two'
    assert not any(stop in tok.decode([i]) for i in tok.encode(text, add_special_tokens=False))
    detok, deltas, found, n = _run(tok, text, use_decode_stream, stop=[stop, "never"])
    assert found == stop
    assert detok.output_text == "".join(deltas) == "The answer is "
    assert tok.decode(tok.encode(text, add_special_tokens=False)[:n]).endswith(stop)  # stopped on its last token


def test_stop_string_included_when_asked(tok, use_decode_stream):
    detok, deltas, found, _ = _run(tok, "The answer is forty-two. END", use_decode_stream, stop=["forty-two"],
                                   include_stop_str_in_output=True)
    assert found == "forty-two"
    assert "".join(deltas) == detok.output_text == "The answer is forty-two"


def test_partial_stop_string_is_held_back_while_streaming(tok, use_decode_stream):
    # "general Ken" never completes ("general Kenn" is not in the text) but its start is
    # held back while it might; the finished delta sends it.
    text = "Hello there, general Kenobi."
    detok, deltas, found, _ = _run(tok, text, use_decode_stream, stop=["general Kenn"])
    assert found is None
    assert "".join(deltas[:-1]) == text[:len(text) - len("general Kenn") + 1]  # the last 11 chars wait
    assert "".join(deltas) == text


def test_multibyte_stop_string(tok, use_decode_stream):
    detok, deltas, found, _ = _run(tok, MULTIBYTE, use_decode_stream, stop=["世界"])
    assert found == "世界" and "".join(deltas) == "Hi 你好，"


def test_leading_space_of_the_first_token_is_kept(tok, use_decode_stream):
    detok = IncrementalDetokenizer(tok, tok.encode("Hello", add_special_tokens=False),
                                   use_decode_stream=use_decode_stream)
    for t in tok.encode(" there, you", add_special_tokens=False):
        detok.add_token(t)
    assert detok.get_delta(finished=True) == " there, you"


def test_skip_special_tokens(tok, use_decode_stream):
    ids = tok.encode("Hello", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    for skip, expected in ((True, "Hello"), (False, "Hello<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip, use_decode_stream=use_decode_stream)
        for t in ids:
            detok.add_token(t)
        assert detok.get_delta(finished=True) == expected


# ---- through the engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_with_smollm2_tokenizer(), dtype="float32", max_model_len=256, num_kvcache_blocks=48)


GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    """A greedy run without stops: (prompt, token ids, text)."""
    prompt = "Once upon a time"
    out = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert len(set(out.token_ids)) > 8 and out.finish_reason == "length"
    return prompt, out.token_ids, out.text


def _boundary_stop(tok, ids: list[int], text: str) -> str:
    """A 4-character stop string of `text` that straddles a token boundary, first seen there."""
    for i in range(2, len(ids) - 4):
        prefix = tok.decode(ids[:i])
        cut = len(prefix)
        stop = text[cut - 2:cut + 2]
        if text.startswith(prefix) and "\ufffd" not in stop and len(stop) == 4 and text.find(stop) == cut - 2:
            return stop
    raise AssertionError("no usable token boundary in the reference text")


@pytest.mark.parametrize("include", [False, True])
def test_engine_stop_string_spanning_tokens(llm, tok, reference, include):
    prompt, ids, text = reference
    stop = _boundary_stop(tok, ids, text)
    out = llm.generate(prompt, SamplingParams(**GREEDY, stop=[stop], include_stop_str_in_output=include),
                       use_tqdm=False)[0].outputs[0]
    cut = text.find(stop) + (len(stop) if include else 0)
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert out.token_ids == ids[:len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_engine_stop_token_id(llm, reference):
    prompt, ids, text = reference
    i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate(prompt, SamplingParams(**GREEDY, stop_token_ids=[ids[i]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:i + 1]  # the stop token is returned in token_ids ...
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[i])
    assert text.startswith(out.text) and out.text == llm.get_tokenizer().decode(ids[:i])  # ... not in the text


def test_engine_min_tokens_holds_off_stop_tokens(llm, reference):
    prompt, ids, _ = reference
    params = SamplingParams(**GREEDY, stop_token_ids=[ids[0]], min_tokens=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert ids[0] not in out.token_ids[:3] and len(out.token_ids) > 3
    if ids[0] in out.token_ids:
        assert out.token_ids.index(ids[0]) == len(out.token_ids) - 1 and out.finish_reason == "stop"


def test_engine_max_tokens_is_length(llm, reference):
    prompt, ids, text = reference
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:5], "length", None)
