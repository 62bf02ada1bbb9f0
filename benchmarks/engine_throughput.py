"""Offline throughput of the engine against transformers on the same workload (CPU, fp32 by default).

Workload: rng = random.Random(0); per request plen = rng.randint(16, 512), olen = rng.randint(16, 256),
prompt ids [rng.randint(100, vocab_size - 1) for _ in range(plen)], greedy, ignore_eos, max_tokens=olen, all
submitted at once. Baselines run in the same process: transformers static batching (batches of 16 in arrival
order, left-padded, max_new_tokens = the batch's max, counting only requested tokens) and transformers one
request at a time (a subset; it is a rate).

    python benchmarks/engine_throughput.py [--model models/smollm2-135m] [--num-requests 256]
    python benchmarks/engine_throughput.py --num-requests 64 --breakdown --no-baselines

--breakdown runs the engine a second time with timers on every part of a step and prints where a step's time goes:
input preparation, linear layers, attention, norms/rotary/activation, lm_head, sampling, detokenisation and output
objects, scheduling and bookkeeping (wall time of a timed run is a little longer than the plain run's).
"""
import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tidepool.workers.engine import LLMEngine, SamplingParams  # noqa: E402
from tidepool.workers.engine.config import EngineConfig  # noqa: E402
from results import record  # noqa: E402


def workload(n: int, vocab_size: int):
    rng = random.Random(0)
    requests = []
    for _ in range(n):
        plen, olen = rng.randint(16, 512), rng.randint(16, 256)
        requests.append(([rng.randint(100, vocab_size - 1) for _ in range(plen)], olen))
    return requests


def run_engine(model: str, requests, args, breakdown: bool = False) -> dict:
    engine = LLMEngine(EngineConfig(model=model, device=args.device, dtype=args.dtype,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    online_reserve=0.0, sla_targets={},   # offline only, as LLM runs it: no seats
                                                                          # or blocks held back, no step time cap
                                    enforce_eager=args.enforce_eager))
    timers = StepBreakdown(engine) if breakdown else None
    for i, (prompt, olen) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True),
                           sla_class="batch")
    bs = engine.config.block_size
    allocated = filled = 0
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        generated += sum(len(o.new_token_ids) for o in outs)
        for seq in engine.scheduler.running:        # KV slots held vs slots holding a token, after the step
            allocated += len(seq.block_table) * bs
            filled += seq.num_computed_tokens
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    step_total = stats["total_schedule_s"] + stats["total_model_s"] + stats["total_sample_s"]
    return {"tokens": generated, "seconds": elapsed, "tok_s": generated / elapsed,
            "kv_waste": 1 - filled / allocated if allocated else 0.0,
            "sched_share": stats["total_schedule_s"] / step_total, "steps": stats["total_steps"],
            "preemptions": stats["preemptions"], "kv_blocks": stats["kv_blocks_total"],
            "graph_replays": stats["decode_graph_replays"],
            "breakdown": timers.table() if timers else None}


class StepBreakdown:
    """Exclusive wall time of each part of an engine step, by wrapping the engine's parts and timing the model's
    modules with forward hooks (CPU ops are synchronous, so perf_counter covers them)."""

    MODULE_PARTS = {"Linear": "linear layers", "PackedLinear": "linear layers", "RMSNorm": "norms/rotary/activation",
                    "MLP": "norms/rotary/activation", "DecoderLayer": "norms/rotary/activation",
                    "Attention": "attention", "LlamaForCausalLM": "embedding"}

    def __init__(self, engine: LLMEngine):
        self.totals: dict[str, float] = {}
        self.stack: list[list[float]] = []        # [start, time spent in timed children]
        self.steps = 0
        runner, model = engine.runner, engine.runner.model
        for module in model.modules():
            part = self.MODULE_PARTS.get(type(module).__name__)
            if part is None:
                continue
            if module is getattr(model, "lm_head", None):
                part = "lm_head"
            module.register_forward_pre_hook(lambda *_: self._enter())
            module.register_forward_hook(lambda *_, part=part: self._leave(part))
        from tidepool.workers.engine.models import llama
        llama.RotaryEmbedding.apply = staticmethod(self._wrap(llama.RotaryEmbedding.apply, "norms/rotary/activation"))
        for name in ("store_kv", "paged_attention"):
            setattr(llama, name, self._wrap(getattr(llama, name), "attention"))
        runner.run = self._wrap(runner.run, "input preparation")     # what the model and lm_head leave over
        engine.sampler = self._wrap_callable(engine.sampler, "sampling")
        engine._append_token = self._wrap(engine._append_token, "detokenise + outputs")
        engine._finish = self._wrap(engine._finish, "detokenise + outputs")
        for name in ("schedule", "postprocess"):
            setattr(engine.scheduler, name, self._wrap(getattr(engine.scheduler, name), "scheduling"))
        engine.step = self._wrap(engine.step, "bookkeeping", count=True)

    def _enter(self) -> None:
        self.stack.append([time.perf_counter(), 0.0])

    def _leave(self, part: str) -> None:
        start, children = self.stack.pop()
        spent = time.perf_counter() - start
        self.totals[part] = self.totals.get(part, 0.0) + spent - children
        if self.stack:
            self.stack[-1][1] += spent

    def _wrap(self, fn, part: str, count: bool = False):
        def timed(*args, **kwargs):
            self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave(part)
                self.steps += count
        return timed

    def _wrap_callable(self, obj, part: str):
        wrapped = self._wrap(obj.__call__, part)

        class Timed:
            def __getattr__(_, name):
                return getattr(obj, name)

            def __call__(_, *args, **kwargs):
                return wrapped(*args, **kwargs)
        return Timed()

    def table(self) -> str:
        total = sum(self.totals.values())
        lines = [f"{'part of a step':28s} {'ms/step':>9s} {'share':>7s}"]
        for part, seconds in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"{part:28s} {1e3 * seconds / max(self.steps, 1):9.2f} {100 * seconds / total:6.1f}%")
        lines.append(f"{'total':28s} {1e3 * total / max(self.steps, 1):9.2f}  ({self.steps} steps)")
        return "\n".join(lines)


