"""Segmented gather matmul (SGMV, Punica): add each token's adapter's low-rank product to a base linear's output.

The tokens of one step are grouped by adapter slot: `rows` lists the token rows that carry an adapter, segment g
holding rows[seg_starts[g]:seg_starts[g + 1]], all of slot seg_slots[g]. For every such row
    y[row] += (x[row] @ a[slot]) @ b[slot]        a: [S, in, R], b: [S, R, out] (the adapter's scale folded in b)
Tokens of no adapter are in no segment and cost nothing. `sgmv_ref` defines the result; `sgmv` is the one entry
point the model calls: the Triton kernel (kernels/triton_lora.py) on CUDA tensors, on CPU a padded batched matmul
over the slots when the segments are of similar length (one decode token per sequence), else a loop over segments.
"""
from dataclasses import dataclass

import torch


@dataclass
class SGMVPlan:
    """A step's token grouping, built once and used by every adapted linear of every layer."""
    rows: torch.Tensor          # [N] int64 token rows with an adapter, grouped by segment
    seg_starts: torch.Tensor    # [G + 1] int32 offsets into rows
    seg_slots: torch.Tensor     # [G] int32 slot of each segment
    segments: list[tuple[int, int, int]]   # (slot, start, end) host copy of the above; end - start >= 1
    contiguous: list[bool]      # per segment: its rows are one ascending run (x[r0:r1], no gather)
    max_len: int
    # the padded batched path (CPU): slots lo..hi as one view of a / b, every slot's rows padded to max_len
    pad_rows: torch.Tensor | None = None    # [hi - lo + 1, max_len] rows, padding points at row 0
    pad_mask: torch.Tensor | None = None    # [hi - lo + 1, max_len, 1] 1 for real rows, 0 for padding
    slot_range: tuple[int, int] | None = None


def make_plan(token_slots: list[int], device: torch.device | str, dtype: torch.dtype = torch.float32,
              pad_waste: float = 2.0) -> SGMVPlan | None:
    """token_slots: per token row of the step, its adapter slot or -1. None when no token has an adapter.
    The padded path is planned when it computes at most `pad_waste` times the rows (CPU tensors only)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return None
    rows, starts, slots, segments, contiguous = [], [0], [], [], []
    for slot in sorted(by_slot):
        r = by_slot[slot]
        segments.append((slot, len(rows), len(rows) + len(r)))
        contiguous.append(r[-1] - r[0] + 1 == len(r))
        rows.extend(r)
        starts.append(len(rows))
        slots.append(slot)
    max_len = max(e - s for _, s, e in segments)
    plan = SGMVPlan(torch.tensor(rows, dtype=torch.int64, device=device),
                    torch.tensor(starts, dtype=torch.int32, device=device),
                    torch.tensor(slots, dtype=torch.int32, device=device), segments, contiguous, max_len)
    lo, hi = slots[0], slots[-1]
    if torch.device(device).type == "cpu" and len(segments) > 1 and \
            (hi - lo + 1) * max_len <= pad_waste * len(rows):
        pad = [[0] * max_len for _ in range(hi - lo + 1)]
        mask = [[0.0] * max_len for _ in range(hi - lo + 1)]
        for slot, r in by_slot.items():
            pad[slot - lo][:len(r)] = r
            mask[slot - lo][:len(r)] = [1.0] * len(r)
        plan.pad_rows = torch.tensor(pad, dtype=torch.int64, device=device)
        plan.pad_mask = torch.tensor(mask, dtype=dtype, device=device)[:, :, None]
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


def _check(y, x, a, b, plan) -> None:
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], (x.shape, y.shape)
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0], (a.shape, b.shape)
    assert a.shape[1] == x.shape[1] and a.shape[2] == b.shape[1] and b.shape[2] == y.shape[1], \
        (x.shape, a.shape, b.shape, y.shape)
    assert x.device == y.device == a.device == b.device == plan.rows.device


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: SGMVPlan) -> torch.Tensor:
    """y += per-row adapter products, in place; x: [T, in], y: [T, out]."""
    _check(y, x, a, b, plan)
    if y.device.type == "cuda":
        from kernels.triton_lora import sgmv_triton
        return sgmv_triton(y, x, a, b, plan.rows, plan.seg_starts, plan.seg_slots, plan.max_len)
    if plan.pad_rows is not None:
        lo, hi = plan.slot_range
        xa = torch.bmm(x[plan.pad_rows], a[lo:hi + 1]) * plan.pad_mask     # [G, L, R]; padding rows zeroed
        delta = torch.bmm(xa, b[lo:hi + 1])                                 # [G, L, out]
        return y.index_add_(0, plan.pad_rows.view(-1), delta.view(-1, y.shape[1]))
    for (slot, start, end), run in zip(plan.segments, plan.contiguous):
        if run:
            r0 = int(plan.rows[start])
            y[r0:r0 + end - start] += (x[r0:r0 + end - start] @ a[slot]) @ b[slot]
        else:
            idx = plan.rows[start:end]
            y.index_add_(0, idx, (x[idx] @ a[slot]) @ b[slot])
    return y
