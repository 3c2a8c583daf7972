"""One engine replica on Ray: what it asks Ray for, and how it starts inside its actor.

GPUs: a replica on a GPU cluster asks for `tensor_parallel_size` GPUs, so its
tensor-parallel ranks get those devices (Ray sets CUDA_VISIBLE_DEVICES for the actor).
CPUs: a replica asks for `cpus_per_replica` CPUs, fractional by default when the
cluster is small: on 2 CPUs, two replicas asking for 1 CPU each leave nothing for
Ray Data's own tasks and the job hangs. torch's intra-op threads follow the CPUs
asked for (at least 1), so replicas sharing a host do not oversubscribe it.
"""
import math
import os
from dataclasses import dataclass, field

# CPUs kept free for Ray's own tasks (Ray Data's reads and splits) when replicas share them out.
RESERVED_CPUS = 1.0
DEFAULT_CPUS_PER_REPLICA = 1.0


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica actor needs, picklable; validated at construction."""
    model: str | None
    engine_kwargs: dict = field(default_factory=dict)   # LLMEngine settings
    served_model_names: tuple[str, ...] | None = None   # None: the model argument (as the server)
    chat_template: str | None = None                    # template text; None: the tokenizer's
    num_replicas: int = 1
    num_cpus: float = DEFAULT_CPUS_PER_REPLICA
    num_gpus: float = 0.0
    torch_threads: int = 1
    log_stats_interval: float = 0.0                     # seconds between throughput lines in the replica's log

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas (--data-parallel-size) must be >= 1, got {self.num_replicas}")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus per replica must be > 0, got {self.num_cpus}")
        if self.num_gpus < 0:
            raise ValueError(f"num_gpus per replica must be >= 0, got {self.num_gpus}")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads per replica must be >= 1, got {self.torch_threads}")

    @classmethod
    def from_args(cls, args, cluster_resources: dict) -> "ReplicaSpec":
        """The spec of `run-batch`/`serve` flags on a cluster with `cluster_resources` (ray.cluster_resources())."""
        from nanovllm.entrypoints.engine_args import engine_kwargs
        kwargs = {k: v for k, v in engine_kwargs(args).items() if not (k == "seed" and v is None)}
        num_replicas = args.data_parallel_size
        cpus = args.cpus_per_replica or default_cpus_per_replica(cluster_resources.get("CPU", 0.0), num_replicas)
        template = _read_template(args.chat_template)
        return cls(model=args.model, engine_kwargs=kwargs,
                   served_model_names=tuple(args.served_model_name) if args.served_model_name else None,
                   chat_template=template, num_replicas=num_replicas, num_cpus=cpus,
                   num_gpus=gpus_per_replica(kwargs, cluster_resources), torch_threads=max(1, math.floor(cpus)),
                   log_stats_interval=getattr(args, "log_stats_interval", 0.0))

    def actor_options(self) -> dict:
        """Ray resource options of one replica actor."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


def default_cpus_per_replica(cluster_cpus: float, num_replicas: int) -> float:
    """1 CPU a replica, or an equal share of the cluster's CPUs less RESERVED_CPUS when smaller."""
    reserve = min(RESERVED_CPUS, cluster_cpus / 2)
    share = (cluster_cpus - reserve) / num_replicas
    if share <= 0:
        raise ValueError(f"the Ray cluster has {cluster_cpus} CPUs: too few for {num_replicas} replicas")
    return min(DEFAULT_CPUS_PER_REPLICA, share)


def gpus_per_replica(engine_kwargs: dict, cluster_resources: dict) -> float:
    """The tensor-parallel size on a GPU replica, else 0 (CPU replicas)."""
    device = engine_kwargs.get("device", "auto")
    on_gpu = device == "cuda" or (device == "auto" and cluster_resources.get("GPU", 0) > 0)
    return float(engine_kwargs.get("tensor_parallel_size", 1)) if on_gpu else 0.0


def _read_template(path: str | None) -> str | None:
    """The template file's text, read where the command runs (the replicas may be on other nodes)."""
    if path is None:
        return None
    from nanovllm.entrypoints.openai.chat_template import ChatTemplate
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the chat template file {path!r}: {e.strerror}") from e
    ChatTemplate(text)   # a template that does not compile fails here, before any replica starts
    return text


def served_model_names(spec: ReplicaSpec) -> list[str]:
    """The names clients may use: --served-model-name, else the model argument as given (as the
    server), else the embedded default's file name."""
    if spec.served_model_names:
        return list(spec.served_model_names)
    if spec.model is not None:
        return [spec.model]
    from nanovllm.engine.model_source import resolve_model
    return [os.path.basename(resolve_model(None).rstrip("/")).removesuffix(".gguf")]


def _template(spec: ReplicaSpec, tokenizer):
    from nanovllm.entrypoints.openai.chat_template import ChatTemplate, load_chat_template
    if spec.chat_template is None:
        return load_chat_template(None, tokenizer)
    return ChatTemplate(spec.chat_template, getattr(tokenizer, "bos_token", None),
                        getattr(tokenizer, "eos_token", None))


def load_ingress_tokenizer(spec: ReplicaSpec):
    """(tokenizer, chat template) for an ingress: the engine's tokenizer without its weights."""
    from nanovllm.engine.model_source import ModelSource, resolve_model
    if spec.engine_kwargs.get("skip_tokenizer_init"):
        return None, None
    source = ModelSource.resolve(resolve_model(spec.model), spec.engine_kwargs.get("load_format", "auto"))
    tokenizer = source.tokenizer(spec.engine_kwargs.get("tokenizer"))
    return tokenizer, _template(spec, tokenizer)


# ---- inside the replica's actor -------------------------------------------------------

@dataclass
class ReplicaEngine:
    """A started replica: its engine, chat template and served names."""
    async_llm: object
    chat_template: object
    served_model_names: list[str]


def start_engine(spec: ReplicaSpec) -> ReplicaEngine:
    """Start the replica's engine in this process, its torch threads set first."""
    import torch
    from nanovllm.engine.async_llm import AsyncLLM
    torch.set_num_threads(spec.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.torch_threads))   # for the TP ranks it spawns
    async_llm = AsyncLLM(spec.model, log_stats_interval=spec.log_stats_interval, **spec.engine_kwargs)
    return ReplicaEngine(async_llm, _template(spec, async_llm.tokenizer), served_model_names(spec))
