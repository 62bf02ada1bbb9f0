"""Speculative decoding for online streams: fewer steps per realtime token, the time saved left to offline work.

(1) A realtime stream alone (LLMEngine in this process, one request at a time, greedy, chat template), with and
    without speculation, on two workloads:
      grounded   rewrite / extract / continue-a-quoted-passage prompts (seeded), whose answers copy the prompt;
      chat       open questions, whose answers do not.
    Per workload and mode: ITL p50/p99 (per request (finish - first token) / (tokens - 1), as /metrics and
    hybrid_sla.py count it), stream-event gap p50/p99 (a verify step hands out several tokens at once: this is
    the longest wait between chunks), acceptance rate, mean accepted length (tokens per verify step), and whether
    the outputs are token for token those of the run without speculation.
    Goals: grounded ITL p50 <= 0.6x without; chat ITL p50 <= 1.05x without.
(2) hybrid_sla.py's scenarios (a) offline alone (once, without speculation: the common denominator and the
    realtime span of both modes), then (b) realtime alone and (c) both, with grounded realtime prompts, without and
    with speculation: goodput_ratio (c total tok/s / (a)), TTFT and ITL p99 ratios (c / b).
    Goal: goodput_ratio up by >= 0.1 with the ratios <= 1.5.

The last line is JSON.

    python benchmarks/spec_decode.py [--model models/smollm2-135m] [--speculative ngram:4] [--no-hybrid]
"""
import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from results import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SENTENCES = [
    "The harbour office opens at seven and closes at noon on Saturdays.",
    "Ferries to the northern islands leave every ninety minutes in summer.",
    "Tickets bought on board cost two euros more than those bought online.",
    "Bicycles travel free, but surfboards need a separate luggage ticket.",
    "In stormy weather the captain may cancel a crossing at short notice.",
    "The café on the upper deck serves soup, sandwiches and hot chocolate.",
    "Passengers with reduced mobility should call the office a day ahead.",
    "Dogs are welcome on the outside decks if they stay on a lead.",
    "Lost property is kept at the harbour office for thirty days.",
    "The last ferry back from the islands leaves at half past nine.",
    "Children under four travel free when sitting on a parent's lap.",
    "Season tickets can be renewed at any ticket machine in the harbour.",
]
TASKS = [
    "Rewrite the following notice in plain words, keeping every fact:\n\n{p}",
    "Copy every sentence of this notice that mentions a price or a time, word for word:\n\n{p}",
    "Here is a notice:\n\n\"{p}\"\n\nQuote the notice back exactly, then add one sentence of your own.",
    "Extract the rules from this text as a bulleted list, using the text's own words:\n\n{p}",
]
CHAT = [
    "What is a good name for a small grey cat?", "Give me three ideas for a rainy Sunday.",
    "Why is the sky blue? Answer briefly.", "Write a haiku about autumn leaves.",
    "How do I boil an egg?", "What should I pack for a weekend in the mountains?",
    "Tell me a fun fact about octopuses.", "Suggest a title for a story about a lighthouse keeper.",
]


def grounded_messages(i: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed * 1000 + i)
    passage = " ".join(rng.sample(SENTENCES, rng.randint(4, 6)))
    return [{"role": "user", "content": TASKS[i % len(TASKS)].format(p=passage)}]


def chat_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": CHAT[i % len(CHAT)]}]


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def stream_alone(engine, prompts, max_tokens: int, trace=None) -> dict:
    """One realtime request at a time; per request its ITL, its stream-event gaps, its tokens. trace: a list that
    gets every step as (seconds, predicted seconds, tokens computed, verifying sequences, drafted, accepted)."""
    from tidepool.workers.engine import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = engine.stats().get("spec_decode", {})
    itl, gaps, outputs = [], [], []
    for i, ids in enumerate(prompts):
        events = []
        engine.add_request(f"s{i}-{time.monotonic_ns()}", ids, params, sla_class="realtime",
                           on_token=lambda out: events.append((time.perf_counter(), len(out.new_token_ids))))
        final = None
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outs = engine.step()
            if trace is not None:
                last = engine._last_step or {}
                trace.append((time.perf_counter() - t0, last.get("predicted_s", 0.0), last.get("tokens", 0),
                              *engine.speculator.last))
            for out in outs:
                if out.finished:
                    final = out
        times = [t for t, n in events if n]
        gaps += [b - a for a, b in zip(times, times[1:])]
        if len(final.token_ids) > 1:
            itl.append((final.finished_time - final.first_token_time) / (len(final.token_ids) - 1))
        outputs.append(final.token_ids)
    after = engine.stats().get("spec_decode", {})
    out = {"itl_p50": 1000 * _pct(itl, 0.5), "itl_p99": 1000 * _pct(itl, 0.99), "gap_p50": 1000 * _pct(gaps, 0.5),
           "gap_p99": 1000 * _pct(gaps, 0.99), "tokens": sum(map(len, outputs)), "outputs": outputs}
    for method, by_class in after.items():
        a, b = by_class["realtime"], before.get(method, {}).get("realtime", {})
        drafted, accepted, steps = (a[k] - b.get(k, 0) for k in ("drafted", "accepted", "verify_steps"))
        out.update(acceptance=accepted / drafted if drafted else 0.0,
                   mean_accepted_length=1 + accepted / steps if steps else 0.0, drafted=drafted)
    return out


