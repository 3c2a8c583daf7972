"""nano-vLLM: a fast, small, readable LLM inference engine."""
from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
