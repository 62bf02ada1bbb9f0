"""Quantized KV cache: its element types and scales. Quantize-on-store and dequantize-on-read are defined in pure
torch by the reference (kernels/paged_attention.py), which the native CPU and Triton kernels are tested against.

A quantized cache keeps keys and values as 8-bit codes: each (token, KV head) row is head_dim codes and the row's
own fp16 scale, set when the row is written (its |max| maps onto the type's largest code, so nothing is clipped).
Each layer also holds fp32 scales for K and for V per KV head ([Hkv]) or per KV head and channel ([Hkv, D], which the
kernels fold into q and into the output at no cost per element): they even out the channels (K's differ by an order
of magnitude after RoPE) before a row takes its scale. A stored value is code * row scale * channel scale.
"""
import torch

from tidepool.kernels.paged_attention import (  # noqa: F401 (the reference defines them)
    QMAX, ROW_SCALE_BYTES, dequantize, head_dim_of, quantize, row_scales)

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")     # "auto": the model's dtype, unquantized
STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else STORAGE[kv_cache_dtype]


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def cache_row_width(dtype: torch.dtype, head_dim: int) -> int:
    """The last dimension of a cache of `dtype`: head_dim, plus the row scale's bytes if quantized."""
    return head_dim + (ROW_SCALE_BYTES if dtype in QMAX else 0)


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype, headroom: float = 1.0) -> torch.Tensor:
    """Scales that map |x| <= amax * headroom onto the type's range; an all-zero head gets scale 1."""
    amax = amax.float()
    return torch.where(amax > 0, amax * headroom / QMAX[dtype], torch.ones_like(amax))


def per_channel(scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Scales [Hkv] or [Hkv, D] as the kernels take them: contiguous fp32 [Hkv, D]."""
    return scale.float().reshape(scale.shape[0], -1).expand(-1, head_dim).contiguous()
