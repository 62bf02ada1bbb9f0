"""Paged KV cache: store and attention, torch reference implementations.

Cache layout, per layer: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; slot -1 means "do not store".

A step's queries are a flattened variable-length batch: q is [T, num_heads, head_dim] with
sequence b owning rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. context_lens[b] counts every token of
sequence b in the cache *including* this step's new ones (stored before attention runs), so
query i of sequence b sits at position context_lens[b] - q_len_b + i and attends causally to
cache positions 0..that position. Decode is the q_len == 1 case.

Only cache slots at positions < context_lens[b] of sequence b are meaningful: every other slot (the rest of its last
block, blocks of other sequences, block-table padding, which may be -1 or any block id) may hold anything, NaN
included, and must not affect the output. A decode row with context 0 (a CUDA-graph padding row) attends to
nothing; its output is unspecified (the native kernel writes zeros; the torch path may give NaN).

This module is pure torch and the definition of the contract: it imports no other kernel. The fast paths (the
native CPU decode kernel of kernels/csrc/paged_decode_cpu.cpp, the Triton kernels) are chosen in kernels/attention.py
only, and each is tested against the functions here. `paged_attention_ref` takes the function for its decode rows
(`decode`, default `paged_decode_ref`), which is how kernels/attention.py puts the native decode kernel under the
same varlen step.

A quantized cache (kernels/kv_quant.py: fp8 or int8 codes) is [num_blocks, block_size, num_kv_heads, head_dim + 2]:
each (token, KV head) row is head_dim codes followed by the row's own scale, an fp16 in the last two bytes, written
with the row (llama.cpp's q8_0 block is the same: an fp16 scale beside its codes). It comes with k_scale and v_scale
([Hkv] or [Hkv, D] fp32 each, per layer): a value is code * row scale * k_scale[head, channel]. The store quantizes,
every read dequantizes to q's dtype, so attention always sees the values the cache holds (a prompt attended whole,
in chunks or after a prefix-cache hit sees the same keys).
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F



QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}     # largest finite code
ROW_SCALE_BYTES = 2     # a quantized row's own scale, fp16, after its head_dim codes


def head_dim_of(cache: torch.Tensor) -> int:
    """head_dim of a cache [num_blocks, block_size, Hkv, head_dim (+ ROW_SCALE_BYTES if quantized)]."""
    return cache.shape[-1] - (ROW_SCALE_BYTES if cache.dtype in QMAX else 0)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [N, Hkv, D], scale [Hkv] or [Hkv, D] -> rows [N, Hkv, D + 2] of `dtype`: per (token, KV head), x / scale
    takes its own fp16 scale r (its |max| maps onto the type's largest code; r = 1 for an all-zero row), and the codes
    are x / scale / r (int8 rounded to nearest, fp8 as torch rounds), then r's two bytes."""
    limit = QMAX[dtype]
    y = x.float() / scale.float().view(scale.shape[0], -1)
    r = (y.abs().amax(-1, keepdim=True) / limit).clamp_(max=65504.0).half()
    r = torch.where(r > 0, r, torch.ones_like(r))
    y = (y / r.float()).clamp_(-limit, limit)
    if dtype == torch.int8:
        y = y.round_()
    codes = y.to(dtype).view(torch.uint8)
    return torch.cat([codes, r.view(torch.uint8)], -1).view(dtype)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., D + 2] of a quantized cache -> their fp16 scales [..., 1]."""
    return rows.view(torch.uint8)[..., -ROW_SCALE_BYTES:].view(torch.float16)


def dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., Hkv, D + 2] (quantize's), scale [Hkv] or [Hkv, D] -> values [..., Hkv, D] of `dtype`."""
    codes = rows[..., :-ROW_SCALE_BYTES].float() * row_scales(rows).float()
    return (codes * scale.float().view(scale.shape[0], -1)).to(dtype)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    # key, value: [N, Hkv, D]; slot_mapping: [N]
    if k_scale is not None:
        key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


