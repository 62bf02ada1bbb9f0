"""Quantized KV cache (kv_cache_dtype) against the 16-bit cache, in one process: tokens that fit in the same KV
memory, accuracy on held-out text, the decode kernel alone, and engine decode throughput.

* capacity: blocks of a fixed KV budget per cache dtype, fp32 and bf16 weights (EngineConfig.kv_block_bytes);
* accuracy: `tidepool models calibrate-kv`'s measurement (workers/engine/kv_calibration.py: the built-in
  calibration set, with --accuracy-text docs this repository's docs after it, whose last fifth is held out and
  teacher-forced in 16-token chunks so every position reads the cache, up to --heldout-positions) with the weights in
  each of --accuracy-dtype (comma-separated): next-token top-1 agreement (and its standard error), mean KL and
  perplexity against the unquantized cache, the reference's top-two margins where the argmax flipped (0: a tie,
  also counted apart), and, with fp32 weights, a bf16 cache's figures (16-bit rounding alone);
* kernel: the native CPU decode op alone, SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64), bf16 q, a bf16
  cache against 8-bit codes, --kernel-batch sequences of --long-len tokens;
* engine: the shared workload (../shared/bench/workload.py) of --num-requests with --engine-dtype weights (bf16 by
  default, so that the `auto` cache is 16-bit), output tokens per second end to end and in decode-only steps; then
  --long-seqs prompts of --long-len tokens each generating --long-out tokens (attention-bound decode); then the
  workload again with the KV pool held to --same-memory-mib for every cache dtype (the case a quantized cache is for:
  memory, not compute, bounds the batch; the default pool holds the whole workload). Every quantized figure is a
  ratio to the `auto` cache's, same run.

    python benchmarks/kv_quant.py [--model models/smollm2-135m] [--kv int8,fp8_e4m3] [--engine-kv int8]
                                  [--num-requests 256] [--long-seqs 16 --long-len 2048 --long-out 32]
                                  [--same-memory-mib 512]
"""
import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
for up in (2, 3):     # ../shared/bench beside the checkout (a worktree sits one folder deeper)
    sys.path.insert(0, str(Path(__file__).resolve().parents[up] / "shared" / "bench"))

import torch  # noqa: E402

from tidepool.workers.engine import LLMEngine, SamplingParams  # noqa: E402
from tidepool.workers.engine.config import EngineConfig  # noqa: E402
from results import record  # noqa: E402


def capacity(model: str, kvs: list[str]) -> list[dict]:
    budget = 2**30
    rows = []
    for weights in ("float32", "bfloat16"):
        base = budget // EngineConfig(model=model, dtype=weights).kv_block_bytes
        for kv in ["auto", *kvs]:
            blocks = budget // EngineConfig(model=model, dtype=weights, kv_cache_dtype=kv).kv_block_bytes
            rows.append({"weights": weights, "kv_cache_dtype": kv, "tokens_per_gib": blocks * 16,
                         "x_auto": round(blocks / base, 2)})
    return rows


def docs_texts() -> list[str]:
    """The prose paragraphs of this repository's docs (docs/**/*.md, in path order): more held-out text than the
    built-in set alone, from the checkout, never downloaded. Code blocks and tables are left out."""
    texts = []
    for path in sorted((Path(__file__).resolve().parent.parent / "docs").rglob("*.md")):
        in_code = False
        for para in path.read_text().split("\n\n"):
            if para.count("```") % 2:
                in_code = not in_code
                continue
            para = para.strip()
            if not in_code and len(para) >= 200 and not para.startswith(("|", "```", "    ", "<")):
                texts.append(para)
    return texts


