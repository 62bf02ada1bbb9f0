"""Segmented gather matmul (SGMV, Punica): add each token's adapter's low-rank product to a base linear's output.

The tokens of one step are grouped by adapter slot: `rows` lists the token rows that carry an adapter, segment g
holding rows[seg_starts[g]:seg_starts[g + 1]], all of slot seg_slots[g]. For every such row
    y[row] += (x[row] @ a[slot]) @ b[slot]        a: [S, in, R], b: [S, R, out] (the adapter's scale folded in b)
Tokens of no adapter are in no segment and cost nothing. `sgmv_ref` defines the result; `sgmv` is the one entry
point the model calls: the Triton kernel (kernels/triton_lora.py) on CUDA tensors; on CPU, GEMMs straight on the
x / y slices of long runs of one adapter's rows (a prefill chunk: no gather, no temporary of y's size, only the
diagonal blocks of a stacked b), and for the remaining rows (decode tokens) the native op of
kernels/csrc/lora_cpu.cpp (fp32: one call per linear, tiles of a few rows of one adapter through its a and the
diagonal blocks of its b in registers, nothing gathered, padded or scattered; self-checked against sgmv_ref
once), else a padded batched matmul over the slots when their counts are similar, else a loop over slots.
"""
from dataclasses import dataclass, field

import torch

from tidepool.kernels.cpu_ops import CheckedOnce, native_op



@dataclass
class SGMVPlan:
    """A step's token grouping, built once and used by every adapted linear of every layer."""
    rows: torch.Tensor          # [N] int64 token rows with an adapter, grouped by segment
    seg_starts: torch.Tensor    # [G + 1] int32 offsets into rows
    seg_slots: torch.Tensor     # [G] int32 slot of each segment
    segments: list[tuple[int, int, int]]   # (slot, start, end) host copy of the above; end - start >= 1
    max_len: int
    # the CPU execution plan: long runs of adjacent rows of one slot (a prefill chunk) straight on x / y slices,
    # the other rows (decode tokens) gathered per slot, or as one padded batched matmul over the slots
    runs: list[tuple[int, int, int]] = field(default_factory=list)     # (slot, r0, r1): rows r0..r1-1
    rest: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, rows) outside the runs
    # the same rows as segments for the native op: int64 rows grouped by slot, offsets, slots
    rest_rows: torch.Tensor | None = None
    rest_starts: torch.Tensor | None = None
    rest_slots: torch.Tensor | None = None
    pad_rows: torch.Tensor | None = None    # [hi - lo + 1, L] rest rows per slot lo..hi, padding points at row 0
    pad_mask: torch.Tensor | None = None    # [hi - lo + 1, L, 1] 1 for real rows, 0 for padding
    slot_range: tuple[int, int] | None = None


def make_plan(token_slots: list[int], device: torch.device | str, dtype: torch.dtype = torch.float32,
              pad_waste: float = 2.0, min_run: int = 8) -> SGMVPlan | None:
    """token_slots: per token row of the step, its adapter slot or -1. None when no token has an adapter.
    On CPU, runs of at least `min_run` adjacent rows of one slot are computed on slices of x and y; the other rows
    as one padded batched matmul when that computes at most `pad_waste` times their rows, else per slot."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return None
    rows, starts, slots, segments = [], [0], [], []
    for slot in sorted(by_slot):
        r = by_slot[slot]
        segments.append((slot, len(rows), len(rows) + len(r)))
        rows.extend(r)
        starts.append(len(rows))
        slots.append(slot)
    max_len = max(e - s for _, s, e in segments)
    plan = SGMVPlan(torch.tensor(rows, dtype=torch.int64, device=device),
                    torch.tensor(starts, dtype=torch.int32, device=device),
                    torch.tensor(slots, dtype=torch.int32, device=device), segments, max_len)
    if torch.device(device).type != "cpu":
        return plan
    rest: dict[int, list[int]] = {}
    row, n = 0, len(token_slots)
    while row < n:
        slot, end = token_slots[row], row + 1
        while end < n and token_slots[end] == slot:
            end += 1
        if slot >= 0:
            if end - row >= min_run:
                plan.runs.append((slot, row, end))
            else:
                rest.setdefault(slot, []).extend(range(row, end))
        row = end
    if not rest:
        return plan
    plan.rest = [(slot, torch.tensor(r, dtype=torch.int64)) for slot, r in sorted(rest.items())]
    flat, offsets = [], [0]
    for _, r in sorted(rest.items()):
        flat.extend(r)
        offsets.append(len(flat))
    plan.rest_rows = torch.tensor(flat, dtype=torch.int64)
    plan.rest_starts = torch.tensor(offsets, dtype=torch.int64)
    plan.rest_slots = torch.tensor(sorted(rest), dtype=torch.int64)
    lo, hi = min(rest), max(rest)
    longest = max(map(len, rest.values()))
    if len(rest) > 1 and (hi - lo + 1) * longest <= pad_waste * sum(map(len, rest.values())):
        pad = [[0] * longest for _ in range(hi - lo + 1)]
        mask = [[0.0] * longest for _ in range(hi - lo + 1)]
        for slot, r in rest.items():
            pad[slot - lo][:len(r)] = r
            mask[slot - lo][:len(r)] = [1.0] * len(r)
        plan.pad_rows = torch.tensor(pad, dtype=torch.int64)
        plan.pad_mask = torch.tensor(mask, dtype=dtype)[:, :, None]
        plan.slot_range = (lo, hi)
    return plan


def sgmv_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """The definition: per segment, gather its rows, shrink through a[slot], expand through b[slot], add."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    for g, slot in enumerate(slots):
        idx = rows[starts[g]:starts[g + 1]]
        delta = (x[idx].float() @ a[slot].float()) @ b[slot].float()
        y.index_add_(0, idx, delta.to(y.dtype))
    return y


