"""One tenant cannot exhaust what the others share (OWASP API4, unrestricted resource consumption): web threads,
the ledger's connections and write lock, the web process's memory, the disk the files live on. Each bound is a
clear 4xx in the API's error format."""
import io
import json
import threading
import time

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from tidepool.service.ledger import token_stream
from tidepool.service.ledger.models import Job, JobStatus

from .conftest import ADMIN, Admin
from .fake_worker import FakeWorker

MAX_ERRORS = 100    # service.ledger.batches.MAX_ERRORS


def _upload(client, key, data: bytes, **fields):
    return client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl"), **fields},
                       headers=key, content_type="multipart/form-data")


def test_a_failed_batch_keeps_a_bounded_error_list(any_app):
    """A file of 1,000 bad lines fails with the first 100 errors and one entry counting the rest."""
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    lines = b"".join(b"not json %d\n" % i for i in range(1000))
    f = _upload(client, key, lines).get_json()["id"]
    b = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "failed"
    errors = b["errors"]["data"]
    assert len(errors) == MAX_ERRORS + 1 and errors[0]["line"] == 1 and errors[MAX_ERRORS - 1]["line"] == MAX_ERRORS
    assert errors[-1]["code"] == "too_many_errors" and str(1000 - MAX_ERRORS) in errors[-1]["message"]


def test_job_listings_are_capped_and_leave_request_bodies_out(any_app):
    """GET /v1/jobs (and the admin listing) pages at most 100 jobs (as OpenAI's lists) and returns each job's
    request body only with include=request: a listing cannot carry a thousand full requests."""
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"prompt": "x" * 1000, "max_tokens": 1, "sla_class": "batch"}
    ids = [client.post("/v1/jobs", json=body, headers=key).get_json()["id"] for _ in range(3)]
    for path, headers in (("/v1/jobs?sla_class=batch", key), (f"/v1/admin/jobs?tenant_id={tenant_id}", admin)):
        r = client.get(f"{path}&limit=1000", headers=headers)
        assert r.status_code == 400 and r.get_json()["error"]["param"] == "limit"
        listed = client.get(f"{path}&limit=100", headers=headers).get_json()["data"]
        assert [j["id"] for j in listed] == ids[::-1] and all("request" not in j for j in listed)
        listed = client.get(f"{path}&include=request", headers=headers).get_json()["data"]
        assert [j["request"]["prompt"] for j in listed] == [body["prompt"]] * 3
        assert client.get(f"{path}&include=everything", headers=headers).status_code == 400
    assert client.get(f"/v1/jobs/{ids[0]}", headers=key).get_json()["request"]["prompt"] == body["prompt"]


def test_message_batch_results_hold_no_connection_while_the_client_reads(any_app, monkeypatch):
    """Results stream a page at a time, each page read in its own short session: a client that stops reading
    holds no pooled connection (nor, on SQLite, the write lock); every result still arrives, in order."""
    from tidepool.service.api import anthropic
    monkeypatch.setattr(anthropic, "RESULTS_PAGE", 2, raising=False)
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    message = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    reqs = [{"custom_id": f"r{i}", "params": message} for i in range(5)]
    batch = client.post("/v1/messages/batches", json={"requests": reqs}, headers=key).get_json()
    ended = client.post(f"/v1/messages/batches/{batch['id']}/cancel", headers=key).get_json()
    assert ended["processing_status"] == "ended", ended
    engine = any_app.services.database
    r = client.get(f"/v1/messages/batches/{batch['id']}/results", headers=key, buffered=False)
    pages = iter(r.response)
    first = next(pages)
    assert engine.pool.checkedout() == 0      # the client has a page and reads no further: nothing is held
    with engine.begin() as conn:              # a writer is not kept waiting (SQLite: the one write lock is free)
        conn.execute(text("UPDATE tenants SET weight = weight"))
    rest = b"".join(pages)
    r.close()
    lines = [json.loads(x) for x in (first + rest).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(5)]
    assert {x["result"]["type"] for x in lines} == {"canceled"}


