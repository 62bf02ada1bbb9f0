"""The fleet plan's inputs and where it is kept (Flask- and torch-free): beat builds the planner's problem
(service/ledger/planner.py) from the ledger and the workers' heartbeats, solves it and stores the plan; the web's
/metrics exports it as `tidepool:desired_workers{pool}` (which KEDA's prometheus scaler follows) and the panel
shows it with the forecast.

- Pools: each enabled model (the registry's, the default model's included) x each device kind the deployment
  runs (TIDEPOOL_PLANNER_POOLS, `gpu=8,cpu=4`: kind = most workers). A gpu pool serves every class; a cpu pool
  serves the deferrable queue beside gpu pools and every class where it is the only kind (as `tidepool worker
  --kind auto` on a CPU host does). A hot model keeps one worker of its first pool that serves online work;
  warm and cold models go to zero when they have neither forecast online traffic nor queued work.
- Throughput: each live worker's own cost model (engine stats in its heartbeat: fixed, per-token and
  per-context seconds of a step, fitted from its measured steps) at a full decode batch, or, lower, the tokens its
  busy workers served since the previous plan (what the cost model does not see: the host's other load, the
  service's own work per job); a pool's rate is the median of its workers', kept in the stored plan so that a pool
  scaled to zero plans with its last measurement. Never measured: FALLBACK_TOKENS_PER_S.
- Forecast: the ledger's jobs by (tenant, class, model) and hour of arrival over HISTORY_DAYS, their estimated
  tokens (the figure admission charges), and the rate of the last RECENT_S as a floor for the next hour.
- Work: queued and running offline jobs by (model, class, deadline: the job's own or its batch's expiry).

Stored in Redis (PLAN_KEY, JSON) or, without Redis (embedded mode), in this process."""
import json
import statistics
import threading
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import planner
from .models import Batch, Job, JobStatus, ModelTier
from ..protocol.sla_classes import OFFLINE_CLASSES, ONLINE_CLASSES, SLA_CLASSES

PLAN_KEY = "tidepool:fleet_plan"
PLAN_INTERVAL = 60.0           # seconds between two plans (beat)
PLAN_TTL = 300.0               # seconds a stored plan is exported; older, the metric is absent (KEDA: 0)
HISTORY_DAYS = 7
RECENT_S = 900.0
DECODE_BATCH = 64              # sequences in the full decode batch a worker's throughput is measured at
DECODE_CONTEXT = 512           # tokens each of them attends to
FALLBACK_TOKENS_PER_S = {"gpu": 2000.0, "cpu": 60.0}   # until a worker of the pool reported its cost model
KINDS = ("gpu", "cpu")


