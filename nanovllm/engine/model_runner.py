"""ModelRunner: one per device (rank). Loads the model, sizes the KV cache, turns a
scheduled step into tensors, runs the forward pass and samples.

Everything a forward pass needs is built in `prepare_*` and published through
`utils/context.py` in `run`, inside one `set_context` block.
"""
import gc
import time
from dataclasses import replace

import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine import cpu_decode_layers, prefill_graph
from nanovllm.engine.cpu_compile import COMPILE_MODE, CompiledForward, resolve_compilation_mode
from nanovllm.engine.cuda_graph import CUDAGraphRunner
from nanovllm.engine.decode_round import DecodeRound
from nanovllm.engine.kv_scales import set_kv_scales
from nanovllm.engine.model_source import ModelSource
from nanovllm.engine.sampling_metadata import ModelRunnerOutput, SamplingMetadata, compute_prompt_logprobs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import StagingBuffer, build_step_inputs
from nanovllm.engine.warmup import compile_progress, log_startup_phase, warm_up_kernels
from nanovllm.kernels import cpu_small_ops, get_attention_backend, kv_quant
from nanovllm.kernels.cpu_linear import use_column_major_weights
from nanovllm.layers.attention import Attention
from nanovllm.layers.quantization import building_with, get_quantization_config, process_weights_after_loading
from nanovllm.layers.sampler import Sampler
from nanovllm.model_config import ModelConfig
from nanovllm.models.registry import get_model_class
from nanovllm.utils.context import Context, set_context
from nanovllm.utils.device import resolve_device, resolve_dtype
from nanovllm.utils.loader import load_dummy_weights, load_named_weights
from nanovllm.utils.parallel import min_over_ranks, tensor_parallel

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB when neither a block count nor a budget is given


def longest_context_first(seqs: list[Sequence]) -> list[Sequence]:
    """`seqs` by context length, longest first; equal lengths keep their order."""
    return sorted(seqs, key=lambda seq: seq.num_tokens, reverse=True)


