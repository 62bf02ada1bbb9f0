"""Scaling with the tide: a trace-driven simulation of a week of tidal traffic on a GPU fleet, sized three ways.

The trace (seeded): four models, each a GPU pool; five tenants whose online demand (realtime and interactive
tokens per second) swells in their day and ebbs at night, lower at the weekend, with per-minute noise and, on
day 4, a three-hour surge of one tenant at twice its usual rate; offline batches (2 to 4 a model a day, 24 h
windows) whose tokens add up to OFFLINE_SHARE of the online volume. One model is cold: no online traffic, a batch
a day. The planner's forecast starts from a prior week of the same traffic (other noise, no surge), as a ledger
in service has one.

The fleets, minute by minute, each worker ready START_S after it was asked for and paid from then, scale-down by
the ScaledObjects' HPA behaviour (five minutes' stabilisation, one pod a minute), online work first on every
worker and offline work (earliest deadline first) in what is left:

- static: every pool sized once for the week's peak online demand plus the reserve and the mean offline load;
- queue: KEDA on the queue (what a Redis-list scaler does): ceil(waiting jobs / 64), at least one worker;
- planner: service/ledger/planner.py every 15 minutes (forecast from the history by hour of day, never below the
  last 15 minutes' rate; the queued batches and their deadlines), then, as the manifests wire it, the higher of
  its desired_workers and the online queue's trigger.

Online SLA attainment: the share of online tokens that arrive in a minute whose online backlog is served within
it. A batch misses its deadline if tokens are left at its window's end.

Per-worker throughput: the CPU figure is the production-shape generated tokens/s of SmolLM2-135M measured by
benchmarks/offline_http.py (benchmarks/results/offline_http.json, `paths.production.gen_tok_s`; FALLBACK_CPU_TOK_S
when the file is missing). No GPU result is recorded here, so a GPU worker is stated as GPU_OVER_CPU times it, and
the larger models as the smallest's tokens/s divided by their size ratio; only ratios are reported, and they do not
depend on this scale.

Then the planner's solve time on the goal's size: 1,000 queued batches over 20 pools (10 models x gpu and cpu),
SOLVES times. Goals: planner SLA attainment >= 99%, no missed deadline that the static fleet meets, worker-hours
<= 60% of static's and <= 80% of queue autoscaling's, solve p99 <= 1 s. One JSON line; the week's demand and
workers per hour go into the result for benchmarks/report.py's plot.

    python benchmarks/tide.py [--days 7] [--seed 1] [--solves 20] [--no-record]
"""
import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tidepool.service.ledger import planner  # noqa: E402
from tidepool.service.ledger.planner import Pool, Problem, Work  # noqa: E402

FALLBACK_CPU_TOK_S = 172.8        # offline_http.json's figure when the file is missing
GPU_OVER_CPU = 40.0
START_S = 120.0                   # a worker loads its model before it serves
STABILISE_MIN, DOWN_PER_MIN = 5, 1
JOB_TOKENS = 256                  # tokens of one job (the queue trigger counts jobs)
QUEUE_THRESHOLD = 64              # jobs per worker (the ScaledObjects' threshold)
PLAN_EVERY_MIN = 15
OFFLINE_SHARE = 0.35
MAX_WORKERS = 24
RESERVE = planner.RESERVE
ONLINE = frozenset({"realtime", "interactive", "batch", "deferrable"})
# model -> (size ratio to the smallest, peak online demand in its GPU workers, tier)
MODELS = {"smollm2-135m": (1.0, 10.0, "hot"), "qwen2-0.5b": (3.0, 7.0, "hot"), "qwen2-1.5b": (8.0, 4.0, "hot"),
          "llama-7b-cold": (30.0, 0.0, "cold")}
# tenant -> (share of each model's online demand, hour of its daily peak, UTC)
TENANTS = {"acme": (0.35, 14), "borealis": (0.25, 9), "cygnus": (0.2, 19), "delta": (0.12, 16), "erato": (0.08, 12)}
SURGE = ("acme", "smollm2-135m", 4, 11, 14, 2.0)     # tenant, model, day, from hour, to hour, factor


def cpu_tokens_per_s() -> tuple[float, str]:
    path = Path(__file__).resolve().parent / "results" / "offline_http.json"
    try:
        value = json.loads(path.read_text())["result"]["paths"]["production"]["gen_tok_s"]
        return float(value), "benchmarks/results/offline_http.json paths.production.gen_tok_s"
    except (OSError, KeyError, ValueError):
        return FALLBACK_CPU_TOK_S, "fallback (no offline_http.json)"


def shape(hour: float, peak: float) -> float:
    """A tenant's day: 15% at night, its peak at `peak` o'clock, about eight busy hours."""
    d = (hour - peak + 12) % 24 - 12
    return 0.15 + 0.85 * math.exp(-(d / 3.2) ** 2)


