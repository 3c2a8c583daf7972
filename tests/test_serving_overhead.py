"""The server's host-side shortcuts give the same results as the plain paths they replace.

PromptEncoder (the event loop's prompt encoding, which keeps the GIL) must give HF's ids for
every text; the uvicorn access log flag must reach uvicorn's config.
"""
import argparse

import pytest

from nanovllm.entrypoints.openai.prompt_encoder import PromptEncoder
from smollm2_tokenizer import smollm2_tokenizer

TEXTS = [
    "What is the capital of France?",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\nand   runs   of spaces  ",
    "naïve café, 東京, emoji 🙂🚀, math ∑ x²",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def test_prompt_encoder_takes_the_rust_tokenizer_and_gives_hfs_ids(tokenizer):
    encoder = PromptEncoder(tokenizer)
    assert encoder._backend is tokenizer._tokenizer
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert encoder.encode(text, add_special_tokens) == tokenizer.encode(
                text, add_special_tokens=add_special_tokens), (text, add_special_tokens)


def test_prompt_encoder_falls_back_where_hf_adds_to_the_rust_encode(tokenizer):
    class Truncating(type(tokenizer)):
        def encode(self, text, add_special_tokens=True, **kwargs):
            return super().encode(text, add_special_tokens=add_special_tokens, **kwargs)[:3]
    subclassed = Truncating.__new__(Truncating)
    subclassed.__dict__.update(tokenizer.__dict__)
    encoder = PromptEncoder(subclassed)
    assert encoder._backend is None
    assert encoder.encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])[:3]


def test_prompt_encoder_serves_a_tokenizer_without_a_rust_backend():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=True):
            return [len(word) for word in text.split()] + ([0] if add_special_tokens else [])
    encoder = PromptEncoder(WordTokenizer())
    assert encoder._backend is None
    assert encoder.encode("one three", add_special_tokens=False) == [3, 5]
    assert encoder.encode("one three") == [3, 5, 0]


@pytest.mark.parametrize("flags, access_log", [([], True), (["--disable-uvicorn-access-log"], False)])
def test_uvicorn_access_log_flag(flags, access_log):
    pytest.importorskip("uvicorn")
    from nanovllm.entrypoints.openai.api_server import add_cli_args, uvicorn_config
    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--port", "0", *flags])
    config = uvicorn_config(object(), args)
    assert config.access_log is access_log and config.port == 0 and config.host == "127.0.0.1"
