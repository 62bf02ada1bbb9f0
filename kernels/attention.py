"""The one attention interface the model code calls: pick a backend, store K/V, attend.

The only place that chooses between the implementations: the Triton kernels (backend "triton"), the native CPU ops
of kernels/cpu_ops.py (backend "torch" on CPU tensors, when built; TIDEPOOL_CPU_KERNELS=0 rules them out) and the
pure-torch references of kernels/paged_attention.py, which define the results and which every fast path is tested
against (tests/kernels)."""

import torch

from tidepool.kernels.kv_quant import head_dim_of, per_channel
from tidepool.kernels.paged_attention import paged_attention_ref, paged_decode_ref, store_kv_ref

BACKENDS = ("torch", "triton")


def resolve_backend(device: torch.device | str, requested: str | None = None) -> str:
    """`requested` (EngineConfig.attention_backend: TIDEPOOL_ATTENTION_BACKEND) wins; otherwise Triton on CUDA,
    torch elsewhere."""
    name = requested or None
    if name is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    return name


def store_kv(backend: str, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k_scale, v_scale [Hkv] or [Hkv, D]: a quantized cache's channel scales (kernels/kv_quant.py), None for a 16/32-bit
    cache."""
    if backend == "triton":
        from tidepool.kernels.triton_kv_store import store_kv_triton
        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.device.type == "cpu" and slot_mapping.dtype == torch.int64 and k_cache.is_contiguous():
        from tidepool.kernels.cpu_ops import native_op
        if k_scale is not None:     # quantized: the reference's codes and row scales, bit for bit
            op = native_op("store_kv_quant")
            if op is not None and key.stride(-1) == 1 and value.stride(-1) == 1:
                head_dim = key.shape[-1]
                return op(key, value, k_cache, v_cache, slot_mapping, per_channel(k_scale, head_dim),
                          per_channel(v_scale, head_dim))
        else:
            op = native_op("store_kv")
            if op is not None and key.stride(-1) == 1 and value.stride(-1) == 1 and key.dtype == k_cache.dtype:
                return op(key, value, k_cache, v_cache, slot_mapping)
    return store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


NATIVE_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                       torch.int8)


def _native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, k_scale=None, v_scale=None) -> torch.Tensor | None:
    """The native CPU decode kernel when it applies (CPU tensors, head_dim a multiple of 8 up to 256), else None.
    A quantized cache is read as it is (codes widened in registers; a row's own scale multiplies its score and its
    probability, the channel scales are folded into q and the output)."""
    head_dim = head_dim_of(k_cache)
    if (q.device.type != "cpu" or k_cache.device.type != "cpu" or head_dim % 8 or head_dim > 256
            or k_cache.dtype not in NATIVE_CACHE_DTYPES):
        return None
    from tidepool.kernels.cpu_ops import paged_decode_op
    op = paged_decode_op(wait=False)      # None while its first build runs in the background
    if op is None:
        return None
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if k_scale is not None:     # q and the output stay fp32 or bf16
        wide = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = op(q.to(wide).contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_tables,
                 context_lens.to(torch.int32).contiguous(), float(scale), per_channel(k_scale, head_dim),
                 per_channel(v_scale, head_dim))
        return out.to(q.dtype)
    out = op(q.to(k_cache.dtype).contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_tables,
             context_lens.to(torch.int32).contiguous(), float(scale))
    return out.to(q.dtype)


def cpu_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """Decode rows (one query per sequence) for the "torch" backend: the native kernel if it applies, else the
    reference."""
    out = _native_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    return out if out is not None else paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                        k_scale, v_scale)


def paged_attention(backend: str, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q: int,
                    scale: float, key=None, value=None, k_scale=None, v_scale=None) -> torch.Tensor:
    """key, value: the step's new K/V rows (already stored), which the torch path reads instead of the cache
    for sequences that are all new (16/32-bit caches). k_scale, v_scale: a quantized cache's scales."""
    if backend == "triton":
        from tidepool.kernels.triton_paged_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q,
                                      scale, k_scale=k_scale, v_scale=v_scale)
    if max_seqlen_q == 1:       # a pure decode step: rows are sequences, nothing to plan per sequence
        return cpu_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, key, value,
                               decode=cpu_decode, k_scale=k_scale, v_scale=v_scale)
