"""A stand-in for a captured CUDA graph, for testing graph runners on the CPU.

`EagerGraph.replay` runs the model eagerly over the runner's static buffers under the context
the runner would have captured for that size (engine/cuda_graph.py's decode runner and
engine/prefill_graph.py's both keep `input_ids`, `positions`, `hidden` and `_context(size)`),
so what a runner writes into its buffers before a replay is checked end to end.
"""
from nanovllm.utils import context as ctx_mod


class EagerGraph:
    def __init__(self, runner, model, size: int):
        self.runner, self.model, self.size = runner, model, size
        self.replays = 0

    def replay(self) -> None:
        r, size = self.runner, self.size
        saved, ctx_mod._CONTEXT = ctx_mod._CONTEXT, None  # the step's context is set around the replay
        try:
            with ctx_mod.set_context(r._context(size)):
                r.hidden[:size] = self.model(r.input_ids[:size], r.positions[:size])
        finally:
            ctx_mod._CONTEXT = saved
        self.replays += 1
