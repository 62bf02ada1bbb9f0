"""Quantized KV cache (kernels/kv_quant.py): quantize/dequantize round trips per dtype with their error bounds, and
every attention path on a quantized cache against the torch reference: the native CPU decode kernel (its AVX2 or
AVX-512 build, whichever this CPU runs), the "torch" backend's varlen step and the Triton kernels (interpreter here,
compiled on a GPU)."""
import random

import pytest
import torch

from tidepool.kernels import attention, cpu_ops
from tidepool.kernels.kv_quant import QMAX, STORAGE, dequantize, quantize, row_scales, scales_from_amax
from tidepool.kernels.paged_attention import paged_attention_ref, paged_decode_ref, store_kv_ref

DTYPES = list(STORAGE.values())
# worst relative error of one element: fp8 e4m3 has 3 mantissa bits (2^-4 after rounding), e5m2 has 2 (2^-3); int8 is
# off by at most half a step of its row's |max| / 127 (each (token, KV head) row takes its own scale)
REL_BOUND = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_error_bounds(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 64, generator=gen) * torch.tensor([0.5, 4.0, 40.0])[:, None]    # heads of unlike range
    scale = scales_from_amax(x.abs().amax(dim=(0, 2)), dtype)
    rows = quantize(x, scale, dtype)
    assert rows.shape == (512, 3, 66) and rows.dtype == dtype
    step = row_scales(rows).float() * scale[:, None]         # [512, 3, 1]: one code's worth in each row
    # a row's |max| maps onto the largest code (up to the fp16 rounding of its scale): nothing is clipped
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(amax / step, torch.full_like(amax, QMAX[dtype]), rtol=2**-10)
    back = dequantize(rows, scale, torch.float32)
    err = (back - x).abs()
    if dtype == torch.int8:
        assert (err <= step / 2 * (1 + 1e-5)).all()
    else:      # relative in the normal range, absolute (one subnormal step) below it
        tiny = step * torch.finfo(dtype).smallest_normal
        assert (err <= torch.maximum(REL_BOUND[dtype] * x.abs(), tiny) * (1 + 1e-5)).all()
    rel = (err.norm() / x.norm()).item()
    assert rel < {torch.float8_e4m3fn: 0.03, torch.float8_e5m2: 0.06, torch.int8: 0.01}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_scales_beat_one_scale_per_channel(dtype):
    """Rows of unlike size under one channel scale: each row's own scale keeps its relative error as small as the
    largest row's."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 2, 64, generator=gen) * torch.logspace(-2, 1, 256)[:, None, None]
    scale = scales_from_amax(x.abs().amax(dim=(0, 2)), dtype)
    back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
    small = slice(0, 32)         # rows 100x below the largest: one shared step would leave them a few codes
    rel = ((back - x)[small].norm() / x[small].norm()).item()
    assert rel < {torch.float8_e4m3fn: 0.03, torch.float8_e5m2: 0.06, torch.int8: 0.01}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_zero_rows_and_huge_values(dtype):
    """An all-zero row takes scale 1 and zero codes; a row past the fp16 scale's range saturates (finite, never
    NaN); values far beyond the channel scale are kept, not clipped, while the row scale can hold them."""
    scale = torch.tensor([1.0])
    x = torch.tensor([[[0.0, 0.0, 0.0, 0.0]], [[1e12, -1e12, 5.0, 0.0]], [[1e4, -3.0, 0.5, 1.0]]])     # head_dim even
    rows = quantize(x, scale, dtype)
    assert row_scales(rows)[0].item() == 1.0 and (rows[0, :, :4].float() == 0).all()
    back = dequantize(rows, scale, torch.float32)
    assert torch.isfinite(back).all()
    assert back[1].abs().max().item() == pytest.approx(QMAX[dtype] * 65504.0)
    assert back[2, 0, 0].item() == pytest.approx(1e4, rel=2**-3)


def quantized_batch(seed, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in contexts]
    pool = sum(blocks) + 2
    ids = list(range(pool))
    rng.shuffle(ids)
    tables = torch.full((len(contexts), max(blocks) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    k_scale = torch.rand(num_kv_heads, head_dim, generator=gen) * 0.05 + 0.005     # per (KV head, channel)
    v_scale = torch.rand(num_kv_heads, head_dim, generator=gen) * 0.05 + 0.005
    k = torch.randn(pool * block_size, num_kv_heads, head_dim, generator=gen) * k_scale * 60
    v = torch.randn(pool * block_size, num_kv_heads, head_dim, generator=gen) * v_scale * 60
    k_cache = torch.empty(pool, block_size, num_kv_heads, head_dim + 2, dtype=dtype)     # codes, then the row's scale
    v_cache = torch.empty_like(k_cache)
    store_kv_ref(k, v, k_cache, v_cache, torch.arange(pool * block_size), k_scale, v_scale)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), k_scale, v_scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_reads_the_dequantized_cache(dtype):
    q, kc, vc, tables, lens, ks, vs = quantized_batch(1, [1, 17, 40], 4, 2, 32, 8, dtype)
    got = paged_decode_ref(q, kc, vc, tables, lens, 0.2, ks, vs)
    want = paged_decode_ref(q, dequantize(kc, ks, torch.float32), dequantize(vc, vs, torch.float32), tables, lens, 0.2)
    torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def native_op():
    if cpu_ops.compiler() is None:
        pytest.skip("no C++ compiler")
    switch = cpu_ops.enabled()
    cpu_ops.configure(enabled=True)
    try:
        op = cpu_ops.paged_decode_op()
    finally:
        cpu_ops.configure(enabled=switch)
    assert op is not None, cpu_ops.unavailable_reason()
    return op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (24, 4)])
def test_native_decode_reads_quantized_cache(native_op, dtype, q_dtype, head_dim, block_size):
    # many sequences (one work item each) and few (one per KV head); contexts across tile and block edges
    for contexts in ([1, 5, 31, 32, 33, 100, 64, 17] * 3, [300, 2]):
        q, kc, vc, tables, lens, ks, vs = quantized_batch(head_dim + len(contexts), contexts, 6, 2, head_dim,
                                                          block_size, dtype)
        q = q.to(q_dtype)
        got = native_op(q, kc, vc, tables, lens, head_dim ** -0.5, ks.contiguous(), vs.contiguous())
        want = paged_decode_ref(q.float(), kc, vc, tables, lens, head_dim ** -0.5, ks, vs)
        tol = 1e-5 if q_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_q_on_int8_cache_is_as_exact_as_fp32_q(native_op, head_dim):
    """With bf16 q an int8 cache's q . k may run as integer dot products (AVX512-VNNI: q rounded to int16 a row), but
    the result stays the fp32 path's up to the bf16 rounding of the output: one bf16 step, not the 2e-2 above."""
    contexts = [1, 5, 31, 32, 33, 100, 64, 17, 300]
    q, kc, vc, tables, lens, ks, vs = quantized_batch(head_dim, contexts, 6, 2, head_dim, 16, torch.int8)
    qb = q.bfloat16()
    got = native_op(qb, kc, vc, tables, lens, head_dim ** -0.5, ks.contiguous(), vs.contiguous()).float()
    exact = native_op(qb.float(), kc, vc, tables, lens, head_dim ** -0.5, ks.contiguous(), vs.contiguous())
    torch.testing.assert_close(got, exact.bfloat16().float(), atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_varlen_on_quantized_cache(native_op, monkeypatch, dtype):
    """Prefill chunks, short chunks and decodes in one step through kernels/attention.py (the native kernel under
    the varlen step) against paged_attention_ref on the same quantized pool."""
    monkeypatch.setattr(cpu_ops, "_enabled", True)
    contexts, q_lens = [40, 9, 70, 3], [40, 3, 20, 1]
    _, kc, vc, tables, lens, ks, vs = quantized_batch(7, contexts, 4, 2, 64, 16, dtype)
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 4, 64, generator=torch.Generator().manual_seed(3))
    got = attention.paged_attention("torch", q, kc, vc, tables, lens, cu, max(q_lens), 0.125, k_scale=ks, v_scale=vs)
    want = paged_attention_ref(q, kc, vc, tables, lens, cu, 0.125, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_quantizes_on_every_backend(dtype):
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(10, 2, 32, generator=gen), torch.randn(10, 2, 32, generator=gen)
    ks, vs = torch.tensor([0.01, 0.02]), torch.tensor([0.03, 0.01])
    slots = torch.tensor([3, -1, 0, 7, 8, 9, 12, 15, 1, 2])
    caches = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in ("torch", "triton"):
        kc = torch.zeros(4, 4, 2, 34, dtype=dtype, device=device if backend == "triton" else "cpu")
        vc = torch.zeros_like(kc)
        if backend == "triton":
            key, value, ks, vs, slots = (t.to(device) for t in (key, value, ks, vs, slots))
        attention.store_kv(backend, key, value, kc, vc, slots, ks, vs)
        caches[backend] = tuple((c.view(torch.uint8) if dtype != torch.int8 else c).cpu() for c in (kc, vc))
    key, ks, slots = key.cpu(), ks.cpu(), slots.cpu()
    keep = slots >= 0
    want = quantize(key[keep], ks, dtype)
    got = caches["torch"][0].view(-1, 2, 34)[slots[keep]]
    assert torch.equal(got, want.view(got.dtype))
    if dtype != torch.int8 and not torch.cuda.is_available():
        return     # Triton's interpreter converts fp32 -> fp8 without carrying a round-up into the exponent
    for a, b in zip(caches["torch"], caches["triton"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_store_matches_the_reference_bit_for_bit(native_op, monkeypatch, dtype, key_dtype):
    """The native quantizing store (kernels/csrc/fused_cpu.cpp) writes the reference's codes and row scales: K and V
    as strided views of a fused qkv, a skipped slot, an all-zero row, a row far past its channel scale."""
    monkeypatch.setattr(cpu_ops, "_enabled", True)
    assert cpu_ops.native_op("store_kv_quant") is not None
    gen = torch.Generator().manual_seed(9)
    qkv = (torch.randn(40, 3 * 2 * 64, generator=gen) * 3).to(key_dtype)
    key, value = qkv[:, 128:256].view(40, 2, 64), qkv[:, 256:].view(40, 2, 64)
    key[3] = 0
    key[5, 1, 7] = 5e3
    ks, vs = torch.rand(2, 64, generator=gen) * 0.05 + 0.005, torch.rand(2, 64, generator=gen) * 0.05 + 0.005
    slots = torch.randperm(64, generator=gen)[:40]
    slots[11] = -1
    want = [torch.zeros(4, 16, 2, 66, dtype=dtype) for _ in range(2)]
    store_kv_ref(key, value, *want, slots, ks, vs)
    got = [torch.zeros(4, 16, 2, 66, dtype=dtype) for _ in range(2)]
    attention.store_kv("torch", key, value, *got, slots, ks, vs)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_read_quantized_cache(dtype):
    """Decode (split over the context and merged) and varlen launches on a quantized pool against the reference."""
    from tidepool.kernels.triton_paged_attention import paged_attention_triton
    device = "cuda" if torch.cuda.is_available() else "cpu"
    contexts = [5, 33, 20]
    q, kc, vc, tables, lens, ks, vs = (t.to(device) for t in quantized_batch(11, contexts, 4, 2, 32, 8, dtype))
    cu = torch.arange(len(contexts) + 1, dtype=torch.int32, device=device)
    got = paged_attention_triton(q, kc, vc, tables, lens, cu, 1, 0.2, num_splits=2, k_scale=ks, v_scale=vs)
    want = paged_decode_ref(q, kc, vc, tables, lens, 0.2, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    q_lens = [5, 4, 1]
    cu = torch.tensor([0, 5, 9, 10], dtype=torch.int32, device=device)
    qv = torch.randn(10, 4, 32, generator=torch.Generator().manual_seed(2)).to(device)
    got = paged_attention_triton(qv, kc, vc, tables, lens, cu, max(q_lens), 0.2, k_scale=ks, v_scale=vs)
    want = paged_attention_ref(qv, kc, vc, tables, lens, cu, 0.2, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
