"""The fleet planner's math (service/ledger/planner.py): the MIP is optimal on small instances (against brute force
over every worker count), the greedy fallback is feasible and never better than optimal, a solver out of time falls
back to it, cold models scale to zero, impossible deadlines are reported late, and the forecast recovers a diurnal
profile from synthetic history (and follows a surge the history has not seen)."""
import math
import random

import pytest

from tidepool.service.ledger import planner
from tidepool.service.ledger.planner import Pool, Problem, Work

EVERY = frozenset({"realtime", "interactive", "batch", "deferrable"})
DEFERRABLE = frozenset({"deferrable"})


def gpu(model="m", rate=100.0, most=3, least=0):
    return Pool(f"{model}/gpu", model, rate, EVERY, most, least, 1.0)


def cpu(model="m", rate=30.0, most=3):
    return Pool(f"{model}/cpu", model, rate, DEFERRABLE, most, 0, 0.25)


def random_problem(rng: random.Random) -> Problem:
    shape = rng.choice(["one-pool", "two-pools"])
    pools = [gpu(rate=rng.choice([80.0, 100.0, 150.0]))]
    T = 4 if shape == "one-pool" else 2
    if shape == "two-pools":
        pools.append(cpu(rate=rng.choice([20.0, 40.0])))
    durations = [rng.choice([600.0, 900.0, 1800.0]) for _ in range(T)]
    online = {"m": [rng.choice([0.0, 40.0, 95.0, 180.0]) for _ in range(T)]}
    work = [Work("m", rng.choice(["batch", "deferrable"]), rng.uniform(1e4, 2e5), rng.randrange(-1, T))
            for _ in range(rng.randint(0, 4))]
    return Problem(pools, durations, online, work)


@pytest.mark.parametrize("seed", range(6))
def test_the_mip_is_optimal_on_small_instances(seed):
    problem = random_problem(random.Random(seed))
    best, _ = planner.brute_force(problem)
    plan = planner.plan(problem, time_limit=10.0)
    assert plan.method == "milp"
    assert planner.objective(problem, plan) <= best * (1 + planner.MIP_GAP) + 1e-9
    assert planner.objective(problem, plan) >= best - 1e-6       # brute force is the optimum: nothing beats it
    workers, late = planner.greedy(problem)
    greedy_plan = planner.Plan(workers, planner._cost(problem, workers), late, "greedy", 0.0)
    assert planner.objective(problem, greedy_plan) >= best - 1e-6


def test_online_capacity_covers_the_peak_plus_the_reserve_and_work_meets_its_deadline():
    problem = Problem([gpu(most=8), cpu(most=4)], [900.0, 900.0, 3600.0], {"m": [250.0, 120.0, 0.0]},
                      [Work("m", "batch", 300_000.0, 1), Work("m", "deferrable", 100_000.0, 2)])
    plan = planner.plan(problem)
    g, c = plan.workers["m/gpu"], plan.workers["m/cpu"]
    for t, peak in enumerate(problem.online["m"]):
        assert 100.0 * g[t] >= 1.1 * peak
    assert plan.late_tokens == pytest.approx(0.0, abs=1e-3)
    # the batch (gpu only) by the end of the second interval, beside the online peak
    assert sum(100.0 * g[t] * 900.0 for t in range(2)) - (250.0 + 120.0) * 900.0 >= 300_000.0 - 1e-3
    assert plan.desired == {"m/gpu": g[0], "m/cpu": c[0]}


def test_cold_models_scale_to_zero_and_a_warm_floor_is_kept():
    problem = Problem([gpu("cold"), cpu("cold"), gpu("hot", least=1)], [900.0, 3600.0],
                      {"cold": [0.0, 0.0], "hot": [0.0, 0.0]})
    plan = planner.plan(problem)
    assert plan.workers == {"cold/gpu": [0, 0], "cold/cpu": [0, 0], "hot/gpu": [1, 1]}


def test_impossible_deadlines_are_reported_late_at_the_pools_maximum():
    problem = Problem([gpu(most=2)], [900.0], {"m": [0.0]}, [Work("m", "batch", 1_000_000.0, 0)])
    plan = planner.plan(problem)
    assert plan.workers["m/gpu"] == [2]
    assert plan.late_tokens == pytest.approx(1_000_000.0 - 2 * 100.0 * 900.0, rel=1e-6)
    workers, late = planner.greedy(problem)
    assert workers["m/gpu"] == [2] and late == pytest.approx(820_000.0, rel=1e-6)


def fleet_problem(seed: int = 7) -> Problem:
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(6)]
    pools = [p for m in models for p in (gpu(m, rng.uniform(500, 3000), 16, 1), cpu(m, rng.uniform(50, 200), 8))]
    durations = planner.intervals(0.0)
    work = [Work(rng.choice(models), rng.choice(["batch", "deferrable"]), rng.uniform(1e5, 5e6),
                 rng.randrange(6, len(durations))) for _ in range(300)]
    return Problem(pools, durations, {m: [rng.uniform(500, 8000) for _ in durations] for m in models}, work)


