"""Bad input: a clear ValueError naming the value, nothing changed.

Engine settings are checked before a model loads; model config fields the engine
does not implement are refused at load; request errors (prompts, lengths,
sampling values) are refused before anything is queued. After every request
error the same engine still serves a good request, with HF's greedy tokens, and
every KV block is free.
"""
import json
import math
import os
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.model_config import ModelConfig
from tiny_models import TINY, hf_greedy, random_prompts

FAMILY = "llama"
MAX_MODEL_LEN = 64
NUM_BLOCKS = 32            # room for 8 sequences of MAX_MODEL_LEN tokens
GOOD_PROMPT = [5, 6, 7, 8, 9]
GOOD_LEN = 8
GREEDY = SamplingParams(temperature=0, max_tokens=GOOD_LEN, ignore_eos=True)
VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(FAMILY)[0]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
               num_kvcache_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def good_reference(tiny_model):
    return hf_greedy(tiny_model(FAMILY)[1], GOOD_PROMPT, GOOD_LEN)


@pytest.fixture
def still_serves(llm, good_reference):
    """After the test: nothing queued, every block free, and a good request still gets HF's tokens."""
    yield llm
    assert_idle(llm)
    out, = llm.generate([GOOD_PROMPT], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == good_reference
    assert_idle(llm)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert [b.block_id for b in engine.block_manager.blocks if b.ref_count] == []


def copy_model(src: str, dst, **config_updates) -> str:
    """A copy of the model directory with config.json fields replaced (None deletes a field)."""
    path = str(dst / "model")
    shutil.copytree(src, path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(config_updates)
    with open(config_path, "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f)
    return path


# ---- engine settings ---------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1, got 0"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an int >= 1, got 2.5"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int >= 1, got True"),
    (dict(max_num_batched_tokens=-8), "max_num_batched_tokens must be an int >= 1, got -8"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1, got 0"),
    (dict(kvcache_block_size=0), "kvcache_block_size must be an int >= 1, got 0"),
    (dict(max_n=0), "max_n must be an int >= 1, got 0"),
    (dict(max_model_len=0), "max_model_len must be >= 1, got 0"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks must be >= 1, got 0"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes must be >= 1, got -1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be in \(0, 1\], got 0"),
    (dict(device="tpu"), "device must be one of .*; got 'tpu'"),
    (dict(dtype="int8"), "dtype must be one of .*; got 'int8'"),
    (dict(load_format="pickle"), "load_format must be one of .*; got 'pickle'"),
    (dict(max_num_seq=4), "unknown engine argument.*max_num_seq"),
    (dict(block_size=16, foo=1), "unknown engine argument.*block_size, foo"),
])
def test_bad_engine_settings(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, **kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_max_model_len_beyond_the_model(model_dir):
    with pytest.raises(ValueError, match="max_model_len .*2048.* max_position_embeddings .*1024"):
        LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=2048, num_kvcache_blocks=256)


def test_max_model_len_may_use_the_yarn_extension(tiny_model, tmp_path):
    """Qwen2.5 style: yarn factor 4 over 256 trained positions allows 1024, not more."""
    path = copy_model(tiny_model("qwen2")[0], tmp_path, max_position_embeddings=256)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=1024, num_kvcache_blocks=64)
    assert llm.llm_engine.max_model_len == 1024
    with pytest.raises(ValueError, match="max_model_len 1025 is beyond .* 256 .*with rope scaling: 1024"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=1025, num_kvcache_blocks=65)


@pytest.mark.parametrize("kwargs", [
    dict(max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=3),       # 4 blocks of 16 needed
    dict(kv_cache_memory_bytes=1),                                  # not even one block
    dict(max_model_len=1024, kv_cache_memory_bytes=1 << 16),        # 8 blocks < 64
])
def test_kv_cache_too_small_for_one_sequence(model_dir, kwargs):
    with pytest.raises(ValueError, match="KV cache too small"):
        LLM(model_dir, dtype="float32", skip_tokenizer_init=True, **kwargs)


def test_kv_cache_just_big_enough(model_dir, tiny_model):
    small = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                num_kvcache_blocks=MAX_MODEL_LEN // 16)
    prompt = random_prompts([40], seed=11)[0]
    out, = small.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 40,
                                                    ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_model(FAMILY)[1], prompt, MAX_MODEL_LEN - 40)
    assert_idle(small)


# ---- model config fields the engine does not implement ------------------------------

