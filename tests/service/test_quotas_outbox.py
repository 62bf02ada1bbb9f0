import pytest
"""Quotas (rate limits, budget, max_queued, max_running) and the outbox (publish, lost publish, sweeper)."""
import base64
import json
import threading

from sqlalchemy.orm import Session

from tidepool.service import create_app
from tidepool.service.ledger import jobs
from tidepool.service.ledger.models import Job, Tenant
from tidepool.service.ledger.quotas import MemoryLimiter

from .conftest import ADMIN, Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8}


def test_requests_per_minute_429_with_retry_after(any_app):
    client = any_app.test_client()
    _, key = Admin(client).tenant(requests_per_minute=3)
    codes = [client.post("/v1/jobs", json=PROMPT, headers=key).status_code for _ in range(4)]
    assert codes == [202, 202, 202, 429]
    r = client.post("/v1/jobs", json=PROMPT, headers=key)
    assert r.get_json()["error"]["code"] == "requests_per_minute"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    _, other = Admin(client).tenant(requests_per_minute=3)
    assert client.post("/v1/jobs", json=PROMPT, headers=other).status_code == 202


def test_tokens_per_minute_counts_prompt_plus_max_tokens(client, admin):
    _, key = admin.tenant(tokens_per_minute=100)
    body = {"prompt": [1] * 20, "max_tokens": 20}  # 40 tokens each
    assert [client.post("/v1/jobs", json=body, headers=key).status_code for _ in range(3)] == [202, 202, 429]
    r = client.post("/v1/jobs", json={"prompt": [1] * 20, "max_tokens": 100}, headers=key)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "request_too_large"


def test_memory_limiter_windows():
    lim = MemoryLimiter()
    assert [lim.hit("t", 2, None, 1, 60.0) for _ in range(3)] == [0, 0, 1]
    assert lim.hit("t", 2, None, 1, 120.0) == 0  # next window
    assert lim.hit("t", None, 10, 11, 120.0) == 2


def test_monthly_budget(client, admin, app):
    tenant_id, key = admin.tenant(monthly_token_budget=1000)
    r = client.post("/v1/jobs", json=PROMPT, headers=key)
    assert r.status_code == 202
    job_id = r.get_json()["id"]
    with Session(app.services.database) as s:
        token = jobs.start(s, job_id, "w1").lease_token
        assert jobs.complete(s, job_id, token, output="x", output_token_ids=[1], prompt_tokens=600,
                             completion_tokens=391, finish_reason="length")
        s.commit()
    r = client.post("/v1/jobs", json=PROMPT, headers=key)
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "insufficient_quota"
    assert int(r.headers["Retry-After"]) > 0