def accuracy(model: str, kvs: list[str], dtype: str, samples: int, text: str = "builtin",
             max_positions: int = 4096) -> list[dict]:
    """The guard's figures per dtype, with the binomial standard error of the top-1 agreement (as llama.cpp's
    `perplexity --kl-divergence` prints it) and the margins (nats) the reference's top two had where the argmax
    flipped. With fp32 weights, a bf16 cache is measured beside them: the loss of 16-bit rounding alone."""
    from tidepool.workers.engine.kv_calibration import calibrate
    from tidepool.workers.engine.tokenizer import Tokenizer
    from tidepool.workers.tools.kv_calibrate import builtin_texts, split
    calib, heldout = split(builtin_texts() + (docs_texts() if text == "docs" else []), Tokenizer(model), samples)
    kept, positions = [], 0
    for seq in heldout:     # held-out sequences up to about max_positions next-token positions
        if positions >= max_positions:
            break
        kept.append(seq)
        positions += len(seq) - 1
    heldout = kept
    rec = calibrate(model, calib, heldout, dtype, tuple(kvs) + (("bfloat16",) if dtype == "float32" else ()))
    rows = []
    for kv, f in rec["accuracy"].items():
        p, n = f["top1_agreement"], f["positions"]
        rows.append({"weights": dtype, "kv_cache_dtype": kv, "text": text, "samples": rec["samples"],
                     "heldout_positions": n,
                     "top1_agreement": round(p, 4), "mean_kl": round(f["mean_kl"], 5),
                     "ppl_16bit": round(f["ppl_ref"], 3), "ppl": round(f["ppl"], 3),
                     "ppl_increase": round(f["ppl_increase"], 4),
                     "top1_agreement_se": round((p * (1 - p) / n) ** 0.5, 4),
                     "disagreements": len(f["flip_margins"]),
                     # flips where the reference's top two were equal (bf16 logits tie often): no top-1 to keep
                     "ties": sum(m == 0 for m in f["flip_margins"]),
                     "top1_agreement_untied": round(1 - sum(m > 0 for m in f["flip_margins"]) / n, 4),
                     "flip_margins": f["flip_margins"]})
    return rows


def kernel(kvs: list[str], batch: int, ctx: int) -> list[dict]:
    from tidepool.kernels import cpu_ops
    from tidepool.kernels.kv_quant import STORAGE, quantize
    op = cpu_ops.paged_decode_op()
    if op is None:
        return []
    gen = torch.Generator().manual_seed(0)
    bs, hkv, d = 16, 3, 64
    nb = batch * ctx // bs
    k, v = torch.randn(nb, bs, hkv, d, generator=gen), torch.randn(nb, bs, hkv, d, generator=gen)
    tables = torch.randperm(nb, generator=gen).to(torch.int32).view(batch, -1).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, 9, d, generator=gen).bfloat16()
    scale = torch.full((hkv, d), 4 / 448)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3
    kb, vb = k.bfloat16(), v.bfloat16()
    base = best(lambda: op(q, kb, vb, tables, lens, 0.125))
    rows = [{"kv_cache_dtype": "auto (bf16)", "batch": batch, "context": ctx, "ms": round(base, 2), "x_auto": 1.0}]
    for kv in kvs:
        kq, vq = quantize(k, scale, STORAGE[kv]), quantize(v, scale, STORAGE[kv])
        ms = best(lambda: op(q, kq, vq, tables, lens, 0.125, scale, scale))
        rows.append({"kv_cache_dtype": kv, "batch": batch, "context": ctx, "ms": round(ms, 2),
                     "x_auto": round(base / ms, 3)})
    return rows


def run_engine(model: str, kv: str, requests, max_num_seqs: int, dtype: str, kv_bytes: int | None = None) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv, max_num_seqs=max_num_seqs,
                                    online_reserve=0.0, sla_targets={}, kv_cache_memory_bytes=kv_bytes))
    peak = 0
    for i, (prompt, olen) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True),
                           sla_class="batch")
    out_tokens, decode_tokens, decode_s = 0, 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        prompt_before = engine.stats()["total_prompt_tokens"]
        outs = engine.step()
        dt = time.perf_counter() - t0
        n = sum(len(o.new_token_ids) for o in outs)
        peak = max(peak, engine.stats()["running"])
        out_tokens += n
        if engine.stats()["total_prompt_tokens"] == prompt_before:     # a step with no prompt tokens
            decode_tokens += n
            decode_s += dt
    wall = time.perf_counter() - start
    stats = engine.stats()
    return {"kv_cache_dtype": kv, "output_tokens": out_tokens, "wall_s": round(wall, 1), "peak_running": peak,
            "kv_tokens": stats["kv_blocks_total"] * engine.config.block_size, "preemptions": stats["preemptions"],
            "tok_s": round(out_tokens / wall, 1),
            "decode_tok_s": round(decode_tokens / decode_s, 1) if decode_s else None}


