"""The server's host-side shortcuts give the same results as the plain paths they replace.

PromptEncoder (the event loop's prompt encoding, which keeps the GIL) must give HF's ids for
every text; the uvicorn access log flag must reach uvicorn's config; request ids drawn without a
system call must still never repeat, in one process or across a fork.
"""
import argparse
import os

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


def test_random_ids_are_hex_of_their_length_and_never_repeat():
    from nanovllm.utils.random_ids import random_hex
    ids = [random_hex() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(random_hex(24)) == 24
    assert len({random_hex(1) for _ in range(1_000)}) == 16   # every digit reachable, zero-padded to width


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_other_ids_than_its_parent():
    from nanovllm.utils.random_ids import random_hex
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its next ids, written back to the parent
        os.write(write, "".join(random_hex() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = f.read()
    parent = "".join(random_hex() for _ in range(4))
    assert len(child) == len(parent) == 128 and child != parent
