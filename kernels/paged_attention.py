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


DECODE_GROUP = 8     # decode sequences of similar length attended together; bounds padding


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    # whole blocks [B, num_blocks * block_size, Hkv, D]; padded (-1) table entries read block 0
    blocks = tables[:, :num_blocks].long().clamp_min(0)
    gathered = cache.index_select(0, blocks.flatten())     # [B * nb, bs, Hkv, D]; far cheaper than cache[blocks]
    return gathered.view(blocks.shape[0], -1, *cache.shape[2:])


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] -> [B, Hq, D]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    lens = context_lens.tolist()
    out = torch.empty_like(q)
    order = sorted(range(len(lens)), key=lens.__getitem__)
    for start in range(0, len(order), DECODE_GROUP):
        members = order[start:start + DECODE_GROUP]
        idx = torch.tensor(members, device=q.device)
        num_blocks = -(-max(lens[b] for b in members) // block_size)
        k = _gather_blocks(k_cache, block_tables[idx], num_blocks)           # [b, L, Hkv, D]
        v = _gather_blocks(v_cache, block_tables[idx], num_blocks)
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
                        scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; see the module docstring for the layout."""
    block_size = k_cache.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    ctx = context_lens.tolist()
    starts = cu_seqlens_q[:-1].tolist()
    out = torch.empty_like(q)

    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = cu_seqlens_q[:-1][idx].long()
        out[rows] = _decode(q[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale)

    for b, n in enumerate(q_lens):
        if n == 1:
            continue
        length = ctx[b]
        num_blocks = -(-length // block_size)
        k = _gather_blocks(k_cache, block_tables[b:b + 1], num_blocks)[0, :length].transpose(0, 1)   # [Hkv, L, D]
        v = _gather_blocks(v_cache, block_tables[b:b + 1], num_blocks)[0, :length].transpose(0, 1)
        qb = q[starts[b]:starts[b] + n].transpose(0, 1)                     # [Hq, n, D]
        q_pos = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qb.to(k.dtype), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[b]:starts[b] + n] = o.transpose(0, 1).to(q.dtype)
    return out
