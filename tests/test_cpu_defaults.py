"""Engine settings the device decides when the user leaves them out (config.py)."""
import pytest

from nanovllm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, Config


@pytest.mark.parametrize("device_type, expected", [("cpu", 256), ("cuda", 8192)])
def test_max_num_batched_tokens_follows_the_device(device_type, expected):
    config = Config.from_kwargs("unused").with_device_defaults(device_type)
    assert config.max_num_batched_tokens == expected == DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]


def test_a_given_max_num_batched_tokens_is_kept():
    assert Config.from_kwargs("unused", max_num_batched_tokens=2048).with_device_defaults("cpu").max_num_batched_tokens == 2048


def test_cpu_engine_gets_the_cpu_budget(tiny_model):
    from nanovllm import LLM
    path, _ = tiny_model("llama")
    llm = LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=16, skip_tokenizer_init=True)
    assert llm.llm_engine.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    assert llm.llm_engine.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
