"""The one attention interface the model code calls: pick a backend, store K/V, attend."""
import os

import torch

from kernels.paged_attention import paged_attention_ref, store_kv_ref

BACKENDS = ("torch", "triton")


def resolve_backend(device: torch.device | str, requested: str | None = None) -> str:
    """`requested` (or TIDEPOOL_ATTENTION_BACKEND) wins; otherwise Triton on CUDA, torch elsewhere."""
    name = requested or os.environ.get("TIDEPOOL_ATTENTION_BACKEND") or None
    if name is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    return name


def store_kv(backend: str, key, value, k_cache, v_cache, slot_mapping) -> None:
    if backend == "triton":
        from kernels.triton_kv_store import store_kv_triton
        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    if key.device.type == "cpu" and slot_mapping.dtype == torch.int64 and k_cache.is_contiguous():
        from kernels.cpu_ops import native_op
        op = native_op("store_kv")
        if op is not None and key.stride(-1) == 1 and value.stride(-1) == 1 and key.dtype == k_cache.dtype:
            return op(key, value, k_cache, v_cache, slot_mapping)
    return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(backend: str, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q: int,
                    scale: float, key=None, value=None) -> torch.Tensor:
    """key, value: the step's new K/V rows (already stored), which the torch path reads instead of the cache
    for sequences that are all new."""
    if backend == "triton":
        from kernels.triton_paged_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, key, value)
