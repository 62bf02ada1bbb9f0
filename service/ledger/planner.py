"""The fleet planner's math (pure: no database, no Redis, no torch): how many workers each pool (model x device
kind) needs over the next intervals, so that

- online capacity covers the forecast online peak of each interval plus RESERVE (10%),
- every queued offline batch finishes before its deadline, at its pool's measured tokens per second,
- at the least worker-hours (each pool's worker-hour weighted by its `weight`).

A mixed-integer program (SciPy's `milp`, HiGHS) with a time limit; when it runs out of time without a solution,
or fails, a greedy plan (cheapest tokens first, earliest deadline first) is used instead. Work that no plan can
finish in time (the pools' maximums are too small) is carried as lateness at a price far above any worker-hour,
so both always return a plan and say how many tokens would be late. `brute_force` enumerates every worker count
of a small problem (the tests' yardstick of optimality).

Units: rates in tokens per second, work in tokens, interval lengths in seconds. Offline work is aggregated by
(model, SLA class, the last interval it may use): batches with the same three are interchangeable for the plan,
so the program's size depends on the number of pools and intervals, not of batches. Pools belong to one model
each, so a model's pools never share work with another model's.

The forecast: each (tenant, class, model)'s arrival rate by hour of day, averaged over the days of history, and
never below the rate measured over the last minutes (a surge the history has not seen)."""
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

RESERVE = 0.10                   # online capacity above the forecast peak
LATE_PRICE = 10.0                # a late token costs this many times the dearest worker-interval there is
DEFAULT_TIME_LIMIT = 1.0         # seconds the MIPs may take (all models together) before greedy plans are used
MIP_GAP = 5e-3                   # a plan within 0.5% of the solver's bound is optimal enough


@dataclass(frozen=True)
class Pool:
    name: str                    # "<model>/<kind>", the label of tidepool:desired_workers
    model: str
    tokens_per_s: float          # one worker's throughput: 1 / its measured cost per token
    classes: frozenset           # the SLA classes its workers serve
    max_workers: int
    min_workers: int = 0
    weight: float = 1.0          # cost of its worker-hour relative to the other pools'

    def serves_online(self, online_classes) -> bool:
        return bool(self.classes & set(online_classes))


@dataclass(frozen=True)
class Work:
    """Queued offline tokens of one model and class that must be done by the end of interval `due`."""
    model: str
    sla_class: str
    tokens: float
    due: int


@dataclass
class Problem:
    pools: list[Pool]
    durations: list[float]                       # seconds of each interval, the first starting now
    online: dict[str, list[float]]               # model -> forecast online peak (tokens/s) of each interval
    work: list[Work] = field(default_factory=list)
    online_classes: tuple = ("realtime", "interactive")
    reserve: float = RESERVE

    def eligible(self, w: Work) -> list[int]:
        return [i for i, p in enumerate(self.pools) if p.model == w.model and w.sla_class in p.classes]

    def peak(self, model: str, t: int) -> float:
        return max(0.0, self.online.get(model, [0.0] * len(self.durations))[t])


@dataclass
class Plan:
    workers: dict[str, list[int]]        # pool -> workers in each interval
    cost: float                          # weighted worker-hours over the horizon
    late_tokens: float                   # offline tokens that no plan finishes by their deadline
    method: str                          # "milp", "milp-incumbent" (time limit, best found), "greedy"
    solve_s: float
    status: str = ""

    @property
    def desired(self) -> dict[str, int]:
        return {name: n[0] for name, n in self.workers.items()}

    def json(self) -> dict:
        return {"desired": self.desired, "workers": self.workers, "worker_hours": round(self.cost, 3),
                "late_tokens": round(self.late_tokens, 1), "method": self.method, "solve_s": round(self.solve_s, 4),
                "status": self.status}


def _late(problem: "Problem") -> float:
    """The price of one late token: above the weighted worker-hours of a worker added for the longest interval to
    avoid it, so a plan is late only where the pools' maximums leave no choice."""
    dearest = max((p.weight for p in problem.pools), default=1.0)
    return LATE_PRICE * dearest * max(problem.durations) / 3600.0


def _cost(problem: Problem, workers: dict[str, list[int]]) -> float:
    return sum(p.weight * n * d / 3600.0 for p in problem.pools for n, d in zip(workers[p.name], problem.durations))


# -- the mixed-integer program --------------------------------------------------------------------------------