@pytest.mark.parametrize("updates,message", [
    (dict(architectures=["GemmaForCausalLM"]), "'GemmaForCausalLM' is not supported; supported: GraniteForCausalLM, "
     "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, "
     "Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
    (dict(use_sliding_window=True, max_window_layers=0, sliding_window=None),
     "needs a positive sliding_window, got None"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types .*chunked_attention"),
    (dict(mlp_bias=True), "mlp_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope type 'dynamic' is not supported .*supported: default, linear, llama3, yarn"),
    (dict(rope_parameters=None, rope_scaling={"type": "longrope", "factor": 2.0}),
     "rope type 'longrope' is not supported"),
    (dict(architectures=["Phi3ForCausalLM"], rope_parameters=None, rope_scaling={"type": "yarn", "factor": 2.0}),
     "rope type 'longrope' is not supported"),  # transformers' Phi3Config reads yarn as longrope
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5 is not supported"),
    (dict(partial_rotary_factor=0.25), "partial_rotary_factor 0.25 is not supported"),
    (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
])
def test_unsupported_model_config(model_dir, tmp_path, updates, message):
    path = copy_model(model_dir, tmp_path, **updates)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=NUM_BLOCKS)


def test_qwen2_sliding_window_field_without_use_sliding_window_is_accepted(tiny_model, tmp_path):
    """Qwen2 checkpoints carry `sliding_window` with `use_sliding_window: false`: full attention."""
    src = tiny_model("qwen2")[0]
    path = copy_model(src, tmp_path, use_sliding_window=False, sliding_window=32768)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=NUM_BLOCKS, max_model_len=64)
    out, = llm.generate([GOOD_PROMPT], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_model("qwen2")[1], GOOD_PROMPT, GOOD_LEN)


@pytest.mark.parametrize("updates", [dict(use_sliding_window=True, sliding_window=128, layer_types=None,
                                          max_window_layers=1),  # layer 1 (of 0, 1) slides
                                     dict(layer_types=["sliding_attention", "full_attention"], sliding_window=128)])
def test_a_sliding_window_limits_the_context_to_it(tiny_model, tmp_path, updates):
    """Up to the window, windowed attention is full attention: the engine serves contexts that
    fit in it (HF's ids) and refuses a longer max_model_len, naming the window."""
    src, hf = tiny_model("qwen2")
    path = copy_model(src, tmp_path, **updates)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=NUM_BLOCKS)
    assert llm.llm_engine.max_model_len == 128
    out, = llm.generate([GOOD_PROMPT], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, GOOD_PROMPT, GOOD_LEN)
    with pytest.raises(ValueError, match="max_model_len 129 is beyond this model's limit 128: .*sliding window 128"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=NUM_BLOCKS, max_model_len=129)


def test_qwen2_window_of_no_layer_caps_nothing(tiny_model, tmp_path):
    """use_sliding_window with max_window_layers at or past the last layer: no layer slides in HF."""
    path = copy_model(tiny_model("qwen2")[0], tmp_path, use_sliding_window=True, sliding_window=128,
                      layer_types=None, max_window_layers=2)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=2 * NUM_BLOCKS)
    assert llm.llm_engine.max_model_len == 1024


def test_model_config_without_architectures():
    hf = {**TINY, "num_key_value_heads": 2}
    assert ModelConfig.from_hf(hf).architecture == "?"  # then the registry names the supported ones


# The fields of published config.json files that decide how they are read (values as in
# Phi-3-mini-4k-instruct's and Mistral-7B-v0.1's; Granite's shaped like granite-3.x's).
PHI3_MINI_4K = dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                    max_position_embeddings=4096, original_max_position_embeddings=4096, rope_scaling=None,
                    rope_theta=10000.0, sliding_window=2047, rms_norm_eps=1e-5, eos_token_id=32000,
                    pad_token_id=32000, attention_bias=False, hidden_act="silu", tie_word_embeddings=False)
MISTRAL_7B_V01 = dict(architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
                      rms_norm_eps=1e-5, eos_token_id=2, hidden_act="silu", tie_word_embeddings=False)
GRANITE_SHAPED = dict(architectures=["GraniteForCausalLM"], hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                      max_position_embeddings=131072, rope_theta=5e6, embedding_multiplier=12.0,
                      residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0,
                      tie_word_embeddings=True, hidden_act="silu")


