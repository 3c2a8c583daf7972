"""GGUF files: hyperparameters, weights (dequantized, HF names) and tokenizer.

`ModelSource` calls three functions here for a `.gguf` path:

- `gguf_model_config(path)`: a `ModelConfig` from the file's metadata (granite,
  llama, phi3, qwen2, qwen3 and qwen3moe architectures; a llama file with
  `llama.expert_count` is Mixtral).
- `iter_gguf_weights(path)`: `(HF-style name, float32 tensor)` for every tensor,
  dequantized by `utils/dequant.py`, with llama.cpp's Q/K row permutation undone
  for llama and granite files. A 4-bit, Q8_0, Q6_K or Q5_K matrix also carries its raw blocks
  (`tensor.gguf_raw`, `tensor.gguf_type`) for the CPU's kernels (QUANTIZED_LINEAR_TYPES). Expert tensors keep llama.cpp's layout (one tensor per
  layer with a leading expert dimension, `ffn_*_exps`, or one per expert in older
  Mixtral files, `ffn_*.E`), which `layers/fused_moe.py` packs as it packs HF's.
- `gguf_tokenizer(path)`: an HF fast tokenizer built from the file's vocabulary,
  merges, special tokens and chat template (by transformers' GGUF converter, so it
  matches `AutoTokenizer.from_pretrained(dir, gguf_file=...)`).

The header is parsed here with `struct` over a memory map, using the `gguf`
package's type enums: `gguf.GGUFReader` builds a numpy view per string and takes
about 3 s on a 49k-token vocabulary, against a few hundredths of a second here.
The parsed header is cached per file, so the three calls read it once.
"""
import functools
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterator

import torch
from tqdm.auto import tqdm

