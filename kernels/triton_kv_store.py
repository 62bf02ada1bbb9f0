"""Triton KV store: write a step's K/V rows into their cache slots (layout in kernels/paged_attention.py); into a
quantized cache (kernels/kv_quant.py) as codes: x / scale[head], saturated, int8 rounded half away from zero (torch
rounds halves to even: the two differ only on exact halves)."""
import torch
import triton
import triton.language as tl

from tidepool.kernels.kv_quant import QMAX, per_channel


@triton.jit
def _quantize(x, scale_ptr, offs, mask, QMAX: tl.constexpr, INT8: tl.constexpr):
    y = x.to(tl.float32) / tl.load(scale_ptr + offs, mask=mask, other=1.0)       # scales [Hkv, D]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return y


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, key_stride, value_stride, k_scale, v_scale,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                     QMAX: tl.constexpr, INT8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key + token.to(tl.int64) * key_stride + offs, mask=mask)
        v = tl.load(value + token.to(tl.int64) * value_stride + offs, mask=mask)
        if QUANT:
            k = _quantize(k, k_scale, offs, mask, QMAX, INT8)
            v = _quantize(v, v_scale, offs, mask, QMAX, INT8)
        tl.store(k_cache + slot * ROW + offs, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + slot * ROW + offs, v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    # key, value: [N, Hkv, D] (rows may be strided, e.g. views of a fused qkv); caches: [blocks, block_size, Hkv, D]
    n, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k_cache and v_cache differ"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"cache heads/dim {tuple(k_cache.shape[2:])} do not match key {(num_kv_heads, head_dim)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    for name, t in (("key", key), ("value", value)):
        assert t.stride(-1) == 1 and t.stride(-2) == head_dim, f"{name} must be contiguous within a token"
    assert slot_mapping.shape == (n,) and not slot_mapping.is_floating_point(), "slot_mapping must be [N] integers"
    assert len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) == 1, "tensors on different devices"
    if n == 0:
        return
    row = num_kv_heads * head_dim
    quant = k_scale is not None
    if quant:
        k_scale, v_scale = per_channel(k_scale, head_dim), per_channel(v_scale, head_dim)
    _store_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                           k_scale if quant else key, v_scale if quant else value,
                           ROW=row, BLOCK=triton.next_power_of_2(row), HEAD_DIM=head_dim, QUANT=quant,
                           QMAX=QMAX.get(k_cache.dtype, 0.0), INT8=k_cache.dtype == torch.int8)
