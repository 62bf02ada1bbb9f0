"""The product's headline: one worker serving realtime requests and an offline batch at once.

Four scenarios on the same worker (embedded shape: SQLite ledger, in-process queue, the real Worker
class; timings come from the ledger, so they include queueing, claim and streaming bookkeeping):
  (a) offline batch alone                  -> offline generated tokens/s
  (b) realtime alone at a steady rate      -> realtime TTFT p50/p99
  (c) both at once                         -> both
  (d) both at once, class priority off     -> realtime submitted as `batch`: first come, first served

Per scenario: realtime TTFT p50/p99 and inter-token latency (ITL, per request (finish - first token) /
(tokens - 1)) p99, offline tok/s, total generated tok/s (offline + realtime), preemptions by kind and
recomputed tokens (engine stats). Then the scheduler's share of step time with --sched-seqs sequences.
Goals: TTFT and ITL p99 (c) <= 1.5x (b); total tok/s (c) >= 90% of (a); recomputed <= 2% of computed
tokens in (c). The last line is JSON, for scripts.

    python benchmarks/hybrid_sla.py [--model models/smollm2-135m] [--device cuda] [--offline 384]
"""
import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import select  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from tidepool.service import create_app, migrate
from tidepool.service.ledger import tenants  # noqa: E402
from tidepool.service.ledger.models import Job, JobStatus  # noqa: E402
from results import record  # noqa: E402


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def scenario(name, args, offline: bool, realtime: bool, priority: bool = True) -> dict:
    from kombu.transport.memory import Channel

    from tidepool.workers.worker import Worker, WorkerConfig
    Channel.queues.clear()
    tmp = Path(tempfile.mkdtemp(prefix="hybrid-"))
    url = f"sqlite:///{tmp / 'ledger.db'}"
    migrate.upgrade(url)
    app = create_app({"database_url": url, "redis_url": None, "storage_dir": str(tmp / "s"), "model": args.model})
    with Session(app.services.database) as s:
        _, key = tenants.create_tenant(s, "bench")
        s.commit()
    engine_kw = {"max_num_seqs": args.max_num_seqs}
    if args.offline_floor is not None:
        engine_kw["offline_floor"] = args.offline_floor
    if getattr(args, "speculative", None):
        engine_kw["speculative"] = args.speculative
    targets = {k: v for k, v in (("ttft_ms", args.rt_ttft_ms), ("itl_ms", args.rt_itl_ms)) if v is not None}
    if targets:
        from tidepool.workers.engine.config import sla_targets_for
        engine_kw["sla_targets"] = sla_targets_for(args.device, {"realtime": targets})
    cfg = WorkerConfig(model=args.model, database_url=url, device=args.device, name=f"bench-{name}",
                       low_water=args.low_water, engine=engine_kw)
    worker = Worker(cfg)
    steps, firsts = _time_steps(worker.engine)
    load = [os.getloadavg()[0]]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}

    def submit(sla, prompt, tokens):
        body = prompt if isinstance(prompt, dict) else {"prompt": prompt}
        r = client.post("/v1/jobs", headers=headers, json={
            **body, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "sla_class": sla})
        assert r.status_code == 202, r.get_json()
        return r.get_json()["id"]

    # warm up the engine (first step compiles/allocates)
    warm = submit("interactive", "warm up", 4)
    _wait(app, [warm])
    offline_ids, rt_ids = [], []
    if offline:
        offline_ids = [submit("batch", f"Document {i}: summarise the following text.", args.offline_tokens)
                       for i in range(args.offline)]
    # The realtime clock starts once the batch is in (submitting it takes this process a second or two): from
    # t0 realtime arrives at its steady rate, not as a catch-up burst of requests all due while it was submitted.
    t0 = time.time()
    if realtime:
        duration = args.rt_duration
        n = int(duration * args.rt_rate)
        for i in range(n):
            target = t0 + i / args.rt_rate
            time.sleep(max(0.0, target - time.time()))
            prompt = args.rt_body(i) if getattr(args, "rt_body", None) else f"Question {i}: what is up?"
            rt_ids.append(submit("realtime" if priority else "batch", prompt, args.rt_tokens))
    _wait(app, offline_ids + rt_ids)
    with Session(app.services.database) as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(offline_ids + rt_ids)))}
    stats = worker.engine.stats()
    worker.stop()
    thread.join(30)
    load.append(os.getloadavg()[0])
    out = {"name": name, "load": load, **_step_summary(steps), "cost_model": stats.get("cost_model")}
    if args.steps_out:
        with open(args.steps_out, "a") as f:
            for i in rt_ids:
                j = rows[i]
                f.write(json.dumps({"scenario": name, "job": i, "queued": (j.queued_at - rows[rt_ids[0]].queued_at)
                                    .total_seconds(), "ttft": (j.first_token_at - j.queued_at).total_seconds(),
                                    "engine_ttft": firsts.get(i)}) + "\n")
            for t, n, b, p, seqs, sampled, att, verifying, drafted, accepted in steps:
                f.write(json.dumps({"scenario": name, "s": t, "tokens": n, "bound": b, "predicted": p,
                                    "seqs": seqs, "sampled": sampled, "attended": att, "verifying": verifying,
                                    "drafted": drafted, "accepted": accepted}) + "\n")
    if rt_ids:
        rt = [rows[i] for i in rt_ids]
        ttft = [(j.first_token_at - j.queued_at).total_seconds() * 1000 for j in rt]
        itl = [(j.finished_at - j.first_token_at).total_seconds() * 1000 / (j.completion_tokens - 1)
               for j in rt if j.completion_tokens > 1]
        claim = [(j.started_at - j.queued_at).total_seconds() * 1000 for j in rt]
        # The engine's share of each TTFT (added to the engine -> first token) and the rest (queue, claim, add)
        engine_ttft = [1000 * firsts[i] for i in rt_ids if i in firsts]
        intake = [t - 1000 * firsts[i] for i, t in zip(rt_ids, ttft) if i in firsts]
        out.update(ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99), itl_p50=_pct(itl, 0.5),
                   itl_p99=_pct(itl, 0.99), rt_n=len(rt_ids), claim_p50=_pct(claim, 0.5), claim_p99=_pct(claim, 0.99),
                   engine_ttft=(_pct(engine_ttft, 0.5), _pct(engine_ttft, 0.99)),
                   intake_ttft=(_pct(intake, 0.5), _pct(intake, 0.99)))
    jobs = [rows[i] for i in offline_ids + rt_ids]
    span = (max(j.finished_at for j in jobs) - min(j.queued_at for j in jobs)).total_seconds()
    out["total_tok_s"] = sum(j.completion_tokens for j in jobs) / span
    if offline_ids:
        off = [rows[i] for i in offline_ids]
        off_span = (max(j.finished_at for j in off) - min(j.queued_at for j in off)).total_seconds()
        out["offline_tok_s"] = sum(j.completion_tokens for j in off) / off_span
    out["preemptions"] = stats.get("preemptions_by_kind", {"recompute": stats["preemptions"]})
    out["recomputed_tokens"] = stats.get("recomputed_tokens", 0)
    out["computed_tokens"] = stats.get("total_computed_tokens", 0)
    out["schedule_share"] = stats["total_schedule_s"] / max(1e-9, stats["total_schedule_s"] + stats["total_model_s"]
                                                          + stats["total_sample_s"])
    return out