class ModelRunner:
    def __init__(self, config: Config, source: ModelSource, model_config: ModelConfig, max_model_len: int,
                 rank: int = 0):
        """`rank`: this runner's tensor-parallel rank; with tensor_parallel_size > 1 the caller
        (nanovllm/distributed) has already joined this process to the process group."""
        self.config = config
        self.compiled_forward = None
        self.cpu_decode_layers = None
        self.prefill_graph_runner = None
        self.rank, self.tp_size = rank, config.tensor_parallel_size
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.block_size = config.kvcache_block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.dtype)
        self.kv_cache_dtype = kv_quant.resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if kv_quant.is_fp8(self.kv_cache_dtype):
            kv_quant.check_fp8_device(self.device, f"kv_cache_dtype={config.kv_cache_dtype!r}")
        # Decode rounds put their rows longest context first over an fp8 cache only: on an H200
        # B1 ran 28,894 tok/s that way against 27,409 in batch order, while over a bf16 cache
        # (whose decode tile waits on memory, not on its own work) it ran 0.7% slower
        # (benchmarks/RESULTS.md "Ninth session: decode rows longest context first").
        self.rows_longest_first = kv_quant.is_fp8(self.kv_cache_dtype)
        self.model = self._load_model(source)
        if kv_quant.is_fp8(self.kv_cache_dtype):
            self._set_kv_scales()
        self.staging = StagingBuffer(self.device) if self.device.type == "cuda" else None
        self.sampler = Sampler()
        with compile_progress(rank):  # sizing, graph capture and warm-up compile every Triton kernel
            start = time.perf_counter()
            self._compile_kernels()
            self.num_kvcache_blocks = self._allocate_kv_cache()
            log_startup_phase(rank, f"KV cache of {self.num_kvcache_blocks} blocks sized", start)
            self.graph_runner = self._capture_cuda_graphs()
            self.prefill_graph_runner = self._capture_prefill_graphs()
            self.compiled_forward = self._compile_forward()
            self.cpu_decode_layers = self._cpu_decode_layers()
            if self.device.type == "cuda":  # every Triton kernel variant now, none mid-traffic
                warm_up_kernels(self)

    # ---- start-up -------------------------------------------------------------

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        torch.manual_seed(self.config.seed)
        quant_config = get_quantization_config(self.config.quantization, self.model_config.quantization_config)
        if quant_config is not None:
            quant_config.check_device(self.device)
            quant_config.configure(self.device, self.config.dtype)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), tensor_parallel(self.rank, self.tp_size), building_with(quant_config):
                model = get_model_class(self.model_config.architecture)(
                    self.model_config, self.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            load_dummy_weights(model, self.config.seed)
        else:
            load_named_weights(model, source.named_weights())
        process_weights_after_loading(model, quant_config)
        if self.device.type == "cpu":
            use_column_major_weights(model)  # faster matrix-vector products (kernels/cpu_linear.py)
        Attention.backend = get_attention_backend(self.device.type)
        return model.eval()

    def _compile_kernels(self) -> None:
        """Kernel variants that the warm-up and graph capture may not reach (the MoE layers'
        tile configs, chosen by token count; the CPU's C++ decode attention and small ops) are
        compiled now, not during serving."""
        if self.device.type == "cpu":  # the C++ decode attention kernel (kernels/cpu_paged_decode.py)
            prepare = getattr(Attention.backend, "prepare_decode_kernel", None)
            layers = self._attention_layers()
            if prepare is not None and layers:
                prepare(self.dtype, self.kv_cache_dtype, layers[0].head_dim)
            if layers:  # RMSNorm, RoPE + K/V store, SiLU-and-mul (kernels/cpu_small_ops.py)
                cpu_small_ops.prepare(self.dtype, layers[0].head_dim)
        if self.device.type == "cuda":
            moe = next((m for m in self.model.modules() if hasattr(m, "compile_kernels")), None)
            if moe is not None:  # every MoE layer of a model has the same shapes
                moe.compile_kernels()

    def _set_kv_scales(self) -> None:
        """An fp8 cache's fixed scales (engine/kv_scales.py), before any cache is attached."""
        calibration = dict(dtype=self.dtype, block_size=self.block_size, vocab_size=self.model_config.vocab_size,
                           max_model_len=self.max_model_len,
                           seed=self.config.seed)
        set_kv_scales(self.model, self._attention_layers(), self.kv_cache_dtype, calibration,
                      self.device, self.tp_size)

    def _kv_bytes_per_block(self) -> int:
        attn = self._attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.kv_cache_dtype.itemsize
        return per_token * self.block_size * len(self._attention_layers())

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _num_blocks_to_allocate(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            return self._gpu_num_blocks()
        budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        return budget // self._kv_bytes_per_block()

    def _gpu_num_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the device after a warm-up at the
        largest step has shown the peak memory of activations and sampling."""
        self._warm_up()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
        return max(0, int(budget // self._kv_bytes_per_block()))

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run the largest prefill step and sample the largest batch, on a scratch KV cache."""
        gc.collect()  # engines no longer referenced give their memory back before we measure
        torch.cuda.empty_cache()
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = max(1, num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._attach_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.reset_peak_memory_stats(self.device)
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        context = Context(
            slot_mapping=(tables.view(num_seqs, -1)[:, :1] * self.block_size
                          + torch.arange(seq_len, device=self.device)).flatten().long(),
            cu_seqlens_q=torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=self.device),
            seq_lens_k=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device),
            block_tables=tables.view(num_seqs, -1), max_seqlen_q=seq_len, max_seqlen_k=seq_len,
            logits_indices=torch.arange(seq_len - 1, num_seqs * seq_len, seq_len, device=self.device))
        with set_context(context):
            self.model.compute_logits(self.model(positions % self.model_config.vocab_size, positions))
        logits = torch.randn(self.config.max_num_seqs, self.model_config.vocab_size, device=self.device)
        self.sampler(logits, SamplingMetadata.worst_case(self.config.max_num_seqs, logits.shape[1], self.device))
        del logits
        self._attach_kv_cache(0)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _allocate_kv_cache(self) -> int:
        num_blocks = min_over_ranks(self._num_blocks_to_allocate(), self.tp_size, self.device)
        needed = self._max_blocks_per_seq()
        if num_blocks < needed:
            raise ValueError(f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens cannot "
                             f"hold one sequence of max_model_len={self.max_model_len} ({needed} blocks); "
                             "give it more memory or lower max_model_len")
        self._attach_kv_cache(num_blocks)
        return num_blocks

    def _max_blocks_per_seq(self) -> int:
        """Cache blocks that one sequence of max_model_len tokens holds."""
        return -(-self.max_model_len // self.block_size)

    def _attach_kv_cache(self, num_blocks: int) -> None:
        # a backend may lay its cache out its own way (triton_attn: V key-minor for fp8)
        new_kv_cache = getattr(Attention.backend, "new_kv_cache", None)
        for attn in self._attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            if new_kv_cache is not None:
                attn.k_cache, attn.v_cache = new_kv_cache(shape, self.kv_cache_dtype, self.device)
            else:
                attn.k_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
                attn.v_cache = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)

    def _capture_cuda_graphs(self) -> CUDAGraphRunner | None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        start = time.perf_counter()
        runner = CUDAGraphRunner(self.model, self.config.max_num_seqs, self._max_blocks_per_seq(), self.max_model_len,
                                 self.model_config.hidden_size, self.dtype, self.device)
        log_startup_phase(self.rank, f"{len(runner.sizes)} decode graphs captured", start)
        return runner

    def _capture_prefill_graphs(self) -> prefill_graph.PrefillGraphRunner | None:
        """Graphs for short prefill steps (engine/prefill_graph.py), in the decode graphs' pool."""
        config = self.config
        if self.graph_runner is None or config.max_prefill_graph_tokens == 0:
            return None
        sizes = prefill_graph.prefill_capture_sizes(config.max_num_batched_tokens, config.max_prefill_graph_tokens)
        start = time.perf_counter()
        runner = prefill_graph.PrefillGraphRunner(
            self.model, sizes, config.max_num_seqs, self._max_blocks_per_seq(), self.max_model_len,
            self.model_config.hidden_size, self.dtype, self.device, pool=self.graph_runner.pool)
        log_startup_phase(self.rank, f"{len(runner.sizes)} prefill graphs captured", start)
        return runner

    def _compile_forward(self) -> CompiledForward | None:
        """The CPU forward compiled by torch.compile (engine/cpu_compile.py), compiled now on a
        one-token step into block 0 (which no sequence holds yet); None when it runs eagerly."""
        self.compilation_mode = resolve_compilation_mode(self.config.compilation_config, self.config.enforce_eager,
                                                         self.device, self.tp_size, self.model)
        if self.compilation_mode != COMPILE_MODE:
            return None
        compiled = CompiledForward(self.model)

        @torch.inference_mode()  # as every step runs: tensors made outside it have other dispatch keys
        def step():
            one = torch.zeros(1, dtype=torch.int64)
            context = Context(slot_mapping=one, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                              seq_lens_k=torch.ones(1, dtype=torch.int32),
                              block_tables=torch.zeros(1, 1, dtype=torch.int32),
                              max_seqlen_q=1, max_seqlen_k=1, is_decode_only=True)
            with set_context(context):
                compiled(one, one.clone())
        compiled.warm_up(step)
        return compiled

    def _cpu_decode_layers(self) -> cpu_decode_layers.DecodeLayers | None:
        """An eager CPU engine's decode steps straight through to their kernels
        (engine/cpu_decode_layers.py), where every layer takes that path; None elsewhere."""
        if self.device.type != "cpu" or self.compiled_forward is not None:
            return None
        return cpu_decode_layers.build(self.model, self.dtype, self.kv_cache_dtype)

    def shutdown(self) -> None:
        """Drop the CUDA graphs (decode and prefill); later steps run eager. nanovllm/distributed
        calls this on every rank before it destroys the process group: graphs that captured NCCL
        collectives can make that hang while they are alive (pytorch/pytorch#115388). A compiled
        CPU forward is dropped too."""
        self.graph_runner = self.prefill_graph_runner = None
        if self.compiled_forward is not None:
            self.compiled_forward.close()
            self.compiled_forward = None

    # ---- one step -------------------------------------------------------------

    def prepare(self, seqs: list[Sequence],
                after: DecodeRound | None = None) -> tuple[torch.Tensor, torch.Tensor, Context, list[int]]:
        """Flatten the scheduled tokens of `seqs` into one batch on the device.

        Returns input_ids [num_tokens], positions [num_tokens], the attention
        context, and the indices (into `seqs`) of the sequences that sample.
        `after`: a launched round whose last tokens, not seen by the host yet, are the
        inputs of this decode step (one per sequence), taken on the device.
        """
        step = build_step_inputs(seqs, self.block_size, num_pending=0 if after is None else 1)
        if after is not None:
            step.input_ids = after.rows_of(seqs)  # the device gathers the tokens by these rows
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables, logits_indices = \
            self._to_device(step.input_ids, step.positions, step.slot_mapping, step.cu_seqlens_q,
                            step.seq_lens_k, step.block_tables, step.logits_indices)
        if after is not None:
            input_ids = after.last_token_ids[input_ids]
        context = Context(
            slot_mapping=slot_mapping, cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k,
            block_tables=block_tables, max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k,
            is_decode_only=step.is_decode_only, logits_indices=logits_indices)
        return input_ids, positions, context, step.sampling

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.staging is None:
            return [torch.from_numpy(array) for array in arrays]
        return self.staging.to_device(*arrays)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(context, input_ids.shape[0]):
            return self.graph_runner.run(input_ids, positions, context)
        prefill_graphs = self.prefill_graph_runner
        if prefill_graphs is not None and prefill_graphs.can_run(context, input_ids.shape[0]):
            return prefill_graphs.run(input_ids, positions, context)
        if self.compiled_forward is not None:
            return self.compiled_forward(input_ids, positions)
        if self.cpu_decode_layers is not None:
            return self.model(input_ids, positions, self.cpu_decode_layers)
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def launch_decode_round(self, seqs: list[Sequence], num_steps: int,
                            after: DecodeRound | None = None) -> DecodeRound:
        """Queue `num_steps` decode steps of `seqs` back to back, with no host sync in between:
        each step's sampled tokens feed the next on the device, positions and KV slots advance
        there too (engine/decode_round.py; a round with a structured-output grammar row queues
        each step's sampling as the host hands it the step before). The block tables must
        already cover every step (Scheduler.extend_decode).

        `after`: a launched round whose last step the host has not seen yet; this round
        continues its sequences `seqs` (a subset of them) from their tokens on the device,
        so the device goes on without waiting for the host (async scheduling).

        The round's rows (`DecodeRound.seqs`, which its outputs follow) are `seqs`, or with
        `rows_longest_first` `seqs` longest context first: the attention kernel runs one
        program per (sequence, KV head) in row order and the GPU starts them in that order,
        so the longest start first and the last wave of programs is short.
        """
        rows = longest_context_first(seqs) if self.rows_longest_first else seqs
        return DecodeRound.launch(self, rows, num_steps, after)

    def _advance_decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
                        context: Context) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """The next decode step's inputs, computed on the device from this step's."""
        positions = positions + 1                                              # [num_seqs]
        blocks = context.block_tables.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
        slots = blocks.long() * self.block_size + positions % self.block_size  # [num_seqs]
        context = replace(context, slot_mapping=slots, seq_lens_k=context.seq_lens_k + 1,
                          max_seqlen_k=context.max_seqlen_k + 1)
        return token_ids, positions, context

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> ModelRunnerOutput:
        """Run one scheduled step; returns the sampled token of each sequence (None: mid-prompt),
        with the logprobs and prompt logprobs that sequences asked for."""
        input_ids, positions, context, sampling = self.prepare(seqs)
        with set_context(context):
            hidden = self._forward(input_ids, positions, context)
            logits = self.model.compute_logits(hidden) if sampling else None
        output = ModelRunnerOutput.empty(len(seqs))
        if logits is not None:  # None on tensor-parallel ranks other than 0
            sampling_seqs = [seqs[i] for i in sampling]
            metadata = SamplingMetadata.build(sampling_seqs, self.model_config.vocab_size, logits.device)
            output.add_samples(sampling, sampling_seqs, self.sampler(logits, metadata))
        output.prompt_logprobs = compute_prompt_logprobs(seqs, hidden, self.model.logits)
        return output