def _check(y, x, a, b, plan, blocks) -> None:
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], (x.shape, y.shape)
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0], (a.shape, b.shape)
    assert a.shape[1] == x.shape[1] and a.shape[2] == b.shape[1] and b.shape[2] == y.shape[1], \
        (x.shape, a.shape, b.shape, y.shape)
    assert x.device == y.device == a.device == b.device == plan.rows.device
    assert blocks is None or (sum(blocks) == b.shape[2] and b.shape[1] % len(blocks) == 0), (blocks, b.shape)


def _expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, blocks) -> None:
    """y += xa @ b in place (y a slice of rows); with `blocks`, b is block diagonal and only its blocks run."""
    if blocks is None or len(blocks) == 1:
        y.addmm_(xa, b)
        return
    r, c = b.shape[0] // len(blocks), 0
    for i, width in enumerate(blocks):
        y[:, c:c + width].addmm_(xa[:, i * r:(i + 1) * r], b[i * r:(i + 1) * r, c:c + width])
        c += width


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: SGMVPlan,
         blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """y += per-row adapter products, in place; x: [T, in], y: [T, out].
    blocks: the output widths of a stacked linear whose b is block diagonal (rank block i of b feeds output
    block i only, zero elsewhere, as the slot pool lays out q/k/v and gate/up); the CPU path then skips the
    zero blocks. The result is the same either way."""
    _check(y, x, a, b, plan, blocks)
    if y.device.type == "cuda":
        from tidepool.kernels.triton_lora import sgmv_triton
        return sgmv_triton(y, x, a, b, plan.rows, plan.seg_starts, plan.seg_slots, plan.max_len)
    for slot, r0, r1 in plan.runs:                      # prefill chunks: GEMMs on slices, no gather, no copy
        _expand(y[r0:r1], x[r0:r1] @ a[slot], b[slot], blocks)
    if not plan.rest:
        return y
    op = _native_rows(y, x, a, b)
    if op is not None:                                  # decode tokens: the native op, one call
        op(y, x, a, b, plan.rest_rows, plan.rest_starts, plan.rest_slots, list(blocks or ()))
    elif plan.pad_rows is not None:                     # decode tokens of several adapters: two batched matmuls
        lo, hi = plan.slot_range
        xa = torch.bmm(x[plan.pad_rows], a[lo:hi + 1]) * plan.pad_mask     # [G, L, R]; padding rows zeroed
        delta = torch.bmm(xa, b[lo:hi + 1])                                 # [G, L, out]
        y.index_add_(0, plan.pad_rows.view(-1), delta.view(-1, y.shape[1]))
    else:
        for slot, idx in plan.rest:
            y.index_add_(0, idx, (x[idx] @ a[slot]) @ b[slot])
    return y


def _native_rows(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """torch.ops.tidepool_cpu.lora_rows when built, self-checked and fit for these tensors (fp32, rows of x and y
    contiguous, a and b contiguous), else None (the torch paths serve)."""
    if not (y.dtype == x.dtype == a.dtype == b.dtype == torch.float32 and x.stride(-1) == 1 and y.stride(-1) == 1
            and a.is_contiguous() and b.is_contiguous() and a.shape[2] <= 512):
        return None
    op = native_op("lora_rows")
    if op is None:
        return None
    return op if _native_checked.ok() else None


def _self_check(op) -> None:
    """The op against sgmv_ref: stacked blocks, ranks and widths off the vector width, full and partial tiles, rows
    of no adapter, an adapter's rows scattered through the step, x and y with padded row strides."""
    gen = torch.Generator().manual_seed(0)
    for d_in, rank, blocks in ((40, 16, (24, 8, 8)), (70, 5, (33,)), (64, 16, (80, 80))):
        n, d_out = rank * len(blocks), sum(blocks)
        a = torch.randn(3, d_in, n, generator=gen)
        b = torch.randn(3, n, d_out, generator=gen)
        x = torch.randn(13, d_in + 3, generator=gen)[:, :d_in]
        y = torch.randn(13, d_out + 5, generator=gen)[:, :d_out]
        slots = [2, -1, 0, 2, 2, 1, 0, -1, 2, 2, 1, 2, 0]
        segs = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                segs.setdefault(slot, []).append(row)
        rows = [r for s in sorted(segs) for r in segs[s]]
        starts = [0]
        for s in sorted(segs):
            starts.append(starts[-1] + len(segs[s]))
        rows_t, starts_t, slots_t = (torch.tensor(v, dtype=torch.int64) for v in (rows, starts, sorted(segs)))
        want = y.clone()
        bd = torch.zeros_like(b)            # a stack's b is block diagonal (the op reads the diagonal blocks only)
        r0, c0 = 0, 0
        for width in blocks:
            bd[:, r0:r0 + rank, c0:c0 + width] = b[:, r0:r0 + rank, c0:c0 + width]
            r0, c0 = r0 + rank, c0 + width
        sgmv_ref(want, x, a, bd, rows_t, starts_t.to(torch.int32), slots_t.to(torch.int32))
        got = y                             # a view with a padded row stride
        op(got, x, a, bd, rows_t, starts_t, slots_t, list(blocks))
        err = (got - want).abs().max().item()
        if not err <= 1e-3:
            raise RuntimeError(f"self-check: max abs err {err} against sgmv_ref (blocks {blocks}, rank {rank})")


_native_checked = CheckedOnce(lambda: _self_check(native_op("lora_rows")), "native CPU LoRA op")
