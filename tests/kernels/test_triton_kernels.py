"""Triton kernels against their torch references: on the GPU when there is one, else on CPU tensors under
TRITON_INTERPRET=1 (set in conftest.py)."""
import os
import random

import pytest
import torch

from tidepool.kernels import attention
from tidepool.kernels.paged_attention import paged_attention_ref, store_kv_ref
from tidepool.kernels.triton_kv_store import store_kv_triton
from tidepool.kernels.triton_paged_attention import paged_attention_triton

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_batch(rng: random.Random, q_lens, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A paged batch with shuffled blocks, -1 padded block tables viewed out of a wider tensor (row stride > width),
    and NaN in every cache slot no sequence owns, so any read outside a sequence's context shows up."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(blocks_per_seq) + rng.randrange(3)
    tables = torch.full((len(contexts), width + 5), -1, dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    owned[0] = True   # the reference reads slot 0 for positions past a sequence's end (then masks them)
    for b, (n, ctx) in enumerate(zip(blocks_per_seq, contexts)):
        ids = [free.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(ctx):
            owned[ids[pos // block_size] * block_size + pos % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    tables = tables.to(DEVICE)[:, :width]   # sliced after the copy, which would not keep the row stride
    batch = (q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), cu)
    return tuple(t.to(DEVICE) for t in batch)


def random_context(rng: random.Random, block_size: int, longest: int) -> int:
    # 1, block boundaries +-1, or anything up to `longest`
    edge = block_size * rng.randint(1, max(1, longest // block_size))
    return rng.choice([1, edge - 1, edge, edge + 1, rng.randint(1, longest)])


def check(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs err {err} > {TOL[dtype]} for {dtype}"


CASES = [  # (seed, dtype, head_dim, block_size, gqa)
    (0, torch.float32, 16, 16, 1), (1, torch.float32, 32, 32, 2), (2, torch.float32, 64, 16, 4),
    (3, torch.float16, 16, 16, 4), (4, torch.float16, 64, 32, 1), (5, torch.float16, 32, 16, 2),
    (6, torch.bfloat16, 16, 32, 2), (7, torch.bfloat16, 64, 16, 4), (8, torch.bfloat16, 128, 16, 1),
    (9, torch.float32, 128, 32, 4), (26, torch.float32, 80, 16, 2), (27, torch.bfloat16, 96, 32, 4),
]
_draw = random.Random(2024)
CASES += [(seed, _draw.choice(list(TOL)), _draw.choice([16, 32, 64]), _draw.choice([16, 32]), _draw.choice([1, 2, 4]))
          for seed in range(10, 26)]


@pytest.mark.parametrize("seed,dtype,head_dim,block_size,gqa", CASES)
def test_decode_matches_reference(seed, dtype, head_dim, block_size, gqa):
    rng = random.Random(seed)
    batch = rng.randint(1, 5)
    contexts = [random_context(rng, block_size, 3 * block_size) for _ in range(batch)]
    num_kv_heads = rng.choice([1, 2, 3])
    args = make_batch(rng, [1] * batch, contexts, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype)
    ref = paged_attention_ref(*args, scale=head_dim ** -0.5)
    for splits in (1, 3, None):   # single pass, forced split-K, and the heuristic
        out = paged_attention_triton(*args, max_seqlen_q=1, scale=head_dim ** -0.5, num_splits=splits)
        check(out, ref, dtype)


@pytest.mark.parametrize("seed,dtype,head_dim,block_size,gqa", CASES)
def test_varlen_mixed_batch_matches_reference(seed, dtype, head_dim, block_size, gqa):
    rng = random.Random(100 + seed)
    q_lens, contexts = [], []
    for kind in rng.sample(["prefill", "extend", "decode", "extend", "prefill"], k=rng.randint(2, 4)):
        ctx = random_context(rng, block_size, 2 * block_size)
        q_len = {"prefill": ctx, "decode": 1, "extend": rng.randint(1, ctx)}[kind]
        q_lens.append(q_len)
        contexts.append(ctx)
    num_kv_heads = rng.choice([1, 2, 3])
    args = make_batch(rng, q_lens, contexts, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype)
    ref = paged_attention_ref(*args, scale=0.3)
    out = paged_attention_triton(*args, max_seqlen_q=max(q_lens), scale=0.3)
    check(out, ref, dtype)


@pytest.mark.parametrize("block_size", [128, 256])
def test_large_blocks(block_size):
    rng = random.Random(block_size)
    contexts = [block_size + 1, 3, block_size - 1]
    for q_lens in ([1, 1, 1], [4, 1, 2]):
        args = make_batch(rng, q_lens, contexts, 4, 2, 32, block_size, torch.float16)
        check(paged_attention_triton(*args, max_seqlen_q=max(q_lens), scale=0.2),
              paged_attention_ref(*args, scale=0.2), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_decode_splits_by_heuristic(dtype):
    rng = random.Random(5)
    args = make_batch(rng, [1, 1], [1500, 37], 4, 1, 16, 32, dtype)
    check(paged_attention_triton(*args, max_seqlen_q=1, scale=0.25), paged_attention_ref(*args, scale=0.25), dtype)


def test_long_prefill_spans_several_query_tiles():
    rng = random.Random(7)
    args = make_batch(rng, [150, 1, 40], [170, 90, 40], 4, 2, 16, 16, torch.float32)
    check(paged_attention_triton(*args, max_seqlen_q=150, scale=0.25), paged_attention_ref(*args, scale=0.25),
          torch.float32)


def test_decode_empty_context_gives_zeros():
    # a CUDA-graph padding row: context 0, no blocks
    rng = random.Random(3)
    q, k_cache, v_cache, tables, contexts, cu = make_batch(rng, [1, 1], [20, 1], 2, 1, 16, 16, torch.float32)
    contexts[1] = 0
    for splits in (1, 2):
        out = paged_attention_triton(q, k_cache, v_cache, tables, contexts, cu, 1, 0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        check(out[:1], paged_attention_ref(q[:1], k_cache, v_cache, tables[:1], contexts[:1], cu[:2], 0.25),
              torch.float32)


@pytest.mark.parametrize("head_dim", [8, 512])
def test_unsupported_head_dim_raises(head_dim):
    args = make_batch(random.Random(0), [1], [4], 2, 2, head_dim, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(*args, max_seqlen_q=1, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_store_kv_matches_reference(dtype, seed):
    rng = random.Random(seed)
    num_kv_heads, head_dim, block_size = rng.choice([(1, 16), (2, 32), (4, 16)]) + (rng.choice([16, 32]),)
    num_blocks, n = 6, rng.randint(1, 40)
    # key/value are strided views, as from a fused qkv projection
    qkv = torch.randn(n, 3, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor(rng.sample(range(num_blocks * block_size), n))
    slots[torch.rand(n) < 0.3] = -1
    slots = slots.to(DEVICE)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv_triton(key, value, *caches, slots)
    store_kv_ref(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_store_kv_casts_to_cache_dtype():
    key, value = torch.randn(2, 5, 2, 16, device=DEVICE)
    slots = torch.tensor([3, -1, 9, 0, 31], device=DEVICE)
    for dtype, tol in ((torch.float16, 0.0), (torch.bfloat16, 2 ** -7)):   # interpreter truncates to bf16, GPU rounds
        caches = [torch.zeros(2, 16, 2, 16, dtype=dtype, device=DEVICE) for _ in range(2)]
        expected = [c.clone() for c in caches]
        store_kv_triton(key, value, *caches, slots)
        store_kv_ref(key, value, *expected, slots)
        for got, want in zip(caches, expected):
            assert ((got.float() - want.float()).abs() <= tol * want.float().abs()).all()


def test_store_kv_rejects_mismatched_shapes():
    caches = [torch.zeros(2, 16, 2, 16, device=DEVICE) for _ in range(2)]
    with pytest.raises(AssertionError, match="cache heads/dim"):
        store_kv_triton(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), *caches, torch.zeros(3, dtype=torch.long))
    with pytest.raises(AssertionError, match="contiguous within a token"):
        key = torch.zeros(3, 16, 2, device=DEVICE).transpose(1, 2)
        store_kv_triton(key, key, *caches, torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_attention_interface_triton_backend(index_dtype):
    rng = random.Random(11)
    q, k_cache, v_cache, tables, contexts, cu = make_batch(rng, [3, 1], [19, 33], 4, 2, 16, 16, torch.float16)
    tables, contexts, cu = tables.to(index_dtype), contexts.to(index_dtype), cu.to(index_dtype)
    key, value = torch.randn(2, 4, 2, 16, device=DEVICE).half()
    slots = torch.tensor([tables[0, 1] * 16, -1, tables[1, 2] * 16, -1], dtype=index_dtype, device=DEVICE)
    for backend in ("torch", "triton"):
        attention.store_kv(backend, key, value, k_cache, v_cache, slots)
    decode_cu = torch.arange(3, dtype=index_dtype, device=DEVICE)   # the same sequences as an all-decode batch
    for q_rows, meta in ((q, (tables, contexts, cu, 3)), (q[2:], (tables, contexts, decode_cu, 1))):
        ref = paged_attention_ref(q_rows, k_cache, v_cache, *meta[:3], 0.25)
        check(attention.paged_attention("triton", q_rows, k_cache, v_cache, *meta, 0.25), ref, torch.float16)
        check(attention.paged_attention("torch", q_rows, k_cache, v_cache, *meta, 0.25), ref, torch.float16)


def test_resolve_backend_by_device_unless_requested():
    """The request is EngineConfig.attention_backend (TIDEPOOL_ATTENTION_BACKEND reaches it through the settings)."""
    assert attention.resolve_backend("cpu") == "torch"
    assert attention.resolve_backend("cuda") == "triton"
    assert attention.resolve_backend("cpu", "triton") == "triton"
    assert attention.resolve_backend("cuda", "torch") == "torch"
    with pytest.raises(ValueError, match="attention backend"):
        attention.resolve_backend("cpu", "flash")