def part_one(args) -> dict:
    from tidepool.workers.engine import EngineConfig, LLMEngine
    results = {}
    for mode in ("off", args.speculative):
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                        speculative=None if mode == "off" else mode))
        tok = engine.tokenizer
        workloads = {"grounded": [tok.encode_chat(grounded_messages(i)) for i in range(args.requests)],
                     "chat": [tok.encode_chat(chat_messages(i)) for i in range(args.requests)]}
        stream_alone(engine, workloads["chat"][:1], 8)            # warm-up
        if args.only:
            workloads = {args.only: workloads[args.only]}
        for name, prompts in workloads.items():
            trace = [] if args.steps_out else None
            results[(name, mode)] = stream_alone(engine, prompts, args.max_tokens, trace)
            if trace:
                with open(args.steps_out, "a") as f:
                    for t, p, n, verifying, drafted, accepted in trace:
                        f.write(json.dumps({"scenario": f"{name} [{mode}]", "s": t, "predicted": p, "tokens": n,
                                            "verifying": verifying, "drafted": drafted, "accepted": accepted})
                                + "\n")
        cm = engine.cost_model
        print(f"  [{mode}] cost model: fixed {1000 * cm.fixed:.1f} ms, per token {1000 * cm.per_token:.2f} ms, "
              f"per context token {1000 * cm.per_context:.4f} ms", flush=True)
        del engine
    return results


