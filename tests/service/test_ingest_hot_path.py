import pytest
"""POST /v1/jobs hot path: group admission, background dispatched_at marks, the auth cache and its limits,
the message format of the direct publish, pooled connections the server closed."""
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import psycopg
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tidepool.service import create_app
from tidepool.service.ledger import jobs, tenants
from tidepool.service.ledger.dispatch import _lpush
from tidepool.service.ledger.wire import make_celery, publish_task as _publish_task, task_message
from tidepool.service.protocol.errors import APIError
from tidepool.service.ledger.models import ApiKey, Job, JobStatus, SlaClass, Tenant, Usage, new_id, utcnow
from tidepool.service.ledger.quotas import GroupAdmission
from tidepool.workers import beat

from .conftest import ADMIN, Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _sql(pg_url: str, sql: str, *params):
    """A statement from 'another process': no ORM session, no in-process invalidation."""
    with psycopg.connect(_plain(pg_url), autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else cur.rowcount


def _row(app, job_id: str) -> Job:
    with Session(app.services.database) as s:
        return s.get(Job, job_id)


def _queue(redis_client, queue="interactive") -> list[str]:
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0] for raw in redis_client.lrange(queue, 0, -1)]


def _app(pg_url, redis_url, tmp_path, **extra):
    return create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                       "admin_token": ADMIN, **extra})


# ---- the message ----------------------------------------------------------------------------------------

def test_direct_publish_writes_what_kombus_producer_writes(redis_url, redis_client):
    celery = make_celery(redis_url)
    with celery.producer_or_acquire() as producer:
        with producer.batch(max_size=10):
            _publish_task(producer, "job_abc", "cmp")
    _lpush(redis_client, "cmp", task_message("job_abc", "cmp"))
    fast, kombu = (json.loads(raw) for raw in redis_client.lrange("cmp", 0, -1))  # LPUSH: newest first
    for msg in (fast, kombu):
        tid = msg["headers"]["id"]
        assert msg["headers"]["root_id"] == tid == msg["properties"]["correlation_id"]
        for ids in (msg["headers"], msg["properties"]):
            for name in ("id", "root_id", "correlation_id", "delivery_tag"):
                ids.pop(name, None)
    assert fast == kombu
    assert json.loads(base64.b64decode(fast["body"]))[0] == ["job_abc"]


# ---- background dispatched_at marks ----------------------------------------------------------------------

@pytest.mark.production_shape
def test_dispatched_at_is_recorded_after_the_response_in_one_statement(app, client, admin, redis_client):
    marks = app.services.dispatcher.marks
    marks.background = False
    _, key = admin.tenant()
    responses = [client.post("/v1/jobs", json=PROMPT, headers=key).get_json() for _ in range(5)]
    ids = [r["id"] for r in responses]
    assert all(r["dispatched_at"] is not None for r in responses)     # published before the 202
    assert sorted(_queue(redis_client)) == sorted(ids)
    assert all(_row(app, i).dispatched_at is None for i in ids)         # not yet recorded
    assert marks.flush() == 5 and marks.flushed == 5
    assert all(_row(app, i).dispatched_at is not None for i in ids)
    assert app.services.dispatcher.republish_undispatched(older_than=0) == 0


def test_background_flusher_records_marks_on_its_own(app, client, admin):
    _, key = admin.tenant()
    job_id = client.post("/v1/jobs", json=PROMPT, headers=key).get_json()["id"]
    deadline = time.monotonic() + 5
    while _row(app, job_id).dispatched_at is None:
        assert time.monotonic() < deadline, "mark never flushed"
        time.sleep(0.02)


@pytest.mark.production_shape
def test_a_late_mark_never_hides_a_job_a_worker_handed_back(app, client, admin, redis_client):
    """Whatever a worker did to a job between its publish and the mark wins: a job it sent back for
    republishing (throttled, or failed for a retry) stays undispatched, so the sweeper republishes it."""
    marks = app.services.dispatcher.marks
    marks.background = False
    _, key = admin.tenant()
    throttled, running, retried, untouched = (client.post("/v1/jobs", json=PROMPT, headers=key).get_json()["id"]
                                              for _ in range(4))
    engine = app.services.database
    with Session(engine) as s:
        # what workers/worker.py does when jobs.start says "throttled": hand it back to the sweeper
        s.execute(update(Job).where(Job.id == throttled, Job.status == JobStatus.queued).values(dispatched_at=None))
        assert jobs.start(s, running, "w1").lease_token
        lease = jobs.start(s, retried, "w1").lease_token
        assert jobs.fail(s, retried, lease, {"code": "oom", "message": "x"}, retry=True)
        s.commit()
    assert marks.flush() == 4 and (marks.flushed, marks.skipped) == (2, 2)
    assert _row(app, throttled).dispatched_at is None and _row(app, retried).dispatched_at is None
    assert _row(app, running).dispatched_at is not None and _row(app, untouched).dispatched_at is not None
    redis_client.delete("interactive")
    assert app.services.dispatcher.republish_undispatched(older_than=0) == 2
    assert sorted(_queue(redis_client)) == sorted([throttled, retried])