def parse_pools(text: str) -> dict[str, int]:
    """`gpu=8,cpu=4` -> {"gpu": 8, "cpu": 4}; ValueError naming what is wrong."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, most = part.partition("=")
        if kind.strip() not in KINDS or not most.strip().isdigit():
            raise ValueError(f"expected kind=max_workers pairs with kind one of {', '.join(KINDS)}, got {part!r}")
        out[kind.strip()] = int(most)
    if not out:
        raise ValueError("no pool")
    return out


def pool_classes(kind: str, kinds) -> frozenset:
    if kind == "cpu" and "gpu" in kinds:
        return frozenset(("deferrable",))
    return frozenset(SLA_CLASSES)


# -- measured throughput ----------------------------------------------------------------------------------------

def worker_rate(heartbeat: dict) -> float | None:
    """Tokens/s of one worker at a full decode batch, from the cost model in its heartbeat (None: none there)."""
    cost = (heartbeat.get("engine") or {}).get("cost_model") or {}
    if not cost.get("observations"):
        return None
    batch = min(DECODE_BATCH, heartbeat.get("seats") or DECODE_BATCH)
    step = cost.get("fixed_s", 0.0) + batch * (cost.get("per_token_s", 0.0) + DECODE_CONTEXT * cost.get("per_context_s", 0.0))
    return batch / step if step > 0 else None


def _pool(hb: dict, default_model: str | None) -> str | None:
    model = hb.get("serves") or default_model
    if not model:
        return None
    return f"{model}/{'gpu' if str(hb.get('device', 'cpu')).startswith('cuda') else 'cpu'}"


def served_rates(heartbeats: list[dict], previous: dict, default_model: str | None) -> tuple[dict[str, float], dict]:
    """pool -> median tokens/s its busy workers served since the previous plan (a worker counts when its engine had
    work waiting at both ends: it ran at what it can, whatever its cost model says); and this plan's samples, per
    worker [at, tokens served, waiting, started_at], for the next one."""
    samples, rates = {}, {}
    for hb in heartbeats:
        engine = hb.get("engine") or {}
        tokens = engine.get("total_prompt_tokens", 0) + engine.get("total_generation_tokens", 0)
        sample = [hb.get("at", 0.0), tokens, engine.get("waiting", 0), hb.get("started_at")]
        samples[hb["name"]] = sample
        before, pool = previous.get(hb["name"]), _pool(hb, default_model)
        if before and pool and before[3] == sample[3] and before[2] > 0 and sample[2] > 0 and sample[0] > before[0]:
            rates.setdefault(pool, []).append((sample[1] - before[1]) / (sample[0] - before[0]))
    return {pool: statistics.median(r) for pool, r in rates.items()}, samples


def measured_rates(heartbeats: list[dict], default_model: str | None) -> dict[str, float]:
    """pool -> median tokens/s of its live workers."""
    rates: dict[str, list[float]] = {}
    for hb in heartbeats:
        rate, pool = worker_rate(hb), _pool(hb, default_model)
        if rate is not None and pool:
            rates.setdefault(pool, []).append(rate)
    return {pool: statistics.median(r) for pool, r in rates.items()}


# -- arrivals and work from the ledger ----------------------------------------------------------------------------

def _hour(s: Session, column):
    if s.get_bind().dialect.name == "postgresql":
        return func.date_trunc("hour", column)
    return func.strftime("%Y-%m-%d %H:00:00", column)


def _ts(value) -> float:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def arrival_history(s: Session, now: datetime, default_model: str | None) -> list[tuple]:
    """((tenant, class, model), hour start in Unix seconds, estimated tokens) of the jobs of the last HISTORY_DAYS."""
    hour = _hour(s, Job.created_at).label("hour")
    rows = s.execute(select(Job.tenant_id, Job.sla_class, Job.model, hour, func.sum(Job.estimated_tokens))
                     .where(Job.created_at >= now - timedelta(days=HISTORY_DAYS, hours=1), Job.created_at < now)
                     .group_by(Job.tenant_id, Job.sla_class, Job.model, hour)).all()
    return [((tenant, cls.value, model or default_model), _ts(h), float(tokens or 0))
            for tenant, cls, model, h, tokens in rows]


def recent_rates(s: Session, now: datetime, default_model: str | None, window: float = RECENT_S) -> dict[tuple, float]:
    rows = s.execute(select(Job.tenant_id, Job.sla_class, Job.model, func.sum(Job.estimated_tokens))
                     .where(Job.created_at >= now - timedelta(seconds=window), Job.created_at < now)
                     .group_by(Job.tenant_id, Job.sla_class, Job.model)).all()
    return {(tenant, cls.value, model or default_model): float(tokens or 0) / window
            for tenant, cls, model, tokens in rows}


def queued_work(s: Session, default_model: str | None) -> list[tuple[str, str, float, float | None]]:
    """(model, class, deadline in Unix seconds or None, estimated tokens) of the offline jobs still to run."""
    deadline = func.coalesce(Job.deadline, Batch.expires_at).label("deadline")
    rows = s.execute(select(Job.model, Job.sla_class, deadline, func.sum(Job.estimated_tokens))
                     .outerjoin(Batch, Batch.id == Job.batch_id)
                     .where(Job.status.in_((JobStatus.queued, JobStatus.running)),
                            Job.sla_class.in_(OFFLINE_CLASSES))
                     .group_by(Job.model, Job.sla_class, deadline)).all()
    return [(model or default_model, cls.value, None if d is None else _ts(d), float(tokens or 0))
            for model, cls, d, tokens in rows]


# -- the problem ------------------------------------------------------------------------------------------------

def build(models: dict[str, str], kinds: dict[str, int], rates: dict[str, float], history: list[tuple],
          recent: dict[tuple, float], work: list[tuple], now: float,
          durations: list[float] | None = None) -> tuple[planner.Problem, list[float]]:
    """The planner's problem: `models` name -> tier (enabled ones), `kinds` kind -> most workers, `rates` pool ->
    tokens/s, over `durations` (default: planner.intervals). Returns it with the intervals' start times."""
    durations = durations or planner.intervals(now)
    starts = [now + sum(durations[:t]) for t in range(len(durations))]
    pools = []
    for model, tier in sorted(models.items()):
        floor = 1 if tier == ModelTier.hot.value else 0
        for kind, most in kinds.items():
            classes = pool_classes(kind, kinds)
            name = f"{model}/{kind}"
            least = floor if classes & set(ONLINE_CLASSES) else 0
            floor = floor if not least else 0          # one warm worker per hot model, in its first online pool
            pools.append(planner.Pool(name, model, rates.get(name, FALLBACK_TOKENS_PER_S[kind]), classes, most,
                                      min(least, most)))
    profile = planner.hourly_profile(history, now, HISTORY_DAYS)
    peaks = planner.forecast(profile, starts, durations, recent)
    online = planner.online_by_model({k: v for k, v in peaks.items() if k[2] in models}, ONLINE_CLASSES,
                                     len(durations))
    items = []
    for model, cls, deadline, tokens in work:
        if model in models:
            due = len(durations) - 1 if deadline is None else planner.due_interval(durations, now, deadline)
            items.append(planner.Work(model, cls, tokens, due))
    return planner.Problem(pools, durations, online, items, ONLINE_CLASSES), starts


