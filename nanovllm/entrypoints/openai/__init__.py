"""The OpenAI-compatible HTTP server: `nanovllm serve` or `python -m nanovllm.entrypoints.openai.api_server`.

Needs the optional packages fastapi and uvicorn; the core engine imports without them.
"""
