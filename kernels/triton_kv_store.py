"""Triton KV store: write a step's K/V rows into their cache slots (layout in kernels/paged_attention.py); into a
quantized cache (kernels/kv_quant.py) as rows of codes and their own fp16 scale: x / scale[head, channel] / r, int8
rounded half away from zero (torch rounds halves to even: the two differ only on exact halves)."""
import torch
import triton
import triton.language as tl

from tidepool.kernels.kv_quant import QMAX, head_dim_of, per_channel


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, key_stride, value_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key + token.to(tl.int64) * key_stride + offs, mask=mask)
        v = tl.load(value + token.to(tl.int64) * value_stride + offs, mask=mask)
        tl.store(k_cache + slot * ROW + offs, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + slot * ROW + offs, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x_ptr, cache, cache_bytes, scale_ptr, slot, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
    """One token's rows [HEADS, HEAD_DIM] (x_ptr at its first element) into the cache slot: per head, x / scale takes
    its own fp16 scale r (|max| / QMAX; 1 for an all-zero row), codes x / scale / r, then r's two bytes."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_DIM)
    offs = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(scale_ptr + offs, mask=mask, other=1.0)
    r = tl.minimum(tl.max(tl.abs(y), 1) / QMAX, 65504.0).to(tl.float16)
    r = tl.where(r > 0, r, 1.0).to(tl.float16)
    y = y / r.to(tl.float32)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    width = HEAD_DIM + 2
    base = slot * (HEADS * width)
    tl.store(cache + base + offs_h[:, None] * width + offs_d[None, :], y.to(cache.dtype.element_ty), mask=mask)
    bits = r.to(tl.uint16, bitcast=True)
    h_mask = offs_h < HEADS
    tl.store(cache_bytes + base + offs_h * width + HEAD_DIM, (bits & 0xFF).to(tl.uint8), mask=h_mask)
    tl.store(cache_bytes + base + offs_h * width + HEAD_DIM + 1, (bits >> 8).to(tl.uint8), mask=h_mask)


@triton.jit
def _store_kv_quant_kernel(key, value, k_cache, v_cache, k_bytes, v_bytes, slot_mapping, key_stride, value_stride,
                           k_scale, v_scale, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:
        _quantize_rows(key + token.to(tl.int64) * key_stride, k_cache, k_bytes, k_scale, slot, HEADS, HEAD_DIM,
                       BLOCK_H, BLOCK_D, QMAX, INT8)
        _quantize_rows(value + token.to(tl.int64) * value_stride, v_cache, v_bytes, v_scale, slot, HEADS, HEAD_DIM,
                       BLOCK_H, BLOCK_D, QMAX, INT8)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    # key, value: [N, Hkv, D] (rows may be strided, e.g. views of a fused qkv); caches: [blocks, block_size, Hkv, D]
    # (D + 2 a row if quantized: the codes, then the row's fp16 scale)
    n, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k_cache and v_cache differ"
    assert (k_cache.shape[2], head_dim_of(k_cache)) == (num_kv_heads, head_dim), \
        f"cache heads/dim {(k_cache.shape[2], head_dim_of(k_cache))} do not match key {(num_kv_heads, head_dim)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    for name, t in (("key", key), ("value", value)):
        assert t.stride(-1) == 1 and t.stride(-2) == head_dim, f"{name} must be contiguous within a token"
    assert slot_mapping.shape == (n,) and not slot_mapping.is_floating_point(), "slot_mapping must be [N] integers"
    assert len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) == 1, "tensors on different devices"
    assert (k_cache.dtype in QMAX) == (k_scale is not None), "a quantized cache comes with its scales"
    if n == 0:
        return
    if k_scale is None:
        row = num_kv_heads * head_dim
        _store_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                               ROW=row, BLOCK=triton.next_power_of_2(row))
        return
    k_scale, v_scale = per_channel(k_scale, head_dim), per_channel(v_scale, head_dim)
    _store_kv_quant_kernel[(n,)](key, value, k_cache, v_cache, k_cache.view(torch.uint8), v_cache.view(torch.uint8),
                                 slot_mapping, key.stride(0), value.stride(0), k_scale, v_scale, HEADS=num_kv_heads,
                                 HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                                 BLOCK_D=triton.next_power_of_2(head_dim), QMAX=QMAX[k_cache.dtype],
                                 INT8=k_cache.dtype == torch.int8)
