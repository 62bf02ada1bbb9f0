"""Dashboard: one JSON document computed from the ledger, the broker and the worker snapshots
(service.ledger.snapshots.SnapshotStore); the page polls it and draws the charts."""
from datetime import timedelta

from flask import current_app, render_template, request

from tidepool.service.ledger.snapshots import SNAPSHOT_TTL, Heartbeats, SnapshotStore

from ..app import services
from ..db import reads
from ..ledger import counters
from ..ledger.models import SLA_CLASSES, utcnow
from .blueprint import bp

LATENCY_WINDOW = timedelta(minutes=15)
RATE_WINDOW = timedelta(seconds=60)
MAX_SAMPLES = 5000


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _latency() -> dict:
    """TTFT (created → first token) and end-to-end (created → finished) of jobs completed recently."""
    rows = counters.completed_since(reads(), utcnow() - LATENCY_WINDOW, MAX_SAMPLES)
    samples = {c: {"ttft": [], "e2e": []} for c in SLA_CLASSES}
    for sla, created, first, finished, _ in rows:
        if first is not None:
            samples[sla.value]["ttft"].append((first - created).total_seconds())
        samples[sla.value]["e2e"].append((finished - created).total_seconds())
    return {c: {"n": len(v["e2e"]), "ttft_p50": percentile(v["ttft"], 0.5), "ttft_p99": percentile(v["ttft"], 0.99),
                "e2e_p50": percentile(v["e2e"], 0.5), "e2e_p99": percentile(v["e2e"], 0.99)}
            for c, v in samples.items()}


HISTORY_WINDOW, HISTORY_STEP = timedelta(minutes=3), timedelta(seconds=10)


def history() -> list[dict]:
    """What the ledger remembers of the last few minutes, to seed the charts on a page load: generated tokens/s and
    TTFT / end-to-end p99 per class of the jobs completed in each step (queue depth, KV use and sequences are
    live readings: their charts start at the first poll)."""
    now = utcnow()
    start = now - HISTORY_WINDOW
    rows = counters.completed_since(reads(), start, MAX_SAMPLES)
    steps = int(HISTORY_WINDOW / HISTORY_STEP)
    buckets = [{"tokens": 0, "ttft": {c: [] for c in SLA_CLASSES}, "e2e": {c: [] for c in SLA_CLASSES}}
               for _ in range(steps)]
    for sla, created, first, finished, tokens in rows:
        b = buckets[min(steps - 1, int((finished - start) / HISTORY_STEP))]
        b["tokens"] += tokens or 0
        if first is not None:
            b["ttft"][sla.value].append((first - created).total_seconds())
        b["e2e"][sla.value].append((finished - created).total_seconds())
    seconds = HISTORY_STEP.total_seconds()
    return [{"ts": (start + (i + 1) * HISTORY_STEP).timestamp(), "tokens_per_s": b["tokens"] / seconds,
             "ttft_p99": {c: percentile(v, 0.99) for c, v in b["ttft"].items()},
             "e2e_p99": {c: percentile(v, 0.99) for c, v in b["e2e"].items()}} for i, b in enumerate(buckets)]


_last_totals: dict[str, tuple[float, int]] = {}  # worker → (at, total generation tokens) seen in a heartbeat


def snapshot_store() -> SnapshotStore:
    return SnapshotStore(services().redis)


def _from_heartbeat(hb: dict) -> dict | None:
    """A worker heartbeat in the snapshot shape, with tokens/s from the previous heartbeat seen."""
    engine, name, at = hb.get("engine") or {}, hb.get("name"), hb.get("at")
    if not name or at is None:
        return None
    total = engine.get("total_generation_tokens", 0)
    rate = 0.0
    prev = _last_totals.get(name)
    if prev is not None and at > prev[0]:
        rate = max(0, total - prev[1]) / (at - prev[0])
    if prev is None or at > prev[0]:
        _last_totals[name] = (at, total)
    return {**engine, "worker": name, "device": hb.get("device"), "ts": at, "generation_tokens_per_s": rate}


def worker_snapshots() -> list[dict]:
    """Snapshots published through workers.metrics, plus the heartbeats of workers that publish none."""
    snaps = {s["worker"]: s for s in snapshot_store().read()}
    beats = Heartbeats(services().redis).read()
    now = utcnow().timestamp()
    for hb in beats:
        snap = _from_heartbeat(hb)
        if snap is not None and snap["worker"] not in snaps and now - snap["ts"] <= SNAPSHOT_TTL:
            snaps[snap["worker"]] = snap
    return sorted(snaps.values(), key=lambda s: s["worker"])


def dashboard_json() -> dict:
    s = reads()
    jobs = {c: {"queued": 0, "running": 0} for c in SLA_CLASSES}
    for sla, status, n in counters.active_by_class(s):
        jobs[sla.value][status.value] = n
    errors = []
    try:
        queues = {c: 0 for c in SLA_CLASSES} | services().dispatcher.queue_depths()
    except Exception as exc:
        queues, errors = None, [f"Broker unreachable: {type(exc).__name__}"]
    try:
        workers = worker_snapshots()
    except Exception as exc:
        workers, errors = [], errors + [f"Worker stats unreachable: {type(exc).__name__}"]
    since = utcnow() - RATE_WINDOW
    ledger_tokens, finished = counters.throughput(s, since)
    queries = sum(w.get("prefix_cache_queries", 0) for w in workers)
    hits = sum(w.get("prefix_cache_hits", 0) for w in workers)
    kv = [w.get("kv_cache_usage", 0.0) for w in workers]
    return {
        "ts": utcnow().timestamp(),
        "queues": queues,
        "jobs": jobs,
        "workers": [{"worker": w["worker"], "device": w.get("device"), "running": w.get("running", 0),
                     "waiting": w.get("waiting", 0), "by_class": w.get("by_class", {}),
                     "kv_cache_usage": w.get("kv_cache_usage", 0.0),
                     "generation_tokens_per_s": w.get("generation_tokens_per_s", 0.0),
                     "preemptions": w.get("preemptions", 0), "age_s": round(utcnow().timestamp() - w["ts"], 1)}
                    for w in workers],
        "kv_cache_usage": max(kv) if kv else None,
        "tokens_per_s": (sum(w.get("generation_tokens_per_s", 0.0) for w in workers) if workers
                         else ledger_tokens / RATE_WINDOW.total_seconds()),
        "tokens_per_s_source": "workers" if workers else "ledger (last 60 s)",
        "jobs_finished_per_min": finished,
        "latency": _latency(),
        "preemptions": sum(w.get("preemptions", 0) for w in workers),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "errors": errors,
    }


@bp.get("/")
def dashboard():
    return render_template("dashboard.html", classes=SLA_CLASSES, refresh_ms=current_app.config.get(
        "PANEL_REFRESH_MS", 3000))


@bp.get("/api/dashboard")
def dashboard_data():
    data = dashboard_json()
    if request.args.get("history"):
        data["history"] = history()
    return data
