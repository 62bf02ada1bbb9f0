"""SGMV: the Triton kernel (interpreter on CPU) and the CPU paths equal the torch reference, for adapters of
different ranks, rows of one adapter scattered through the step, and tokens of no adapter left untouched."""
import os
import random

import pytest
import torch

from tidepool.kernels import cpu_ops, lora_ops
from tidepool.kernels.lora_ops import make_plan, sgmv, sgmv_ref
from tidepool.kernels.triton_lora import sgmv_triton

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def make_case(seed, tokens, slots, rank, dim_in, dim_out, dtype, none_share=0.3):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    token_slots = [-1 if rng.random() < none_share else rng.randrange(slots) for _ in range(tokens)]
    x = torch.randn(tokens, dim_in, generator=gen).to(dtype)
    y = torch.randn(tokens, dim_out, generator=gen).to(dtype)
    a = (torch.randn(slots, dim_in, rank, generator=gen) / dim_in ** 0.5).to(dtype)
    b = torch.randn(slots, rank, dim_out, generator=gen).to(dtype)
    return token_slots, x, y, a, b


CASES = [  # (seed, tokens, slots, rank, in, out, dtype)
    (0, 1, 1, 8, 64, 96, torch.float32), (1, 37, 4, 16, 64, 160, torch.float32),
    (2, 64, 8, 16, 96, 64, torch.float32), (3, 5, 3, 48, 128, 40, torch.float32),
    (4, 33, 4, 32, 64, 128, torch.float16), (5, 21, 2, 8, 64, 64, torch.bfloat16),
]


@pytest.mark.parametrize("seed,tokens,slots,rank,dim_in,dim_out,dtype", CASES)
def test_triton_sgmv_matches_reference(seed, tokens, slots, rank, dim_in, dim_out, dtype):
    token_slots, x, y, a, b = make_case(seed, tokens, slots, rank, dim_in, dim_out, dtype)
    plan = make_plan(token_slots, DEVICE)
    if plan is None:
        token_slots[0] = 0
        plan = make_plan(token_slots, DEVICE)
    ref = sgmv_ref(y.clone(), x, a, b, plan.rows.cpu(), plan.seg_starts.cpu(), plan.seg_slots.cpu())
    out = sgmv_triton(y.clone().to(DEVICE), x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), plan.rows, plan.seg_starts,
                      plan.seg_slots, plan.max_len).cpu()
    scale = max(1.0, ref.float().abs().max().item())
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale
    untouched = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(out[untouched], y[untouched])


def block_diagonal(b, blocks):
    """b with rank block i feeding output block i only (the slot pool's layout of q/k/v and gate/up)."""
    r, c = b.shape[1] // len(blocks), 0
    out = torch.zeros_like(b)
    for i, width in enumerate(blocks):
        out[:, i * r:(i + 1) * r, c:c + width] = b[:, i * r:(i + 1) * r, c:c + width]
        c += width
    return out


@pytest.fixture(params=["native", "torch"])
def cpu_path(request, monkeypatch):
    """The decode rows through the native op (kernels/csrc/lora_cpu.cpp; skipped where it cannot be built) or,
    with the op ruled out, the torch paths."""
    if request.param == "torch":
        monkeypatch.setattr(lora_ops, "_native_rows", lambda *args: None)
    elif cpu_ops.paged_decode_op() is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    return request.param


def test_native_op_serves_fp32_decode_rows():
    if cpu_ops.paged_decode_op() is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    x, y = torch.randn(4, 8), torch.randn(4, 16)
    a, b = torch.randn(2, 8, 4), torch.randn(2, 4, 16)
    assert lora_ops._native_rows(y, x, a, b) is not None           # built and self-checked
    assert lora_ops._native_rows(y.half(), x.half(), a.half(), b.half()) is None    # fp32 only: torch for the rest
    assert lora_ops._native_rows(y, x, a.transpose(1, 2).contiguous().transpose(1, 2), b) is None


@pytest.mark.parametrize("none_share,tokens,prefill", [(0.0, 64, False), (0.3, 64, False), (0.0, 3, False),
                                                        (0.5, 200, False), (0.0, 200, True), (0.3, 300, True)])
def test_cpu_paths_match_reference(none_share, tokens, prefill, cpu_path):
    for seed in range(3):
        token_slots, x, y, a, b = make_case(seed, tokens, 8, 18, 64, 96, torch.float32, none_share)
        token_slots = [s if s < 0 else s % 6 for s in token_slots]           # a gap at slots 6, 7
        if prefill:      # chunks of 1-40 rows of one slot (or of none) between single decode rows
            rng, token_slots = random.Random(seed), []
            while len(token_slots) < tokens:
                slot = -1 if rng.random() < none_share else rng.randrange(6)
                token_slots += [slot] * (rng.randint(1, 40) if rng.random() < 0.5 else 1)
            token_slots = token_slots[:tokens]
        for blocks in (None, (32, 64), (16, 40, 40)):
            bb = b if blocks is None else block_diagonal(b, blocks)
            for waste, min_run in ((0.0, 8), (2.0, 8), (100.0, 8), (100.0, 1), (2.0, 10 ** 9)):
                # per-slot loop, either, padded rest; every row in runs; no runs
                plan = make_plan(token_slots, "cpu", pad_waste=waste, min_run=min_run)
                ref = sgmv_ref(y.clone(), x, a, bb, plan.rows, plan.seg_starts, plan.seg_slots)
                out = sgmv(y.clone(), x, a, bb, plan, blocks)
                assert (out - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
                assert sum(r1 - r0 for _, r0, r1 in plan.runs) + sum(len(r) for _, r in plan.rest) == \
                    sum(s >= 0 for s in token_slots)
    assert make_plan([-1, -1], "cpu") is None
    plan = make_plan([2, 2, 2, 0, 2, -1, 1, 1, 1], "cpu", min_run=3)
    assert plan.runs == [(2, 0, 3), (1, 6, 9)] and [(s, r.tolist()) for s, r in plan.rest] == [(0, [3]), (2, [4])]
