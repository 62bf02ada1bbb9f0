"""Decode attention microbenchmark, CPU: the pure-torch path against the native kernel, ms per layer (wall time) and
the K/V bytes read per second (every cached token's K and V rows once).

Defaults follow the engine benchmark's worst decode step with SmolLM2-135M: 256 sequences with contexts uniform in
[16, 768], 9 query heads, 3 KV heads, head_dim 64, block 16, fp32, blocks shuffled over an 8192-block pool.
--pools N cycles N separate pools so that every call reads from DRAM, as the engine's 30 layers do.

    python -m tidepool.kernels.bench_decode [--threads 1] [--pools 8] [--repeat 7] [--dtype bfloat16] [--native-only] [--huge-pages]
"""
import argparse
import random
import time

import torch

from tidepool.kernels.cpu_ops import paged_decode_op
from tidepool.kernels.cpu_pages import empty_on_huge_pages, huge_page_bytes
from tidepool.kernels.paged_attention import paged_decode_ref


def make_batch(seed=0, batch=256, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, pool=8192,
               shortest=16, longest=768, dtype=torch.float32):
    rng = random.Random(seed)
    lens = [rng.randint(shortest, longest) for _ in range(batch)]
    blocks = [-(-n // block_size) for n in lens]
    free = list(range(pool))
    rng.shuffle(free)
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, dtype=dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def timed(fn, q, pools, tables, lens, repeat):
    fn(q, *pools[0], tables, lens, 0.125)
    times = []
    for i in range(repeat * len(pools)):
        k, v = pools[i % len(pools)]
        start = time.perf_counter()
        fn(q, k, v, tables, lens, 0.125)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pools", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--huge-pages", action="store_true", help="K/V pools on 2 MiB pages, as the engine's KV cache")
    ap.add_argument("--native-only", action="store_true", help="time the native kernel only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q, k, v, tables, lens = make_batch(batch=args.batch, dtype=getattr(torch, args.dtype))
    pools = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(args.pools - 1)]
    if args.huge_pages:     # the pools where the engine keeps its KV cache (kernels/cpu_pages.py)
        pools = [tuple(empty_on_huge_pages(c.shape, c.dtype).copy_(c) for c in pool) for pool in pools]
    op = paged_decode_op()
    want = paged_decode_ref(q, k, v, tables, lens, 0.125)
    err = (op(q, k, v, tables, lens, 0.125).float() - want.float()).abs().max()
    print(f"{args.batch} seqs, {int(lens.sum())} cached tokens, {args.dtype}, threads {args.threads}, "
          f"{args.pools} pool(s), {(huge_page_bytes() or 0) / 2**20:.0f} MiB on huge pages; max abs diff {err.item():.2e}")
    kv_bytes = 2 * int(lens.sum()) * k[0, 0].numel() * k.element_size()
    for name, fn in (("torch path", paged_decode_ref), ("native kernel", op)):
        if name == "torch path" and args.native_only:
            continue
        best, median = timed(fn, q, pools, tables, lens, args.repeat)
        print(f"  {name:14s} {best:7.1f} ms/layer (median {median:.1f}), K/V read at {kv_bytes / best / 1e6:5.1f} GB/s"
              f" (median {kv_bytes / median / 1e6:.1f})")


if __name__ == "__main__":
    main()