def online_trace(rng: np.random.Generator, minutes: int, rates: dict, surge: bool) -> dict:
    """(tenant, model) -> online tokens/s per minute."""
    out = {}
    t = np.arange(minutes) / 60.0
    day = (t // 24).astype(int)
    weekend = np.where(day % 7 >= 5, 0.6, 1.0)
    for model, (_, peak_workers, _) in MODELS.items():
        if peak_workers == 0:
            continue
        for tenant, (share, peak_h) in TENANTS.items():
            base = np.array([shape(h % 24, peak_h) for h in t])
            noise = np.empty(minutes)
            x = 0.0
            eps = rng.normal(0, 0.05, minutes)
            for i in range(minutes):    # AR(1): minute-to-minute noise that persists for a few minutes
                x = 0.8 * x + eps[i]
                noise[i] = math.exp(x)
            rate = rates[model] * peak_workers * share * base * weekend * noise
            if surge and (tenant, model) == SURGE[:2]:
                s_day, h0, h1, factor = SURGE[2:]
                window = (day == s_day) & (t % 24 >= h0) & (t % 24 < h1)
                rate = np.where(window, rate * factor, rate)
            out[(tenant, model)] = rate
    return out


def batch_trace(rng: random.Random, days: int, online: dict, rates: dict) -> list[dict]:
    """Offline batches: (model, tenant, arrival minute, tokens, deadline minute)."""
    batches = []
    for model, (_, peak_workers, tier) in MODELS.items():
        daily = sum(float(r.sum()) * 60 for (t, m), r in online.items() if m == model) / days
        if tier == "cold":
            daily = rates[model] * 4 * 3600       # four worker-hours of work a day
        for d in range(days):
            n = rng.randint(2, 4)
            weights = [rng.uniform(0.5, 1.5) for _ in range(n)]
            for w in weights:
                at = d * 1440 + rng.randrange(1440)
                batches.append({"model": model, "tenant": rng.choice(list(TENANTS)), "at": at,
                                "tokens": OFFLINE_SHARE * daily * w / sum(weights) if tier != "cold" else
                                daily * w / sum(weights), "deadline": at + 1440})
    return sorted(batches, key=lambda b: b["at"])


class Fleet:
    """One pool's workers: asked-for times (paid from then, ready START_S later) and the HPA's scale-down."""

    def __init__(self, n: int = 0):
        self.asked = [-START_S / 60] * n      # ready at once at the start
        self.recent: list[int] = []
        self.paid_minutes = 0

    def ready(self, minute: int) -> int:
        return sum(1 for a in self.asked if minute - a >= START_S / 60)

    def scale(self, desired: int, minute: int) -> None:
        self.recent = (self.recent + [desired])[-STABILISE_MIN:]
        target = max(self.recent)             # scale-down waits for five quiet minutes
        if target > len(self.asked):
            self.asked += [minute] * (target - len(self.asked))
        elif target < len(self.asked):
            for _ in range(min(DOWN_PER_MIN, len(self.asked) - target)):
                self.asked.remove(max(self.asked))   # the youngest (not yet ready) first

    def pay(self) -> None:
        self.paid_minutes += len(self.asked)


def simulate(policy: str, minutes: int, online: dict, batches: list[dict], rates: dict, history: list[tuple],
             static: dict | None = None) -> dict:
    models = list(MODELS)
    fleets = {m: Fleet(static[m] if static else (1 if MODELS[m][2] == "hot" else 0)) for m in models}
    backlog = {m: 0.0 for m in models}
    demand = {m: sum(r for (t, mm), r in online.items() if mm == m) if any(mm == m for _, mm in online)
              else np.zeros(minutes) for m in models}
    queued: list[dict] = []
    pending = [dict(b, left=b["tokens"]) for b in batches]
    nxt, served_ok, total, missed, done = 0, 0.0, 0.0, [], []
    history = list(history)
    hour_acc: dict = {}
    plan_desired: dict = {}
    solves = []
    series = {m: [] for m in models}
    for minute in range(minutes):
        while nxt < len(pending) and pending[nxt]["at"] <= minute:
            queued.append(pending[nxt])
            nxt += 1
        if policy == "planner" and minute % PLAN_EVERY_MIN == 0:
            plan = _plan(minute, models, rates, history, online, queued)
            solves.append(plan.solve_s)
            plan_desired = plan.desired
        for m in models:
            f = fleets[m]
            jobs_online = backlog[m] / JOB_TOKENS
            jobs_offline = sum(b["left"] for b in queued if b["model"] == m) / JOB_TOKENS
            floor = 1 if MODELS[m][2] == "hot" else 0
            if policy == "queue":
                f.scale(min(MAX_WORKERS, max(floor, math.ceil((jobs_online + jobs_offline) / QUEUE_THRESHOLD))),
                        minute)
            elif policy == "planner":
                f.scale(min(MAX_WORKERS, max(plan_desired.get(f"{m}/gpu", floor),
                                             math.ceil(jobs_online / QUEUE_THRESHOLD))), minute)
            f.pay()
            capacity = f.ready(minute) * rates[m] * 60.0
            arrived = float(demand[m][minute]) * 60.0
            need = backlog[m] + arrived
            on = min(capacity, need)
            backlog[m] = need - on
            total += arrived
            if backlog[m] <= 1e-6:
                served_ok += arrived
            spare = capacity - on
            mine = sorted((b for b in queued if b["model"] == m), key=lambda b: b["deadline"])
            for b in mine:                    # earliest deadline first in what online left
                if spare <= 0:
                    break
                take = min(spare, b["left"])
                b["left"] -= take
                spare -= take
            series[m].append((float(demand[m][minute]) / rates[m], f.ready(minute), len(f.asked)))
        for b in list(queued):
            if b["left"] <= 1e-6:
                queued.remove(b)
                done.append(b)
            elif minute + 1 >= b["deadline"]:
                queued.remove(b)
                missed.append(b)
        if policy == "planner":               # the ledger's history grows by the minute's arrivals
            hour = minute // 60
            for (tenant, m), r in online.items():
                hour_acc[(tenant, m, hour)] = hour_acc.get((tenant, m, hour), 0.0) + float(r[minute]) * 60
            if minute % 60 == 59:
                for (tenant, m, h), tokens in list(hour_acc.items()):
                    if h == hour:
                        history.append(((tenant, "interactive", m), h * 3600.0, tokens))
                        del hour_acc[(tenant, m, h)]
    unfinished = [b for b in queued + pending[nxt:]]
    return {"worker_hours": sum(f.paid_minutes for f in fleets.values()) / 60.0,
            "sla_attainment": served_ok / total if total else 1.0,
            "missed": {(b["model"], b["at"]) for b in missed}, "completed": len(done),
            "unfinished": len(unfinished), "solves": solves, "series": series}


def _plan(minute: int, models: list, rates: dict, history: list, online: dict, queued: list) -> planner.Plan:
    now = minute * 60.0
    durations = planner.intervals(now)
    starts = [now + sum(durations[:t]) for t in range(len(durations))]
    pools = [Pool(f"{m}/gpu", m, rates[m], ONLINE, MAX_WORKERS, 1 if MODELS[m][2] == "hot" else 0) for m in models]
    profile = planner.hourly_profile(history, now)
    lo = max(0, minute - 15)
    recent = {(t, "interactive", m): float(r[lo:minute].mean()) for (t, m), r in online.items()} if minute else {}
    peaks = planner.forecast(profile, starts, durations, recent)
    by_model = planner.online_by_model(peaks, ("realtime", "interactive"), len(durations))
    work = [Work(b["model"], "batch", b["left"], planner.due_interval(durations, now, b["deadline"] * 60.0))
            for b in queued]
    return planner.plan(Problem(pools, durations, by_model, work))


def static_sizes(online: dict, batches: list, rates: dict, days: int) -> dict:
    out = {}
    for m in MODELS:
        series = sum((r for (t, mm), r in online.items() if mm == m), np.zeros(1))
        peak = float(np.max(series))
        offline = sum(b["tokens"] for b in batches if b["model"] == m) / (days * 86400)
        out[m] = max(1, math.ceil(((1 + RESERVE) * peak + offline) / rates[m]))
    return out


def solve_times(solves: int, seed: int) -> tuple[list[float], list[float], list[str]]:
    """The goal's size: 1,000 queued batches over 20 pools (10 models, gpu and cpu): each solve's wall seconds, CPU
    seconds of this process (on a shared host the wall clock also counts other processes' turns) and method."""
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(10)]
    pools = [p for m in models for p in (Pool(f"{m}/gpu", m, rng.uniform(2000, 8000), ONLINE, 32, 1),
                                         Pool(f"{m}/cpu", m, rng.uniform(60, 200), frozenset({"deferrable"}), 8, 0,
                                              0.25))]
    times, cpu, methods = [], [], []
    for k in range(solves):
        now = k * 900.0
        durations = planner.intervals(now)
        work = [Work(rng.choice(models), rng.choice(["batch", "deferrable"]), rng.uniform(1e5, 2e7),
                     planner.due_interval(durations, now, now + rng.uniform(1800, 86400))) for _ in range(1000)]
        online = {m: [rng.uniform(1000, 40000) for _ in durations] for m in models}
        started = time.process_time()
        plan = planner.plan(Problem(pools, durations, online, work))
        cpu.append(time.process_time() - started)
        times.append(plan.solve_s)
        methods.append(plan.method)
    return times, cpu, methods


