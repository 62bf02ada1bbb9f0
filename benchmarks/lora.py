"""Many LoRA adapters in one continuous batch against the base model alone, in one process.

Workload: the peer workload (/work/shared/bench/workload.py: seeded prompts of 16-512 tokens, 16-256 output tokens,
greedy, ignore_eos, all submitted at once). Runs, each on a fresh engine over the same requests:
  base        no adapters (max_loras 0)
  lora-8      requests round-robin over 8 rank-16 adapters on every projection (q/k/v/o/gate/up/down), max_loras 8
  lora-32     round-robin over 32 such adapters with max_loras 8 (slot eviction and reloads in play)
Adapters are written in PEFT format (adapter_config.json + adapter_model.safetensors) with random non-zero weights.
Goals: lora-8 >= 0.80 x base generated tok/s, lora-32 >= 0.6 x base. Prints a table and one JSON line.

    python benchmarks/lora.py [--model models/smollm2-135m] [--num-requests 64] [--max-output 256]

--max-output caps each request's output (a shorter run; the prompts are unchanged).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, "/work/shared/bench")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from results import record  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def workload(n: int, vocab: int):
    try:
        from workload import make_workload
    except ImportError:          # the same draw, written out (see the module docstring)
        import random
        rng = random.Random(0)
        out = []
        for _ in range(n):
            plen, olen = rng.randint(16, 512), rng.randint(16, 256)
            out.append(([rng.randint(100, vocab - 1) for _ in range(plen)], olen))
        return out
    return make_workload(n, vocab)


def write_adapter_files(folder: Path, cfg, rank: int, seed: int) -> None:
    """A PEFT folder with random rank-`rank` weights on every projection (also used by lora_peer_vllm.py, so it
    needs torch and safetensors only); cfg: hidden/intermediate sizes, heads, kv heads, head_dim, layers."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (d_in, d_out) in dims.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS), "bias": "none"}))


def run(model: str, requests, loras: list | None, args) -> dict:
    from tidepool.workers.engine import LLMEngine, SamplingParams
    from tidepool.workers.engine.config import EngineConfig
    engine = LLMEngine(EngineConfig(model=model, device=args.device, max_num_seqs=args.max_num_seqs,
                                    online_reserve=0.0, sla_targets={},
                                    max_loras=args.max_loras if loras else 0, max_lora_rank=args.rank))
    started = time.perf_counter()
    for i, (prompt, olen) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=min(olen, args.max_output), temperature=0.0,
                                                           ignore_eos=True),
                           sla_class="batch", lora=loras[i % len(loras)] if loras else None)
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
    wall = time.perf_counter() - started
    stats = engine.stats()
    lora = stats.get("lora", {})
    return {"tok_s": generated / wall, "generated": generated, "wall_s": wall, "steps": stats["total_steps"],
            "evicted": lora.get("evicted", 0), "loads": lora.get("loads", 0), "load_s": lora.get("load_s", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--many-adapters", type=int, default=32)
    args = ap.parse_args()
    from tidepool.workers.engine import LoRARequest
    from tidepool.workers.engine.config import EngineConfig
    cfg = EngineConfig(model=args.model).model_config
    requests = workload(args.num_requests, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(max(args.adapters, args.many_adapters)):
            write_adapter_files(Path(tmp) / f"a{i}", cfg, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", str(Path(tmp) / f"a{i}")))
        results = {"base": run(args.model, requests, None, args),
                   f"lora-{args.adapters}": run(args.model, requests, adapters[:args.adapters], args),
                   f"lora-{args.many_adapters}": run(args.model, requests, adapters[:args.many_adapters], args)}
    base = results["base"]["tok_s"]
    print(f"{'run':<10} {'gen tok/s':>10} {'x base':>7} {'tokens':>7} {'wall s':>7} {'evicted':>7} {'loads':>6}")
    for name, r in results.items():
        print(f"{name:<10} {r['tok_s']:>10.1f} {r['tok_s'] / base:>7.2f} {r['generated']:>7} {r['wall_s']:>7.1f} "
              f"{r['evicted']:>7} {r['loads']:>6}")
    few, many = results[f"lora-{args.adapters}"], results[f"lora-{args.many_adapters}"]
    line = {"bench": "lora", "model": Path(args.model).name, "n": args.num_requests,
            "max_output": args.max_output, "rank": args.rank, "max_loras": args.max_loras,
            "base_tok_s": round(base, 1), "lora_few_adapters": args.adapters,
            "lora_few_tok_s": round(few["tok_s"], 1), "lora_few_vs_base": round(few["tok_s"] / base, 3),
            "lora_many_adapters": args.many_adapters, "lora_many_tok_s": round(many["tok_s"], 1),
            "lora_many_vs_base": round(many["tok_s"] / base, 3), "lora_many_evicted": many["evicted"],
            "goal_few": 0.8, "goal_many": 0.6,
            "met": few["tok_s"] / base >= 0.8 and many["tok_s"] / base >= 0.6}
    print(json.dumps(line))
    record("lora", line)


if __name__ == "__main__":
    main()