def test_a_message_batch_body_is_read_a_request_at_a_time(any_app):
    """POST /v1/messages/batches (bodies up to 256 MB, as Anthropic's) is parsed one request at a time into the
    batch's input file: the web process never holds the whole body, parsed or not."""
    import tracemalloc
    any_app.config["TIDEPOOL"].batch_chunk_size = 10     # (the rows of one insert are held)
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    params = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 32000}]}
    body = json.dumps({"requests": [{"custom_id": f"r{i}", "params": params} for i in range(250)]}).encode()
    warm = {"requests": [{"custom_id": "w", "params": params}]}     # first-use imports are not the body's
    assert client.post("/v1/messages/batches", json=warm, headers=key).status_code == 200
    stream = io.BytesIO(body)
    tracemalloc.start()
    try:
        r = client.post("/v1/messages/batches", input_stream=stream, content_length=len(body),
                        content_type="application/json", headers=key)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 200, r.get_json()
    assert r.get_json()["request_counts"]["processing"] == 250
    # the body is 8 MB; read whole it costs twice that or more. Read a request at a time it measured 0.81-1.02 MB
    # (a chunk of 10 rows of 32 KB held for one insert, the parser's buffers, and what earlier tests left warm)
    assert peak < len(body) / 5, (peak, len(body))


def test_message_batch_bodies_are_checked_as_they_stream(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    ok = {"custom_id": "a", "params": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}}
    cases = [({"requests": [ok], "extra": 1}, 400, "extra"), ({"requests": []}, 400, "requests"),
             ({"requests": 5}, 400, "requests"), ({"requests": [ok, ok]}, 400, "requests.1.custom_id"),
             ({"requests": [{**ok, "params": {**ok["params"], "stream": True}}]}, 400, "requests.0.params.stream"),
             ({"requests": [{**ok, "custom_id": "b\\x00"}]}, 400, None)]
    for body, status, param in cases:
        r = client.post("/v1/messages/batches", json=body, headers=key)
        assert r.status_code == status, (body, r.get_json())
        assert r.get_json()["type"] == "error" and r.get_json()["error"]["type"] == "invalid_request_error"
    for raw in (b'{"requests": [', b'{"requests": [{"custom_id": "a"}] x', b'\\xff\\xfe'):
        r = client.post("/v1/messages/batches", data=raw, content_type="application/json", headers=key)
        assert r.status_code == 400, raw
    r = client.post("/v1/messages/batches", data=b"{}", content_type="application/json", headers=key,
                    environ_overrides={"CONTENT_LENGTH": str((256 << 20) + 1)})     # refused on its stated length
    assert r.status_code == 413 and r.get_json()["error"]["type"] == "request_too_large"
    storage = any_app.services.storage.root
    assert not [p for p in storage.rglob("*") if p.is_file()]      # nothing refused left bytes behind
    assert client.post("/v1/messages/batches", json={"requests": [ok]}, headers=key).status_code == 200


# ---- concurrent online requests ----------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _queued_job(app, tenant_id: str, timeout: float = 10.0) -> str:
    """The id of the tenant's queued job, once its request has submitted it."""
    engine, deadline = app.services.database, time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Session(engine) as s:
            job_id = s.scalar(select(Job.id).where(Job.tenant_id == tenant_id, Job.status == JobStatus.queued))
        if job_id:
            return job_id
        time.sleep(0.02)
    raise AssertionError("no job was queued")


def _open_stream(app, tenant_id, key):
    """A streamed chat request whose first token has arrived, left open: (response, job id)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=app.test_client().post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers=key, buffered=False)))
    t.start()
    job_id = _queued_job(app, tenant_id)
    hub = token_stream.for_redis(app.services.redis)
    while t.is_alive():      # (until the request has subscribed: an event before that is not heard)
        hub.publish(job_id, {"t": "tok", "d": "He", "p": 0})
        t.join(0.05)
    assert out["r"].status_code == 200, out["r"].get_data()
    return out["r"], job_id


def test_a_tenant_cannot_hold_more_online_requests_than_its_cap(any_app):
    """max_concurrent_requests bounds a tenant's online requests in progress (each holds a web thread): past it a
    429 with Retry-After, in each API's error shape; the slot is free again when the client goes away."""
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_concurrent_requests=1)
    slots = any_app.services.slots
    stream, job_id = _open_stream(any_app, tenant_id, key)
    assert next(iter(stream.response)).startswith(b"data: ")
    assert slots.active(tenant_id, time.time()) == 1
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=key)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.get_json()["error"]["code"] == "max_concurrent_requests"
    r = client.post("/v1/messages", json={"model": "m", **CHAT}, headers=key)
    assert r.status_code == 429 and r.get_json()["error"]["type"] == "rate_limit_error"
    other_id, other = Admin(client).tenant(max_concurrent_requests=1)     # another tenant is not affected
    with FakeWorker(any_app, other_id):
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=other).status_code == 200
    stream.close()                                  # the client goes away mid-stream
    assert slots.active(tenant_id, time.time()) == 0
    with Session(any_app.services.database) as s:
        assert s.get(Job, job_id).status == JobStatus.cancelled
    with FakeWorker(any_app, tenant_id):
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=key).status_code == 200
        r = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=key)
        assert r.status_code == 200 and r.get_data().endswith(b"data: [DONE]\n\n")
    assert slots.active(tenant_id, time.time()) == 0


