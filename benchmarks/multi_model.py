"""Several models in one worker process: one engine per model, each stepping on its own thread through
one DeviceStepper as `tidepool worker --models a,b` runs them (workers/model_workers.py, workers/device_stepper.py:
offline steps overlap, online work takes its steps one at a time and first), or with no stepper at all (--stepping
threads), or one step at a time always (--stepping turns), each mode one after the other.

  (a) model A alone, an offline batch              -> A tok/s
  (b) model B alone, the same batch                -> B tok/s
  (c) both batches at once, per stepping mode      -> per-model tok/s (its tokens over the time until its own last
      request finished); goal: sum >= 90% of the better of (a), (b); and both batches' tokens over the wall time
  (d) warm load of B (engine construction: weights + KV pool), first and second time -> seconds
  (e) A realtime requests alone, then while B runs its batch (per stepping mode) -> A TTFT p50/p99
      (goal: p99 with B busy <= 1.5x alone)

Model B is by default a random-weight Qwen2-architecture model of another shape, written to a temp folder;
`--model-b models/smollm2-135m` (A's own folder, a second engine of it) measures two models of one size.
The last line is JSON, for scripts. Run it under `flock /tmp/tidepool-bench.lock`.

    python benchmarks/multi_model.py [--model-a models/smollm2-135m] [--model-b DIR] [--requests 32]
                                     [--tokens 64] [--stepping threads,turns,shared]
"""
import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from results import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


class Stepping:
    """The engines stepped until closed, each on its own thread: "threads", without a stepper (a Worker's engine
    loop alone); "shared", through one DeviceStepper as in `tidepool worker --models a,b`; "turns", through one
    DeviceStepper taking every step one at a time (overlap_offline=False)."""

    def __init__(self, engines: dict, mode: str):
        from tidepool.workers.device_stepper import DeviceStepper
        self.stop, self.stepper = threading.Event(), DeviceStepper(overlap_offline=mode != "turns")
        target = self._own if mode == "threads" else self._shared
        self.threads = [threading.Thread(target=target, args=(name, e), daemon=True) for name, e in engines.items()]
        for t in self.threads:
            t.start()

    def _own(self, name, engine):
        while not self.stop.is_set():
            if not engine.wait_for_work(0.05):
                continue
            engine.step()

    def _shared(self, name, engine):
        self.stepper.serve(name, engine, engine.step, self.stop)

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(10)


def _batch(engine, tag: str, n: int, tokens: int, prompt_len: int, rng) -> threading.Event:
    """Queue n offline requests; the event is set when all have finished, its `at` the perf_counter() then."""
    from tidepool.workers.engine import SamplingParams
    done, left = threading.Event(), [n]
    lock = threading.Lock()
    vocab = min(engine.config.model_config.vocab_size, 1000)

    def on_token(out):
        if out.finished:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.at = time.perf_counter()
                    done.set()
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), sla_class="batch",
                           on_token=on_token)
    return done


def _offline(engines: dict, args, rng, mode: str = "shared") -> dict:
    stepping = Stepping(engines, mode)
    start = time.perf_counter()
    events = {name: _batch(e, f"off-{name}-{time.time_ns()}", args.requests, args.tokens, args.prompt_len, rng)
              for name, e in engines.items()}
    ends = {}
    for name, ev in events.items():
        ev.wait()
        ends[name] = ev.at     # when its last request finished (not when this loop got to it)
    wall = max(ends.values()) - start
    stepping.close()
    return {name: args.requests * args.tokens / (ends[name] - start) for name in engines} | {
        "wall_s": wall, "total_tok_s": len(engines) * args.requests * args.tokens / wall}


