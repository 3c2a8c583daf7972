"""CUDA graphs for decode steps: capture once per batch size, replay each step.

A decode step of a small model is hundreds of short kernels; launching them one
by one from Python leaves the GPU idle between them. `CUDAGraphRunner` captures
the model's forward pass for a set of batch sizes over static input buffers. A
step with `n` decoding sequences copies its inputs into the buffers of the
smallest captured size `>= n` and replays that graph; the later steps of a
multi-step decode round advance those buffers in place instead (`run_next_step`).
Padding rows point at a harmless context (one key in block 0) and write no KV (slot -1).
"""
from collections.abc import Callable

import torch

from nanovllm.utils.context import Context, set_context

SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16  # above the small sizes, capture every multiple of this
MAX_CAPTURED_BATCH = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in SMALL_BATCH_SIZES if s < top]
    sizes += range(BATCH_SIZE_STEP, top, BATCH_SIZE_STEP)
    return sorted(set(sizes) | {top})


@torch.inference_mode()
def capture_graphs(sizes: list[int], context: Callable[[int], Context], forward: Callable[[int], None],
                   pool=None) -> tuple[dict[int, torch.cuda.CUDAGraph], object]:
    """A graph of `forward(size)` (the model over static buffers) under `context(size)` for each
    size, largest first so that the smaller graphs reuse its memory; all in `pool` (default: the
    first graph's). Returns the graphs by size and the pool."""
    graphs = {}
    for size in sorted(sizes, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with set_context(context(size)):
            forward(size)  # warm-up: lazy initialisations happen outside the capture
            with torch.cuda.graph(graph, pool):
                forward(size)
        pool = graph.pool() if pool is None else pool
        graphs[size] = graph
        torch.cuda.synchronize()
    return graphs, pool


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        n, dev = self.max_bs, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens_k = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool, which the prefill graphs share
        self._capture_all(model)

    def _context(self, bs: int) -> Context:
        return Context(slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                       seq_lens_k=self.seq_lens_k[:bs], block_tables=self.block_tables[:bs],
                       max_seqlen_q=1, max_seqlen_k=self.max_model_len, is_decode_only=True)

    def _capture_all(self, model: torch.nn.Module) -> None:
        def forward(bs: int) -> None:
            self.hidden[:bs] = model(self.input_ids[:bs], self.positions[:bs])
        self.graphs, self.pool = capture_graphs(self.sizes, self._context, forward)

    def can_run(self, context: Context, num_tokens: int) -> bool:
        return context.is_decode_only and num_tokens <= self.max_bs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """Replay the graph for this decode batch; returns hidden states [num_seqs, hidden]."""
        n = input_ids.shape[0]
        bs = self._size(n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = context.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.seq_lens_k[:n] = context.seq_lens_k
        self.seq_lens_k[n:bs] = 1
        width = context.block_tables.shape[1]
        self.block_tables[:n, :width] = context.block_tables
        self.block_tables[n:bs] = 0
        self.graphs[bs].replay()
        return self.hidden[:n]

    def run_next_step(self, token_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """The next step of the decode batch that `run` (or this) replayed last: its inputs advanced
        in place in the graph's buffers by one kernel (the padding rows stay as they were), then
        the replay. token_ids: [num_seqs] int64, the last step's samples. Returns [num_seqs, hidden]."""
        from nanovllm.kernels import triton_ops
        n = token_ids.shape[0]
        triton_ops.advance_decode_(token_ids, self.input_ids, self.positions, self.slot_mapping,
                                   self.seq_lens_k, self.block_tables, block_size)
        self.graphs[self._size(n)].replay()
        return self.hidden[:n]

    def _size(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds `num_seqs` rows."""
        return next(s for s in self.sizes if s >= num_seqs)
