"""Tensor parallelism: one model over two ranks (TP=2) against the same model on one (TP=1), on the same devices, in
one process (rank 0 here, rank 1 its child; on a CPU host the two ranks split the cores, one thread each on 2 cores).

Parts, each one JSON line (and together the recorded result):
  parity      greedy token ids at TP=2 equal TP=1's, fp32, for a random Llama with GQA (4 query heads over 2 KV
              heads, made on the fly) and the given model (SmolLM2-135M: 9 query heads over 3 KV heads, split 3/6):
              16 requests, a 48-token shared prefix on every other one, prompts 24-200 tokens, 24 output tokens,
              a step budget of 64 tokens (chunked prefill), a KV pool too small for all of them (preemption: swap
              and recompute), and a LoRA adapter (rank 8, every projection, random weights) on every third request.
  throughput  offline generated tok/s of the peer-style workload (seeded prompts of 32-256 tokens, outputs of
              32-128, greedy, ignore_eos, all submitted at once), TP=2 / TP=1. Goal >= 0.8.
  memory      bytes of weights the largest rank holds (the loaded parameters, tied ones once), TP=2 / TP=1. Goal
              <= 0.55. Then with device_memory_gib set between the two (a smaller device): TP=1 is refused with
              the size that fits, TP=2 serves.

    python benchmarks/tensor_parallel.py [--model models/smollm2-135m] [--num-requests 48] [--device cpu]
"""
import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lora import write_adapter_files  # noqa: E402
from results import record  # noqa: E402


def engine(model: str, tp: int, args, **overrides):
    from tidepool.workers.engine import LLMEngine
    from tidepool.workers.engine.config import EngineConfig
    fields = dict(model=model, device=args.device, dtype="float32", tensor_parallel_size=tp, online_reserve=0.0,
                  sla_targets={}, max_num_seqs=args.max_num_seqs)
    return LLMEngine(EngineConfig(**{**fields, **overrides}))


def drive(eng, requests) -> tuple[dict, float, int]:
    """Add every (id, prompt, params, lora) at once and step to the end: token ids by id, seconds, tokens."""
    for rid, prompt, params, lora in requests:
        eng.add_request(rid, prompt, params, sla_class="batch", lora=lora)
    out, generated = {}, 0
    start = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            generated += len(o.new_token_ids)
            if o.finished:
                out[o.request_id] = o.token_ids
    return out, time.perf_counter() - start, generated


