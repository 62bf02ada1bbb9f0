"""Triton paged attention over the KV cache (layout in kernels/paged_attention.py).

decode: one query token per sequence; a program takes one (sequence, KV head, split) and all the query heads
of that KV head together, so each K/V row is read once per group. Long contexts are split across programs
(flash-decoding) and a second kernel merges the splits by their log-sum-exp.
varlen: a tile of query tokens of one sequence and one query head, causal relative to the sequence's cached
prefix, so one launch serves a mixed batch of prefills, chunked-prefill chunks and decodes.

Both gather cache rows token by token through the block table, so any block size works, and both size their
grids from host-known shapes (block table width, max_seqlen_q), never from context_lens, so neither syncs.
Softmax runs in base 2 with fp32 accumulators; a sequence with no keys (context 0, e.g. a padding row) gets zeros.
A quantized cache (fp8 e4m3 / e5m2, int8; kernels/kv_quant.py) is read as codes and dequantized in registers: K's
channel scales (of the program's KV head) folded into q, V's into the output; each row's own fp16 scale (the two bytes
after its codes, read through a byte view of the cache) multiplies its score (K) or its probability before p . V (V).
"""
import functools
import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)

from tidepool.kernels.kv_quant import head_dim_of, per_channel  # noqa: E402
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MIN_SPLIT_TOKENS = 512   # a split shorter than this costs more in the merge than it wins in parallelism


@triton.jit
def _row_scales(cache_bytes, rows, mask, HEAD_DIM: tl.constexpr):
    """The fp16 scales of quantized cache rows (offsets `rows`), from the two bytes after each row's codes."""
    lo = tl.load(cache_bytes + rows + HEAD_DIM, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(cache_bytes + rows + HEAD_DIM + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, k_scale, v_scale,
                   k_bytes, v_bytes, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kslot, stride_kh, split_len,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    dot_ty = tl.float32 if UPCAST else (q.dtype.element_ty if QUANT else k_cache.dtype.element_ty)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens + seq)
    start = split * split_len
    end = tl.minimum(context, start + split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q_tile = tl.load(q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                     mask=qo_mask, other=0.0).to(dot_ty)            # [G, D]
    v_mul = tl.full([BLOCK_D], 1.0, tl.float32)
    if QUANT:       # scales per (KV head, channel): K's into q, V's into the output
        k_mul = tl.load(k_scale + kv_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        q_tile = (q_tile.to(tl.float32) * k_mul[None, :]).to(dot_ty)
        v_mul = tl.load(v_scale + kv_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_kslot + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dot_ty)   # [N, D]
        v = tl.load(v_cache + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dot_ty)
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale_log2          # [G, N]
        if QUANT:
            s = s * _row_scales(k_bytes, rows, n_mask, HEAD_DIM)[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        pv = p
        if QUANT:
            pv = p * _row_scales(v_bytes, rows, n_mask, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    safe_l = tl.where(l > 0, l, 1.0)
    o = acc / safe_l[:, None] * v_mul[None, :]
    if NUM_SPLITS == 1:
        tl.store(out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out.dtype.element_ty), mask=qo_mask)
    else:
        # part_out [B, Hq, S, D] fp32, part_lse [B, Hq, S]; an empty split has lse -inf
        row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_out + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qo_mask)
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out, stride_ot, stride_oh, num_heads,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse + base + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)                                                                # [S]
    o = tl.load(part_out + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)                       # [S, D]
    total = tl.sum(w, 0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, merged.to(out.dtype.element_ty),
             mask=d_mask)


@triton.jit
def _varlen_kernel(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, k_scale, v_scale,
                   k_bytes, v_bytes, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kslot, stride_kh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, QUANT: tl.constexpr):
    dot_ty = tl.float32 if UPCAST else (q.dtype.element_ty if QUANT else k_cache.dtype.element_ty)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    context = tl.load(context_lens + seq)
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    qo_mask = m_mask[:, None] & d_mask[None, :]
    tokens = (q_start + offs_m).to(tl.int64)
    q_pos = context - q_len + offs_m                                                      # [M]
    q_tile = tl.load(q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                     mask=qo_mask, other=0.0).to(dot_ty)              # [M, D]
    v_mul = tl.full([BLOCK_D], 1.0, tl.float32)
    if QUANT:
        k_mul = tl.load(k_scale + kv_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        q_tile = (q_tile.to(tl.float32) * k_mul[None, :]).to(dot_ty)
        v_mul = tl.load(v_scale + kv_head * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
    # keys up to the tile's last query; a tile past the sequence's queries runs no iterations
    kv_end = tl.where(tile * BLOCK_M < q_len, tl.minimum(context, context - q_len + (tile + 1) * BLOCK_M), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_kslot + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dot_ty)
        v = tl.load(v_cache + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(dot_ty)
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale_log2          # [M, N]
        if QUANT:
            s = s * _row_scales(k_bytes, rows, n_mask, HEAD_DIM)[None, :]
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # rows past q_len may see no key in this tile; keep their max finite so no NaN reaches acc
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        pv = p
        if QUANT:
            pv = p * _row_scales(v_bytes, rows, n_mask, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None] * v_mul[None, :]
    tl.store(out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=qo_mask)


def _check(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, Hkv, D]"
    num_kv_heads = k_cache.shape[2]
    assert head_dim_of(k_cache) == head_dim, f"q head_dim {head_dim} != cache head_dim {head_dim_of(k_cache)}"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"triton paged attention supports head_dim {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {head_dim}")
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} KV heads"
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in SUPPORTED_DTYPES + QUANTIZED_DTYPES:
        raise ValueError(f"triton paged attention supports {SUPPORTED_DTYPES} (caches also {QUANTIZED_DTYPES}), got "
                         f"q {q.dtype} cache {k_cache.dtype}")
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert q.stride(-1) == 1, "q must be contiguous in head_dim"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and not block_tables.is_floating_point(), \
        "block_tables must be [B, max_blocks] integers, contiguous per row"
    num_seqs = block_tables.shape[0]
    assert context_lens.shape == (num_seqs,) and cu_seqlens_q.shape == (num_seqs + 1,), \
        "context_lens must be [B] and cu_seqlens_q [B + 1]"
    assert context_lens.is_contiguous() and cu_seqlens_q.is_contiguous()
    assert len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)}) == 1, \
        "tensors on different devices"


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    sms = _sm_count(device)
    wanted = math.ceil(2 * sms / (batch * num_kv_heads))
    return max(1, min(wanted, math.ceil(max_context / MIN_SPLIT_TOKENS)))