def test_concurrent_submissions_respect_max_queued(any_app):
    app = any_app
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(max_queued=5)
    results, barrier = [], threading.Barrier(12)

    def submit():
        c = app.test_client()
        barrier.wait()
        results.append(c.post("/v1/jobs", json=PROMPT, headers=key).status_code)

    threads = [threading.Thread(target=submit) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [202] * 5 + [429] * 7
    with Session(app.services.database) as s:
        assert s.query(Job).filter_by(tenant_id=tenant_id).count() == 5
        assert s.get(Tenant, tenant_id).queued_count == 5
    # cancelling one frees a slot
    first = client.get("/v1/jobs", headers=key).get_json()["data"][0]["id"]
    client.post(f"/v1/jobs/{first}/cancel", headers=key)
    assert client.post("/v1/jobs", json=PROMPT, headers=key).status_code == 202


def test_transitions_are_guarded_and_max_running_holds(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_running=1)
    a, b = (client.post("/v1/jobs", json=PROMPT, headers=key).get_json()["id"] for _ in range(2))
    with Session(any_app.services.database) as s:
        lease = jobs.start(s, a, "w1").lease_token
        assert lease and jobs.start(s, a, "w2").reason == "not_queued"
        assert jobs.start(s, b, "w2").reason == "throttled"
        assert jobs.first_token(s, a, lease) and not jobs.complete(
            s, a, "stale", output="", output_token_ids=[], prompt_tokens=1, completion_tokens=1, finish_reason="stop")
        assert jobs.complete(s, a, lease, output="hi", output_token_ids=[5], prompt_tokens=3, completion_tokens=1,
                             finish_reason="stop")
        assert not jobs.complete(s, a, lease, output="again", output_token_ids=[], prompt_tokens=3,
                                 completion_tokens=1, finish_reason="stop")  # redelivery cannot complete twice
        lease_b = jobs.start(s, b, "w2").lease_token
        assert jobs.fail(s, b, lease_b, {"code": "oom", "message": "x"}, retry=True)
        s.commit()
        t = s.get(Tenant, tenant_id)
        assert (t.queued_count, t.running_count) == (1, 0)
    done = client.get(f"/v1/jobs/{a}", headers=key).get_json()
    assert done["status"] == "completed" and done["output"] == {"text": "hi", "token_ids": [5]}
    assert done["usage"]["total_tokens"] == 4 and done["attempts"] == 1 and done["worker"] == "w1"
    assert done["first_token_at"] is not None and done["finished_at"] is not None
    retried = client.get(f"/v1/jobs/{b}", headers=key).get_json()
    assert retried["status"] == "queued" and retried["dispatched_at"] is None and retried["attempts"] == 1


def _queued_job_ids(redis_client, queue):
    out = []
    for raw in redis_client.lrange(queue, 0, -1):
        msg = json.loads(raw)
        assert msg["headers"]["task"] == "tidepool.run_job"
        args, kwargs, _ = json.loads(base64.b64decode(msg["body"]))
        out.append(args[0])
        assert args == [args[0]] and kwargs == {}
    return out


@pytest.mark.production_shape
def test_outbox_publishes_one_message_per_job_to_its_class_queue(client, admin, redis_client):
    _, key = admin.tenant()
    ids = {cls: [client.post("/v1/jobs", json={**PROMPT, "sla_class": cls}, headers=key).get_json()["id"]
                 for _ in range(2)] for cls in ("realtime", "interactive", "batch", "deferrable")}
    for cls, expected in ids.items():
        assert sorted(_queued_job_ids(redis_client, cls)) == sorted(expected)


def test_sweeper_republishes_a_lost_publish(pg_url, redis_url, redis_client, tmp_path):
    broken = create_app({"database_url": pg_url, "redis_url": "redis://127.0.0.1:1/0",
                         "storage_dir": str(tmp_path), "admin_token": ADMIN})
    client = broken.test_client()
    _, key = Admin(client).tenant()
    r = client.post("/v1/jobs", json=PROMPT, headers=key)
    assert r.status_code == 202 and r.get_json()["dispatched_at"] is None  # committed, publish lost
    job_id = r.get_json()["id"]
    broken.services.database.dispose()

    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path)})
    dispatcher = app.services.dispatcher
    assert dispatcher.republish_undispatched(older_than=3600) == 0  # too young: a publish may be in flight
    assert dispatcher.republish_undispatched(older_than=0) == 1
    assert _queued_job_ids(redis_client, "interactive") == [job_id]
    assert dispatcher.republish_undispatched(older_than=0) == 0  # now recorded as dispatched
    assert _queued_job_ids(redis_client, "interactive") == [job_id]
    app.services.database.dispose()


def test_embedded_mode_publishes_in_process(embedded_app):
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    client.post("/v1/jobs", json=PROMPT, headers=key)
    depths = embedded_app.services.dispatcher.queue_depths()
    assert depths["interactive"] == 1 and depths["batch"] == 0


@pytest.mark.production_shape
def test_a_real_celery_worker_consumes_the_published_messages(client, admin, redis_url):
    from celery import Celery
    from celery.contrib.testing.worker import start_worker
    from kombu import Queue

    _, key = admin.tenant()
    ids = [client.post("/v1/jobs", json={**PROMPT, "sla_class": "batch"}, headers=key).get_json()["id"]
           for _ in range(3)]
    got, done = [], threading.Event()
    worker_app = Celery("test-worker", broker=redis_url, set_as_current=False)
    worker_app.conf.update(task_queues=[Queue("batch")], worker_hijack_root_logger=False)

    @worker_app.task(name="tidepool.run_job")
    def run_job(job_id):
        got.append(job_id)
        if len(got) == len(ids):
            done.set()

    with start_worker(worker_app, pool="solo", perform_ping_check=False, queues=["batch"], loglevel="WARNING"):
        assert done.wait(15)
    assert sorted(got) == sorted(ids)