class _Layout:
    """Column indices: n[p,t] (integer workers), o[p,t] (online tokens/s a pool serves), z[c,p,t] (tokens/s of
    offline class c a pool runs), s[c] (late tokens of class c). Within a class every token may run on the same
    pools, so earliest deadline first is optimal and the deadlines are cumulative constraints: by the end of each
    interval, the class's work due by then is done."""

    def __init__(self, problem: Problem):
        P, T = len(problem.pools), len(problem.durations)
        self.P, self.T = P, T
        self.n = np.arange(P * T).reshape(P, T)
        col = P * T
        self.online_pools = [i for i, p in enumerate(problem.pools) if p.serves_online(problem.online_classes)]
        self.o = {}
        for i in self.online_pools:
            for t in range(T):
                self.o[i, t] = col
                col += 1
        self.groups = _groups(problem)
        self.classes = sorted({w.sla_class for w in self.groups})
        self.z = {}
        for c in self.classes:
            for i, p in enumerate(problem.pools):
                if c in p.classes:
                    for t in range(T):
                        self.z[c, i, t] = col
                        col += 1
        self.s = {c: col + k for k, c in enumerate(self.classes)}
        self.size = col + len(self.classes)


def _groups(problem: Problem) -> list[Work]:
    """Work summed per (model, class, due interval), the due clipped to the horizon (overdue: the first interval)."""
    T = len(problem.durations)
    merged: dict[tuple, float] = {}
    for w in problem.work:
        if w.tokens > 0:
            key = (w.model, w.sla_class, min(max(w.due, 0), T - 1))
            merged[key] = merged.get(key, 0.0) + w.tokens
    return [Work(m, c, tokens, due) for (m, c, due), tokens in sorted(merged.items())]


