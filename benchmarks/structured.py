"""Constrained decoding cost: engine throughput of N requests with a JSON schema against the same N requests
without one, and the mask work per step (filling the bitmasks + applying them in the sampler).

Workload: rng = random.Random(0); prompts of rng.randint(16, 128) random token ids. Run "cold": every request
constrained by SCHEMA (temperature 1, seed i), so each stops where its JSON ends; it fixes each request's length
and warms the engine (KV pool pages, prefix cache), so it is printed but not in the ratio. Run "plain": the same
prompts unconstrained, each with max_tokens = its cold output length and ignore_eos. Run "schema": the cold run
again, now on a warm engine like plain's. Run "half": every other request constrained, the rest plain; the mask
fraction of step time there is the issue's goal (< 10% with half of a 256-row batch constrained). All runs in
one process; the ratio is schema tok/s over plain tok/s (goal >= 0.9).

    python benchmarks/structured.py [--model models/smollm2-135m] [--num-requests 256] [--device cpu]
"""
import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tidepool.workers.engine.sampler as sampler_module  # noqa: E402
from tidepool.workers.engine import LLMEngine, SamplingParams  # noqa: E402
from tidepool.workers.engine.config import EngineConfig  # noqa: E402
from results import record  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "tags", "address", "status"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
}


class ApplyTimer:
    """Times the sampler's mask application (synchronised on CUDA so the time is the kernel's)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.calls = device, 0.0, 0
        self.inner = sampler_module.apply_bitmask
        sampler_module.apply_bitmask = self

    def __call__(self, logits, bitmask):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.inner(logits, bitmask)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def run(engine: LLMEngine, prompts, params: list[SamplingParams], label: str, timer: ApplyTimer) -> dict:
    before = engine.stats()
    timer.seconds, timer.calls = 0.0, 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{label}{i}", prompt, p, sla_class="batch")
    outs, generated, steps, start = {}, 0, 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.finished:
                outs[out.request_id] = out
        steps += 1
    elapsed = time.perf_counter() - start
    after = engine.stats()
    fill = after["structured_mask_s"] - before["structured_mask_s"]
    return {"label": label, "seconds": elapsed, "tokens": generated, "tok_s": generated / elapsed, "steps": steps,
            "fill_ms_step": 1e3 * fill / steps, "apply_ms_step": 1e3 * timer.seconds / steps,
            "mask_share": (fill + timer.seconds) / elapsed,
            "rows": after["structured_masked_rows"] - before["structured_masked_rows"],
            "outs": [outs[f"{label}{i}"] for i in range(len(prompts))]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(256, args.num_requests)))
    vocab = engine.config.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randint(100, vocab - 1) for _ in range(rng.randint(16, 128))] for _ in range(args.num_requests)]
    timer = ApplyTimer(engine.runner.device)
    run(engine, prompts[:8], [SamplingParams(max_tokens=8, structured={"json_schema": SCHEMA})] * 8, "warm", timer)

    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                  structured={"json_schema": SCHEMA}) for i in range(len(prompts))]
    # A first schema pass gives each request's length and touches the KV pool (allocated lazily), so the timed
    # runs below all start on a warm engine and the order of the runs does not favour one.
    cold = run(engine, prompts, constrained, "cold", timer)
    lengths = [len(o.token_ids) for o in cold["outs"]]
    plain_params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                    for i, n in enumerate(lengths)]
    plain = run(engine, prompts, plain_params, "plain", timer)
    schema = run(engine, prompts, constrained, "schema", timer)
    half = run(engine, prompts, [c if i % 2 == 0 else p for i, (c, p) in enumerate(zip(constrained, plain_params))],
               "half", timer)

    parsed = sum(o.finish_reason == "stop" for o in schema["outs"])
    print(f"model={args.model} device={args.device} requests={len(prompts)} "
          f"output tokens={schema['tokens']} (schema run: {parsed} finished by the grammar, "
          f"{len(prompts) - parsed} at max_tokens={args.max_tokens})")
    print(f"{'run':8} {'s':>8} {'tok/s':>9} {'steps':>6} {'fill ms/step':>13} {'apply ms/step':>14} {'mask share':>11}")
    for r in (cold, plain, schema, half):
        print(f"{r['label']:8} {r['seconds']:8.2f} {r['tok_s']:9.1f} {r['steps']:6d} {r['fill_ms_step']:13.3f} "
              f"{r['apply_ms_step']:14.3f} {100 * r['mask_share']:10.1f}%")
    print(f"throughput ratio schema/plain: {schema['tok_s'] / plain['tok_s']:.3f} (goal >= 0.9)")
    print(f"mask share of step time with half the rows constrained: {100 * half['mask_share']:.1f}% (goal < 10%)")
    record("structured", {"model": Path(args.model).name, "device": args.device, "requests": len(prompts),
                          "runs": {r["label"]: {k: r[k] for k in ("seconds", "tok_s", "steps", "fill_ms_step",
                                                                  "apply_ms_step", "mask_share")}
                                   for r in (cold, plain, schema, half)},
                          "schema_vs_plain": schema["tok_s"] / plain["tok_s"], "half_mask_share": half["mask_share"]})


if __name__ == "__main__":
    main()