def kernel_meta(kind: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device_type: str, num_splits: int = 1, max_seqlen_q: int = 1, quant: bool = False) -> dict:
    """Constexprs and num_warps for a launch of the decode ("decode") or varlen ("varlen") kernel. dtype: what the
    dots run in (the cache's, or q's over a quantized cache: quant)."""
    # CPU tensors only run under TRITON_INTERPRET, whose tl.dot returns garbage for bf16: feed it fp32 there.
    # fp32 dots stay exact (ieee) rather than tf32, since fp32 inputs are the tight-tolerance test path.
    upcast = dtype == torch.bfloat16 and device_type == "cpu"
    fp32 = dtype == torch.float32
    block_d = triton.next_power_of_2(head_dim)
    meta = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=block_d,
                # no config spills registers on sm_90 (tests/kernels/test_triton_compile.py compiles them for it);
                # fp32 dots run on FMA units and need the smallest tiles
                # a quantized cache's rows (codes and a 2-byte scale) are byte-aligned: narrower loads, more registers
                BLOCK_N=16 if fp32 else 64 if head_dim <= (64 if quant else 128) else 32,
                PRECISION="ieee" if fp32 or upcast else "tf32", UPCAST=upcast, QUANT=quant)
    if kind == "decode":
        meta.update(NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(meta["GROUP"])), num_warps=4)
    else:
        meta.update(BLOCK_M=16 if fp32 else min(64, max(16, triton.next_power_of_2(max_seqlen_q))),
                    num_warps=8 if block_d >= 128 else 4)
    return meta


def _compute_dtype(q, k_cache) -> tuple[torch.dtype, bool]:
    quant = k_cache.dtype in QUANTIZED_DTYPES
    return (q.dtype if quant else k_cache.dtype), quant


def _bytes(k_cache, v_cache, quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as bytes, for the row scales of a quantized one (the caches themselves, unused, otherwise)."""
    return (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if quant else (k_cache, v_cache)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                 num_splits: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    # q [B, Hq, D], one token per sequence -> out [B, Hq, D]
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    dtype, quant = _compute_dtype(q, k_cache)
    meta = kernel_meta("decode", num_heads, num_kv_heads, head_dim, block_size, dtype, q.device.type, quant=quant)
    splits = num_splits or _num_splits(batch, num_kv_heads, max_context, q.device)
    split_len = triton.cdiv(triton.cdiv(max_context, splits), meta["BLOCK_N"]) * meta["BLOCK_N"]
    meta["NUM_SPLITS"] = splits = triton.cdiv(max_context, split_len)
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        k_scale if quant else q, v_scale if quant else q, *_bytes(k_cache, v_cache, quant), scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2), split_len, **meta)
    if splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=meta["BLOCK_D"],
            num_warps=4)
    return out


def paged_varlen(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q: int,
                 scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    dtype, quant = _compute_dtype(q, k_cache)
    meta = kernel_meta("varlen", num_heads, num_kv_heads, head_dim, block_size, dtype, q.device.type,
                       max_seqlen_q=max_seqlen_q, quant=quant)
    grid = (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), num_heads, num_seqs)
    _varlen_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out,
        k_scale if quant else q, v_scale if quant else q, *_bytes(k_cache, v_cache, quant), scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2), **meta)
    return out


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q: int,
                           scale: float, num_splits: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """Same contract as paged_attention_ref; max_seqlen_q must bound every q_len (host int, no sync)."""
    _check(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    assert (k_cache.dtype in QUANTIZED_DTYPES) == (k_scale is not None), "a quantized cache comes with its scales"
    if k_scale is not None:
        k_scale, v_scale = per_channel(k_scale, q.shape[-1]), per_channel(v_scale, q.shape[-1])
    if max_seqlen_q == 1 and q.shape[0] == block_tables.shape[0]:
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, k_scale, v_scale)
    return paged_varlen(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale,
                        k_scale, v_scale)
