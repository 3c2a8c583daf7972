"""Config: the engine settings of one `LLM`, validated once at construction.

Users pass these as keyword arguments to `LLM(model, **kwargs)`; an unknown
keyword or an out-of-range value is a `ValueError` naming it. `Config` is frozen:
values derived later (the model's config, the resolved device and dtype, the KV
cache size) live in the objects that derive them, not here.
"""
from dataclasses import dataclass, fields

from nanovllm.layers.quantization import check_quantization_option

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's; "fp8" is e4m3
# 16 tokens per block, as vLLM: prefix-cache hits and the last partial block waste
# at most 15 slots, and our attention kernels gather keys by slot, so the block size
# does not constrain their tile shapes (Nano-vLLM's 256 comes from flash-attn's paging).
DEFAULT_BLOCK_SIZE = 16
# Sixteen decode steps per scheduling round on a GPU. With async scheduling (the next round
# launched before the host has seen the last step of the current one) B1 on the H200 ran
# 23.4k tok/s at 4, 23.5-23.7k at 8 and 23.6-23.7k at 16 steps on one machine (offline the
# throughput is flat past 8), but serving is not: B3 (bench_serving.py, 64 concurrent
# streams) served 23.7k and 24.0k tok/s at 16 against 21.4k and 22.2k at 8, alternating on one
# machine (1 step: 7.3-7.9k, 4: 19.9k), at the same TTFT (benchmarks/RESULTS.md "Eleventh
# session"). The cost: streams get their tokens a round at a time (16 steps: ~35 ms at B3's
# batch), and a request added between `LLMEngine.step` calls may wait one round more, as the
# next round is already launched (AsyncLLM holds chaining back while it has requests queued).
DEFAULT_GPU_SCHEDULER_STEPS = 16
# Prefill (and mixed) steps of up to this many tokens replay CUDA graphs on a GPU
# (engine/prefill_graph.py): eagerly, a step of one to 64 short prompts was 24-30 ms of kernel
# launches for 1.2-4.6 ms of GPU work on an H200, replayed 2.1-7.8 ms (benchmarks/RESULTS.md
# "Twenty-eighth session"). Larger steps are the GPU's work more than their launches.
DEFAULT_MAX_PREFILL_GRAPH_TOKENS = 2048
# Adaptive rounds (Config.adaptive_rounds), for an engine served online: its slots change hands
# while it runs (a stream ends, the client sends its next request), and a full-length round makes
# both ends wait. Two rules, measured on the simulated device (benchmarks/RESULTS.md "B3: rounds
# while requests arrive"):
# - After a request arrives, while the batch has room (fewer than max_num_seqs), the next round
#   runs at most ARRIVAL_ROUND_STEPS steps and each round after it doubles (1, 2, 4, 8, 16) up to
#   num_scheduler_steps; steps that prefill count as rounds, so where the next round is the
#   arrival's prefill step the decode rounds after it run 2, 4, 8, 16: a burst of arrivals (B3's
#   wave of 64, sent as the previous 64 streams end) joins within a step or two instead of waiting
#   out a 16-step round its first requests started alone; once arrivals stop, full-length rounds
#   return within four rounds.
# - A round ends where one of its sequences reaches max_tokens, if that is at least
#   MIN_CLIPPED_ROUND_STEPS steps in: its stream ends then instead of a round later, and its slot
#   can take the next arrival. (Without it the short rounds shift the requests of a closed loop
#   off the round grid, and their last rows ran up to 15 steps past their end.) A round of one step
#   is not clipped to while another sequence goes on: it runs synchronously (nothing can be chained
#   onto it), so the device would wait for the host. A round is not chained past that end while a
#   request waits (it takes the slot).
# A full batch runs full-length rounds. Off by default: they trade TPOT and throughput for TTFT. On
# the H200 (RESULTS.md "Thirty-first session"), B3 at concurrency 64 served the same with them; requests
# arriving at Poisson times got their first token sooner (TTFT median 20.5 against 32.8 ms at 50 a
# second, 28.2 against 35.0 at 100) but streamed slower (TPOT median 2.51 against 2.24 ms, 3.13 against
# 2.71), and at 100 a second, where 64 in flight is the limit, the server completed 9% fewer requests.
ARRIVAL_ROUND_STEPS = 1
MIN_CLIPPED_ROUND_STEPS = 2
# vLLM's compilation modes that this engine has: 0 runs eagerly, 3 torch.compiles the CPU
# forward pass (engine/cpu_compile.py). vLLM's 1 and 2 (stock torch.compile, trace once) are
# not offered; on the GPU the forward runs Triton kernels and CUDA graphs instead.
COMPILATION_MODES = {0: "none (eager)", 3: "compile the CPU forward pass with Inductor"}