def _time_steps(engine) -> tuple[list, dict]:
    """Record (seconds, tokens, time bound) of every engine step the worker runs (the benchmark's own wrapper),
    and per job the seconds from its request's arrival in the engine to its first token."""
    steps, step, schedule, batch, shape, firsts = [], engine.step, engine.scheduler.schedule, [None], [None], {}

    def scheduled():
        b = batch[0] = schedule()
        # the step's shape before it runs: sequences, those that sample a token, context attended
        shape[0] = (len(b.seqs), sum(s.num_computed_tokens + n == s.num_tokens for s, n in
                                     zip(b.seqs, b.num_new_tokens)), b.attended)
        return b

    def timed():
        batch[0] = None
        t0 = time.perf_counter()
        outs = step()
        if batch[0]:
            steps.append((time.perf_counter() - t0, batch[0].num_tokens, batch[0].time_limit_s,
                          batch[0].predicted_s, *shape[0], *engine.speculator.last))
        for out in outs:
            job = out.request_id.rpartition("@")[0]
            if out.first_token_time is not None and job not in firsts:
                firsts[job] = out.first_token_time - out.arrival_time
        return outs
    engine.scheduler.schedule, engine.step = scheduled, timed
    return steps, firsts


def _step_summary(steps) -> dict:
    """Step time p50/p99 of the steps that ran under an online time bound and of those that did not, so a tail
    caused by stalls (steps far over what they carried) can be told from one caused by the budget."""
    out = {}
    for kind, keep in (("bounded", lambda b: b is not None), ("free", lambda b: b is None)):
        ts = [t for t, n, b, *_ in steps if n and keep(b)]
        toks = [n for t, n, b, *_ in steps if n and keep(b)]
        if ts:
            out[f"{kind}_steps"] = len(ts)
            out[f"{kind}_step_ms"] = (1000 * _pct(ts, 0.5), 1000 * _pct(ts, 0.99))
            out[f"{kind}_tokens_p50"] = _pct(toks, 0.5)
    # Bounded steps against the cost model's prediction and their bound: a tail of steps far over their
    # prediction is a stall or a misprediction, one of steps at their prediction is the bound itself.
    bounded = [(t, b, p) for t, n, b, p, *_ in steps if n and b is not None and p > 0]
    if bounded:
        ratio = [t / p for t, b, p in bounded]
        out["over_prediction"] = (_pct(ratio, 0.5), _pct(ratio, 0.99))
        out["over_bound_share"] = sum(t > b for t, b, p in bounded) / len(bounded)
    return out


