"""Files and Batch API through the official openai client against the app on a real socket."""
import io
import json

import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidepool.service.ledger import batches as ledger, jobs
from tidepool.service.ledger.models import Batch, Job

from .conftest import Admin


def _line(i, url="/v1/chat/completions", **body):
    body = body or {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})


def _client(app, live_server, **quota):
    _, key = Admin(app.test_client()).tenant(**quota)
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=key["Authorization"].split()[1], max_retries=0)


def _count_jobs(app):
    with Session(app.services.database) as s:
        return s.scalar(select(func.count()).select_from(Job))


@pytest.mark.production_shape
def test_files_and_batch_lifecycle_with_openai_client(app, live_server, redis_client):
    oa = _client(app, live_server)
    data = "\n".join(_line(i) for i in range(3)).encode()
    f = oa.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.bytes == len(data) and f.purpose == "batch" and f.filename == "in.jsonl"
    assert oa.files.retrieve(f.id).id == f.id
    assert [x.id for x in oa.files.list()] == [f.id]
    assert oa.files.content(f.id).read() == data

    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"run": "1"})
    assert batch.status == "in_progress" and batch.request_counts.total == 3 and batch.metadata == {"run": "1"}
    assert redis_client.llen("batch") == 3
    assert oa.batches.retrieve(batch.id).status == "in_progress"
    assert [b.id for b in oa.batches.list()] == [batch.id]

    # a worker completes one job and fails one; cancelling the batch cancels the last and finalises
    with Session(app.services.database) as s:
        ids = s.scalars(select(Job.id).where(Job.batch_id == batch.id).order_by(Job.custom_id)).all()
        lease = jobs.start(s, ids[0], "w").lease_token
        jobs.complete(s, ids[0], lease, output="hello", output_token_ids=[1], prompt_tokens=3, completion_tokens=1,
                      finish_reason="stop")
        lease = jobs.start(s, ids[1], "w").lease_token
        jobs.fail(s, ids[1], lease, {"code": "engine_error", "message": "boom"})
        s.commit()
    assert oa.batches.retrieve(batch.id).request_counts.completed == 1
    cancelled = oa.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 1
    out = [json.loads(x) for x in oa.files.content(cancelled.output_file_id).read().splitlines()]
    assert out[0]["custom_id"] == "req-0"
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    errs = [json.loads(x) for x in oa.files.content(cancelled.error_file_id).read().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [("req-1", "engine_error"),
                                                                   ("req-2", "job_cancelled")]
    with pytest.raises(openai.ConflictError):
        oa.batches.cancel(batch.id)

    assert oa.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(f.id)


def test_invalid_lines_fail_the_batch_with_line_numbers_and_no_rows(app, live_server):
    oa = _client(app, live_server, max_tokens_per_request=64)
    lines = [_line(0), "{not json", json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
             _line(0), _line(4, url="/v1/completions"), _line(5, messages=[], max_tokens=4),
             _line(6, messages=[{"role": "user", "content": "x"}], max_tokens=65), "[1]", _line(8)]
    f = oa.files.create(file=("bad.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    got = [(e.line, e.code) for e in batch.errors.data]
    assert got == [(2, "invalid_json"), (3, "missing_required_parameter"), (4, "duplicate_custom_id"),
                   (5, "invalid_url"), (6, "invalid_value"), (7, "max_tokens_exceeded"), (8, "invalid_request")]
    assert _count_jobs(app) == 0
    assert oa.batches.retrieve(batch.id).status == "failed"


def test_batch_request_errors(app, live_server):
    oa = _client(app, live_server, allowed_sla_classes=["interactive", "batch"])
    f = oa.files.create(file=("in.jsonl", io.BytesIO(_line(0).encode())), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        oa.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        oa.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.PermissionDeniedError):
        oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                          extra_body={"sla_class": "deferrable"})
    with pytest.raises(openai.BadRequestError):
        oa.files.create(file=("x.txt", io.BytesIO(b"x")), purpose="fine-tune")


@pytest.mark.production_shape
def test_deferrable_batch_goes_to_deferrable_queue(app, live_server, redis_client):
    oa = _client(app, live_server)
    f = oa.files.create(file=("in.jsonl", io.BytesIO(_line(0).encode())), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                          extra_body={"sla_class": "deferrable"})
    assert b.status == "in_progress"
    assert (redis_client.llen("deferrable"), redis_client.llen("batch")) == (1, 0)


def test_upload_over_the_limit_is_413_and_leaves_nothing(app, live_server, tmp_path):
    oa = _client(app, live_server, max_file_bytes=1000)
    with pytest.raises(openai.APIStatusError) as exc:
        oa.files.create(file=("big.jsonl", io.BytesIO(b"x" * 200_000)), purpose="batch")
    assert exc.value.status_code == 413 and exc.value.body["code"] == "file_too_large"
    # just over the limit, within the multipart slack: caught while streaming to storage
    with pytest.raises(openai.APIStatusError) as exc:
        oa.files.create(file=("big.jsonl", io.BytesIO(b"x" * 1001)), purpose="batch")
    assert exc.value.status_code == 413
    assert list(oa.files.list()) == []
    assert not [p for p in (tmp_path / "storage").rglob("*") if p.is_file()]


@pytest.mark.production_shape
def test_fifty_thousand_line_batch_is_accepted(app, live_server, redis_client):
    oa = _client(app, live_server)
    data = "\n".join(_line(i, url="/v1/completions", prompt=[1, 2, 3], max_tokens=4) for i in range(50_000))
    f = oa.files.create(file=("big.jsonl", io.BytesIO(data.encode())), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "in_progress" and b.request_counts.total == 50_000
    assert _count_jobs(app) == 50_000 and redis_client.llen("batch") == 50_000
    with Session(app.services.database) as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.dispatched_at.is_(None))) == 0
    too_many = data + "\n" + _line(50_000, url="/v1/completions", prompt=[1], max_tokens=1)
    f2 = oa.files.create(file=("big2.jsonl", io.BytesIO(too_many.encode())), purpose="batch")
    b2 = oa.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="24h")
    assert b2.status == "failed" and [(e.line, e.code) for e in b2.errors.data] == [(50_001, "too_many_lines")]
    assert _count_jobs(app) == 50_000


def test_finalize_waits_for_running_jobs(embedded_app, tmp_path):
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    data = ("\n".join(_line(i) for i in range(2))).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
                    headers=key).get_json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    storage = embedded_app.services.storage
    with Session(embedded_app.services.database) as s:
        batch = s.get(Batch, b["id"])
        a, c = s.scalars(select(Job.id).where(Job.batch_id == batch.id).order_by(Job.custom_id)).all()
        lease = jobs.start(s, a, "w").lease_token
        assert not ledger.finalize(s, storage, batch)
        jobs.complete(s, a, lease, output="o", output_token_ids=[], prompt_tokens=1, completion_tokens=1,
                      finish_reason="stop")
        lease = jobs.start(s, c, "w").lease_token
        jobs.complete(s, c, lease, output="p", output_token_ids=[], prompt_tokens=1, completion_tokens=1,
                      finish_reason="stop")
        assert ledger.finalize(s, storage, batch)
        s.commit()
    done = client.get(f"/v1/batches/{b['id']}", headers=key).get_json()
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert done["error_file_id"] is None and done["output_file_id"]
