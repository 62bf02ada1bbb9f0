"""Paged KV cache: store and attention, torch reference implementations.

Cache layout, per layer: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; slot -1 means "do not store".

A step's queries are a flattened variable-length batch: q is [T, num_heads, head_dim] with
sequence b owning rows cu_seqlens_q[b]:cu_seqlens_q[b+1]. context_lens[b] counts every token of
sequence b in the cache *including* this step's new ones (stored before attention runs), so
query i of sequence b sits at position context_lens[b] - q_len_b + i and attends causally to
cache positions 0..that position. Decode is the q_len == 1 case.
"""
import torch
import torch.nn.functional as F


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    # key, value: [N, Hkv, D]; slot_mapping: [N]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def _gather_slots(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    # [B, max_len] slot index of every cache position; positions past a sequence's length point at slot 0
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].long()
    slots = blocks * block_size + (pos % block_size)
    return torch.where(pos[None, :] < lengths[:, None], slots, torch.zeros_like(slots))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; see the module docstring for the layout."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    ctx = context_lens.tolist()
    starts = cu_seqlens_q[:-1].tolist()
    out = torch.empty_like(q)

    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        lens = context_lens[idx]
        max_len = max(ctx[b] for b in decode)
        slots = _gather_slots(block_tables[idx], lens, block_size, max_len)
        k = flat_k[slots].transpose(1, 2)                                   # [B, Hkv, L, D]
        v = flat_v[slots].transpose(1, 2)
        rows = cu_seqlens_q[:-1][idx]
        qd = q[rows].unsqueeze(2)                                           # [B, Hq, 1, D]
        mask = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(qd.to(k.dtype), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(2).to(q.dtype)

    for b, n in enumerate(q_lens):
        if n == 1:
            continue
        length = ctx[b]
        slots = _gather_slots(block_tables[b:b + 1], context_lens[b:b + 1], block_size, length)[0]
        k = flat_k[slots].transpose(0, 1)                                   # [Hkv, L, D]
        v = flat_v[slots].transpose(0, 1)
        qb = q[starts[b]:starts[b] + n].transpose(0, 1)                     # [Hq, n, D]
        q_pos = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qb.to(k.dtype), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[b]:starts[b] + n] = o.transpose(0, 1).to(q.dtype)
    return out
