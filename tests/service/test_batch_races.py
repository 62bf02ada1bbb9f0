"""A batch cancel and the batch finaliser that meet end in one consistent state, with the output files written once:
both are guarded transitions of the batch row, so whichever commits second finds the batch gone from the states it
moves from and changes nothing. The interleavings are forced step by step (a view read before the other side
committed), on Postgres and on SQLite; then through the API on Postgres, where the finaliser commits between the
cancel request's read of the batch and its write."""
import io
import json

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidepool.service.ledger import batches as ledger, jobs
from tidepool.service.ledger.models import Batch, BatchStatus, File, Job
from tidepool.workers import beat

from .conftest import Admin


def _finished_batch(app) -> tuple[str, dict]:
    """A batch of two requests, both completed by a worker: the finaliser may close it now."""
    client = app.test_client()
    _, key = Admin(client).tenant()
    lines = "\n".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": f"p{i}"}})
                      for i in range(2)).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=key).get_json()["id"]
    b = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "in_progress", b
    with Session(app.services.database) as s:
        for job_id in s.scalars(select(Job.id).where(Job.batch_id == b["id"])).all():
            lease = jobs.start(s, job_id, "w").lease_token
            assert jobs.complete(s, job_id, lease, output="o", output_token_ids=[1], prompt_tokens=1,
                                 completion_tokens=1, finish_reason="stop")
        s.commit()
    return b["id"], key


def _outputs(app, batch_id: str) -> tuple[Batch, int, int]:
    """The batch, the batch_output File rows written for it and the files in storage."""
    with Session(app.services.database) as s:
        batch = s.get(Batch, batch_id)
        rows = s.scalar(select(func.count()).select_from(File).where(File.purpose == "batch_output"))
    stored = sum(1 for p in app.services.storage.root.rglob("*") if p.is_file())
    return batch, rows, stored - 1      # the input file


def _stale(app, batch_id: str) -> tuple[Session, Batch]:
    """A session holding the batch as read now, its read transaction over (as a request that read it earlier)."""
    s = Session(app.services.database, expire_on_commit=False)
    batch = s.get(Batch, batch_id)
    s.commit()
    return s, batch


def test_a_cancel_that_read_the_batch_before_the_finaliser_closed_it_changes_nothing(any_app):
    app = any_app
    batch_id, _ = _finished_batch(app)
    s, stale = _stale(app, batch_id)
    assert stale.status == BatchStatus.in_progress
    assert beat.finalize_batches(app.services) == 1                # the finaliser commits first
    with s:
        assert not ledger.cancel(s, stale)               # the cancel's guarded transition finds it completed
        assert stale.status == BatchStatus.completed      # ... and the caller sees what it is now
        assert not ledger.finalize(s, app.services.storage, stale)
        s.commit()
    batch, rows, stored = _outputs(app, batch_id)
    assert (batch.status, batch.cancelling_at, batch.cancelled_at) == (BatchStatus.completed, None, None)
    assert (batch.completed, rows, stored) == (2, 1, 1)   # one output file, written once


def test_a_finaliser_that_read_the_batch_before_the_cancel_closed_it_changes_nothing(any_app):
    app = any_app
    batch_id, key = _finished_batch(app)
    s, stale = _stale(app, batch_id)
    r = app.test_client().post(f"/v1/batches/{batch_id}/cancel", headers=key)     # the cancel commits first
    assert r.status_code == 200 and r.get_json()["status"] == "cancelled", r.get_json()
    with s:
        assert not ledger.finalize(s, app.services.storage, stale)
        s.commit()
    batch, rows, stored = _outputs(app, batch_id)
    assert (batch.status, batch.completed_at, batch.output_file_id) == \
        (BatchStatus.cancelled, None, r.get_json()["output_file_id"])
    assert (rows, stored) == (1, 1)


def test_the_finaliser_committing_inside_a_cancel_request_makes_it_a_409(app, monkeypatch):
    """Postgres: the request reads the batch (in progress), the finaliser closes it, the request's cancel follows."""
    batch_id, key = _finished_batch(app)
    cancel = ledger.cancel

    def finaliser_first(s, batch):
        assert beat.finalize_batches(app.services) == 1
        return cancel(s, batch)

    monkeypatch.setattr(ledger, "cancel", finaliser_first)
    r = app.test_client().post(f"/v1/batches/{batch_id}/cancel", headers=key)
    assert r.status_code == 409 and r.get_json()["error"]["code"] == "batch_not_cancellable", r.get_json()
    assert "completed" in r.get_json()["error"]["message"]
    batch, rows, stored = _outputs(app, batch_id)
    assert (batch.status, batch.cancelled_at, rows, stored) == (BatchStatus.completed, None, 1, 1)
