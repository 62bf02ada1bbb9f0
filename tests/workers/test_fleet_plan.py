"""The fleet planner's beat task on a real ledger (Postgres with Redis, and the embedded SQLite default): the
forecast comes from the ledger's arrival history by hour, the work from the queued batch jobs, the throughput from
the workers' heartbeats; the plan is exported on the web's /metrics as tidepool:desired_workers{pool} and shown on
the panel's models page with the forecast."""
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from tidepool.service import create_app, migrate
from tidepool.service.ledger import tenants
from tidepool.service.ledger.models import Job, JobStatus, SlaClass
from tidepool.service.ledger.snapshots import Heartbeats
from tidepool.workers import beat

from .conftest import flush_redis

ADMIN = "admin"
NOW = datetime(2026, 12, 1, 9, 30, tzinfo=timezone.utc)


@pytest.fixture(params=["postgres", "sqlite"])
def app(request, tiny_model, tmp_path):
    if request.param == "postgres":
        redis_url = request.getfixturevalue("redis_url")
        flush_redis(redis_url)
        db_url = request.getfixturevalue("pg_url")
    else:
        redis_url, db_url = None, f"sqlite:///{tmp_path / 'ledger.db'}"
        migrate.upgrade(db_url)
    app = create_app({"database_url": db_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                      "model": tiny_model, "admin_token": ADMIN, "planner_pools": "gpu=6,cpu=3"})
    yield app
    if redis_url:
        flush_redis(redis_url)
    else:
        from tidepool.service.ledger.fleet import PlanStore
        PlanStore._local.clear()
    app.services.database.dispose()


def test_the_plan_follows_the_ledger_and_is_exported_and_shown(app, tiny_model):
    model = Path(tiny_model).name
    with Session(app.services.database) as s:
        tenant, key = tenants.create_tenant(s, "tide", 1.0)
        # a week of interactive arrivals: 7,200,000 tokens in each 10:00 hour (2,000 tokens/s), 360,000 otherwise
        for day in range(1, 8):
            for hour in range(24):
                at = NOW.replace(hour=hour, minute=10) - timedelta(days=day)
                tokens = 7_200_000 if hour == 10 else 360_000
                s.add(Job(tenant_id=tenant.id, sla_class=SlaClass.interactive, status=JobStatus.completed,
                          model=model, endpoint="/v1/jobs", request={}, estimated_tokens=tokens, created_at=at,
                          queued_at=at, finished_at=at))
        # queued offline work due in two hours
        for i in range(3):
            s.add(Job(tenant_id=tenant.id, sla_class=SlaClass.batch, status=JobStatus.queued, model=model,
                      endpoint="/v1/jobs", request={}, estimated_tokens=1_000_000, created_at=NOW, queued_at=NOW,
                      deadline=NOW + timedelta(hours=2)))
        s.commit()
    # a live gpu worker whose cost model says 1,000 tokens/s at a full batch: 64 / (0.032 + 64 * 0.0005)
    Heartbeats(app.services.redis).put({"name": "gpu-1", "device": "cuda", "seats": 64, "engine": {"cost_model": {
        "fixed_s": 0.032, "per_token_s": 0.0005, "per_context_s": 0.0, "observations": 100}}}, ttl=60)
    try:
        plan = beat.plan_fleet(app.services, now=NOW.timestamp())
    finally:
        Heartbeats(app.services.redis).delete("gpu-1")
    pools = plan["pools"]
    assert set(pools) == {f"{model}/gpu", f"{model}/cpu"}
    gpu = pools[f"{model}/gpu"]
    assert gpu["tokens_per_s"] == pytest.approx(1000.0)
    assert pools[f"{model}/cpu"]["tokens_per_s"] == 60.0           # never measured: the fallback
    forecast = plan["forecast"][model]
    assert forecast[0] == pytest.approx(100.0, rel=1e-6)            # 09:30-09:45: 360,000 tokens an hour
    assert max(forecast) == pytest.approx(2000.0, rel=1e-6)         # the 10:00 hour
    hour10 = next(t for t, start in enumerate(plan["starts"]) if int(start // 3600) % 24 == 10)
    assert gpu["workers"][hour10] >= 3                              # 1.1 x 2,000 tokens/s at 1,000 per worker
    # 3,000,000 batch tokens by 11:30 beside the online peak: the fleet runs more than the online floor before
    assert gpu["desired"] >= 1 and plan["late_tokens"] == pytest.approx(0.0, abs=1e-3)
    done = sum(w * 1000.0 * d for w, d, start in zip(gpu["workers"], plan["durations"], plan["starts"])
               if start < NOW.timestamp() + 7200)
    online = sum(f * d for f, d, start in zip(forecast, plan["durations"], plan["starts"]) if start < NOW.timestamp() + 7200)
    assert done - online >= 3_000_000 - 1e-3
    # /metrics and the panel (the stored plan is exported while younger than 5 minutes: store it as of now)
    beat.plan_fleet(app.services)
    client = app.test_client()
    text = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    exported = dict(re.findall(r'^tidepool:desired_workers\{pool="([^"]+)"\} ([0-9.]+)$', text, re.M))
    assert set(exported) == {f"{model}/gpu", f"{model}/cpu"} and float(exported[f"{model}/gpu"]) >= 1
    assert re.search(rf'^tidepool:forecast_online_tokens_per_s\{{model="{re.escape(model)}"\}} ', text, re.M)
    https = {"base_url": "https://localhost"}
    page = client.get("/admin/login", **https)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf}, **https).status_code == 302
    html = client.get("/admin/models", **https).text
    assert 'id="fleet-plan"' in html and f'data-pool="{model}/gpu"' in html and 'id="fleet-forecast"' in html


def test_a_pools_rate_is_what_its_busy_workers_served_when_that_is_lower_than_their_cost_model():
    from tidepool.service.ledger import fleet
    cost = {"fixed_s": 0.032, "per_token_s": 0.0005, "per_context_s": 0.0, "observations": 100}   # 1,000 tokens/s

    def beat(name, at, tokens, waiting, started=1.0):
        return {"name": name, "device": "cuda", "seats": 64, "at": at, "started_at": started,
                "engine": {"cost_model": cost, "total_prompt_tokens": tokens // 4, "total_generation_tokens":
                           tokens - tokens // 4, "waiting": waiting}}
    first = [beat("a", 100.0, 0, 3), beat("b", 100.0, 0, 0), beat("c", 100.0, 0, 2)]
    rates, samples = fleet.served_rates(first, {}, "m")
    assert rates == {} and set(samples) == {"a", "b", "c"}
    # a: busy throughout, 24,000 tokens in 60 s; b: idle at first (its rate says nothing); c: restarted meanwhile
    later = [beat("a", 160.0, 24_000, 5), beat("b", 160.0, 3_000, 4), beat("c", 160.0, 90_000, 4, started=2.0)]
    rates, _ = fleet.served_rates(later, samples, "m")
    assert rates == {"m/gpu": 400.0}
    assert fleet.measured_rates(later, "m") == {"m/gpu": 1000.0}
