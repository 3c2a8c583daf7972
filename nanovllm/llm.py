"""LLM: the offline facade. `LLM(model).generate(prompts, params)` as in vLLM."""
from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine, PromptType
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):  # None: the embedded default model
        self.llm_engine = LLMEngine(model, **kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts`; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = self._add_all(prompts, params)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                bar.set_postfix_str(self._throughput())
        return [finished[i] for i in ids]

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: a bad one aborts those already queued."""
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.llm_engine.add_request(None, prompt, p))
        except Exception:
            for request_id in ids:
                self.llm_engine.abort(request_id)
            raise
        return ids

    def _throughput(self) -> str:
        prefill, decode, seconds = self.llm_engine.last_step_stats
        if seconds <= 0:
            return ""
        kind, n = ("Prefill", prefill) if prefill else ("Decode", decode)
        return f"{kind}: {n / seconds:.0f} tok/s"


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
