"""Decode attention bandwidth: Triton paged kernel vs SDPA on the same K/V gathered contiguous.

    python benchmarks/kernel_bench.py                       # fp16+bf16, batch 1..256, context 512..32k
    python benchmarks/kernel_bench.py --batches 32,64 --contexts 4096,8192 --dtypes bf16

Bandwidth = bytes of K and V read / kernel time; share of peak against the device's HBM bandwidth (table below,
or --peak-gbps). The L2 is flushed before every timed call, so small cases are not served from cache.
"""
import argparse
import math
import sys

import torch

from tidepool.kernels.triton_paged_attention import _num_splits, paged_attention_triton
from results import record  # noqa: E402

PEAK_GBPS = [  # (substring of torch.cuda.get_device_name, HBM GB/s); first match wins
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350), ("GH200", 4000),
    ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864),
    ("L4", 300), ("A10", 600), ("RTX 4090", 1008), ("RTX 3090", 936),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=ints, default=[512, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp16", "bf16"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-kv-gib", type=float, default=40.0, help="skip cases whose K+V exceed this")
    p.add_argument("--peak-gbps", type=float, default=None, help="device HBM peak, GB/s (default: by device name)")
    p.add_argument("--no-sdpa", action="store_true", help="time the Triton kernel only")
    args = p.parse_args(argv)
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes takes {sorted(DTYPES)}, got {d!r}")
    return args


def device_peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def time_ms(fn, warmup: int, iters: int) -> float:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2]


def bench_case(batch, context, dtype, args):
    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    # scattered blocks, as in a long-running cache
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    contexts = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    scale = d ** -0.5
    kv_bytes = 2 * batch * context * hkv * d * k_cache.element_size()

    def triton_call():
        return paged_attention_triton(q, k_cache, v_cache, tables, contexts, cu, 1, scale)

    out = triton_call()
    row = {"triton_ms": time_ms(triton_call, args.warmup, args.iters), "bytes": kv_bytes,
           "splits": _num_splits(batch, hkv, blocks_per_seq * bs, q.device)}
    if not args.no_sdpa:
        try:
            # [B, Hkv, L, D] gathered contiguous, outside the timed region
            slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device="cuda")).view(batch, -1)[:, :context]
            k = k_cache.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
            v = v_cache.view(-1, hkv, d)[slots].transpose(1, 2).contiguous()
            qs = q.unsqueeze(2)

            def sdpa_call():
                return torch.nn.functional.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)

            ref = sdpa_call().squeeze(2)
            row["max_err"] = (out.float() - ref.float()).abs().max().item()
            row["sdpa_ms"] = time_ms(sdpa_call, args.warmup, args.iters)
            del k, v
        except torch.cuda.OutOfMemoryError:
            row["sdpa_ms"] = None
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py needs a CUDA device (the Triton kernels are timed on the GPU); none found.",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or device_peak_gbps(name)
    print(f"device: {name}; peak HBM: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    print(f"heads {args.num_heads}/{args.num_kv_heads} kv, head_dim {args.head_dim}, block_size {args.block_size}")
    pct = lambda gbps: f"{100 * gbps / peak:5.1f}%" if peak else "   n/a"   # noqa: E731
    header = (f"{'dtype':>5} {'batch':>5} {'ctx':>6} {'splits':>6} | {'triton us':>9} {'GB/s':>7} {'peak':>6} | "
              f"{'sdpa us':>9} {'GB/s':>7} {'peak':>6} | {'speedup':>7} {'max err':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for dname in args.dtypes:
        for batch in args.batches:
            for context in args.contexts:
                kv_gib = 2 * batch * context * args.num_kv_heads * args.head_dim * 2 / 2**30
                if kv_gib > args.max_kv_gib:
                    print(f"{dname:>5} {batch:>5} {context:>6} skipped: K+V {kv_gib:.0f} GiB > --max-kv-gib")
                    continue
                r = bench_case(batch, context, DTYPES[dname], args)
                t_gbps = r["bytes"] / (r["triton_ms"] * 1e6)
                line = (f"{dname:>5} {batch:>5} {context:>6} {r['splits']:>6} | {r['triton_ms'] * 1e3:>9.1f} "
                        f"{t_gbps:>7.0f} {pct(t_gbps)} | ")
                if r.get("sdpa_ms"):
                    s_gbps = r["bytes"] / (r["sdpa_ms"] * 1e6)
                    line += (f"{r['sdpa_ms'] * 1e3:>9.1f} {s_gbps:>7.0f} {pct(s_gbps)} | "
                             f"{r['sdpa_ms'] / r['triton_ms']:>6.2f}x {r['max_err']:>8.1e}")
                else:
                    line += f"{'oom' if 'sdpa_ms' in r else '-':>9}"
                print(line, flush=True)
                rows.append({"dtype": dname, "batch": batch, "context": context, "splits": r["splits"],
                             "triton_gbps": t_gbps, "sdpa_gbps": r["bytes"] / (r["sdpa_ms"] * 1e6)
                             if r.get("sdpa_ms") else None})
    record("kernel_bench", {"gpu": name, "peak_gbps": peak, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
