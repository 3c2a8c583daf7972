"""Sampling defaults from the model's generation_config.json, and OpenAI-shaped errors.

A request (server) or call (`LLM.generate` without SamplingParams) that leaves a sampling
field out gets the model's generation_config.json value, as vLLM does; the request's own
fields win. The OpenAI error object's `code` is a string or null; `param` names the field.
"""
import asyncio
import json
import os
import shutil

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from smollm2_tokenizer import tiny_model_with_smollm2_tokenizer

GENERATION_CONFIG = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "do_sample": True,
                     "eos_token_id": 2}
SET = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gen-defaults") / "model")
    shutil.copytree(tiny_model_with_smollm2_tokenizer(), path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    with LLM(path, dtype="float32", max_model_len=128, num_kvcache_blocks=32) as llm:
        yield llm


def test_calls_without_sampling_params_take_the_models_defaults(llm):
    defaults = llm.get_default_sampling_params()
    assert {k: getattr(defaults, k) for k in SET} == SET and defaults.top_p == 1.0
    implicit = llm.generate(["Once upon"], use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate(["Once upon"], SamplingParams(**SET), use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate(["Once upon"], SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    assert implicit == explicit and len(implicit) == 16
    assert plain != implicit  # the repetition penalty from the file applied


def test_server_requests_take_the_defaults_and_errors_are_openai_shaped(llm):
    pytest.importorskip("fastapi")
    from nanovllm.entrypoints.openai.serving_engine import OpenAIServing

    class Engine:  # what OpenAIServing reads of an AsyncLLM
        tokenizer, generation_defaults = llm.get_tokenizer(), llm.llm_engine.generation_defaults
    serving = OpenAIServing(Engine(), ["tiny"], None)
    params = serving.sampling_params({"top_k": 9})
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 9, 1.3)


def test_error_code_is_a_string_or_null_and_param_names_max_tokens():
    pytest.importorskip("fastapi")
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.entrypoints.openai.api_server import build_app
    async_llm = AsyncLLM(tiny_model_with_smollm2_tokenizer(), max_model_len=64, num_kvcache_blocks=8,
                         log_stats_interval=0)
    app = build_app(async_llm, ["tiny"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            too_long = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500})
            unknown = await http.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
            missing = await http.post("/v1/completions", json={})
            return too_long, unknown, missing
    try:
        too_long, unknown, missing = asyncio.run(go())
    finally:
        async_llm.shutdown()
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert missing.status_code == 400 and missing.json()["error"]["code"] is None