from nanovllm.model_config import ModelConfig
from nanovllm.utils.dequant import dequantize, num_bytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)       # v1 (32-bit counts) predates every file in use
DEFAULT_ALIGNMENT = 32            # llama.cpp's default when general.alignment is absent
HEADER_BYTES = 24                 # magic, version, tensor count, metadata count
# GGUF architecture -> HF architecture name of our model registry
ARCHITECTURES = {"granite": "GraniteForCausalLM", "llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MIXTRAL = "MixtralForCausalLM"  # a llama file with experts
# llama.cpp's expert gating functions (LLAMA_EXPERT_GATING_FUNC_TYPE): the supported one
EXPERT_GATING_SOFTMAX = 1
# architectures whose Q/K rows llama.cpp's converter interleaves (see unpermute_qk)
PERMUTED_QK = ("granite", "llama")
# scalar metadata value types: GGUFValueType id -> struct format
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("loading .gguf files needs the gguf package: pip install gguf") from None
    return gguf


# ---- the header ----------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (ggml's ne reversed)
    type_name: str           # ggml type, e.g. "Q4_K"
    offset: int              # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    metadata: dict
    tensors: dict[str, TensorInfo]
    data_start: int


class _Cursor:
    """Reads little-endian values from a buffer; running off its end is a truncated file."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def one(self, fmt: str):
        return self.unpack(fmt)[0]

    def string(self) -> str:
        length = self.one("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, value_type: int):
        if value_type in _SCALAR_FORMATS:
            return self.one(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"<{count}{_SCALAR_FORMATS[item_type][1]}"))
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse (once per file version) the metadata and tensor table of a GGUF file.

    Raises ValueError for a file that is not GGUF, is truncated, or holds an
    unsupported tensor type.
    """
    st = os.stat(path)
    return _read_header_cached(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_header_cached(path: str, mtime_ns: int, size: int) -> GGUFHeader:
    if size < HEADER_BYTES:
        raise ValueError(f"{path} is not a GGUF file ({size} bytes, too short for a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            return _parse(_Cursor(buf, path), path, size)
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ValueError(f"{path} is truncated or corrupt: its GGUF header cannot be read ({e})") from None


def _parse(cur: _Cursor, path: str, size: int) -> GGUFHeader:
    cur.pos = 4
    version, num_tensors, num_kv = cur.unpack("<IQQ")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    metadata = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.one("<I"))
    raw_tensors = [_tensor_entry(cur) for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{path}: general.alignment must be a positive integer, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in raw_tensors:
        type_name = _type_name(type_id)
        try:
            info = TensorInfo(name, shape, type_name, offset, num_bytes(type_name, shape))
        except ValueError as e:
            raise ValueError(f"{path}: tensor {name!r}: {e}") from None
        end = data_start + offset + info.nbytes
        if end > size:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {end}, "
                             f"but the file has {size} bytes")
        tensors[name] = info
    return GGUFHeader(path, metadata, tensors, data_start)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.one("<I")
    dims = cur.unpack(f"<{n_dims}Q")
    type_id, offset = cur.unpack("<IQ")
    return name, tuple(reversed(dims)), type_id, offset


def _type_name(type_id: int) -> str:
    try:
        return _gguf().GGMLQuantizationType(type_id).name
    except ValueError:
        raise ValueError(f"unknown GGUF tensor type id {type_id}") from None


# ---- hyperparameters -------------------------------------------------------------

def gguf_model_config(path: str) -> ModelConfig:
    """The normalized hyperparameters of a GGUF model (one of ARCHITECTURES)."""
    header = read_gguf_header(path)
    md = header.metadata
    arch = _architecture(header)

    def get(key: str, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = md.get(f"{arch}.attention.key_length") or hidden // heads
    _check_rope_dims(path, md.get(f"{arch}.rope.dimension_count"), head_dim)
    return ModelConfig(
        architecture=MIXTRAL if arch == "llama" and md.get("llama.expert_count") else ARCHITECTURES[arch],
        vocab_size=md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ())) or
        header.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=md.get(f"{arch}.feed_forward_length") or get("expert_feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=md.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in header.tensors,
        rope_scaling=_rope_scaling(header, arch),
        eos_token_ids=_eos_ids(md),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        dtype=_file_dtype(header),
        quantization_config={"quant_method": "gguf"} if _file_dtype(header) is None else None,
        # llama.cpp writes 0 for "no window" (phi3 files of Phi-4)
        sliding_window=md.get(f"{arch}.attention.sliding_window") or None,
        **_granite_scalars(md, arch),
        **_expert_fields(header, arch),
    )


def _expert_fields(header: GGUFHeader, arch: str) -> dict:
    """ModelConfig's expert fields from llama.cpp's keys (none for a dense file). GGUF has
    no dense layers between sparse ones; llama.cpp renormalizes the top-k weights of both
    families unless the file says otherwise (expert_weights_norm)."""
    md = header.metadata
    count = md.get(f"{arch}.expert_count") or 0
    if not count:
        return {}
    if md.get(f"{arch}.expert_shared_count"):
        raise ValueError(f"{header.path}: shared experts ({arch}.expert_shared_count="
                         f"{md[f'{arch}.expert_shared_count']}) are not supported")
    gating = md.get(f"{arch}.expert_gating_func", EXPERT_GATING_SOFTMAX)
    if gating != EXPERT_GATING_SOFTMAX:
        raise ValueError(f"{header.path}: expert gating function {gating} ({arch}.expert_gating_func) "
                         "is not supported (supported: 1, softmax)")
    return dict(num_experts=count, num_experts_per_tok=md.get(f"{arch}.expert_used_count") or 0,
                moe_intermediate_size=md.get(f"{arch}.expert_feed_forward_length")
                or md.get(f"{arch}.feed_forward_length") or 0,
                norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", True)))


def _granite_scalars(md: dict, arch: str) -> dict:
    """ModelConfig's Granite fields from llama.cpp's keys; an attention scale of 0 or none
    means 1/sqrt(head_dim) there, as None does here."""
    return dict(embedding_multiplier=float(md.get(f"{arch}.embedding_scale", 1.0)),
                residual_multiplier=float(md.get(f"{arch}.residual_scale", 1.0)),
                attention_multiplier=float(md[f"{arch}.attention.scale"]) if md.get(f"{arch}.attention.scale")
                else None,
                logits_scaling=float(md.get(f"{arch}.logit_scale", 1.0)))


def _architecture(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{header.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def _check_rope_dims(path: str, rope_dims: int | None, head_dim: int) -> None:
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{path}: partial rotary embedding (rope.dimension_count {rope_dims} "
                         f"< head_dim {head_dim}) is not supported")


def _rope_scaling(header: GGUFHeader, arch: str) -> dict | None:
    md = header.metadata
    if "rope_freqs.weight" in header.tensors:
        raise ValueError(f"{header.path}: per-frequency rope factors (tensor rope_freqs.weight, "
                         "llama 3.1-style rope scaling) are not supported in GGUF files")
    if "rope_factors_long.weight" in header.tensors:
        raise ValueError(f"{header.path}: longrope scaling (tensors rope_factors_long/short.weight, "
                         "Phi-3 128k-style) is not supported")
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    raise ValueError(f"{header.path}: rope scaling type {kind!r} is not supported (supported: none, linear, yarn)")


def _eos_ids(md: dict) -> tuple[int, ...]:
    """EOS, plus llama.cpp's end-of-turn and end-of-message tokens where the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(md[k]) for k in keys if k in md))


def _file_dtype(header: GGUFHeader) -> str | None:
    """The checkpoint dtype of an unquantized file (its 2-D tensors' type); None when quantized."""
    types = {t.type_name for t in header.tensors.values() if len(t.shape) == 2}
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    return names.get(types.pop()) if len(types) == 1 else None


# ---- weights -------------------------------------------------------------------

# block types whose raw blocks a weight keeps beside its dequantized values
QUANTIZED_LINEAR_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")

# GGUF tensor name -> HF name; blk.N.<key> maps to model.layers.N.<value>
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # experts: the router, then each projection of every expert (a leading expert dimension)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}
# older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# where an architecture names its layer tensors otherwise: Phi-3 keeps q/k/v and gate/up fused
# (its ffn_up is gate and up), as its HF checkpoints do
ARCH_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, path: str, arch: str) -> str:
    """llama.cpp's tensor name -> the HF checkpoint name, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    if m := _EXPERT_RE.fullmatch(gguf_name):
        layer, projection, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, key, kind = m.groups()
        names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
        if key in names:
            return f"model.layers.{layer}.{names[key]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"{path}: GGUF tensor {gguf_name!r} has no place in the supported models")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (llama family).

    convert_hf_to_gguf.py stores each head's rows as (half, 2) pairs so that ggml's
    rope rotates adjacent values; HF's rotate-half layout keeps them as (2, half).
    w: [num_heads * head_dim, ...] (a weight or a bias).
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a GGUF file, dequantized."""
    header = read_gguf_header(path)
    arch = _architecture(header)
    cfg = gguf_model_config(path)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    infos = tqdm(header.tensors.values(), desc="Loading GGUF tensors", unit="tensor", leave=False,
                 disable=None)  # None: shown on a terminal only
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for info in infos:
            start = header.data_start + info.offset
            raw = torch.frombuffer(bytearray(buf[start:start + info.nbytes]), dtype=torch.uint8)
            tensor = dequantize(raw, info.type_name, info.shape)
            key = info.name.split(".")[2] if info.name.startswith("blk.") else None
            if arch in PERMUTED_QK and key in heads:
                tensor = unpermute_qk(tensor, heads[key])
                raw = unpermute_qk(raw.view(info.shape[0], -1), heads[key])  # whole rows move
            if len(info.shape) == 2 and info.type_name in QUANTIZED_LINEAR_TYPES:
                # the file's blocks too, for layers that keep them (layers/quantization/gguf.py)
                tensor.gguf_raw, tensor.gguf_type = raw, info.type_name
            yield hf_name(info.name, path, arch), tensor


# ---- tokenizer -----------------------------------------------------------------

# llama.cpp tokenizer metadata -> the names transformers' GGUF tokenizer converter reads
TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                  "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(path: str):
    """An HF fast tokenizer from the file's vocabulary, special tokens and chat template."""
    return gguf_tokenizer_loader(path)()


def gguf_tokenizer_loader(path: str):
    """`gguf_tokenizer(path)` as a function to call later; the modules it needs are imported now."""
    from transformers import PreTrainedTokenizerFast
    convert = _tokenizer_converter()

    def load():
        md = read_gguf_header(path).metadata
        if "tokenizer.ggml.tokens" not in md:
            raise ValueError(f"{path} has no tokenizer in its metadata; pass tokenizer=<HF tokenizer dir>")
        tokenizer_dict = {name: md[f"tokenizer.ggml.{key}"] for key, name in TOKENIZER_KEYS.items()
                          if f"tokenizer.ggml.{key}" in md}
        backend, extra = convert(md["general.architecture"], tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **_tokenizer_config(md), **extra)
    return load


def _tokenizer_config(md: dict) -> dict:
    tokens = md["tokenizer.ggml.tokens"]
    config = {name: tokens[md[f"tokenizer.ggml.{key}"]] for name, key in SPECIAL_TOKENS.items()
              if f"tokenizer.ggml.{key}" in md}
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise
    default_bos = md.get("tokenizer.ggml.model") == "llama"
    config["add_bos_token"] = bool(md.get("tokenizer.ggml.add_bos_token", default_bos))
    config["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False))
    return config


def _tokenizer_converter():
    """transformers' `convert_gguf_tokenizer(architecture, tokenizer_dict)`."""
    try:  # transformers >= 5.x
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer
    return convert_gguf_tokenizer
