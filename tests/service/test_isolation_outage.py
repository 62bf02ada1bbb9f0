"""A ledger outage (Postgres taken away behind a proxy, as a restart does) during online requests: new
requests get 503 with Retry-After; waiting requests ride it out, or get a 503 naming their job id (never a
500, and the job is not lost or cancelled, so a client need not resubmit and pay twice); streams always end
with an error event and [DONE]. Streams never splice the text of two attempts of a job."""
import json
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session

from tidepool.service import create_app
from tidepool.service.ledger import jobs
from tidepool.service.api import openai_compat
from tidepool.service.ledger.models import Job, JobStatus, utcnow
from tidepool.service.ledger import token_stream

from ..tcp_proxy import TcpProxy
from .conftest import ADMIN, Admin

BODY = {"prompt": "Hello", "max_tokens": 8}


@pytest.fixture
def outage(pg_url, redis_url, tmp_path):
    """An app whose ledger connection goes through a proxy the test can stop, plus a direct connection."""
    host, port = pg_url.split("@", 1)[1].split("/", 1)[0].split(":")
    proxy = TcpProxy(host, int(port)).start()
    app = create_app({"database_url": proxy.url_for(pg_url), "redis_url": redis_url, "admin_token": ADMIN,
                      "storage_dir": str(tmp_path / "storage"), "auth_cache_ttl": 0})
    direct = create_engine(pg_url)
    _, key = Admin(app.test_client()).tenant()
    yield app, proxy, direct, key, token_stream.for_redis(app.services.redis)
    proxy.stop()
    app.services.database.dispose()
    direct.dispose()


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    thread.start()
    return thread, out


def _dispatched_job(direct) -> str:
    """The online request's job, once it is published (its waiter subscribed before that)."""
    end = time.monotonic() + 20
    while time.monotonic() < end:
        with Session(direct) as s:
            job_id = s.scalar(select(Job.id).where(Job.dispatched_at.is_not(None)))
        if job_id:
            return job_id
        time.sleep(0.02)
    raise AssertionError("no dispatched job")


def _claim(direct, job_id) -> str:
    with Session(direct) as s:
        token = jobs.start(s, job_id, "test-worker").lease_token
        s.commit()
    return token


def _complete(direct, job_id, token, text="Hello world"):
    with Session(direct) as s:
        assert jobs.complete(s, job_id, token, output=text, output_token_ids=[1, 2], prompt_tokens=1,
                             completion_tokens=2, finish_reason="stop")
        s.commit()


def _sse_events(resp) -> list:
    events = []
    for line in b"".join(resp.response).decode().splitlines():
        if line.startswith("data: "):
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def _text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def test_new_requests_get_503_with_retry_after_while_the_ledger_is_down(outage):
    app, proxy, _, key, _ = outage
    client = app.test_client()
    proxy.stop()
    for method, path, body in (("post", "/v1/jobs", BODY), ("post", "/v1/completions", BODY),
                               ("get", "/v1/jobs", None)):
        r = getattr(client, method)(path, json=body, headers=key)
        assert r.status_code == 503, (path, r.status_code, r.get_json())
        assert r.get_json()["error"]["code"] == "database_unavailable" and int(r.headers["Retry-After"]) > 0
    proxy.start()
    assert client.post("/v1/jobs", json=BODY, headers=key).status_code == 202


def test_a_waiting_request_rides_out_a_short_outage(outage):
    app, proxy, direct, key, _ = outage
    thread, out = _in_thread(lambda: app.test_client().post("/v1/completions", json=BODY, headers=key))
    job_id = _dispatched_job(direct)
    token = _claim(direct, job_id)
    proxy.stop()                                # the database restarts while the request waits
    _complete(direct, job_id, token)            # (the worker's write lands on the other side of it)
    time.sleep(2.5)
    proxy.start()
    thread.join(30)
    r = out["r"]
    assert r.status_code == 200, r.get_json()
    assert r.get_json()["id"] == job_id and r.get_json()["choices"][0]["text"] == "Hello world"


def test_a_long_outage_answers_503_naming_the_job_which_is_not_cancelled(outage, monkeypatch):
    app, proxy, direct, key, _ = outage
    monkeypatch.setattr(openai_compat, "LEDGER_PATIENCE", 1.5)
    thread, out = _in_thread(lambda: app.test_client().post("/v1/completions", json=BODY, headers=key))
    job_id = _dispatched_job(direct)
    token = _claim(direct, job_id)
    proxy.stop()
    thread.join(30)
    r = out["r"]
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
    assert r.get_json()["error"]["code"] == "database_unavailable" and job_id in r.get_json()["error"]["message"]
    _complete(direct, job_id, token)            # the job carried on: the client fetches it, pays once
    proxy.start()
    got = app.test_client().get(f"/v1/jobs/{job_id}", headers=key).get_json()
    assert got["status"] == "completed" and got["output"]["text"] == "Hello world"


def test_a_stream_cut_by_an_outage_ends_with_an_error_and_done(outage, monkeypatch):
    app, proxy, direct, key, stream = outage
    monkeypatch.setattr(openai_compat, "LEDGER_PATIENCE", 1.5)
    thread, out = _in_thread(lambda: app.test_client().post("/v1/completions", json={**BODY, "stream": True},
                                                            headers=key))
    job_id = _dispatched_job(direct)
    _claim(direct, job_id)
    stream.publish(job_id, {"t": "tok", "d": "Hel", "p": 0})
    thread.join(30)
    proxy.stop()
    events = _sse_events(out["r"])
    assert _text(events) == "Hel"
    assert events[-2]["error"]["code"] == "database_unavailable" and job_id in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"
    proxy.start()
    with Session(direct) as s:
        assert s.get(Job, job_id).status == JobStatus.running      # not cancelled: the client was told its id


def _rerun(direct, job_id) -> str:
    """The worker died: its lease lapses, the sweeper requeues the job, another worker claims it."""
    with Session(direct) as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        assert jobs.reclaim_lapsed(s) == 1
        s.commit()
    return _claim(direct, job_id)


@pytest.mark.parametrize("second", ["same", "different"])
def test_a_stream_never_splices_two_attempts(outage, second):
    app, _, direct, key, stream = outage
    thread, out = _in_thread(lambda: app.test_client().post("/v1/completions", json={**BODY, "stream": True},
                                                            headers=key))
    job_id = _dispatched_job(direct)
    _claim(direct, job_id)
    stream.publish(job_id, {"t": "tok", "d": "Hello", "p": 0})      # attempt 1 streams, then its worker dies
    thread.join(30)
    stream.publish(job_id, {"t": "end", "status": "queued"})        # (a SIGTERM hands the attempt back)
    token = _rerun(direct, job_id)
    text = "Hello world" if second == "same" else "Howdy there"    # sampled: a rerun may differ
    stream.publish(job_id, {"t": "tok", "d": text[:5], "p": 0})
    stream.publish(job_id, {"t": "tok", "d": text[5:], "p": 5})
    _complete(direct, job_id, token, text)
    stream.publish(job_id, {"t": "end", "status": "completed"})
    events = _sse_events(out["r"])
    assert events[-1] == "[DONE]"
    if second == "same":                       # the rerun continues exactly from what the client has
        assert _text(events) == "Hello world" and not any("error" in e for e in events if isinstance(e, dict))
    else:                                      # never "Hello" + " there": the stream says the job restarted
        assert _text(events) == "Hello"
        assert events[-2]["error"]["code"] == "job_restarted" and job_id in events[-2]["error"]["message"]