def parity(model: str, name: str, args, adapter_root: Path) -> dict:
    from tidepool.workers.engine import LoRARequest, SamplingParams
    from tidepool.workers.engine.config import EngineConfig
    cfg = EngineConfig(model=model).model_config
    adapter = adapter_root / f"{name}-r8"
    write_adapter_files(adapter, cfg, 8, seed=1)
    lora = LoRARequest("r8", str(adapter))
    rng = random.Random(1)
    prefix = [rng.randint(3, cfg.vocab_size - 1) for _ in range(48)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = []
    for i in range(16):
        body = [rng.randint(3, cfg.vocab_size - 1) for _ in range(rng.randint(24, 200))]
        requests.append((f"p{i}", prefix + body if i % 2 else body, params, lora if i % 3 == 0 else None))
    line = {"part": "parity", "model": name}
    for kind, swap in (("swap", 0.01), ("recompute", 0.0)):
        outs, stats = {}, {}
        for tp in (1, 2):
            eng = engine(model, tp, args, max_num_batched_tokens=64, block_size=8, num_kv_blocks=64,
                         swap_space_gib=swap, max_loras=1, max_lora_rank=8)
            outs[tp], _, _ = drive(eng, requests)
            stats[tp] = eng.stats()
            del eng
        s = stats[2]
        line[kind] = {"identical": outs[1] == outs[2], "requests": len(outs[2]),
                      "preemptions": s["preemptions_by_kind"][kind], "prefix_cache_hits": s["prefix_cache_hits"],
                      "lora_tokens": s["lora"]["tokens"].get("r8", 0)}
    line["identical"] = all(line[k]["identical"] for k in ("swap", "recompute"))
    return line


def throughput(model: str, args) -> dict:
    from tidepool.workers.engine import SamplingParams
    from tidepool.workers.engine.config import EngineConfig
    vocab = EngineConfig(model=model).model_config.vocab_size
    rng = random.Random(0)
    requests = [(f"t{i}", [rng.randint(100, vocab - 1) for _ in range(rng.randint(32, 256))],
                 SamplingParams(max_tokens=rng.randint(32, 128), temperature=0.0, ignore_eos=True), None)
                for i in range(args.num_requests)]
    runs = {}
    for tp in (1, 2):
        eng = engine(model, tp, args)
        _, seconds, generated = drive(eng, requests)
        runs[tp] = generated / seconds
        del eng
    return {"part": "throughput", "model": Path(model).name, "requests": args.num_requests,
            "tp1_tok_s": round(runs[1], 1), "tp2_tok_s": round(runs[2], 1), "ratio": round(runs[2] / runs[1], 3),
            "goal": 0.8, "met": runs[2] / runs[1] >= 0.8}


def memory(model: str, args) -> dict:
    from tidepool.workers.engine import SamplingParams
    from tidepool.workers.engine.model_runner import DoesNotFit, check_fits
    weights = {}
    for tp in (1, 2):
        eng = engine(model, tp, args, num_kv_blocks=64, calibrate=False)
        weights[tp] = eng.runner.largest_rank_weight_bytes
        del eng
    ratio = weights[2] / weights[1]
    # a device that holds TP=2's largest rank and one sequence, but not the whole model
    from tidepool.workers.engine.config import EngineConfig
    probe = EngineConfig(model=model, device=args.device, dtype="float32", max_model_len=2048)
    need_tp1 = weights[1] + probe.blocks_per_sequence * probe.kv_block_bytes
    cap_gib = round(need_tp1 * 0.8 / 2**30, 3)
    refused = None
    try:
        check_fits(EngineConfig(model=model, device=args.device, dtype="float32", max_model_len=2048,
                                device_memory_gib=cap_gib))
    except DoesNotFit as exc:
        refused = str(exc)
    eng = engine(model, 2, args, max_model_len=2048, device_memory_gib=cap_gib, calibrate=False)
    outs, _, _ = drive(eng, [("m0", [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                              None)])
    served = len(outs.get("m0", [])) == 8
    kv_blocks = eng.runner.num_kv_blocks
    del eng
    return {"part": "memory", "model": Path(model).name, "tp1_weight_mib": round(weights[1] / 2**20, 1),
            "tp2_rank_weight_mib": round(weights[2] / 2**20, 1), "ratio": round(ratio, 3), "goal": 0.55,
            "met": ratio <= 0.55 and refused is not None and served, "device_memory_gib": cap_gib,
            "tp1_refused": refused, "tp2_served": served, "tp2_kv_blocks": kv_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--parts", default="parity,throughput,memory")
    args = ap.parse_args()
    from tidepool.workers.tools.tiny_model import make_tiny_model
    lines = []
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "parity" in parts:
            tiny = str(make_tiny_model(Path(tmp) / "llama-gqa", seed=1, init_std=0.08, arch="llama",
                                       num_attention_heads=4, num_key_value_heads=2))
            for model, name in ((tiny, "random-llama-gqa"), (args.model, Path(args.model).name)):
                lines.append(parity(model, name, args, Path(tmp)))
                print(json.dumps(lines[-1]), flush=True)
    if "throughput" in parts:
        lines.append(throughput(args.model, args))
        print(json.dumps(lines[-1]), flush=True)
    if "memory" in parts:
        lines.append(memory(args.model, args))
        print(json.dumps(lines[-1]), flush=True)
    summary = {"bench": "tensor_parallel", "device": args.device, "threads": torch.get_num_threads(),
               "met": all(line.get("met", line.get("identical")) for line in lines), "parts": lines}
    print(json.dumps({k: v for k, v in summary.items() if k != "parts"}))
    record("tensor_parallel", summary)


if __name__ == "__main__":
    main()