def test_every_exit_path_frees_the_slot(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_concurrent_requests=1, max_queued=0, requests_per_minute=1000)
    slots = any_app.services.slots
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=key)
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "max_queued"     # refused after the slot
    client.patch(f"/v1/admin/tenants/{tenant_id}/quota", json={"max_queued": None, "tokens_per_minute": 1},
                 headers={"Authorization": f"Bearer {ADMIN}"})
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=key)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "request_too_large"    # rate check
    any_app.config["TIDEPOOL"].online_timeout = 1.0
    client.patch(f"/v1/admin/tenants/{tenant_id}/quota", json={"tokens_per_minute": None},
                 headers={"Authorization": f"Bearer {ADMIN}"})
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=key)
    assert r.status_code == 504          # nobody ran it
    assert slots.active(tenant_id, time.time()) == 0


def test_default_quota_caps_concurrent_requests_and_storage(any_app):
    client = any_app.test_client()
    tenant_id, _ = Admin(client).tenant()
    quota = client.get(f"/v1/admin/tenants/{tenant_id}", headers={"Authorization": f"Bearer {ADMIN}"}).get_json()
    assert quota["quota"]["max_concurrent_requests"] == 16
    assert quota["quota"]["max_files"] == 10_000 and quota["quota"]["max_storage_bytes"] == 10 << 30


def test_redis_slots_are_leases_a_dead_process_gives_back(redis_client):
    """A web process that dies holding slots (it never releases them) frees them when their leases lapse."""
    from tidepool.service.ledger.quotas import LEASE_SECONDS, RedisSlots
    slots, now = RedisSlots(redis_client), 1_000_000.0
    held = slots.acquire("ten_x", 2, now)
    assert held and slots.acquire("ten_x", 2, now) and slots.acquire("ten_x", 2, now + 1) is None
    slots.renew("ten_x", held, now + LEASE_SECONDS - 1)           # its holder is alive: renewed
    assert slots.acquire("ten_x", 2, now + LEASE_SECONDS + 1) is not None    # the other lapsed
    assert slots.acquire("ten_x", 2, now + LEASE_SECONDS + 2) is None
    slots.release("ten_x", held)
    assert slots.active("ten_x", now + LEASE_SECONDS + 2) == 1
    assert redis_client.ttl("tp:slots:{ten_x}") > 0      # nothing lives on in Redis without an expiry


# ---- uploads -------------------------------------------------------------------------------------------------

def _stored(app) -> set:
    return {p.name for p in app.services.storage.root.rglob("*") if p.is_file()}


