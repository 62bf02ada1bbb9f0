"""The native CPU decode kernel's tiled paths (kernels/csrc/paged_decode_cpu.cpp: attend16 on AVX-512 builds, 16-position
tiles; attend8 on AVX2 builds, 32-position tiles of four 8-lane groups; both may span cache blocks, read each K/V row
once for a whole GQA group and keep a running softmax across tiles) against the pure-torch
reference (kernels/paged_attention.py), on the cases that path adds: contexts on and around tile and block edges with
block sizes that do not divide 16, group sizes 1-8, scores whose maximum arrives late (every rescale of the running
softmax is exercised), bf16 and fp16 caches accumulated in fp32, and batches big enough to be split per sequence
against the same rows attended per KV head."""
import os
import random

import pytest
import torch

from tidepool.kernels import cpu_ops
from tidepool.kernels.paged_attention import paged_decode_ref

pytestmark = pytest.mark.skipif(cpu_ops.compiler() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def op():
    switch = os.environ.pop("TIDEPOOL_CPU_KERNELS", None)
    try:
        found = cpu_ops.paged_decode_op()
    finally:
        if switch is not None:
            os.environ["TIDEPOOL_CPU_KERNELS"] = switch
    assert found is not None, f"a compiler is present but the kernel is unavailable: {cpu_ops.unavailable_reason()}"
    return found


def paged(rng: random.Random, contexts, num_kv_heads, group, head_dim, block_size, dtype, ramp=0.0):
    """Shuffled blocks, NaN in every slot no sequence owns; with `ramp`, key t of a sequence is pushed along q by
    ramp * t / context, so the highest scores come last."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks = [-(-c // block_size) for c in contexts]
    pool = sum(blocks) + 2
    k_cache = torch.full((pool, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    q = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen)
    free = list(range(pool))
    rng.shuffle(free)
    tables = torch.full((len(contexts), max(blocks) + 1), -1, dtype=torch.int32)
    for b, (n, ctx) in enumerate(zip(blocks, contexts)):
        ids = [free.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        if ramp:
            direction = q[b].view(num_kv_heads, group, head_dim).mean(1)                  # [Hkv, D]
            k += ramp * torch.arange(ctx)[:, None, None] / ctx * direction[None]
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        for pos in range(ctx):
            k_cache[ids[pos // block_size], pos % block_size] = k[pos]
            v_cache[ids[pos // block_size], pos % block_size] = v[pos]
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, torch.tensor(contexts, dtype=torch.int32)


EDGES = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 127, 128, 129]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 48])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_and_block_edges(op, block_size, group, dtype):
    rng = random.Random(block_size * 10 + group)
    q, k_cache, v_cache, tables, lens = paged(rng, EDGES, 2, group, 64, block_size, dtype)
    out = op(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isfinite(out).all(), "a NaN from an unowned slot leaked"
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 32, 256])
def test_running_softmax_when_the_maximum_comes_late(op, dtype, head_dim):
    """Scores rise along the context (by up to ~20 nats): every tile raises the running max and rescales."""
    rng = random.Random(head_dim)
    q, k_cache, v_cache, tables, lens = paged(rng, [700, 333, 64, 17], 3, 3, head_dim, 16, dtype,
                                              ramp=20.0 / head_dim ** 0.5)
    scale = head_dim ** -0.5
    out = op(q, k_cache, v_cache, tables, lens, scale)
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_and_per_kv_head_items_agree(op, dtype):
    """A big batch is split one item per sequence, a small one per (sequence, KV head): each row's arithmetic is the
    same either way, bit for bit, and so is the result under any thread count."""
    rng = random.Random(11)
    contexts = [rng.choice(EDGES + [rng.randint(1, 300)]) for _ in range(40)]
    q, k_cache, v_cache, tables, lens = paged(rng, contexts, 3, 3, 64, 16, dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            whole = op(q, k_cache, v_cache, tables, lens, 0.125)
            for b in (0, 7, 39):
                alone = op(q[b:b + 1].contiguous(), k_cache, v_cache, tables[b:b + 1], lens[b:b + 1].contiguous(),
                           0.125)
                assert torch.equal(alone[0], whole[b])
    finally:
        torch.set_num_threads(threads)
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    assert (whole.float() - ref).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 160])
def test_bf16_pair_dot_and_widened_paths(op, head_dim):
    """bf16 caches on AVX512-BF16 CPUs take vdpbf16ps straight on the cache's K rows for q.k where head_dim % 32 == 0
    (p rounded to bf16 for p.V, as the reference rounds it), and widen K rows to fp32 otherwise: both against the
    reference, with odd tile tails (positions past the context never read the NaN of the slot after them)."""
    rng = random.Random(head_dim + 1)
    q, k_cache, v_cache, tables, lens = paged(rng, [1, 15, 17, 33, 100, 257], 2, 3, head_dim, 16, torch.bfloat16,
                                              ramp=10.0 / head_dim ** 0.5)
    scale = head_dim ** -0.5
    out = op(q, k_cache, v_cache, tables, lens, scale)
    assert torch.isfinite(out).all(), "a NaN from an unowned slot leaked"
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert (out.float() - ref).abs().max().item() <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 24, 40, 72, 136, 256])
def test_head_dims_of_eight_lane_groups(op, dtype, head_dim):
    """head_dims in multiples of 8 (all but 256 not multiples of 16, which AVX-512 builds send to the AVX2 path too;
    136 and 256 take more than one pass of accumulator registers over a V row), across tile edges (8-lane groups and 32-position tiles partly past the
    context read a zero row, never the NaN after it) with the maximum arriving late."""
    rng = random.Random(head_dim + 7)
    q, k_cache, v_cache, tables, lens = paged(rng, [1, 7, 8, 9, 31, 32, 33, 40, 95, 96, 97, 130], 2, 3, head_dim, 16,
                                              dtype, ramp=10.0 / head_dim ** 0.5)
    scale = head_dim ** -0.5
    out = op(q, k_cache, v_cache, tables, lens, scale)
    assert torch.isfinite(out).all(), "a NaN from an unowned slot leaked"
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [5, 6, 7])
@pytest.mark.parametrize("head_dim", [80, 96, 160])
def test_row_and_column_blocks_of_the_v_pass(op, dtype, group, head_dim):
    """attend16 updates up to four query rows of a KV head side by side and passes over V for up to four rows and
    four 16-lane vectors at a time: groups of 5-7 rows and head_dims of 5, 6 and 10 vectors leave partial blocks of
    each. Batches both big (one item per sequence; fp32 rows of three KV heads prefetched into L2) and small (one item
    per KV head)."""
    rng = random.Random(group * 1000 + head_dim)
    contexts = [1, 16, 17, 40, 129, 300, 5, 64, 33, 250]
    q, k_cache, v_cache, tables, lens = paged(rng, contexts, 3, group, head_dim, 16, dtype,
                                              ramp=10.0 / head_dim ** 0.5)
    scale = head_dim ** -0.5
    ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    out = op(q, k_cache, v_cache, tables, lens, scale)
    assert torch.isfinite(out).all(), "a NaN from an unowned slot leaked"
    assert (out.float() - ref).abs().max().item() <= TOL[dtype]
    few = op(q[:2].contiguous(), k_cache, v_cache, tables[:2], lens[:2].contiguous(), scale)
    assert (few.float() - ref[:2]).abs().max().item() <= TOL[dtype]
