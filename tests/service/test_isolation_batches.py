"""A batch is never left in `validating`: its row is written in one transaction with its jobs (or as failed),
so a web process that dies while validating leaves nothing behind; a batch found validating long after its
creation (left by an older server) is failed by beat with a clear error."""
import io
import json
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from tidepool.service.protocol import request_bodies as bodies
from tidepool.service.ledger.models import Batch, BatchStatus, Job, utcnow
from tidepool.workers import beat

from .conftest import Admin


class Killed(BaseException):
    """SIGKILL of the web process at this point."""


def _upload(client, key, n):
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "hi", "max_tokens": 2}}).encode() + b"\n" for i in range(n))
    return client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                       headers=key, content_type="multipart/form-data").get_json()["id"]


def test_a_web_process_dying_while_validating_leaves_no_batch(any_app, monkeypatch):
    app = any_app
    client = app.test_client()
    _, key = Admin(client).tenant()
    file_id = _upload(client, key, 5)
    real, seen = bodies.check, []

    def dies_on_line_3(*args, **kwargs):
        seen.append(1)
        if len(seen) == 3:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(bodies, "check", dies_on_line_3)
    with pytest.raises(Killed):
        client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key)
    with Session(app.services.database) as s:      # what another process sees
        assert s.scalar(select(func.count()).select_from(Batch)) == 0
        assert s.scalar(select(func.count()).select_from(Job)) == 0
    monkeypatch.setattr(bodies, "check", real)
    b = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == 5


def test_beat_fails_a_batch_left_validating(app):
    client = app.test_client()
    tenant_id, key = Admin(client).tenant()
    file_id = _upload(client, key, 1)
    b = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    engine = app.services.database
    with Session(engine) as s:    # as an older server left it, an hour ago
        stuck = Batch(tenant_id=tenant_id, endpoint="/v1/completions", input_file_id=file_id, completion_window="24h",
                      sla_class="batch", status=BatchStatus.validating, total=0, completed=0, failed=0,
                      created_at=utcnow() - timedelta(hours=1))
        fresh = Batch(tenant_id=tenant_id, endpoint="/v1/completions", input_file_id=file_id,
                      completion_window="24h", sla_class="batch", status=BatchStatus.validating, total=0,
                      completed=0, failed=0, created_at=utcnow())
        s.add_all([stuck, fresh])
        s.commit()
        stuck_id, fresh_id = stuck.id, fresh.id
    assert beat.sweep(app.services)["batches_failed"] == 1
    got = client.get(f"/v1/batches/{stuck_id}", headers=key).get_json()
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "validation_interrupted"
    assert client.get(f"/v1/batches/{fresh_id}", headers=key).get_json()["status"] == "validating"
    assert client.get(f"/v1/batches/{b['id']}", headers=key).get_json()["status"] == "in_progress"
