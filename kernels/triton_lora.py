"""Triton SGMV (Punica): the low-rank products of a step's adapters, grouped by slot (layout in kernels/lora_ops.py).

shrink: a program takes BLOCK_M rows of one segment and computes xa = x[rows] @ a[slot] ([M, R], fp32);
expand: a program takes BLOCK_M rows and BLOCK_N output columns and adds xa @ b[slot] into y[rows].
Rows are gathered through `rows`, so the tokens of one adapter need not be adjacent. A row belongs to one segment,
so no two programs write the same y element. Grids come from host-known sizes (segments, longest segment).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x, a, xa, rows, seg_starts, seg_slots, stride_xt, stride_as, stride_ak,
                   K, R, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(0)
    start = tl.load(seg_starts + g)
    end = tl.load(seg_starts + g + 1)
    slot = tl.load(seg_slots + g).to(tl.int64)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    row = tl.load(rows + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        xt = tl.load(x + row[:, None] * stride_xt + (k0 + offs_k)[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)            # [M, K]
        at = tl.load(a + slot * stride_as + (k0 + offs_k)[:, None] * stride_ak + offs_r[None, :],
                     mask=k_mask[:, None] & (offs_r < R)[None, :], other=0.0).to(tl.float32)      # [K, R]
        acc += tl.dot(xt, at, input_precision="ieee")
    tl.store(xa + offs_m[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _expand_kernel(xa, b, y, rows, seg_starts, seg_slots, stride_yt, stride_bs, stride_br,
                   N, R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(0)
    start = tl.load(seg_starts + g)
    end = tl.load(seg_starts + g + 1)
    slot = tl.load(seg_slots + g).to(tl.int64)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    row = tl.load(rows + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    xt = tl.load(xa + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)   # [M, R]
    bt = tl.load(b + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                 mask=(offs_r < R)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)            # [R, N]
    delta = tl.dot(xt, bt, input_precision="ieee")
    ptrs = y + row[:, None] * stride_yt + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + delta).to(y.dtype.element_ty), mask=mask)


def sgmv_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_len: int,
                block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    # x: [T, in], y: [T, out], a: [S, in, R], b: [S, R, out]; rows [N], seg_starts [G + 1], seg_slots [G]
    assert x.stride(1) == 1 and y.stride(1) == 1, "x and y rows must be contiguous"
    assert a.stride(2) == 1 and b.stride(2) == 1, "a and b must be contiguous in their last dimension"
    assert rows.dtype == torch.int64 and not seg_starts.is_floating_point() and not seg_slots.is_floating_point()
    groups = seg_slots.shape[0]
    if groups == 0 or max_len == 0:
        return y
    rank, out = b.shape[1], b.shape[2]
    block_r = max(16, triton.next_power_of_2(rank))
    xa = torch.empty(rows.shape[0], block_r, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(max_len, block_m)
    _shrink_kernel[(groups, m_blocks)](x, a, xa, rows, seg_starts, seg_slots, x.stride(0), a.stride(0),
                                       a.stride(1), x.shape[1], rank,
                                       BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r)
    _expand_kernel[(groups, m_blocks, triton.cdiv(out, block_n))](
        xa, b, y, rows, seg_starts, seg_slots, y.stride(0), b.stride(0), b.stride(1), out, rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return y