def solve_milp(problem: Problem, time_limit: float = DEFAULT_TIME_LIMIT, fixed: dict | None = None):
    """The MIP of one model's pools (plan() splits the models); returns (workers or None, late tokens, status).
    `fixed` (pool -> workers per interval) pins the integers, which makes it the LP that brute_force asks."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    L = _Layout(problem)
    pools, durations = problem.pools, problem.durations
    unit = max(p.tokens_per_s for p in pools)       # rates in units of the fastest worker, work in its hours
    c = np.zeros(L.size)
    lo, hi = np.zeros(L.size), np.full(L.size, np.inf)
    integrality = np.zeros(L.size)
    for i, p in enumerate(pools):
        for t, d in enumerate(durations):
            col = L.n[i, t]
            c[col] = p.weight * d / 3600.0
            integrality[col] = 1
            lo[col], hi[col] = p.min_workers, p.max_workers
            if fixed is not None:
                lo[col] = hi[col] = fixed[p.name][t]
    for (k, i, t), col in L.z.items():   # a little for later work: of equal plans, the one that works sooner
        c[col] = 1e-6 * durations[t] / 3600.0 * (t + 1) / len(durations)
    for col in L.s.values():
        c[col] = _late(problem) * unit * 3600.0
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    r = 0

    def add(entries, low, high):
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        rlo.append(low)
        rhi.append(high)
        r += 1

    for i, p in enumerate(pools):            # a pool's online and offline tokens/s fit its workers
        for t in range(L.T):
            entries = [(L.n[i, t], -p.tokens_per_s / unit)] + [(L.z[k, i, t], 1.0) for k in L.classes if (k, i, t) in L.z]
            if (i, t) in L.o:
                entries.append((L.o[i, t], 1.0))
            add(entries, -np.inf, 0.0)
    for model in {p.model for p in pools}:   # online: the peak served, the reserve on top available
        members = [i for i in L.online_pools if pools[i].model == model]
        for t in range(L.T):
            peak = problem.peak(model, t)
            if peak <= 0:
                continue
            add([(L.o[i, t], 1.0) for i in members], peak / unit, np.inf)
            add([(L.n[i, t], pools[i].tokens_per_s / unit) for i in members], (1 + problem.reserve) * peak / unit,
                np.inf)
    for k in L.classes:                      # each class's work due by the end of t done by then, or late
        due = [0.0] * L.T
        for w in L.groups:
            if w.sla_class == k:
                due[w.due] += w.tokens
        cumulative = np.cumsum(due)
        for t in range(L.T):
            if due[t] > 0:
                entries = [(col, durations[tt] / 3600.0) for (kk, i, tt), col in L.z.items() if kk == k and tt <= t]
                add(entries + [(L.s[k], 1.0)], cumulative[t] / unit / 3600.0, np.inf)
    A = coo_matrix((vals, (rows, cols)), shape=(r, L.size)).tocsr()
    res = milp(c, integrality=integrality, bounds=Bounds(lo, hi),
               constraints=LinearConstraint(A, np.array(rlo), np.array(rhi)) if r else None,
               options={"time_limit": time_limit, "disp": False, "mip_rel_gap": MIP_GAP})
    if res.x is None:
        return None, math.inf, res.message
    x = res.x
    workers = {p.name: [int(round(x[L.n[i, t]])) for t in range(L.T)] for i, p in enumerate(pools)}
    status = "optimal" if res.status == 0 else "time limit"
    return workers, float(sum(x[col] for col in L.s.values())) * unit * 3600.0, status


# -- greedy ---------------------------------------------------------------------------------------------------

def greedy(problem: Problem) -> tuple[dict[str, list[int]], float]:
    """Online first: each interval's peak plus reserve from the model's cheapest-per-token online pools. Then
    offline work, earliest due first, into the spare capacity of intervals up to its due (earliest first), and
    where that is not enough, into added workers (cheapest per token, latest interval first). Returns (workers,
    late tokens)."""
    pools, durations, T = problem.pools, problem.durations, len(problem.durations)
    n = {p.name: [p.min_workers] * T for p in pools}
    used = {p.name: [0.0] * T for p in pools}       # tokens/s committed
    per_token = sorted(range(len(pools)), key=lambda i: pools[i].weight / pools[i].tokens_per_s)
    for model in {p.model for p in pools}:
        members = [i for i in per_token if pools[i].model == model and pools[i].serves_online(problem.online_classes)]
        for t in range(T):
            peak = problem.peak(model, t)
            need = (1 + problem.reserve) * peak - sum(pools[i].tokens_per_s * n[pools[i].name][t] for i in members)
            for i in members:
                if need <= 1e-9:
                    break
                p = pools[i]
                add = min(p.max_workers - n[p.name][t], math.ceil(need / p.tokens_per_s - 1e-9))
                n[p.name][t] += max(add, 0)
                need -= max(add, 0) * p.tokens_per_s
            left = peak                                # the served peak is committed, the reserve is not
            for i in members:
                p = pools[i]
                take = min(left, p.tokens_per_s * n[p.name][t])
                used[p.name][t] += take
                left -= take
    late = 0.0
    for w in sorted(_groups(problem), key=lambda w: w.due):
        left = w.tokens
        eligible = [i for i in per_token if i in problem.eligible(w)]
        for t in range(w.due + 1):                     # spare capacity, earliest first
            for i in eligible:
                p = pools[i]
                spare = p.tokens_per_s * n[p.name][t] - used[p.name][t]
                if spare > 1e-9 and left > 0:
                    rate = min(spare, left / durations[t])
                    used[p.name][t] += rate
                    left -= rate * durations[t]
        for t in range(w.due, -1, -1):                 # then more workers
            for i in eligible:
                p = pools[i]
                while left > 1e-6 and n[p.name][t] < p.max_workers:
                    n[p.name][t] += 1
                    rate = min(p.tokens_per_s, left / durations[t])
                    used[p.name][t] += rate
                    left -= rate * durations[t]
        late += max(left, 0.0)
    return n, late


# -- the plan -------------------------------------------------------------------------------------------------

def plan(problem: Problem, time_limit: float = DEFAULT_TIME_LIMIT) -> Plan:
    """Each model's MIP (a model's pools share work only among themselves), the models sharing `time_limit`; a
    model whose MIP has no plan in its share of the time (or fails) gets the greedy plan instead."""
    started = time.perf_counter()
    models = sorted({p.model for p in problem.pools})
    workers, late, methods, statuses = {}, 0.0, set(), set()
    for k, model in enumerate(models):
        part = Problem([p for p in problem.pools if p.model == model], problem.durations,
                       {model: problem.online.get(model, [0.0] * len(problem.durations))},
                       [w for w in problem.work if w.model == model], problem.online_classes, problem.reserve)
        left = time_limit - (time.perf_counter() - started)
        w, l, method, status = _plan_one(part, max(left / (len(models) - k), 0.01))
        workers.update(w)
        late += l
        methods.add(method)
        statuses.add(status)
    method = "greedy" if "greedy" in methods else "milp-incumbent" if "milp-incumbent" in methods else "milp"
    return Plan(workers, _cost(problem, workers), late, method, time.perf_counter() - started,
                ", ".join(sorted(statuses)))


def _plan_one(problem: Problem, time_limit: float):
    try:
        workers, late, status = solve_milp(problem, time_limit)
    except Exception as exc:          # a solver failure must not leave the fleet without a plan
        workers, late, status = None, math.inf, f"failed: {exc!r}"
    if workers is None:
        return (*greedy(problem), "greedy", status)
    if status == "optimal":
        return workers, late, "milp", status
    g_workers, g_late = greedy(problem)  # timed out with a solution: the better of it and the greedy one
    price = _late(problem)
    if _cost(problem, g_workers) + price * g_late < _cost(problem, workers) + price * late:
        return g_workers, g_late, "greedy", status
    return workers, late, "milp-incumbent", status


def brute_force(problem: Problem) -> tuple[float, dict[str, list[int]]]:
    """Every combination of worker counts (small problems only), each checked by the LP with the counts fixed;
    returns (the least cost + lateness price, its workers)."""
    pools, T = problem.pools, len(problem.durations)
    late_price = _late(problem)
    best, arg = math.inf, None
    ranges = [range(p.min_workers, p.max_workers + 1) for p in pools for _ in range(T)]
    for combo in itertools.product(*ranges):
        fixed = {p.name: list(combo[i * T:(i + 1) * T]) for i, p in enumerate(pools)}
        cost = _cost(problem, fixed)
        if cost >= best:
            continue
        workers, late, _ = solve_milp(problem, time_limit=10.0, fixed=fixed)
        if workers is not None and cost + late_price * late < best - 1e-9:
            best, arg = cost + late_price * late, fixed
    return best, arg


def objective(problem: Problem, plan_: Plan) -> float:
    return plan_.cost + _late(problem) * plan_.late_tokens


# -- the forecast ---------------------------------------------------------------------------------------------

def hourly_profile(history: list[tuple], now: float, days: int = 7) -> dict[tuple, list[float]]:
    """(key, hour start in Unix seconds, tokens) buckets -> key -> mean tokens/s in each hour of day (UTC), over
    the whole hours of the last `days` days (each hour of day once a day), or the days the history covers (a day
    without arrivals counts as zero)."""
    end = now - now % 3600
    since = end - days * 86400
    seen = [start for _, start, _ in history if since <= start < end]
    if not seen:
        return {}
    covered = max(1, min(days, math.ceil((end - min(seen)) / 86400)))
    out: dict[tuple, list[float]] = {}
    for key, start, tokens in history:
        if since <= start < end:
            hour = int(start // 3600) % 24
            out.setdefault(key, [0.0] * 24)[hour] += tokens / 3600.0 / covered
    return out


def forecast(profile: dict[tuple, list[float]], starts: list[float], durations: list[float],
             recent: dict[tuple, float] | None = None) -> dict[tuple, list[float]]:
    """Each key's forecast peak (tokens/s) in each interval: the highest hourly rate of the hours the interval
    overlaps, never below the recently measured rate (`recent`, same keys) for intervals within the next hour."""
    recent = recent or {}
    out = {}
    for key in set(profile) | set(recent):
        rates = profile.get(key, [0.0] * 24)
        peaks = []
        for start, d in zip(starts, durations):
            hours = range(int(start // 3600), int(math.ceil((start + d) / 3600)))
            peak = max(rates[h % 24] for h in hours)
            if start < starts[0] + 3600:
                peak = max(peak, recent.get(key, 0.0))
            peaks.append(peak)
        out[key] = peaks
    return out


def online_by_model(forecasts: dict[tuple, list[float]], online_classes, T: int) -> dict[str, list[float]]:
    """Sum the (tenant, class, model) forecasts of the online classes per model."""
    out: dict[str, list[float]] = {}
    for (tenant, sla_class, model), peaks in forecasts.items():
        if sla_class in online_classes:
            acc = out.setdefault(model, [0.0] * T)
            for t in range(T):
                acc[t] += peaks[t]
    return out


def intervals(now: float, fine: int = 4, fine_s: float = 900.0, horizon_s: float = 86400.0) -> list[float]:
    """Interval lengths from now: `fine` intervals of `fine_s`, then whole hours to `horizon_s`."""
    durations = [fine_s] * fine
    end = now + fine * fine_s
    while end < now + horizon_s:
        step = 3600.0 - end % 3600 if end % 3600 else 3600.0
        durations.append(step)
        end += step
    return durations


def due_interval(durations: list[float], now: float, deadline: float) -> int:
    """The last interval that ends by `deadline` (-1: none does, the work is already short of time)."""
    end, due = now, -1
    for t, d in enumerate(durations):
        end += d
        if end > deadline + 1e-6:
            break
        due = t
    return due