def part_two(args) -> dict:
    """hybrid_sla.py's (a), (b), (c) with grounded realtime prompts, without and with speculation."""
    import hybrid_sla
    h = argparse.Namespace(model=args.model, device=args.device, offline=args.offline,
                           offline_tokens=args.offline_tokens,
                           rt_rate=args.rt_rate, rt_tokens=args.rt_tokens, rt_duration=None, max_num_seqs=64,
                           low_water=8, rt_ttft_ms=None, rt_itl_ms=None, steps_out=args.steps_out,
                           offline_floor=args.offline_floor,
                           rt_body=lambda i: {"messages": grounded_messages(i, seed=1)})
    out = {}
    # One (a), without speculation, for both modes: the same denominator and the same realtime span. (Offline
    # sequences may speculate while their batch is small, so each mode's own (a) would differ, and the gain would
    # compare two denominators and two realtime spans, not the mixed runs.)
    h.speculative, h.rt_duration = None, None
    a = hybrid_sla.scenario("a offline alone [off]", h, offline=True, realtime=False)
    h.rt_duration = max(2.0, args.offline * args.offline_tokens / a["offline_tok_s"])
    for mode in ("off", args.speculative):
        h.speculative = None if mode == "off" else mode
        b = hybrid_sla.scenario(f"b realtime alone [{mode}]", h, offline=False, realtime=True)
        c = hybrid_sla.scenario(f"c both [{mode}]", h, offline=True, realtime=True)
        out[mode] = {"goodput_ratio": c["total_tok_s"] / a["total_tok_s"],
                     "ttft_p99_ratio": c["ttft_p99"] / b["ttft_p99"],
                     "itl_p99_ratio": c["itl_p99"] / b["itl_p99"], "rt_itl_p50_b": b["itl_p50"],
                     "rt_itl_p50_c": c["itl_p50"], "offline_tok_s_a": a["offline_tok_s"],
                     "offline_tok_s_c": c["offline_tok_s"], "total_tok_s_c": c["total_tok_s"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: models/smollm2-135m, else a tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--speculative", default="ngram:4", help="the mode compared with none (TIDEPOOL_SPECULATIVE form)")
    p.add_argument("--requests", type=int, default=8, help="requests per workload in (1)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--no-hybrid", action="store_true", help="skip (2)")
    p.add_argument("--no-stream", action="store_true", help="skip (1)")
    p.add_argument("--offline", type=int, default=48, help="(2): offline jobs")
    p.add_argument("--offline-tokens", type=int, default=64)
    p.add_argument("--rt-rate", type=float, default=2.0)
    p.add_argument("--rt-tokens", type=int, default=48)
    p.add_argument("--offline-floor", type=float, default=None, help="(2): offline floor share (hybrid_sla.py's)")
    p.add_argument("--only", choices=("grounded", "chat"), default=None, help="(1): one workload only")
    p.add_argument("--steps-out", default=None, help="append every step (time, prediction, drafts) as JSON lines")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.model is None:
        default = Path("models/smollm2-135m")
        if (default / "config.json").is_file():
            args.model = str(default)
        else:
            from tidepool.workers.tools.tiny_model import make_tiny_model
            args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-") + "/tiny", seed=1))
    print(f"model {args.model} on {args.device}; speculative {args.speculative} vs none", flush=True)
    result = {"model": args.model, "device": args.device, "speculative": args.speculative}
    if not args.no_stream:
        result.update(report_one(args, part_one(args)))
    if not args.no_hybrid:
        result.update(report_two(args, part_two(args)))
    print(json.dumps(result))
    record("spec_decode", result)


def report_one(args, one) -> dict:
    spec, result = args.speculative, {}
    print(f"\n(1) realtime stream alone, {args.requests} requests x <= {args.max_tokens} tokens, greedy")
    print(f"{'workload':<10}{'mode':<10}{'ITL p50':>9}{'ITL p99':>9}{'gap p50':>9}{'gap p99':>9}{'accept':>8}"
          f"{'mean len':>9}{'tokens':>8}{'same out':>9}")
    names = [n for n in ("grounded", "chat") if (n, "off") in one]
    for name in names:
        off, on = one[(name, "off")], one[(name, spec)]
        same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
        for mode, r in (("none", off), (spec, on)):
            same_text = "" if r is off else f"{same}/{len(off['outputs'])}"
            print(f"{name:<10}{mode:<10}{r['itl_p50']:>9.1f}{r['itl_p99']:>9.1f}{r['gap_p50']:>9.1f}"
                  f"{r['gap_p99']:>9.1f}{r.get('acceptance', float('nan')):>8.2f}"
                  f"{r.get('mean_accepted_length', float('nan')):>9.2f}{r['tokens']:>8}{same_text:>9}")
        result[name] = {"itl_p50_ratio": on["itl_p50"] / off["itl_p50"],
                        "itl_p99_ratio": on["itl_p99"] / off["itl_p99"],
                        "itl_p50_ms": [round(off["itl_p50"], 1), round(on["itl_p50"], 1)],
                        "acceptance": round(on.get("acceptance", 0.0), 3),
                        "mean_accepted_length": round(on.get("mean_accepted_length", 0.0), 2),
                        "same_outputs": f"{same}/{len(off['outputs'])}"}
    print("goals: grounded ITL p50 ratio <= 0.6, chat <= 1.05: "
          + ", ".join(f"{n} {result[n]['itl_p50_ratio']:.2f}" for n in names))
    return result


def report_two(args, two) -> dict:
    spec, result = args.speculative, {}
    print(f"\n(2) hybrid_sla (a, b, c), grounded realtime prompts, {args.offline} offline x {args.offline_tokens}")
    print(f"{'mode':<10}{'goodput':>9}{'TTFT p99':>10}{'ITL p99':>9}{'rt ITL p50 b/c ms':>19}"
          f"{'offline tok/s a/c':>19}")
    for mode, r in two.items():
        print(f"{mode:<10}{r['goodput_ratio']:>9.2f}{r['ttft_p99_ratio']:>10.2f}{r['itl_p99_ratio']:>9.2f}"
              f"{r['rt_itl_p50_b']:>9.1f}/{r['rt_itl_p50_c']:<9.1f}{r['offline_tok_s_a']:>9.1f}/"
              f"{r['offline_tok_s_c']:<9.1f}")
    result["hybrid"] = {m: {k: round(v, 3) for k, v in r.items()} for m, r in two.items()}
    result["goodput_gain"] = round(two[spec]["goodput_ratio"] - two["off"]["goodput_ratio"], 3)
    print(f"goal: goodput_ratio up by >= 0.1 ({result['goodput_gain']:+.2f}) with TTFT and ITL p99 ratios <= 1.5")
    return result


if __name__ == "__main__":
    main()