def hourly(series: dict, days: int) -> list[dict]:
    out = []
    for h in range(days * 24):
        row = {"hour": h}
        for key in ("demand", "ready"):
            idx = 0 if key == "demand" else 1
            row[key] = round(sum(float(np.mean([s[idx] for s in v[h * 60:(h + 1) * 60]])) for v in series.values()), 3)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--solves", type=int, default=20)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    cpu, source = cpu_tokens_per_s()
    rates = {m: cpu * GPU_OVER_CPU / size for m, (size, _, _) in MODELS.items()}
    minutes = args.days * 1440
    online = online_trace(np.random.default_rng(args.seed), minutes, rates, surge=True)
    prior = online_trace(np.random.default_rng(args.seed + 1000), 7 * 1440, rates, surge=False)
    history = [((t, "interactive", m), (h - 7 * 24) * 3600.0, float(r[h * 60:(h + 1) * 60].sum()) * 60)
               for (t, m), r in prior.items() for h in range(7 * 24)]
    batches = batch_trace(random.Random(args.seed), args.days, online, rates)
    static = static_sizes(online, batches, rates, args.days)
    started = time.perf_counter()
    runs = {"static": simulate("static", minutes, online, batches, rates, history, static),
            "queue": simulate("queue", minutes, online, batches, rates, history),
            "planner": simulate("planner", minutes, online, batches, rates, history)}
    sim_s = time.perf_counter() - started
    solve, solve_cpu, methods = solve_times(args.solves, args.seed)
    p, s, q = runs["planner"], runs["static"], runs["queue"]
    demand = sum(float(r.sum()) for r in online.values()) / len(next(iter(online.values())))
    peak = float(np.max(sum(online.values())))
    result = {
        "planner_worker_hours_ratio": round(p["worker_hours"] / s["worker_hours"], 3),
        "planner_vs_queue_ratio": round(p["worker_hours"] / q["worker_hours"], 3),
        "sla_attainment": round(p["sla_attainment"], 5),
        "missed_deadlines": len(p["missed"]),
        "static_missed_deadlines": len(s["missed"]),
        "queue_missed_deadlines": len(q["missed"]),
        "missed_that_static_met": len(p["missed"] - s["missed"]),
        "solve_s_p99": round(float(np.percentile(solve, 99)), 4),
        "solve_s_p50": round(float(np.percentile(solve, 50)), 4),
        "solve_cpu_s_p99": round(float(np.percentile(solve_cpu, 99)), 4),
        "solve_methods": {m: methods.count(m) for m in sorted(set(methods))},
        "sim_solve_s_p99": round(float(np.percentile(p["solves"], 99)), 4),
        "sim_solves": len(p["solves"]),
        "worker_hours": {k: round(v["worker_hours"], 1) for k, v in runs.items()},
        "sla_attainment_by_fleet": {k: round(v["sla_attainment"], 5) for k, v in runs.items()},
        "static_workers": static,
        "batches": len(batches), "days": args.days, "seed": args.seed,
        "online_mean_over_peak": round(demand / peak, 3),
        "tokens_per_s_per_worker": {m: round(r, 1) for m, r in rates.items()}, "tokens_per_s_source": source,
        "gpu_over_cpu": GPU_OVER_CPU, "simulate_s": round(sim_s, 1),
        "week": [dict(h, static=sh["ready"], queue=qh["ready"], planner=ph["ready"]) for h, sh, qh, ph in
                 zip(hourly(p["series"], args.days), hourly(s["series"], args.days), hourly(q["series"], args.days),
                     hourly(p["series"], args.days))],
    }
    for row in result["week"]:
        row.pop("ready", None)
    goals = {"sla_attainment >= 0.99": result["sla_attainment"] >= 0.99,
             "no miss static meets": result["missed_that_static_met"] == 0,
             "<= 60% of static": result["planner_worker_hours_ratio"] <= 0.6,
             "<= 80% of queue": result["planner_vs_queue_ratio"] <= 0.8,
             "solve p99 <= 1 s": result["solve_s_p99"] <= 1.0}
    result["goals"] = goals
    print(f"worker-hours: static {s['worker_hours']:.0f}, queue {q['worker_hours']:.0f}, planner {p['worker_hours']:.0f}"
          f"; SLA attainment: static {s['sla_attainment']:.4f}, queue {q['sla_attainment']:.4f}, planner "
          f"{p['sla_attainment']:.4f}; missed deadlines: static {len(s['missed'])}, queue {len(q['missed'])}, planner "
          f"{len(p['missed'])}; solve (1,000 batches x 20 pools) p50 {result['solve_s_p50']} s p99 "
          f"{result['solve_s_p99']} s", file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "week"}))
    if not args.no_record:
        from results import record
        record("tide", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
