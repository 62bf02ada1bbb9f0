"""Ledger transitions the sweeper relies on: deadlines, lapsed leases, counters, batch expiry; and the reads every
route shares: a tenant's row by id, a listing's page by id cursor."""
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from tidepool.service.ledger import batches as ledger, jobs, pages, tenants
from tidepool.service.ledger.models import Batch, File, Job, JobStatus, Tenant, utcnow

from .conftest import Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8}


def _submit(client, key, n=1, **extra):
    return [client.post("/v1/jobs", json={**PROMPT, **extra}, headers=key).get_json()["id"] for _ in range(n)]


def test_deadlines_expire_queued_jobs(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    late, fine = _submit(client, key, 2, deadline=(utcnow() + timedelta(hours=1)).isoformat())
    with Session(any_app.services.database) as s:
        s.execute(update(Job).where(Job.id == late).values(deadline=utcnow() - timedelta(seconds=1)))
        assert jobs.start(s, late, "w").reason == "expired"
        assert jobs.expire_overdue(s) == 0
        s.execute(update(Job).where(Job.id == fine).values(deadline=utcnow() - timedelta(seconds=1)))
        assert jobs.expire_overdue(s) == 1
        s.commit()
        assert s.get(Tenant, tenant_id).queued_count == 0
    assert {client.get(f"/v1/jobs/{j}", headers=key).get_json()["status"] for j in (late, fine)} == {"expired"}


def test_a_deadline_already_past_is_accepted_and_expires_the_job_unrun(any_app):
    """The document cannot say 'in the future' (nor can a client tell a deadline that passed on its way): a past
    deadline is accepted, and the job expires as one whose deadline passed while it waited."""
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    (by_text,) = _submit(client, key, deadline="2001-02-03T04:05:06.5+01:00")
    (by_number,) = _submit(client, key, deadline=0)
    assert client.get(f"/v1/jobs/{by_text}", headers=key).get_json()["deadline"] == 981169506
    with Session(any_app.services.database) as s:
        assert jobs.start(s, by_text, "w").reason == "expired"
        assert jobs.expire_overdue(s) == 1
        s.commit()
        assert s.get(Tenant, tenant_id).queued_count == 0
    assert {client.get(f"/v1/jobs/{j}", headers=key).get_json()["status"] for j in (by_text, by_number)} == {"expired"}


def test_lapsed_leases_are_requeued_then_failed(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    (job_id,) = _submit(client, key)
    with Session(any_app.services.database) as s:
        for attempt in (1, 2):
            lease = jobs.start(s, job_id, f"w{attempt}", lease_seconds=-1).lease_token
            assert lease and jobs.reclaim_lapsed(s, max_attempts=2) == 1
            s.commit()
            assert s.get(Job, job_id).status == (JobStatus.queued if attempt == 1 else JobStatus.failed)
        assert not jobs.complete(s, job_id, lease, output="", output_token_ids=[], prompt_tokens=1,
                                 completion_tokens=1, finish_reason="stop")
        t = s.get(Tenant, tenant_id)
        assert (t.queued_count, t.running_count) == (0, 0)
    assert client.get(f"/v1/jobs/{job_id}", headers=key).get_json()["error"]["code"] == "lease_expired"


def test_cancel_a_running_job_frees_the_running_slot(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant(max_running=1)
    a, b = _submit(client, key, 2)
    with Session(any_app.services.database) as s:
        lease = jobs.start(s, a, "w").lease_token
        s.commit()
    assert client.post(f"/v1/jobs/{a}/cancel", headers=key).get_json()["status"] == "cancelled"
    with Session(any_app.services.database) as s:
        assert not jobs.renew_lease(s, a, lease)  # the worker learns the job is gone
        assert jobs.start(s, b, "w").lease_token
        s.commit()


def test_expired_batch_finalizes_as_expired(embedded_app):
    import io
    import json
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")},
                    headers=key).get_json()["id"]
    b = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    with Session(embedded_app.services.database) as s:
        batch = s.get(Batch, b["id"])
        ledger.expire(s, batch)
        assert ledger.finalize(s, embedded_app.services.storage, batch)
        s.commit()
    done = client.get(f"/v1/batches/{b['id']}", headers=key).get_json()
    assert done["status"] == "expired" and done["output_file_id"] is None and done["error_file_id"]
    errors = client.get(f"/v1/files/{done['error_file_id']}/content", headers=key).data.decode().splitlines()
    assert json.loads(errors[0])["error"]["code"] == "batch_expired"    # as OpenAI reports it
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}


def test_a_tenants_rows_by_id_and_by_page(any_app):
    client = any_app.test_client()
    (mine, _), (theirs, _) = Admin(client).tenant(), Admin(client).tenant()
    day = utcnow().replace(hour=0, minute=0, second=0, microsecond=0)
    with Session(any_app.services.database) as s:
        for n, (file_id, tenant_id) in enumerate([("file-a", mine), ("file-b", mine), ("file-c", mine),
                                                   ("file-d", theirs)]):
            s.add(File(id=file_id, tenant_id=tenant_id, purpose="batch" if n else "batch_output", filename="f",
                       bytes=1, created_at=day + timedelta(hours=n)))
        s.commit()
        assert tenants.owned(s, File, "file-a", mine).id == "file-a"
        assert tenants.owned(s, File, "file-d", mine) is None    # another tenant's row is absent
        assert tenants.owned(s, File, "file-a", mine, purpose="batch") is None

        def ids(limit=10, **kw):
            return [f.id for f in pages.page(s, File, limit, tenant_id=mine, **kw)]
        assert ids() == ["file-c", "file-b", "file-a"] and ids(ascending=True) == ["file-a", "file-b", "file-c"]
        assert ids(1) == ["file-c", "file-b"]    # limit + 1: there is more
        assert ids(after="file-c") == ["file-b", "file-a"]    # the next page
        assert ids(after="file-a", ascending=True) == ["file-b", "file-c"]
        assert ids(before="file-a") == ["file-c", "file-b"]    # the rows before a cursor
        assert ids(before="file-c", ascending=True) == ["file-a", "file-b"]
        assert ids(created_from=day + timedelta(hours=1), created_before=day + timedelta(hours=2)) == ["file-b"]
        assert ids(purpose="batch_output") == ["file-a"]
        assert [f.id for f in pages.page(s, File, 10)] == ["file-d", "file-c", "file-b", "file-a"]