def engine_rows(model: str, kvs: list[str], requests, max_num_seqs: int, label: str, dtype: str,
                kv_bytes: int | None = None) -> list[dict]:
    run_engine(model, "auto", requests[:2], max_num_seqs, dtype)    # warm-up: the first engine of a process pays more
    rows = [run_engine(model, kv, requests, max_num_seqs, dtype, kv_bytes) for kv in ["auto", *kvs]]
    base = rows[0]
    for r in rows:
        r["workload"], r["weights"] = label, dtype
        r["x_auto"] = round(r["tok_s"] / base["tok_s"], 3)
        if r["decode_tok_s"] and base["decode_tok_s"]:
            r["decode_x_auto"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
        print(r, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/smollm2-135m")
    p.add_argument("--kv", default="int8,fp8_e4m3", help="quantized dtypes, comma-separated")
    p.add_argument("--engine-kv", default="int8", help="quantized dtypes the engine runs take (each is a full run)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--long-seqs", type=int, default=16)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--long-out", type=int, default=32)
    p.add_argument("--kernel-batch", type=int, default=64)
    p.add_argument("--same-memory-mib", type=int, default=512, help="the KV pool of the same-memory engine runs")
    p.add_argument("--accuracy-dtype", default="float32,bfloat16")
    p.add_argument("--engine-dtype", default="bfloat16", help="the engine runs' weights (bf16: a 16-bit cache)")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--accuracy-text", choices=("builtin", "docs"), default="docs",
                   help="builtin: the calibration set shipped with the package; docs: it and this repository's docs")
    p.add_argument("--heldout-positions", type=int, default=4096)
    p.add_argument("--skip", default="", help="parts to leave out: accuracy,kernel,engine,long,same_memory")
    args = p.parse_args()
    kvs, skip = args.kv.split(","), set(filter(None, args.skip.split(",")))
    engine_kvs = args.engine_kv.split(",")
    result = {"model": Path(args.model).name, "capacity": capacity(args.model, kvs)}
    print(result["capacity"], flush=True)
    if "kernel" not in skip:
        result["kernel"] = kernel(kvs, args.kernel_batch, args.long_len)
        print(result["kernel"], flush=True)
    record("kv_quant", result)      # after each part: a long run that is cut short keeps what it measured
    if "engine" not in skip:
        from workload import make_workload
        vocab = EngineConfig(model=args.model).model_config.vocab_size
        result["engine"] = engine_rows(args.model, engine_kvs, make_workload(args.num_requests, vocab), 256,
                                       f"workload n={args.num_requests}", args.engine_dtype)
        record("kv_quant", result)
    if "same_memory" not in skip:
        from workload import make_workload
        vocab = EngineConfig(model=args.model).model_config.vocab_size
        result["engine_same_memory"] = engine_rows(
            args.model, engine_kvs, make_workload(args.num_requests, vocab), 256,
            f"workload n={args.num_requests}, {args.same_memory_mib} MiB of KV", args.engine_dtype,
            args.same_memory_mib * 2**20)
        record("kv_quant", result)
    if "long" not in skip:
        rng = random.Random(0)
        vocab = EngineConfig(model=args.model).model_config.vocab_size
        requests = [([rng.randint(100, vocab - 1) for _ in range(args.long_len)], args.long_out)
                    for _ in range(args.long_seqs)]
        result["long_context"] = engine_rows(args.model, engine_kvs, requests, args.long_seqs,
                                             f"{args.long_seqs} x {args.long_len} tokens", args.engine_dtype)
        record("kv_quant", result)
    if "accuracy" not in skip:
        result["accuracy"] = []
        for dtype in args.accuracy_dtype.split(","):
            result["accuracy"] += accuracy(args.model, kvs, dtype, args.samples, args.accuracy_text,
                                           args.heldout_positions)
        print(result["accuracy"], flush=True)
        record("kv_quant", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
