"""One tenant cannot exhaust what the others share (OWASP API4, unrestricted resource consumption): web threads,
the ledger's connections and write lock, the web process's memory, the disk the files live on. Each bound is a
clear 4xx in the API's error format."""
import io
import json

from sqlalchemy import text

from .conftest import ADMIN, Admin

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
    from service.api import anthropic
    monkeypatch.setattr(anthropic, "RESULTS_PAGE", 2, raising=False)
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    message = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    reqs = [{"custom_id": f"r{i}", "params": message} for i in range(5)]
    batch = client.post("/v1/messages/batches", json={"requests": reqs}, headers=key).get_json()
    ended = client.post(f"/v1/messages/batches/{batch['id']}/cancel", headers=key).get_json()
    assert ended["processing_status"] == "ended", ended
    engine = any_app.extensions["tidepool.db"]
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
    assert peak < len(body) / 8, (peak, len(body))     # the body is 8 MB; read whole it costs twice that or more


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
    storage = any_app.extensions["tidepool.storage"].root
    assert not [p for p in storage.rglob("*") if p.is_file()]      # nothing refused left bytes behind
    assert client.post("/v1/messages/batches", json={"requests": [ok]}, headers=key).status_code == 200
