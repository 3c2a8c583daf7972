"""ModelConfig: one normalized view of a model's hyperparameters.

HF `config.json` files (old `rope_scaling` + `rope_theta`, or transformers 5's
`rope_parameters`) and GGUF metadata are both turned into this one frozen
dataclass, so the model code reads a single vocabulary. Fields the engine does
not implement (MLP bias, unknown rope types, other activations) are rejected here
with a clear error instead of giving silently wrong text. A sliding attention
window is taken as a limit on the context instead: up to the window, windowed and
full attention are the same computation.

Mixture-of-experts families (Qwen3-MoE, Mixtral) add the expert fields: how many
experts, how many each token routes to, their intermediate size, whether the
top-k weights are renormalized, and which layers keep a dense MLP.
"""
from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_MAX_POSITIONS = 2048  # transformers' default max_position_embeddings for these families
# transformers' defaults where a config leaves these out
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROUTING_FUNCTIONS = ("softmax",)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # bias on q/k/v projections (Qwen2)
    qk_norm: bool                   # RMSNorm on q and k per head (Qwen3)
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str | None = None        # the checkpoint's dtype, e.g. "bfloat16"
    sliding_window: int | None = None  # attention window of the layers that have one (None: none do)
    # Granite's scalars (1.0 / None elsewhere): input embeddings times embedding_multiplier,
    # each attention and MLP output times residual_multiplier before its residual add,
    # attention scores times attention_multiplier (None: 1/sqrt(head_dim)), logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # mixture of experts (0 experts: every layer is dense): each token's router softmax picks
    # num_experts_per_tok of num_experts experts of moe_intermediate_size, their weights
    # renormalized to sum 1 when norm_topk_prob; layer i is sparse unless it is in
    # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (Qwen3-MoE's rule)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the checkpoint's `quantization_config` (config.json), read by layers/quantization
    quantization_config: dict | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts:
            _check_experts(self)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def max_model_len_limit(self) -> int:
        """The longest context the model supports, with rope scaling's extension (as vLLM derives it).

        Linear and yarn scaling stretch the positions the model was trained on by `factor`
        (yarn from `original_max_position_embeddings`); llama3 configs already state the
        extended length in max_position_embeddings. A sliding window caps it: only contexts
        that fit in the window are computed exactly without one.
        """
        limit = self.max_rope_positions
        return limit if self.sliding_window is None else min(limit, self.sliding_window)

    @property
    def max_rope_positions(self) -> int:
        """max_position_embeddings, extended by rope scaling."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        if scaling.get("rope_type") == "yarn":
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * (scaling.get("factor") or 1.0)))
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Normalize an HF config.json dict (and generation_config.json, for EOS ids)."""
        arch = (hf.get("architectures") or ["?"])[0]
        _reject_unsupported(hf)
        rope_theta, rope_scaling = _rope_settings(hf, arch)
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope_scaling=rope_scaling,
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            bos_token_id=hf.get("bos_token_id"),
            dtype=hf.get("torch_dtype") or hf.get("dtype"),
            sliding_window=_sliding_window(hf, arch),
            quantization_config=hf.get("quantization_config"),
            **(_granite_scalars(hf) if arch == "GraniteForCausalLM" else {}),
            **(_moe_fields(hf, arch) if arch in MOE_ARCHITECTURES else {}),
        )


def _as_list(v) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _eos_ids(hf: dict, gen: dict) -> tuple[int, ...]:
    ids = _as_list(hf.get("eos_token_id")) + _as_list(gen.get("eos_token_id"))
    return tuple(dict.fromkeys(int(i) for i in ids))


def _granite_scalars(hf: dict) -> dict:
    """Granite's four scalars, with transformers' GraniteConfig defaults (its attention
    scale defaults to 1.0, not 1/sqrt(head_dim))."""
    return dict(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
                logits_scaling=float(hf.get("logits_scaling", 1.0)))


def _moe_fields(hf: dict, arch: str) -> dict:
    """The expert fields of a Qwen3-MoE or Mixtral config, with transformers' defaults.

    Mixtral's experts have the config's intermediate_size and renormalize their top-k
    weights always; Qwen3-MoE names both and may keep dense layers between sparse ones.
    """
    _reject_unsupported_moe(hf)
    # transformers 5 saves either family's count as num_local_experts; the hub's Qwen3-MoE
    # configs name it num_experts
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if arch == "MixtralForCausalLM":
        return dict(num_experts=num_experts or 8, num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    return dict(num_experts=num_experts or 128, num_experts_per_tok=hf.get("num_experts_per_tok", 8),
                moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def _reject_unsupported_moe(hf: dict) -> None:
    """Expert features of other families (shared experts, other routing) are refused by name."""
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key):
            raise ValueError(f"shared experts ({key}={hf[key]}) are not supported")
    scoring = hf.get("scoring_func", "softmax")
    if scoring not in SUPPORTED_ROUTING_FUNCTIONS:
        raise ValueError(f"routing function (scoring_func) {scoring!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROUTING_FUNCTIONS)})")
    if hf.get("topk_method", "greedy") != "greedy" or hf.get("n_group", 1) not in (None, 1):
        raise ValueError(f"grouped top-k routing (topk_method={hf.get('topk_method')!r}, "
                         f"n_group={hf.get('n_group')}) is not supported")


def _check_experts(cfg: "ModelConfig") -> None:
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={cfg.num_experts}], "
                         f"got {cfg.num_experts_per_tok}")
    if cfg.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size must be positive, got {cfg.moe_intermediate_size}")
    if cfg.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be positive, got {cfg.decoder_sparse_step}")


def _rope_settings(hf: dict, arch: str) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # what transformers' Phi3Config reads both as
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "yarn" and not params.get("original_max_position_embeddings"):
        # as transformers' standardize_rope_params: yarn scales from the config's own length
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    return float(theta), {"rope_type": rope_type, **params}


def _sliding_window(hf: dict, arch: str) -> int | None:
    """The window of the layers that attend through one, or None, as transformers reads it.

    Mistral's applies to every layer (4096 when the field is absent; null: none), Mixtral's
    too (none when absent); transformers 5 lists each layer's kind in `layer_types`;
    Qwen2/Qwen3 configs carry a `sliding_window` that applies with `use_sliding_window`, to
    the layers from `max_window_layers` on.
    """
    window = hf.get("sliding_window")
    if arch == "MixtralForCausalLM":  # transformers' MixtralConfig: no window unless one is given
        used = window is not None
    elif arch == "MistralForCausalLM":
        window = hf.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        used = window is not None
    elif hf.get("layer_types"):
        used = "sliding_attention" in hf["layer_types"]
    elif "use_sliding_window" in hf:
        first_sliding = hf.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS)
        used = bool(hf["use_sliding_window"]) and first_sliding < hf["num_hidden_layers"]
    else:
        used = window is not None
    if not used:
        return None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding window attention needs a positive sliding_window, got {window!r}")
    return window


def _reject_unsupported(hf: dict) -> None:
    if set(hf.get("layer_types") or []) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types other than full_attention and sliding_attention are not supported: "
                         f"{set(hf['layer_types'])}")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