def assert_feasible(problem: Problem, plan) -> None:
    assert plan.late_tokens == pytest.approx(0.0, abs=1e-3)
    for p in problem.pools:
        assert all(p.min_workers <= n <= p.max_workers for n in plan.workers[p.name])


def test_a_solver_with_no_plan_in_time_falls_back_to_the_greedy_plan(monkeypatch):
    """What HiGHS returns when its time limit comes before any incumbent: no solution."""
    problem = fleet_problem()
    monkeypatch.setattr(planner, "solve_milp", lambda part, time_limit: (None, math.inf, "time limit reached"))
    plan = planner.plan(problem, time_limit=1e-9)
    assert plan.method == "greedy"
    assert plan.workers == planner.greedy(problem)[0]
    assert_feasible(problem, plan)


def test_a_solver_out_of_time_keeps_the_better_of_its_incumbent_and_the_greedy_plan():
    """With no time (each model's MIP gets the 10 ms floor), whether HiGHS has an incumbent depends on the CPU: the
    plan is then greedy or an incumbent, never dearer than the greedy plan, and meets every deadline."""
    problem = fleet_problem()
    plan = planner.plan(problem, time_limit=1e-9)
    assert plan.method in ("greedy", "milp-incumbent")
    assert plan.cost <= planner._cost(problem, planner.greedy(problem)[0]) + 1e-6
    assert_feasible(problem, plan)


def test_intervals_and_due_intervals():
    now = 10 * 3600 + 600.0
    durations = planner.intervals(now)
    assert durations[:4] == [900.0] * 4
    assert sum(durations) >= 86400.0 and all(d <= 3600.0 for d in durations)
    assert (now + sum(durations[:5])) % 3600 == 0          # whole hours after the fine intervals
    assert planner.due_interval(durations, now, now + 1800.0) == 1
    assert planner.due_interval(durations, now, now + 100.0) == -1
    assert planner.due_interval(durations, now, now + 10 * 86400.0) == len(durations) - 1


# -- the forecast -------------------------------------------------------------------------------------------

def diurnal(hour: float, base: float, swing: float) -> float:
    """tokens/s: low at 04:00 UTC, high at 16:00"""
    return base + swing * (1 - math.cos(2 * math.pi * (hour - 4) / 24)) / 2


def test_the_forecast_recovers_each_tenants_diurnal_profile_from_history():
    rng = random.Random(3)
    now = 20 * 86400.0 + 9 * 3600       # 09:00 on day 20
    keys = {("acme", "interactive", "m"): (50.0, 400.0), ("acme", "batch", "m"): (10.0, 0.0),
            ("zeta", "realtime", "m"): (5.0, 100.0)}
    history = []
    for (key, (base, swing)) in keys.items():
        for h in range(7 * 24):
            start = now - 7 * 86400 + h * 3600
            rate = diurnal((start / 3600) % 24, base, swing) * rng.uniform(0.9, 1.1)
            history.append((key, start, rate * 3600))
    profile = planner.hourly_profile(history, now)
    for key, (base, swing) in keys.items():
        for hour in range(24):
            assert profile[key][hour] == pytest.approx(diurnal(hour, base, swing), rel=0.06)
    durations = planner.intervals(now)
    starts = [now + sum(durations[:t]) for t in range(len(durations))]
    peaks = planner.forecast(profile, starts, durations)
    online = planner.online_by_model(peaks, ("realtime", "interactive"), len(durations))
    assert set(online) == {"m"}
    for t, start in enumerate(starts):     # the interval's highest hour, both online tenants summed
        hour = int(start // 3600) % 24
        expected = diurnal(hour, 50, 400) + diurnal(hour, 5, 100)
        assert online["m"][t] >= expected * 0.94
    # at 16:00 the day's peak
    t16 = next(t for t, s in enumerate(starts) if int(s // 3600) % 24 == 16)
    assert online["m"][t16] == pytest.approx(450.0 + 105.0, rel=0.06)


def test_a_surge_the_history_has_not_seen_lifts_the_next_hour_only():
    now = 8 * 86400.0
    history = [(("t", "interactive", "m"), now - 86400 * d + 3600 * h, 100.0 * 3600) for d in range(1, 8)
               for h in range(24)]
    profile = planner.hourly_profile(history, now)
    durations = planner.intervals(now)
    starts = [now + sum(durations[:t]) for t in range(len(durations))]
    peaks = planner.forecast(profile, starts, durations, recent={("t", "interactive", "m"): 300.0})
    series = peaks[("t", "interactive", "m")]
    assert all(p == pytest.approx(300.0) for p, s in zip(series, starts) if s < now + 3600)
    assert all(p == pytest.approx(100.0) for p, s in zip(series, starts) if s >= now + 3600)