def run_hf_static(model_dir: str, requests, batch_size: int, dtype, device) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    counted = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            chunk = requests[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            new = max(o for _, o in chunk)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad)
            counted += sum(o for _, o in chunk)
    elapsed = time.perf_counter() - start
    return {"tokens": counted, "seconds": elapsed, "tok_s": counted / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from tidepool.service.ledger.settings import Config
    ap.add_argument("--model", default=Config.setting("model") or "models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--static-batch-size", type=int, default=16)
    ap.add_argument("--static-requests", type=int, default=None,
                    help="run the static-batching baseline on the first N requests (default: all)")
    ap.add_argument("--single-requests", type=int, default=8, help="one-at-a-time baseline on the first N")
    ap.add_argument("--breakdown", action="store_true", help="also print where a step's time goes (a second run)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--enforce-eager", action="store_true", default=bool(Config.setting("enforce_eager")),
                    help="GPU: no CUDA graphs (default: TIDEPOOL_ENFORCE_EAGER)")
    args = ap.parse_args()
    if not Path(args.model, "config.json").is_file():
        sys.exit(f"no model at {args.model}: run `tidepool models pull smollm2-135m` first")

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    requests = workload(args.num_requests, cfg.model_config.vocab_size)
    print(f"model {args.model} | device {args.device} | dtype {cfg.torch_dtype} | threads {torch.get_num_threads()}"
          f" | {len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens,"
          f" {sum(o for _, o in requests)} output tokens")

    ours = run_engine(args.model, requests, args)
    print(f"tidepool engine       {ours['tok_s']:8.1f} tok/s  ({ours['tokens']} tokens in {ours['seconds']:.1f} s,"
          f" {ours['steps']} steps, {ours['preemptions']} preemptions, {ours['kv_blocks']} KV blocks,"
          f" {ours['graph_replays']} decode-graph replays)")
    if args.breakdown:
        timed = run_engine(args.model, requests, args, breakdown=True)
        print(f"per-step breakdown (timed run: {timed['tok_s']:.1f} tok/s)\n{timed['breakdown']}")
    line = {"model": Path(args.model).name, "device": args.device, "dtype": str(cfg.torch_dtype).split(".")[-1],
            "threads": torch.get_num_threads(), "requests": len(requests),
            "engine": {k: ours[k] for k in ("tok_s", "tokens", "seconds", "steps", "preemptions", "kv_blocks",
                                             "graph_replays", "kv_waste", "sched_share")}}
    if args.no_baselines:
        record("engine_throughput", line)
        return
    static = run_hf_static(args.model, requests[:args.static_requests or len(requests)], args.static_batch_size,
                           cfg.torch_dtype, args.device)
    print(f"transformers static   {static['tok_s']:8.1f} tok/s  ({static['tokens']} requested tokens in"
          f" {static['seconds']:.1f} s, batches of {args.static_batch_size})")
    single = run_hf_static(args.model, requests[:args.single_requests], 1, cfg.torch_dtype, args.device)
    print(f"transformers single   {single['tok_s']:8.1f} tok/s  ({single['tokens']} tokens in"
          f" {single['seconds']:.1f} s, first {args.single_requests} requests)")
    print(f"ratio vs static batching     {ours['tok_s'] / static['tok_s']:.2f}x   (goal >= 3x)")
    print(f"ratio vs one at a time       {ours['tok_s'] / single['tok_s']:.2f}x")
    print(f"mean KV-slot waste           {100 * ours['kv_waste']:.2f}%   (goal <= 4%)")
    print(f"scheduler share of step time {100 * ours['sched_share']:.2f}%   (goal <= 10%)")
    line.update(transformers_static_tok_s=static["tok_s"], transformers_single_tok_s=single["tok_s"],
                vs_static=ours["tok_s"] / static["tok_s"], vs_single=ours["tok_s"] / single["tok_s"])
    record("engine_throughput", line)


if __name__ == "__main__":
    main()
