"""Batch work costs the ledger and the broker per job, never per token: the statements a worker sends to the ledger
and the commands Redis serves for a batch of jobs are the same whether each job generates 2 tokens or 24. Counted
(SQLAlchemy's cursor events; Redis's own command statistics), never timed, with the worker driven pass by pass (no
threads), on the production shape (Postgres, Redis) and on the embedded default (SQLite, the in-process broker)."""
from sqlalchemy import event
from sqlalchemy.orm import Session

from tidepool.service import create_app, migrate
from tidepool.service.ledger import tenants
from tidepool.service.ledger.models import Job, JobStatus
from tidepool.workers.worker import Worker, WorkerConfig

JOBS = 6
SHORT, LONG = 2, 24


class Ledger:
    """The web app (where jobs are submitted) and the broker a worker takes them from."""

    def __init__(self, db_url: str, redis_url: str | None, model: str, storage: str):
        self.db_url, self.redis_url, self.model = db_url, redis_url, model
        if db_url.startswith("sqlite"):
            migrate.upgrade(db_url)      # as `tidepool serve` does (Postgres: the fixture's migrated database)
        self.app = create_app({"database_url": db_url, "redis_url": redis_url, "storage_dir": storage, "model": model,
                               "admin_token": "admin"})
        with Session(self.app.services.database) as s:
            _, self.key = tenants.create_tenant(s, "costs", 1.0)
            s.commit()

    def submit(self, max_tokens: int) -> list[str]:
        client, ids = self.app.test_client(), []
        for i in range(JOBS):
            r = client.post("/v1/jobs", json={"prompt": f"costs {i}", "max_tokens": max_tokens, "ignore_eos": True,
                                              "sla_class": "batch"}, headers={"Authorization": f"Bearer {self.key}"})
            assert r.status_code == 202, r.get_json()
            ids.append(r.get_json()["id"])
        return ids

    def completed(self, ids: list[str]) -> list[int]:
        with Session(self.app.services.database) as s:
            rows = [s.get(Job, i) for i in ids]
            assert all(j.status == JobStatus.completed for j in rows), [j.status for j in rows]
            return [j.completion_tokens for j in rows]


def redis_commands(url: str) -> dict:
    import redis
    return {k: v["calls"] for k, v in redis.Redis.from_url(url).info("commandstats").items()}


def run_batch(ledger: Ledger, max_tokens: int, name: str) -> dict:
    """Submit JOBS batch jobs, then one worker takes them all, runs them to the end and writes the results; what it
    cost the ledger (statements) and Redis (commands served, the worker's and anyone's) from the first take on."""
    ids = ledger.submit(max_tokens)
    broker = ledger.redis_url or "memory://"
    w = Worker(WorkerConfig(model=ledger.model, database_url=ledger.db_url, broker_url=broker,
                            redis_url=ledger.redis_url, device="cpu", name=name, lease_seconds=30, fair_intake=False))
    statements = []
    event.listen(w.db, "before_cursor_execute", lambda *args: statements.append(args[2]))
    try:
        w.connect()
        before = redis_commands(ledger.redis_url) if ledger.redis_url else {}
        while w.pull():          # offline messages come one a pass, while the engine has room: all of them here
            pass
        assert len(w.inflight) == JOBS
        steps = 0
        while w.engine.has_unfinished():
            w.engine_step()
            steps += 1
        assert w.finish_done()
        after = redis_commands(ledger.redis_url) if ledger.redis_url else {}
    finally:
        w.close()
    assert ledger.completed(ids) == [max_tokens] * JOBS
    served = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0) and k != "cmdstat_info"}
    return {"statements": len(statements), "redis_commands": served, "steps": steps}


def assert_no_per_token_costs(ledger: Ledger) -> None:
    short = run_batch(ledger, SHORT, "costs-short")
    long = run_batch(ledger, LONG, "costs-long")
    assert long["steps"] >= short["steps"] + LONG - SHORT       # the long jobs took that many more engine steps
    assert long["statements"] == short["statements"], (short, long)
    # Redis's count may differ by a command or two run on a clock (the broker's restore of lapsed messages, whose
    # calls follow elapsed time), never by one per token or per step: 22 more steps, 132 more tokens here.
    extra = sum(long["redis_commands"].values()) - sum(short["redis_commands"].values())
    assert abs(extra) <= 2, (short, long)


def test_batch_jobs_cost_postgres_and_redis_nothing_per_token(pg_url, redis_url, tiny_model, tmp_path):
    from tests.workers.conftest import flush_redis
    flush_redis(redis_url)
    try:
        assert_no_per_token_costs(Ledger(pg_url, redis_url, tiny_model, str(tmp_path / "storage")))
    finally:
        flush_redis(redis_url)


def test_batch_jobs_cost_the_embedded_ledger_nothing_per_token(tiny_model, tmp_path):
    assert_no_per_token_costs(Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", None, tiny_model,
                                     str(tmp_path / "storage")))
