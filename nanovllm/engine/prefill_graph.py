"""CUDA graphs for short prefill steps: capture once per token count, replay each step.

Launching a prefill step kernel by kernel costs the host far more than the GPU spends on a
few short prompts: on an H200 a step of one to 64 prompts of 32 tokens took 24-30 ms in the
model runner for 1.2-4.6 ms of device work (benchmarks/RESULTS.md, "Twenty-eighth session").
Every short request pays that in its time to first token, and a server pays it at every wave
of arrivals. `PrefillGraphRunner` captures the model's forward pass once for each size in
`prefill_capture_sizes` (up to Config.max_prefill_graph_tokens) over static buffers. A step
that is not decode-only, with `n` tokens from `m` sequences, goes into the graph of the
smallest size `T >= n`:

- tokens n..T are padding: position 0, and no KV write (slot -1);
- the graph's batch has `min(T, max_num_seqs)` sequence rows (a scheduled step of T tokens has
  at most that many sequences; a step of more, as the warm-up runs, goes eager); rows m.. are
  padding with no queries (their query run starts and ends at n), so the attention kernel's
  programs for them return at once;
- the attention kernel's grid is sized for the bound `max_seqlen_q = T` and a context of up to
  max_model_len (its split-KV choice is baked at capture, and any split count is correct).

The graphs share the decode graphs' memory pool: one step runs at a time on a device.
"""
import torch

from nanovllm.engine.cuda_graph import capture_graphs
from nanovllm.utils.context import Context

SMALL_SIZES = (16, 32, 64, 128)  # token counts captured below SIZE_STEP
SIZE_STEP = 256                  # then every multiple of this: a step pads fewer tokens than this


def prefill_capture_sizes(max_num_batched_tokens: int, max_prefill_graph_tokens: int) -> list[int]:
    """Token counts captured for an engine whose steps hold at most `max_num_batched_tokens`, up
    to `max_prefill_graph_tokens` (Config's, >= 1)."""
    top = min(max_num_batched_tokens, max_prefill_graph_tokens)
    sizes = [s for s in SMALL_SIZES if s < top] + list(range(SIZE_STEP, top, SIZE_STEP))
    return sorted(set(sizes) | {top})


class PrefillGraphRunner:
    def __init__(self, model: torch.nn.Module, sizes: list[int], max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, pool=None):
        """`sizes`: the token counts to capture (`prefill_capture_sizes`); `pool`: a graph memory
        pool to capture into (the decode graphs'), default a new one."""
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        tokens, rows, dev = self.max_tokens, self._num_rows(self.max_tokens), device
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.seq_lens_k = torch.ones(rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self._capture_all(model)

    def _num_rows(self, size: int) -> int:
        """Sequence rows of the graph for `size` tokens."""
        return min(size, self.max_num_seqs)

    def _context(self, size: int) -> Context:
        rows = self._num_rows(size)
        return Context(slot_mapping=self.slot_mapping[:size], cu_seqlens_q=self.cu_seqlens_q[:rows + 1],
                       seq_lens_k=self.seq_lens_k[:rows], block_tables=self.block_tables[:rows],
                       max_seqlen_q=size, max_seqlen_k=self.max_model_len)

    def _capture_all(self, model: torch.nn.Module) -> None:
        def forward(size: int) -> None:
            self.hidden[:size] = model(self.input_ids[:size], self.positions[:size])
        self.graphs, self.pool = capture_graphs(self.sizes, self._context, forward, self.pool)

    def can_run(self, context: Context, num_tokens: int) -> bool:
        """A step with queries of more than one token somewhere (decode-only steps have their
        own graphs), of at most the largest size's tokens, whose sequences fit its graph's rows
        (the engine's warm-up runs steps of more sequences than max_num_seqs)."""
        if context.is_decode_only or num_tokens > self.max_tokens:
            return False
        return context.seq_lens_k.shape[0] <= self._num_rows(self._size(num_tokens))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """Replay the graph for this step; returns hidden states [num_tokens, hidden]."""
        n, num_seqs = input_ids.shape[0], context.seq_lens_k.shape[0]
        size = self._size(n)
        rows = self._num_rows(size)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.positions[n:size] = 0
        self.slot_mapping[:n] = context.slot_mapping
        self.slot_mapping[n:size] = -1
        self.cu_seqlens_q[:num_seqs + 1] = context.cu_seqlens_q
        self.cu_seqlens_q[num_seqs + 1:rows + 1] = n
        self.seq_lens_k[:num_seqs] = context.seq_lens_k
        # a table may hold blocks beyond max_model_len's (allocated ahead for a decode round):
        # no key there is read, since no context is longer than max_model_len
        width = min(context.block_tables.shape[1], self.block_tables.shape[1])
        self.block_tables[:num_seqs, :width] = context.block_tables[:, :width]
        self.graphs[size].replay()
        return self.hidden[:n]

    def _size(self, num_tokens: int) -> int:
        """The smallest captured token count that holds `num_tokens`."""
        return next(s for s in self.sizes if s >= num_tokens)