def scheduler_share(args, num_seqs: int, steps: int = 12) -> dict:
    """The scheduler's share of step time with num_seqs sequences decoding (plus realtime arrivals), engine only."""
    from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
    # Seats for num_seqs offline sequences beside the online reserve (10% of max_num_seqs).
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                    max_num_seqs=num_seqs + num_seqs // 9 + 1))
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"off{i}", f"Document {i}: summarise the following text.", params, sla_class="batch")
    _admit_all(engine, num_seqs)
    base = engine.stats()
    for i in range(steps):
        if i % 3 == 0:
            engine.add_request(f"rt{i}", f"Question {i}: what is up?", SamplingParams(max_tokens=4),
                               sla_class="realtime")
        engine.step()
    end = engine.stats()
    sched = end["total_schedule_s"] - base["total_schedule_s"]
    total = sched + sum(end[k] - base[k] for k in ("total_model_s", "total_sample_s"))
    return {"seqs": num_seqs, "running": base["running"], "steps": steps,
            "schedule_ms_per_step": 1000 * sched / steps, "step_ms": 1000 * total / steps, "share": sched / total}


def _admit_all(engine, num_seqs: int, patience: int = 8) -> None:
    """Step until the prompts are in and the steps are decodes. Without online work a step is held within the idle
    cap (ttft_ms - itl_ms: 540 ms on CPU), and on a slow device num_seqs decodes do not fit in it: running decodes
    take the step first, so the last prompts wait until a running sequence finishes (never, at max_tokens 10,000).
    Admission has then stalled: stop once no sequence was admitted in `patience` steps."""
    running, still = 0, 0
    while still < patience:
        engine.step()
        stats = engine.stats()
        if not stats["waiting"] and stats["last_step"]["tokens"] <= num_seqs:
            return
        running, still = stats["running"], still + 1 if stats["running"] <= running else 0