DECODE_GROUP = 8     # decode sequences of similar length attended together; bounds padding
SHORT_CHUNK = 16     # paged_attention_ref attends chunks of at most this many queries as decode rows


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_blocks: int, scale: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    # whole blocks [B, num_blocks * block_size, Hkv, D]; padded (-1) table entries read block 0; a quantized cache's
    # codes (scale given) come back as `dtype` values
    blocks = tables[:, :num_blocks].long().clamp_min(0)
    gathered = cache.index_select(0, blocks.flatten())     # [B * nb, bs, Hkv, D]; far cheaper than cache[blocks]
    if scale is not None:
        gathered = dequantize(gathered, scale, dtype)
    return gathered.view(blocks.shape[0], -1, *gathered.shape[2:])


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] -> [B, Hq, D]. The pure-torch definition of decode attention."""
    block_size, num_kv_heads = k_cache.shape[1:3]
    head_dim = head_dim_of(k_cache)
    group = q.shape[1] // num_kv_heads
    lens = context_lens.tolist()
    out = torch.empty_like(q)
    order = sorted(range(len(lens)), key=lens.__getitem__)
    for start in range(0, len(order), DECODE_GROUP):
        members = order[start:start + DECODE_GROUP]
        idx = torch.tensor(members, device=q.device)
        num_blocks = -(-max(lens[b] for b in members) // block_size)
        k = _gather_blocks(k_cache, block_tables[idx], num_blocks, k_scale, q.dtype)      # [b, L, Hkv, D]
        v = _gather_blocks(v_cache, block_tables[idx], num_blocks, v_scale, q.dtype)
        valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[idx, None]   # [b, L]
        for row, b in enumerate(members):
            v[row, lens[b]:] = 0.0                         # slots past the end may hold anything, even NaN
        qg = q[idx].view(len(members), num_kv_heads, group, head_dim).to(k.dtype)
        o = torch.empty(len(members), num_kv_heads, group, head_dim, dtype=k.dtype, device=q.device)
        for h in range(num_kv_heads):
            scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).float()   # [b, G, L]
            scores.mul_(scale).masked_fill_(~valid[:, None, :], float("-inf"))
            o[:, h] = torch.bmm(scores.softmax(-1).to(v.dtype), v[:, :, h])
        out[idx] = o.view(len(members), -1, head_dim).to(q.dtype)
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                        decode: Callable[..., torch.Tensor] = paged_decode_ref, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; see the module docstring for the layout. key, value [T, Hkv, D]: the step's
    new K/V rows as stored in the cache, if at hand: a sequence that is all new reads them instead of the cache
    (an unquantized cache only). decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    attends the decode rows (q_len == 1)."""
    block_size = k_cache.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    ctx = context_lens.tolist()
    starts = cu_seqlens_q[:-1].tolist()
    out = torch.empty_like(q)

    if all(n == 1 for n in q_lens):          # a pure decode step: rows are sequences, no gathers
        return decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    # Short chunks (decodes, a verify step's k + 1 positions) go to `decode` row by row: query i of a chunk of n
    # over context L is a decode row with context L - n + i + 1. Longer ones are attended per sequence below.
    rows, seq_of_row, row_lens = [], [], []
    for b, n in enumerate(q_lens):
        if 0 < n <= SHORT_CHUNK:
            rows += range(starts[b], starts[b] + n)
            seq_of_row += [b] * n
            row_lens += range(ctx[b] - n + 1, ctx[b] + 1)
    if rows:
        idx = torch.tensor(seq_of_row, device=q.device)
        at = torch.tensor(rows, device=q.device)
        out[at] = decode(q[at], k_cache, v_cache, block_tables[idx],
                         torch.tensor(row_lens, dtype=context_lens.dtype, device=q.device), scale, k_scale, v_scale)

    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(q_lens):
        if n <= SHORT_CHUNK:
            continue
        length = ctx[b]
        if n == length and key is not None and key.dtype == k_cache.dtype:
            k = key[starts[b]:starts[b] + n].transpose(0, 1)                     # [Hkv, L, D]
            v = value[starts[b]:starts[b] + n].transpose(0, 1)
        else:
            num_blocks = -(-length // block_size)
            k = _gather_blocks(k_cache, block_tables[b:b + 1], num_blocks, k_scale, q.dtype)[0, :length].transpose(0, 1)
            v = _gather_blocks(v_cache, block_tables[b:b + 1], num_blocks, v_scale, q.dtype)[0, :length].transpose(0, 1)
        # query heads grouped by their KV head, [Hkv, G, n, D]; K/V broadcast over the group (stride 0, no copies),
        # so SDPA's fused CPU kernel applies
        kv_heads = k.shape[0]
        qb = q[starts[b]:starts[b] + n].view(n, kv_heads, group, -1).permute(1, 2, 0, 3).to(k.dtype)
        k, v = k.unsqueeze(1).expand(-1, group, -1, -1), v.unsqueeze(1).expand(-1, group, -1, -1)
        if n == length:     # the whole sequence is new: plain causal, which lets the kernel skip masked blocks
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(length - n, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out[starts[b]:starts[b] + n].view(n, kv_heads, group, -1).copy_(o.permute(2, 0, 1, 3))
    return out
