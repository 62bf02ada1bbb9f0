"""SGMV: the Triton kernel (interpreter on CPU) and the CPU paths equal the torch reference, for adapters of
different ranks, rows of one adapter scattered through the step, and tokens of no adapter left untouched."""
import os
import random

import pytest
import torch

from kernels.lora_ops import make_plan, sgmv, sgmv_ref
from kernels.triton_lora import sgmv_triton

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


@pytest.mark.parametrize("none_share,tokens", [(0.0, 64), (0.3, 64), (0.0, 3), (0.5, 200)])
def test_cpu_paths_match_reference(none_share, tokens):
    for seed in range(3):
        token_slots, x, y, a, b = make_case(seed, tokens, 8, 16, 64, 96, torch.float32, none_share)
        token_slots = [s if s < 0 else s % 6 for s in token_slots]           # a gap at slots 6, 7
        for waste in (0.0, 2.0, 100.0):                                      # loop, either, padded
            plan = make_plan(token_slots, "cpu", pad_waste=waste)
            ref = sgmv_ref(y.clone(), x, a, b, plan.rows, plan.seg_starts, plan.seg_slots)
            out = sgmv(y.clone(), x, a, b, plan)
            assert (out - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert make_plan([-1, -1], "cpu") is None
    assert make_plan([2, 2, 0, 2], "cpu").contiguous == [True, False]