def test_uploads_count_against_the_tenants_files_and_bytes(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_files=2, max_storage_bytes=1000)
    a = _upload(client, key, b"x" * 300).get_json()["id"]
    _upload(client, key, b"x" * 300)
    r = _upload(client, key, b"x")
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "max_files"
    assert client.delete(f"/v1/files/{a}", headers=key).status_code == 200
    r = _upload(client, key, b"x" * 701)              # 300 + 701 > 1000: cut off as it arrives
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "max_storage_bytes"
    assert _upload(client, key, b"x" * 700).status_code == 200
    assert len(_stored(any_app)) == 2                 # nothing refused was kept
    reqs = [{"custom_id": "a", "params": {"model": "m", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Hi"}]}}]
    r = client.post("/v1/messages/batches", json={"requests": reqs}, headers=key)     # its requests are a file too
    assert r.status_code == 429 and r.get_json()["error"]["type"] == "rate_limit_error"
    assert len(_stored(any_app)) == 2


def test_concurrent_uploads_never_pass_the_file_limit(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_files=3)
    codes, barrier = [], threading.Barrier(8)

    def upload():
        c = any_app.test_client()
        barrier.wait()
        codes.append(_upload(c, key, b"{}\n").status_code)

    threads = [threading.Thread(target=upload) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] * 3 + [429] * 5
    assert len(client.get("/v1/files", headers=key).get_json()["data"]) == 3 == len(_stored(any_app))


def test_uploads_count_against_requests_per_minute(any_app):
    if time.time() % 60 > 50:      # the count is per one-minute window: start in a fresh one
        time.sleep(61 - time.time() % 60)
    client = any_app.test_client()
    _, key = Admin(client).tenant(requests_per_minute=2)
    assert [_upload(client, key, b"{}\n").status_code for _ in range(2)] == [200, 200]
    r = _upload(client, key, b"{}\n")
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "requests_per_minute"
    assert int(r.headers["Retry-After"]) >= 1 and len(_stored(any_app)) == 2


def test_an_upload_that_expires_is_deleted_by_beat(any_app):
    from tidepool.workers import beat
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    f = _upload(client, key, b"{}\n", **fields).get_json()
    assert f["expires_at"] == f["created_at"] + 3600
    keep = _upload(client, key, b"{}\n").get_json()
    assert keep["expires_at"] is None
    for bad in ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                {"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"},
                {"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
                {"expires_after[seconds]": "3600"}):
        r = _upload(client, key, b"{}\n", **bad)
        assert r.status_code == 400 and r.get_json()["error"]["param"].startswith("expires_after["), bad
    assert beat.sweep(any_app.services)["files_expired"] == 0
    with any_app.services.database.begin() as conn:       # an hour later
        conn.execute(text("UPDATE files SET expires_at = created_at WHERE id = :id"), {"id": f["id"]})
    assert beat.sweep(any_app.services)["files_expired"] == 1
    assert client.get(f"/v1/files/{f['id']}", headers=key).status_code == 404
    assert _stored(any_app) == {keep["id"]}


# ---- tokens per minute -----------------------------------------------------------------------------------------

CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(100))    # 300 UTF-8 bytes a byte-level BPE splits


def test_text_without_a_tokenizer_counts_a_token_per_byte(any_app):
    """Without the model's tokenizer the prompt is estimated from its UTF-8 bytes, one token per byte (an upper
    bound): text a tokenizer splits into single bytes cannot pass tokens_per_minute at four times its limit."""
    client = any_app.test_client()
    _, key = Admin(client).tenant(tokens_per_minute=200)
    for body in ({"prompt": CJK, "max_tokens": 4}, {"messages": [{"role": "user", "content": CJK}], "max_tokens": 4}):
        r = client.post("/v1/jobs", json=body, headers=key)
        assert r.status_code == 400 and r.get_json()["error"]["code"] == "request_too_large", r.get_json()
    assert client.post("/v1/jobs", json={"prompt": "x" * 150, "max_tokens": 4}, headers=key).status_code == 202


def test_with_the_models_tokenizer_the_prompt_is_counted_exactly(sqlite_url, tmp_path):
    from tidepool.service import create_app
    from tidepool.workers.tools.tiny_model import train_tokenizer
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "max_position_embeddings": 4096}))
    tokenizer = train_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    app = create_app({"database_url": sqlite_url, "redis_url": None, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN, "model": str(folder)})
    try:
        client = app.test_client()
        _, key = Admin(client).tenant(tokens_per_minute=400)
        english = "the quick brown fox jumps over the lazy dog " * 12
        exact = len(tokenizer.encode(english, add_special_tokens=False).ids)
        assert exact + 4 < 400 < len(english.encode())
        r = client.post("/v1/jobs", json={"prompt": english, "max_tokens": 4}, headers=key)
        assert r.status_code == 202, r.get_json()
        with Session(app.services.database) as s:
            assert s.get(Job, r.get_json()["id"]).estimated_tokens == exact + 4
        assert len(tokenizer.encode(CJK + CJK, add_special_tokens=False).ids) + 4 > 400
        r = client.post("/v1/jobs", json={"prompt": CJK + CJK, "max_tokens": 4}, headers=key)
        assert r.status_code == 400 and r.get_json()["error"]["code"] == "request_too_large"
    finally:
        app.services.database.dispose()


def test_json_bodies_are_bounded_per_route(any_app):
    """A body that carries a prompt may be up to 16 MiB (README "Request limits"); every other JSON body (admin,
    batch creation) is refused past 1 MiB before it is parsed."""
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    padding = "x" * (1 << 20)
    for path, body, headers in (("/v1/batches", {"input_file_id": padding, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}, key),
                                ("/v1/admin/tenants", {"name": padding}, admin)):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 413 and r.get_json()["error"]["code"] == "request_too_large", path
    r = client.post("/v1/jobs", json={"prompt": "x" * (3 << 19), "max_tokens": 1}, headers=key)    # 1.5 MiB
    assert r.status_code == 202, r.get_json()