@dataclass(frozen=True)
class Config:
    model: str
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None          # None: the model's max_position_embeddings, capped
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    kvcache_block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"              # "auto": the model's dtype; fp8 halves the bytes (kernels/kv_quant.py)
    num_kvcache_blocks: int | None = None     # fixed cache size; overrides the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU: memory budget for the KV cache
    gpu_memory_utilization: float = 0.9       # GPU: fraction of device memory the engine may use
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None
    max_n: int = 64                           # cap on SamplingParams.n
    # Decode steps run back to back on the device per scheduling round (vLLM's multi-step
    # scheduling): the host's scheduling and output work is paid once per round. No round runs
    # past the step where its last sequence reaches max_tokens. None:
    # DEFAULT_GPU_SCHEDULER_STEPS on a GPU with one rank, 1 elsewhere.
    num_scheduler_steps: int | None = None
    # Launch each multi-step round before the host has seen the last step of the one before
    # (vLLM's async scheduling), so the device does not wait for the round boundary's host
    # work. None: on where multi-step rounds run on a GPU. Needs num_scheduler_steps > 1.
    async_scheduling: bool | None = None
    # Shape multi-step rounds around arrivals and ends of requests (ARRIVAL_ROUND_STEPS above
    # says how, why, and why it is off by default). Needs num_scheduler_steps > 1.
    adaptive_rounds: bool = False
    trust_remote_code: bool = False           # accepted for vLLM compatibility; nothing remote runs
    # Weight quantization method (layers/quantization's registry; vLLM's option). None: the
    # checkpoint's own `quantization_config`, or dense weights when it has none. A name
    # quantizes an unquantized checkpoint at load, or must match the checkpoint's method.
    quantization: str | None = None
    # vLLM's compilation_config, as its mode (an int, or {"mode": int} / {"level": int}):
    # 0 eager, 3 the CPU forward compiled by torch.compile (engine/cpu_compile.py). None: the
    # device's default (engine/cpu_compile.py says which). enforce_eager=True means 0.
    compilation_config: int | dict | None = None
    # GPU: the largest prefill or mixed step, in tokens, replayed from a CUDA graph (one graph per
    # token count up to it, captured at start-up); 0: such steps run eagerly (decode steps keep
    # their graphs). enforce_eager=True turns all graphs off.
    max_prefill_graph_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS

    def __post_init__(self):
        _check_positive(self, "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size",
                        "kvcache_block_size", "max_n")
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_scheduler_steps is not None and (not isinstance(self.num_scheduler_steps, int)
                                                     or self.num_scheduler_steps < 1):
            raise ValueError(f"num_scheduler_steps must be an int >= 1, got {self.num_scheduler_steps!r}")
        if not isinstance(self.adaptive_rounds, bool):
            raise ValueError(f"adaptive_rounds must be a bool, got {self.adaptive_rounds!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        check_quantization_option(self.quantization)
        if self.compilation_config is not None:  # normalized to the mode (an int) once, here
            object.__setattr__(self, "compilation_config", _compilation_mode(self.compilation_config))
            if self.enforce_eager and self.compilation_config != 0:
                raise ValueError(f"enforce_eager=True runs eagerly; it contradicts compilation_config mode "
                                 f"{self.compilation_config}")
        _check_int_at_least(self, 0, "max_prefill_graph_tokens")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "Config":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


def _check_positive(cfg: Config, *names: str) -> None:
    _check_int_at_least(cfg, 1, *names)


def _check_int_at_least(cfg: Config, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _compilation_mode(value) -> int:
    """compilation_config as its mode: an int, or a dict of only "mode" (or vLLM's older "level")."""
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in ("mode", "level"):
            raise ValueError(f"compilation_config takes only a mode here ({{'mode': 0}} or {{'mode': 3}}), "
                             f"got {value!r}")
        value = next(iter(value.values()))
    if isinstance(value, bool) or value not in COMPILATION_MODES:
        modes = ", ".join(f"{m} ({name})" for m, name in COMPILATION_MODES.items())
        raise ValueError(f"compilation_config mode must be one of {modes}; got {value!r}")
    return value