def _wait(app, ids, timeout=3600):
    end = time.time() + timeout
    while time.time() < end:
        with Session(app.services.database) as s:
            left = s.scalar(select(Job.id).where(Job.id.in_(ids), Job.status.in_(
                (JobStatus.queued, JobStatus.running))).limit(1))
        if left is None:
            return
        time.sleep(0.25)   # timings come from the ledger; polling only notices the end (and costs this process CPU)
    raise TimeoutError("jobs did not finish")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: models/smollm2-135m, else a tiny model)")
    p.add_argument("--device", default=None)
    p.add_argument("--offline", type=int, default=384, help="offline jobs in the batch (its span sets the realtime "
                   "phases': the longer the span, the more realtime requests, and the steadier their p99)")
    p.add_argument("--offline-tokens", type=int, default=128)
    p.add_argument("--rt-rate", type=float, default=4.0, help="realtime requests per second")
    p.add_argument("--rt-tokens", type=int, default=16)
    p.add_argument("--rt-duration", type=float, default=None, help="seconds of realtime load (default: (a)'s span)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--low-water", type=int, default=8)
    p.add_argument("--rt-ttft-ms", type=float, default=None, help="realtime ttft target (default: engine config)")
    p.add_argument("--rt-itl-ms", type=float, default=None, help="realtime pace, itl_ms (default: engine config)")
    p.add_argument("--offline-floor", type=float, default=None, help="offline floor share (default: engine config)")
    p.add_argument("--sched-seqs", type=int, default=256, help="sequences for the scheduler-share check (0: skip)")
    p.add_argument("--no-fcfs", action="store_true", help="skip scenario (d)")
    p.add_argument("--steps-out", default=None, help="append every step (time, shape, bound, prediction) as JSON lines")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's, one a core)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="Python's thread switch interval for this process (default: Python's, 5 ms)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.model is None:
        default = Path("models/smollm2-135m")
        if (default / "config.json").is_file():
            args.model = str(default)
        else:
            from tidepool.workers.tools.tiny_model import make_tiny_model
            args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-") + "/tiny", seed=1))
    if args.device is None:
        from tidepool.workers.worker import default_device
        args.device = default_device()
    print(f"model {args.model} on {args.device}; offline {args.offline} x {args.offline_tokens} tokens; "
          f"realtime {args.rt_rate}/s x {args.rt_tokens} tokens", flush=True)

    a = scenario("a offline alone", args, offline=True, realtime=False)
    if args.rt_duration is None:
        args.rt_duration = max(2.0, a["offline_tok_s"] and args.offline * args.offline_tokens / a["offline_tok_s"])
    b = scenario("b realtime alone", args, offline=False, realtime=True)
    c = scenario("c both", args, offline=True, realtime=True)
    rows = [a, b, c]
    if not args.no_fcfs:
        rows.append(scenario("d both, FCFS", args, offline=True, realtime=True, priority=False))
    nan = float("nan")
    print(f"\n{'scenario':<20}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'offline':>9}{'total':>8}"
          f"{'suspend':>9}{'swap':>6}{'recomp':>8}{'recomputed':>12}{'sched':>7}")
    print(f"{'':<20}{'ms':>10}{'ms':>10}{'ms':>9}{'tok/s':>9}{'tok/s':>8}{'':>9}{'':>6}{'':>8}{'tokens':>12}{'share':>7}")
    for r in rows:
        k = r["preemptions"]
        print(f"{r['name']:<20}{r.get('ttft_p50', nan):>10.1f}{r.get('ttft_p99', nan):>10.1f}"
              f"{r.get('itl_p99', nan):>9.1f}{r.get('offline_tok_s', nan):>9.1f}{r['total_tok_s']:>8.1f}"
              f"{k.get('suspend', 0):>9}{k.get('swap', 0):>6}{k.get('recompute', 0):>8}{r['recomputed_tokens']:>12}"
              f"{r['schedule_share']:>7.1%}")
    result = {"ttft_p99_ratio": c["ttft_p99"] / b["ttft_p99"], "itl_p99_ratio": c["itl_p99"] / b["itl_p99"],
              "goodput_ratio": c["total_tok_s"] / a["total_tok_s"],
              "offline_ratio": c["offline_tok_s"] / a["offline_tok_s"],
              "recomputed_share": c["recomputed_tokens"] / max(1, c["computed_tokens"])}
    if len(rows) > 3:
        result["fcfs_ttft_p99_ratio"] = rows[3]["ttft_p99"] / b["ttft_p99"]
    if args.sched_seqs:
        share = scheduler_share(args, args.sched_seqs)
        print(f"\nscheduler at {share['seqs']} seqs ({share['running']} running): "
              f"{share['schedule_ms_per_step']:.2f} ms of a {share['step_ms']:.0f} ms step "
              f"({share['share']:.2%}; goal < 5%)")
        result.update(schedule_share=share["share"], schedule_share_seqs=share["seqs"],
                      schedule_share_running=share["running"])
    print("\nsteps (ms p50/p99, tokens p50) under an online time bound and without; host load average at start/end;"
          " fitted cost model (fixed, per token, per context token, ms)")
    for r in rows:
        cm = r.get("cost_model") or {}
        print(f"{r['name']:<20}" + "".join(
            f" {k} {r[k + '_steps']} steps {r[k + '_step_ms'][0]:.0f}/{r[k + '_step_ms'][1]:.0f} ms, "
            f"{r[k + '_tokens_p50']} tok;" for k in ("bounded", "free") if k + "_steps" in r)
            + f" load {r['load'][0]:.1f}/{r['load'][1]:.1f}; cost {1000 * cm.get('fixed_s', 0):.1f}, "
            f"{1000 * cm.get('per_token_s', 0):.2f}, {1000 * cm.get('per_context_s', 0):.4f}")
        if "over_prediction" in r:
            print(f"{'':<20} bounded steps: actual / predicted {r['over_prediction'][0]:.2f}/"
                  f"{r['over_prediction'][1]:.2f} (p50/p99), {r['over_bound_share']:.0%} over their bound")
    print("\nrealtime TTFT split (ms p50/p99): queued -> in the engine (broker, claim, add) and in the engine -> "
          "first token (the step under way, then the prompt's step)")
    for r in rows:
        if "engine_ttft" in r:
            print(f"{r['name']:<20} intake {r['intake_ttft'][0]:.0f}/{r['intake_ttft'][1]:.0f}, engine "
                  f"{r['engine_ttft'][0]:.0f}/{r['engine_ttft'][1]:.0f}; claim "
                  f"{r['claim_p50']:.0f}/{r['claim_p99']:.0f}")
    print(f"\ngoals: ttft_p99_ratio <= 1.5, itl_p99_ratio <= 1.5, goodput_ratio >= 0.90, recomputed_share <= 0.02")
    result.update(model=args.model, device=args.device, offline=args.offline, rt_rate=args.rt_rate,
                  load=[round(x, 1) for r in rows[1:3] for x in r["load"]])
    print(json.dumps(result))
    record("hybrid_sla", result)


if __name__ == "__main__":
    main()