def plan_json(problem: planner.Problem, plan: planner.Plan, starts: list[float], now: float,
              samples: dict | None = None) -> dict:
    return {"at": now, "starts": starts, "durations": problem.durations, "samples": samples or {},
            "pools": {p.name: {"model": p.model, "desired": plan.workers[p.name][0], "workers": plan.workers[p.name],
                               "tokens_per_s": p.tokens_per_s, "max_workers": p.max_workers,
                               "min_workers": p.min_workers} for p in problem.pools},
            "forecast": {m: [round(v, 3) for v in series] for m, series in problem.online.items()},
            "work_tokens": {m: sum(w.tokens for w in problem.work if w.model == m) for m in {p.model for p in
                                                                                              problem.pools}},
            "method": plan.method, "status": plan.status, "solve_s": plan.solve_s, "late_tokens": plan.late_tokens,
            "worker_hours": plan.cost}


# -- where the plan is kept -------------------------------------------------------------------------------------

class PlanStore:
    _local: dict[str, str] = {}
    _lock = threading.Lock()

    def __init__(self, redis_client=None):
        self.redis = redis_client

    def put(self, plan: dict) -> None:
        data = json.dumps(plan)
        if self.redis is not None:
            self.redis.set(PLAN_KEY, data)
        else:
            with self._lock:
                self._local[PLAN_KEY] = data

    def get(self, max_age: float | None = PLAN_TTL, now: float | None = None) -> dict | None:
        if self.redis is not None:
            raw = self.redis.get(PLAN_KEY)
        else:
            with self._lock:
                raw = self._local.get(PLAN_KEY)
        if not raw:
            return None
        plan = json.loads(raw)
        now = time.time() if now is None else now
        return plan if max_age is None or now - plan.get("at", 0) <= max_age else None

    def rates(self) -> tuple[dict[str, float], dict]:
        """The last measured tokens/s of each pool (a pool at zero has no worker to measure), and the workers'
        samples of the last plan (served_rates)."""
        plan = self.get(max_age=None) or {}
        return {name: p["tokens_per_s"] for name, p in plan.get("pools", {}).items()}, plan.get("samples", {})
