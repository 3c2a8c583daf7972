"""FP8 KV cache: the cache dtypes `kv_cache_dtype` names, and the torch quantize/dequantize
that the CPU attention path and the tests use (the Triton kernels do the same inline).

A cache element is `fp8(clamp(x / scale))` and reads back as `fp8 * scale`. Scales are
float32 tensors `[num_kv_heads]`, one for K and one for V in each layer, fixed for the
cache's lifetime (`engine/kv_scales.py` sets them at start-up): a prefix-cache hit reads
blocks written long before, so a scale may never change under them.

torch's CPU kernels for `index_copy_`, `index_select` and indexing do not all take float8
dtypes, so the CPU path moves cache rows through `uint8` views of the same bytes (`as_bytes`).
"""
import torch

# vLLM's values; "fp8" is e4m3 (OCP float8_e4m3fn: no inf, max 448), as on Hopper and Ada.
KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 conversions and matrix units


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype: the model's for "auto", else the fp8 dtype `name` means."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def check_fp8_device(device: torch.device, option: str) -> None:
    """A clear error at start for an fp8 option on a GPU without fp8 (before sm_89)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"{option} needs a GPU with fp8 (compute capability >= "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: Ada or Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [num_tokens, num_kv_heads, head_dim]; scale: [num_kv_heads] -> fp8 of x's shape."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: fp8 [..., num_kv_heads, head_dim]; scale: [num_kv_heads] -> `dtype` of x's shape."""
    return (x.float() * scale[:, None]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (fp8 is one byte), for copies torch has no float8 kernel for."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo `as_bytes`."""
    return t.view(dtype) if t.dtype != dtype else t