@pytest.mark.parametrize("hf,expected", [
    (PHI3_MINI_4K, dict(head_dim=96, sliding_window=2047, max_model_len_limit=2047, rope_scaling=None,
                        eos_token_ids=(32000,), attention_multiplier=None)),
    (MISTRAL_7B_V01, dict(head_dim=128, sliding_window=4096, max_model_len_limit=4096, num_key_value_heads=8)),
    ({**MISTRAL_7B_V01, "sliding_window": None, "rope_theta": 1e6},  # v0.2 on: no window
     dict(sliding_window=None, max_model_len_limit=32768, rope_theta=1e6)),
    ({k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"},  # transformers' default
     dict(sliding_window=4096)),
    (GRANITE_SHAPED, dict(head_dim=64, embedding_multiplier=12.0, residual_multiplier=0.22,
                          attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=True,
                          sliding_window=None)),
    ({k: v for k, v in GRANITE_SHAPED.items() if k != "attention_multiplier"},  # transformers' default
     dict(attention_multiplier=1.0)),
], ids=["phi3-mini-4k", "mistral-7b-v0.1", "mistral-7b-v0.2", "mistral-default-window", "granite",
        "granite-default-scale"])
def test_published_config_shapes_are_read(hf, expected):
    cfg = ModelConfig.from_hf(hf)
    assert {name: getattr(cfg, name) for name in expected} == expected


# ---- sampling settings ---------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (dict(temperature=math.nan), "temperature must be a finite number, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number, got inf"),
    (dict(temperature=-math.inf), "temperature must be a finite number, got -inf"),
    (dict(temperature="0.7"), "temperature must be a finite number, got '0.7'"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be >= 1, got -3"),
    (dict(max_tokens=2.5), "max_tokens must be an int, got 2.5"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool, got 'yes'"),
    (dict(presence_penalty=True), "presence_penalty must be a finite number, got True"),
    (dict(logprobs=True), "logprobs must be an int, got True"),
    (dict(stop=5), "stop must be a list of strings, got 5"),
    (dict(stop=b"###"), "stop must be a list of strings, got b'###'"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list of token ids, got 7"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_edge_values_are_accepted():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop=("a", "b"), stop_token_ids={7}).stop == ["a", "b"]


@pytest.mark.parametrize("seed", [-1, 2 ** 64 + 5, -(10 ** 30)])
def test_extreme_seeds_and_top_k_run(still_serves, seed):
    """Any Python int is a seed (vLLM takes them too), and top_k beyond the vocabulary means all of it."""
    params = SamplingParams(temperature=1.0, seed=seed, top_k=10 ** 30, max_tokens=6, ignore_eos=True)
    first, second = (still_serves.generate([GOOD_PROMPT], params, use_tqdm=False)[0] for _ in range(2))
    assert len(first.outputs[0].token_ids) == 6 and first.outputs[0].token_ids == second.outputs[0].token_ids


# ---- requests --------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,message", [
    ([], "the prompt is empty"),
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ([5, VOCAB, 6], f"token id {VOCAB} is outside the vocabulary \\[0, {VOCAB}\\)"),
    ([5, 10 ** 12], "token id 1000000000000 is outside the vocabulary"),
    ([-1, 5], "token id -1 is outside the vocabulary"),
    ([5, 2.0], "token id 2.0 is outside the vocabulary"),
    ([5, "7"], "token id '7' is outside the vocabulary"),
    ([True, 5], "token id True is outside the vocabulary"),
    ([5] * MAX_MODEL_LEN, f"the prompt has {MAX_MODEL_LEN} tokens, but max_model_len is {MAX_MODEL_LEN}"),
    ([5] * (MAX_MODEL_LEN + 100), f"the prompt has {MAX_MODEL_LEN + 100} tokens"),
    ("hello", "text prompts need a tokenizer"),
    ({"text": [5]}, "a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    (5.5, "a prompt must be a string, a list of token ids or a dict, got float"),
])
def test_bad_prompts(still_serves, prompt, message):
    with pytest.raises(ValueError, match=message):
        still_serves.generate([prompt], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def text_llm(model_dir, tmp_path_factory):
    """The same model with a word-level tokenizer: word "t<i>" is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = str(tmp_path_factory.mktemp("with-tokenizer") / "model")
    shutil.copytree(model_dir, path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1", unk_token="t0").save_pretrained(path)
    return LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("prompt", ["", "   \n", {"prompt": ""}])
def test_empty_text_prompt(text_llm, good_reference, prompt):
    with pytest.raises(ValueError, match="the prompt is empty"):
        text_llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_idle(text_llm)
    good = " ".join(f"t{i}" for i in GOOD_PROMPT)
    out, = text_llm.generate([good], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == GOOD_PROMPT and out.outputs[0].token_ids == good_reference
    assert_idle(text_llm)


@pytest.mark.parametrize("messages,kwargs,message", [
    ([{"role": "user", "content": 5}], {}, "can only concatenate str"),       # a non-string content
    ([{"role": "user"}], {}, "has no attribute 'content'"),                  # no content
    ([{"role": "wizard", "content": "t5"}], {}, "unknown role wizard"),       # the template's raise_exception
    ([{"role": "user", "content": "t5"}], {"messages": []}, "multiple values for keyword argument 'messages'"),
])
def test_chat_template_errors_are_value_errors(text_llm, monkeypatch, messages, kwargs, message):
    monkeypatch.setattr(text_llm.get_tokenizer(), "chat_template",
                        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                        "{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}")
    with pytest.raises(ValueError, match=f"the chat template could not render these messages: .*{message}"):
        text_llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
    assert_idle(text_llm)
    out, = text_llm.chat([{"role": "user", "content": "t5 t6"}], GREEDY, use_tqdm=False)
    assert out.prompt == "user t5 t6 " and len(out.outputs[0].token_ids) == GOOD_LEN


@pytest.mark.parametrize("prompt_len,max_tokens", [(60, 5), (63, 2), (1, MAX_MODEL_LEN)])
def test_prompt_plus_max_tokens_beyond_max_model_len(still_serves, prompt_len, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with pytest.raises(ValueError, match=rf"prompt \({prompt_len} tokens\) \+ max_tokens \({max_tokens}\) "
                                         rf"exceeds max_model_len \({MAX_MODEL_LEN}\)"):
        still_serves.generate([[5] * prompt_len], params, use_tqdm=False)


def test_longest_allowed_request_runs_to_max_model_len(still_serves, tiny_model):
    prompt = random_prompts([MAX_MODEL_LEN - 4], seed=12)[0]
    out, = still_serves.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                 use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(tiny_model(FAMILY)[1], prompt, 4)
    out, = still_serves.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                 use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_one_bad_prompt_queues_none_of_the_batch(still_serves):
    prompts = [GOOD_PROMPT, [1, 2, 3], [5, -7], [8, 9]]
    with pytest.raises(ValueError, match="token id -7"):
        still_serves.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("prompts,params,message", [
    (None, GREEDY, "a prompt must be a string, a list of token ids or a dict, got NoneType"),
    (5, GREEDY, "a prompt must be a string, a list of token ids or a dict, got int"),
    ([GOOD_PROMPT], {"max_tokens": 4}, "sampling_params must be a SamplingParams or a list of them, got {'max_tokens'"),
    ([GOOD_PROMPT, GOOD_PROMPT], [GREEDY, None], "sampling_params must be a SamplingParams or a list of them"),
])
def test_bad_call_arguments(still_serves, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        still_serves.generate(prompts, params, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        still_serves.stream(prompts, params)


def test_fault_in_the_forward_pass_fails_the_call_cleanly(still_serves, monkeypatch):
    """An exception inside a step propagates from generate/stream; that call's requests are aborted
    (every block freed) and the same LLM serves the next call (the `still_serves` check)."""
    runner = still_serves.llm_engine.model_runner
    real_run, calls = runner.run, []

    def failing_run(*args, **kwargs):   # the second forward pass fails: after the prefill, in the decode
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real_run(*args, **kwargs)
    monkeypatch.setattr(runner, "run", failing_run)
    # a penalty keeps every step a plain `run`, also where multi-step decode rounds are the default
    params = SamplingParams(temperature=0, max_tokens=GOOD_LEN, ignore_eos=True, repetition_penalty=1.1)
    with pytest.raises(RuntimeError, match="injected fault"):
        still_serves.generate([GOOD_PROMPT, [9, 8, 7, 6]], params, use_tqdm=False)
    assert_idle(still_serves)
    calls.clear()
    stream = still_serves.stream([GOOD_PROMPT], params)
    assert next(stream).outputs[0].token_ids   # the prefill's token came through
    with pytest.raises(RuntimeError, match="injected fault"):
        next(stream)
    assert_idle(still_serves)
    monkeypatch.undo()


def test_params_list_of_the_wrong_length(still_serves):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        still_serves.generate([GOOD_PROMPT] * 3, [GREEDY, GREEDY], use_tqdm=False)


def test_bad_request_through_the_engine_api(still_serves):
    engine = still_serves.llm_engine
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [VOCAB + 1])
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request("long", [5] * 10, SamplingParams(max_tokens=MAX_MODEL_LEN))
    assert engine.step() == []


def test_a_tokenizer_that_does_not_load_fails_the_engine_with_its_own_error(model_dir, tmp_path):
    # the tokenizer loads in a thread beside the model runner: its failure must still reach the caller
    from transformers import AutoTokenizer
    bad = tmp_path / "bad_tokenizer"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(Exception) as direct:
        AutoTokenizer.from_pretrained(str(bad))
    with pytest.raises(type(direct.value)) as failure:
        LLM(model_dir, dtype="float32", tokenizer=str(bad), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=NUM_BLOCKS)
    assert str(failure.value) == str(direct.value)