_CRASH = """
import os, signal, sys
from tidepool.service import create_app
app = create_app({"database_url": sys.argv[1], "redis_url": sys.argv[2], "storage_dir": sys.argv[3]})
app.services.dispatcher.marks.background = False
r = app.test_client().post("/v1/jobs", json={"prompt": "Hello", "max_tokens": 8},
                           headers={"Authorization": "Bearer " + sys.argv[4]})
assert r.status_code == 202, r.get_json()
print(r.get_json()["id"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # after the 202 and the publish, before dispatched_at is recorded
"""


def test_a_crash_before_the_mark_costs_one_duplicate_message_and_still_one_completion(
        pg_url, redis_url, redis_client, tmp_path):
    app = _app(pg_url, redis_url, tmp_path)
    engine = app.services.database
    with Session(engine) as s:
        tenant, key = tenants.create_tenant(s, "crash")
        s.commit()
        tenant_id = tenant.id
    proc = subprocess.run([sys.executable, "-c", _CRASH, pg_url, redis_url, str(tmp_path / "s"), key],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    job_id = proc.stdout.split()[-1]
    job = _row(app, job_id)
    assert job.status == JobStatus.queued and job.dispatched_at is None       # accepted and durable
    assert _queue(redis_client) == [job_id]                                    # published
    assert beat.sweep(app.services, republish_after=0)["republished"] == 1              # the sweeper's duplicate
    assert _queue(redis_client) == [job_id, job_id]
    # Both messages reach workers. workers/worker.py claims a message with jobs.start (a guarded
    # queued -> running UPDATE) and acks it without running anything when that returns no lease.
    outcomes = []
    for raw in (redis_client.rpop("interactive"), redis_client.rpop("interactive")):
        msg_job = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
        with Session(engine) as s:
            started = jobs.start(s, msg_job, "w1")
            if started.lease_token:
                assert jobs.complete(s, msg_job, started.lease_token, output="hi", output_token_ids=[1],
                                     prompt_tokens=2, completion_tokens=1, finish_reason="stop")
            s.commit()
        outcomes.append(started.reason or "ran")
    assert outcomes == ["ran", "not_queued"]
    job = _row(app, job_id)
    assert job.status == JobStatus.completed and job.attempts == 1
    with Session(engine) as s:
        assert s.scalar(select(Usage.requests).where(Usage.tenant_id == tenant_id)) == 1
        assert s.get(Tenant, tenant_id).queued_count == 0
    engine.dispose()


# ---- group admission -------------------------------------------------------------------------------------

def _tenant(engine, **quota) -> tuple[str, int, str]:
    with Session(engine) as s:
        tenant, key = tenants.create_tenant(s, f"g{time.monotonic_ns()}", quota=quota)
        s.commit()
        key_id = s.scalar(select(ApiKey.id).where(ApiKey.tenant_id == tenant.id))
        return tenant.id, key_id, key


def _job(tenant_id, idempotency_key=None) -> Job:
    now = utcnow()
    return Job(id=new_id("job_"), tenant_id=tenant_id, sla_class=SlaClass.interactive, status=JobStatus.queued,
               endpoint="/v1/completions", request={"prompt": "x", "max_tokens": 1}, metadata_=None,
               idempotency_key=idempotency_key, request_hash=None, estimated_tokens=2, deadline=None,
               attempts=0, created_at=now, queued_at=now)


def _gated(engine):
    """connect() for GroupAdmission whose first call blocks until `gate` is set."""
    gate, entered = threading.Event(), threading.Event()

    @contextmanager
    def connect():
        if not entered.is_set():
            entered.set()
            assert gate.wait(10)
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    return connect, gate, entered


def _admit_concurrently(group, engine, jobs_, key_id):
    """The first job's leader blocks in connect until all the others are queued behind it."""
    connect, gate, entered = _gated(engine)
    results = {}

    def run(job):
        try:
            results[job.id] = group.admit(job, key_id, connect)
        except Exception as exc:
            results[job.id] = exc

    threads = [threading.Thread(target=run, args=(jobs_[0],))]
    threads[0].start()
    assert entered.wait(10)
    for job in jobs_[1:]:
        threads.append(threading.Thread(target=run, args=(job,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(group.lanes[(job.tenant_id, key_id)].pending) < len(threads) - 1:  # keep arrival order
            assert time.monotonic() < deadline
            time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join(10)
    return [results[j.id] for j in jobs_]


@pytest.mark.production_shape
def test_concurrent_submissions_share_one_statement_and_commit(app):
    engine = app.services.database
    tenant_id, key_id, _ = _tenant(engine)
    group = GroupAdmission()
    batch = [_job(tenant_id) for _ in range(6)]
    xmins = _admit_concurrently(group, engine, batch, key_id)
    assert (group.batches, group.admitted) == (2, 6)                 # the leader alone, then the 5 others
    assert all(isinstance(x, str) for x in xmins) and len(set(xmins[1:])) == 1 and xmins[0] != xmins[1]
    rows = _sql(app.config["TIDEPOOL"].database_url, "SELECT id, xmin::text, request::text, metadata::text, "
                "status::text, sla_class::text FROM jobs WHERE tenant_id = %s", tenant_id)
    assert {r[0]: r[1] for r in rows} == {j.id: x for j, x in zip(batch, xmins)}
    # the same column values the ORM writes (json text as json.dumps gives it; a None metadata as JSON null)
    assert {r[2:] for r in rows} == {('{"prompt": "x", "max_tokens": 1}', "null", "queued", "interactive")}
    with Session(engine) as s:
        assert s.get(Tenant, tenant_id).queued_count == 6


@pytest.mark.production_shape
def test_a_refused_group_is_admitted_job_by_job_in_arrival_order(app):
    engine = app.services.database
    tenant_id, key_id, _ = _tenant(engine, max_queued=3)
    group = GroupAdmission()
    batch = [_job(tenant_id) for _ in range(6)]
    out = _admit_concurrently(group, engine, batch, key_id)
    assert [isinstance(o, str) for o in out] == [True, True, True, False, False, False]
    assert all(isinstance(o, APIError) and o.status == 429 and o.code == "max_queued" for o in out[3:])
    with Session(engine) as s:
        assert s.get(Tenant, tenant_id).queued_count == 3
        assert s.query(Job).filter_by(tenant_id=tenant_id).count() == 3


@pytest.mark.production_shape
def test_a_duplicate_idempotency_key_in_a_group_fails_only_its_own_job(app):
    engine = app.services.database
    tenant_id, key_id, _ = _tenant(engine)
    group = GroupAdmission()
    batch = [_job(tenant_id), _job(tenant_id, "k1"), _job(tenant_id), _job(tenant_id, "k1")]
    out = _admit_concurrently(group, engine, batch, key_id)
    assert [type(o) for o in out[:3]] == [str, str, str] and isinstance(out[3], IntegrityError)
    with Session(engine) as s:
        assert s.get(Tenant, tenant_id).queued_count == 3


@pytest.mark.production_shape
def test_a_revoked_key_or_disabled_tenant_admits_nothing(app):
    engine = app.services.database
    url = app.config["TIDEPOOL"].database_url
    tenant_id, key_id, _ = _tenant(engine)
    _sql(url, "UPDATE api_keys SET revoked_at = now() WHERE id = %s", key_id)
    out = _admit_concurrently(GroupAdmission(), engine, [_job(tenant_id) for _ in range(3)], key_id)
    assert all(isinstance(o, APIError) and o.status == 401 for o in out)
    tenant_id, key_id, _ = _tenant(engine)
    _sql(url, "UPDATE tenants SET disabled = true WHERE id = %s", tenant_id)
    out = _admit_concurrently(GroupAdmission(), engine, [_job(tenant_id) for _ in range(3)], key_id)
    assert all(isinstance(o, APIError) and o.status == 403 for o in out)
    with Session(engine) as s:
        assert s.query(Job).count() == 0


def test_many_concurrent_submissions_respect_max_queued_exactly(app):
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(max_queued=17)
    results, barrier = [], threading.Barrier(40)

    def submit():
        c = app.test_client()
        barrier.wait()
        results.append(c.post("/v1/jobs", json=PROMPT, headers=key).status_code)

    threads = [threading.Thread(target=submit) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [202] * 17 + [429] * 23
    with Session(app.services.database) as s:
        assert s.query(Job).filter_by(tenant_id=tenant_id).count() == 17
        assert s.get(Tenant, tenant_id).queued_count == 17


# ---- the auth cache --------------------------------------------------------------------------------------

def _prefix(key_header: dict) -> str:
    return "_".join(key_header["Authorization"].split()[1].split("_")[:2])


def test_revoke_and_disable_through_this_process_take_effect_at_once(pg_url, redis_url, tmp_path):
    app = _app(pg_url, redis_url, tmp_path, auth_cache_ttl=3600)
    client = app.test_client()
    admin = Admin(client)
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs", headers=key).status_code == 200           # cached now
    r = client.post(f"/v1/admin/keys/{_prefix(key)}/revoke", headers=admin.headers)
    assert r.status_code == 200
    assert client.get("/v1/jobs", headers=key).status_code == 401
    assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 401
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs", headers=key).status_code == 200
    assert client.post(f"/v1/admin/tenants/{tenant_id}/disable", headers=admin.headers).status_code == 200
    assert client.get("/v1/jobs", headers=key).status_code == 403
    assert client.post(f"/v1/admin/tenants/{tenant_id}/enable", headers=admin.headers).status_code == 200
    assert client.get("/v1/jobs", headers=key).status_code == 200
    app.services.database.dispose()


def _until(status_of, expected, limit):
    """Seconds until status_of() == expected (checked every 20 ms), failing after limit."""
    start = time.monotonic()
    while status_of() != expected:
        assert time.monotonic() - start < limit, f"not {expected} after {limit} s"
        time.sleep(0.02)
    return time.monotonic() - start


TTL = 1.0


def test_a_key_revoked_by_another_process_creates_no_job_and_is_refused_within_the_ttl(
        pg_url, redis_url, tmp_path):
    app = _app(pg_url, redis_url, tmp_path, auth_cache_ttl=TTL)
    client = app.test_client()
    _, key = Admin(client).tenant()
    assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 202   # cached now
    env = {**os.environ, "TIDEPOOL_DATABASE_URL": pg_url, "TIDEPOOL_STORAGE_DIR": str(tmp_path / "s")}
    cli = subprocess.run([sys.executable, "-m", "tidepool.workers.cli", "keys", "revoke", _prefix(key)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    revoked = time.monotonic()
    r = client.post("/v1/jobs", json=PROMPT, headers=key)      # the admission statement checks the key itself
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/jobs", headers=key).status_code == 401   # ... and dropped the cached entry
    with Session(app.services.database) as s:
        assert s.query(Job).count() == 1
    assert time.monotonic() - revoked < TTL
    app.services.database.dispose()


def test_reads_see_another_process_revoking_or_disabling_within_the_ttl(pg_url, redis_url, tmp_path):
    app = _app(pg_url, redis_url, tmp_path, auth_cache_ttl=TTL)
    client = app.test_client()
    admin = Admin(client)
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs", headers=key).status_code == 200
    _sql(pg_url, "UPDATE api_keys SET revoked_at = now() WHERE prefix = %s", _prefix(key))
    assert _until(lambda: client.get("/v1/jobs", headers=key).status_code, 401, TTL + 0.5) <= TTL + 0.1
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs", headers=key).status_code == 200
    _sql(pg_url, "UPDATE tenants SET disabled = true WHERE id = %s", tenant_id)
    assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 403    # at once for writes
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs", headers=key).status_code == 200
    _sql(pg_url, "UPDATE tenants SET disabled = true WHERE id = %s", tenant_id)
    assert _until(lambda: client.get("/v1/jobs", headers=key).status_code, 403, TTL + 0.5) <= TTL + 0.1
    app.services.database.dispose()


def test_max_queued_lowered_by_another_process_holds_at_once(pg_url, redis_url, tmp_path):
    app = _app(pg_url, redis_url, tmp_path, auth_cache_ttl=3600)
    client = app.test_client()
    tenant_id, key = Admin(client).tenant()
    assert [client.post("/v1/jobs", json=PROMPT, headers=key).status_code for _ in range(2)] == [202, 202]
    _sql(pg_url, "UPDATE quotas SET max_queued = 2 WHERE tenant_id = %s", tenant_id)
    r = client.post("/v1/jobs", json=PROMPT, headers=key)
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "max_queued"
    assert "at most 2 queued" in r.get_json()["error"]["message"]
    app.services.database.dispose()


# ---- pooled connections ----------------------------------------------------------------------------------

@pytest.mark.production_shape
def test_pooled_connections_the_server_closed_are_replaced_before_use(app, client, admin, pg_url):
    _, key = admin.tenant()
    assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 202
    app.services.dispatcher.marks.flush()
    db = pg_url.rsplit("/", 1)[1]
    killed = _sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND pid <> pg_backend_pid()", db)
    assert killed
    time.sleep(0.2)
    for _ in range(3):
        assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 202
        assert client.get("/v1/jobs", headers=key).status_code == 200