def _ttft(engine, args, rng, busy=None, mode: str = "shared") -> list[float]:
    """Realtime probes on engine, one every --rt-interval seconds; busy (another engine) runs its batch meanwhile."""
    from tidepool.workers.engine import SamplingParams
    stepping = Stepping({"a": engine} | ({"b": busy} if busy is not None else {}), mode)
    if busy is not None:
        _batch(busy, f"bg-{time.time_ns()}", args.requests * 4, args.tokens, args.prompt_len, rng)
        time.sleep(0.5)
    firsts, lock = {}, threading.Lock()
    vocab = min(engine.config.model_config.vocab_size, 1000)
    for i in range(args.rt_requests):
        rid, sent = f"rt-{time.time_ns()}-{i}", time.perf_counter()

        def on_token(out, rid=rid, sent=sent):
            with lock:
                if rid not in firsts and out.token_ids:
                    firsts[rid] = time.perf_counter() - sent
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), sla_class="realtime",
                           on_token=on_token)
        time.sleep(args.rt_interval)
    end = time.monotonic() + 60
    while len(firsts) < args.rt_requests and time.monotonic() < end:
        time.sleep(0.01)
    stepping.close()
    if busy is not None:     # drop the rest of the background batch
        for rid in list(busy.requests):
            busy.abort(rid)
        while busy.has_unfinished():
            busy.step()
    return [v * 1000 for v in firsts.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-a", default="models/smollm2-135m")
    ap.add_argument("--model-b", default=None, help="default: a random-weight Qwen2 model of another shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--rt-requests", type=int, default=20)
    ap.add_argument("--rt-interval", type=float, default=0.25)
    ap.add_argument("--stepping", default="threads,shared",
                    help="how the two engines share the device in (c) and (e), comma-separated: threads (each on its "
                    "own thread, no stepper), shared (through DeviceStepper, as the worker runs them), turns "
                    "(DeviceStepper, every step one at a time)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.stepping.split(",") if m.strip()]
    if not modes or set(modes) - {"threads", "turns", "shared"}:
        ap.error("--stepping: threads, turns and/or shared")

    from tidepool.workers.engine import EngineConfig, LLMEngine
    model_b = args.model_b
    if model_b is None:
        from tidepool.workers.tools.tiny_model import make_tiny_model
        model_b = str(make_tiny_model(str(Path(tempfile.mkdtemp(prefix="mm-")) / "qwen-b"), arch="qwen2", seed=3,
                                      hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                                      num_key_value_heads=2))
    kw = {"device": args.device, "max_num_seqs": args.max_num_seqs}
    rng = random.Random(0)
    a = LLMEngine(EngineConfig(model=args.model_a, **kw))
    loads = []
    for _ in range(2):                     # (d) warm load: the first reads the files, the second hits the cache
        t0 = time.perf_counter()
        b = LLMEngine(EngineConfig(model=model_b, **kw))
        loads.append(time.perf_counter() - t0)
    alone_a = _offline({"a": a}, args, rng)["a"]
    alone_b = _offline({"b": b}, args, rng)["b"]
    ttft_alone = _ttft(a, args, rng)
    better = max(alone_a, alone_b)
    out = {"a_alone_tok_s": alone_a, "b_alone_tok_s": alone_b, "b_load_s": loads,
           "a_rt_ttft_ms_alone": {"p50": _pct(ttft_alone, 0.5), "p99": _pct(ttft_alone, 0.99)}}
    print(f"(a) A alone {alone_a:.1f} tok/s   (b) B alone {alone_b:.1f} tok/s", flush=True)
    print(f"(d) B load: {loads[0]:.2f} s first, {loads[1]:.2f} s again", flush=True)
    p99a = out["a_rt_ttft_ms_alone"]["p99"]
    print(f"(e) A realtime TTFT alone: p50 {out['a_rt_ttft_ms_alone']['p50']:.0f} ms, p99 {p99a:.0f} ms", flush=True)
    for mode in modes:
        both = _offline({"a": a, "b": b}, args, rng, mode)
        ttft_busy = _ttft(a, args, rng, busy=b, mode=mode)
        res = {"a_with_b_tok_s": both["a"], "b_with_a_tok_s": both["b"],
               "sum_over_better_single": (both["a"] + both["b"]) / better, "wall_s": both["wall_s"],
               "total_tok_s": both["total_tok_s"],
               "a_rt_ttft_ms_with_b_batch": {"p50": _pct(ttft_busy, 0.5), "p99": _pct(ttft_busy, 0.99)}}
        out[mode] = res
        print(f"[{mode}] (c) together: A {both['a']:.1f} + B {both['b']:.1f} = {both['a'] + both['b']:.1f} tok/s "
              f"= {res['sum_over_better_single']:.2f}x the better single (goal >= 0.90); both batches' tokens "
              f"over the wall time {both['total_tok_s']:.1f} tok/s", flush=True)
        p50b, p99b = res["a_rt_ttft_ms_with_b_batch"]["p50"], res["a_rt_ttft_ms_with_b_batch"]["p99"]
        print(f"[{mode}] (e) A realtime TTFT while B runs a batch: p50 {p50b:.0f} ms, p99 {p99b:.0f} ms "
              f"({p99b / p99a:.2f}x alone; goal <= 1.5x)", flush=True)
    print(json.dumps(out))
    record("multi_model", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
