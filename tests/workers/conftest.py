"""Real backends and real worker processes: Postgres databases cloned from a migrated template, a
private redis-server for the session (flushed per test, so concurrent test runs on one machine don't
share queues), `tidepool worker` / `tidepool beat` subprocesses over a tiny random-weight model."""
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from werkzeug.serving import make_server

from tidepool.service import create_app
from tidepool.service.ledger import redis_conn, tenants
from tidepool.service.ledger.models import Job
from tidepool.service.ledger.snapshots import HEARTBEAT_KEY, Heartbeats

from ..conftest import free_port, start_redis  # noqa: F401  (the fault tests restart their own servers)

ROOT = Path(__file__).resolve().parents[2]
_counter = itertools.count()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    return str(make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), seed=1))


@pytest.fixture(scope="session")
def redis_url(redis_server):
    return f"{redis_server}/0"


def flush_redis(url: str) -> None:
    redis.Redis.from_url(url).flushdb()


class Stack:
    """One ledger + broker + web app, and the worker/beat processes started against it."""

    def __init__(self, db_url: str, model: str, tmp: Path, redis_url: str):
        self.db_url, self.model, self.tmp = db_url, model, tmp
        self.redis_url = redis_url
        self.redis = redis_conn.client(redis_url)      # (a Redis Cluster's too)
        self.storage = str(tmp / "storage")
        self.app = create_app({"database_url": db_url, "redis_url": redis_url, "storage_dir": self.storage,
                               "model": model, "admin_token": "admin"})
        self.engine = self.app.services.database
        self.procs: list[subprocess.Popen] = []
        self.server = None
        self.url = None

    # -- processes ---------------------------------------------------------------------------------
    def env(self, **extra) -> dict:
        env = dict(os.environ, TIDEPOOL_DATABASE_URL=self.db_url, TIDEPOOL_REDIS_URL=self.redis_url,
                   TIDEPOOL_MODEL=self.model, TIDEPOOL_STORAGE_DIR=self.storage, TIDEPOOL_LOG_LEVEL="WARNING",
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def start(self, *args, wait_for: str | None = None, **env) -> subprocess.Popen:
        log = open(self.tmp / f"{args[0]}-{next(_counter)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", *args], cwd=self.tmp, env=self.env(**env),
                                stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log.name
        self.procs.append(proc)
        if wait_for:
            self.wait(lambda: self.redis.exists(HEARTBEAT_KEY.format(wait_for)) or proc.poll() is not None, 60,
                      f"worker {wait_for} to start")
            assert proc.poll() is None, Path(proc.log_path).read_text()
        return proc

    def worker(self, name: str, kind: str = "gpu", **env) -> subprocess.Popen:
        env.setdefault("TIDEPOOL_LEASE_SECONDS", 4)
        return self.start("worker", "--kind", kind, "--device", "cpu", wait_for=name, TIDEPOOL_WORKER_NAME=name,
                          **env)

    def heartbeat(self, name: str) -> dict:
        return Heartbeats(self.redis).get(name) or {}

    def serve(self) -> str:
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        return self.url

    def close(self) -> None:
        for proc in self.procs:     # pytest shows this only for a failed test
            print(f"--- {proc.args[3:5]} exit={proc.poll()} log tail:\n"
                  + "\n".join(Path(proc.log_path).read_text().splitlines()[-40:]))
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.server is not None:
            self.server.shutdown()
        self.engine.dispose()

    # -- ledger --------------------------------------------------------------------------------------
    def tenant(self, name: str | None = None, weight: float = 1.0) -> tuple[str, str]:
        with Session(self.engine) as s:
            t, key = tenants.create_tenant(s, name or f"t{next(_counter)}", weight)
            s.commit()
            return t.id, key

    def submit(self, key: str, n: int = 1, **body) -> list[str]:
        client = self.app.test_client()
        ids = []
        for i in range(n):
            r = client.post("/v1/jobs", json={"prompt": f"job {i}", **body}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 202, r.get_json()
            ids.append(r.get_json()["id"])
        return ids

    def jobs(self, *where) -> list[Job]:
        with Session(self.engine) as s:
            return s.scalars(select(Job).where(*where).order_by(Job.id)).all()

    def count(self, *where) -> int:
        with Session(self.engine) as s:
            return s.scalar(select(func.count()).select_from(Job).where(*where))

    @staticmethod
    def wait(cond, timeout: float = 60, what: str = "condition", every: float = 0.1):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = cond()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def stack(pg_url, tiny_model, tmp_path, redis_url):
    flush_redis(redis_url)
    st = Stack(pg_url, tiny_model, tmp_path, redis_url)
    yield st
    st.close()
    flush_redis(redis_url)


def served_stack(pg_databases, tiny_model, tmp, redis_url, worker: str):
    """A module-scoped fixture's body: the web app, one gpu worker named `worker` and beat on a fresh database;
    stopped, flushed and dropped afterwards (`yield from served_stack(...)`)."""
    flush_redis(redis_url)
    url = pg_databases.create()
    st = Stack(url, tiny_model, tmp, redis_url)
    st.serve()
    st.worker(worker)
    st.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_BEAT_SCHEDULE=tmp / "beat-schedule")
    yield st
    st.close()
    flush_redis(redis_url)
    pg_databases.drop(url)
