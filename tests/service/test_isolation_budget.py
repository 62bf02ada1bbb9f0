"""The monthly token budget is reserved at admission (prompt estimate + max_tokens, atomically with the other
quotas) and settled to the actual usage at completion or released on failure, cancellation or expiry: however
the submissions arrive, the tokens a tenant can have accepted never exceed its budget."""
import threading
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from tidepool.service.ledger import jobs
from tidepool.service.ledger.models import Job, JobStatus, Tenant, Usage, utcnow

from .conftest import Admin

BODY = {"prompt": "Hi", "max_tokens": 100}     # 2 (its bytes: no tokenizer here) + 100 tokens reserved each
EACH = 102


def _reserved(app, tenant_id) -> int:
    with Session(app.services.database) as s:
        return s.get(Tenant, tenant_id).budget_reserved


def _accepted_tokens(app, tenant_id) -> int:
    with Session(app.services.database) as s:
        return s.scalar(select(func.coalesce(func.sum(Job.estimated_tokens), 0)).where(Job.tenant_id == tenant_id))


def test_concurrent_submissions_never_exceed_the_budget(any_app):
    app = any_app
    tenant_id, key = Admin(app.test_client()).tenant(monthly_token_budget=1000)
    codes, barrier = [], threading.Barrier(50)

    def submit(path, body):
        c = app.test_client()
        barrier.wait()
        codes.append(c.post(path, json=body, headers=key).status_code)

    threads = [threading.Thread(target=submit, args=("/v1/jobs", BODY)) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [202] * 9 + [429] * 41          # 9 x 101 = 909 <= 1000 < 10 x 101
    assert _accepted_tokens(app, tenant_id) == _reserved(app, tenant_id) == 9 * EACH


def test_sequential_submissions_and_batches_never_exceed_the_budget(any_app):
    app = any_app
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(monthly_token_budget=1000)
    codes = [client.post("/v1/jobs", json=BODY, headers=key).status_code for _ in range(50)]
    assert codes == [202] * 9 + [429] * 41
    r = client.post("/v1/jobs", json=BODY, headers=key)
    assert r.get_json()["error"]["code"] == "insufficient_quota" and int(r.headers["Retry-After"]) > 0
    # a batch file is refused as a whole when its lines do not fit in what is left
    lines = b"".join(b'{"custom_id": "c%d", "method": "POST", "url": "/v1/completions", "body": '
                     b'{"prompt": "Hi", "max_tokens": 20}}\n' % i for i in range(5))
    import io
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=key, content_type="multipart/form-data").get_json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "insufficient_quota"
    assert _accepted_tokens(app, tenant_id) == _reserved(app, tenant_id) == 9 * EACH


def test_reservations_are_settled_or_released_when_jobs_finish(any_app):
    app = any_app
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(monthly_token_budget=1000)
    ids = [client.post("/v1/jobs", json=BODY, headers=key).get_json()["id"] for _ in range(9)]
    assert client.post("/v1/jobs", json=BODY, headers=key).status_code == 429
    engine = app.services.database
    with Session(engine) as s:
        token = jobs.start(s, ids[0], "w").lease_token              # completes using 11 of its 101
        assert jobs.complete(s, ids[0], token, output="x", output_token_ids=[1], prompt_tokens=1,
                             completion_tokens=10, finish_reason="stop")
        token = jobs.start(s, ids[1], "w").lease_token              # fails: nothing used
        assert jobs.fail(s, ids[1], token, {"code": "x", "message": "x"})
        token = jobs.start(s, ids[2], "w").lease_token              # lease lapses, retried: still reserved
        s.execute(update(Job).where(Job.id == ids[2]).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        assert jobs.reclaim_lapsed(s) == 1
        assert jobs.cancel(s, ids[3])                               # cancelled
        s.execute(update(Job).where(Job.id == ids[4]).values(deadline=utcnow() - timedelta(seconds=1)))
        assert jobs.expire_overdue(s) == 1                          # expired
        s.commit()
    assert _reserved(app, tenant_id) == 5 * EACH
    # 11 used + 505 reserved: four more fit (11 + 909 <= 1000), the fifth does not
    codes = [client.post("/v1/jobs", json=BODY, headers=key).status_code for _ in range(5)]
    assert codes == [202] * 4 + [429]
    with Session(engine) as s:
        s.execute(update(Job).where(Job.tenant_id == tenant_id, Job.status == JobStatus.queued)
                  .values(deadline=utcnow() - timedelta(seconds=1)))
        jobs.expire_overdue(s)
        s.commit()
        assert s.scalar(select(Usage.prompt_tokens + Usage.completion_tokens).where(Usage.tenant_id == tenant_id)) == 11
    assert _reserved(app, tenant_id) == 0


def test_online_requests_reserve_too(any_app):
    app = any_app
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(monthly_token_budget=150)
    assert client.post("/v1/jobs", json=BODY, headers=key).status_code == 202
    r = client.post("/v1/completions", json=BODY, headers=key)
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "insufficient_quota"
    assert _reserved(app, tenant_id) == EACH


def test_an_admission_waiting_on_a_completion_sees_its_usage(app):
    """The completion holds the tenant row until it commits; an admission queued behind it must count the
    tokens that completion used (not a snapshot of usage from before it waited)."""
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(monthly_token_budget=1000)
    job_id = client.post("/v1/jobs", json=BODY, headers=key).get_json()["id"]
    engine = app.services.database
    with Session(engine) as s:
        token = jobs.start(s, job_id, "w").lease_token
        s.commit()
    completing = Session(engine)
    assert jobs.complete(completing, job_id, token, output="x", output_token_ids=[1], prompt_tokens=1,
                         completion_tokens=899, finish_reason="length")       # 900 used; not committed yet
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault(
        "r", app.test_client().post("/v1/jobs", json=BODY, headers=key)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()                     # blocked on the tenant row held by the completion
    completing.commit()
    completing.close()
    waiter.join(30)
    r = result["r"]
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "insufficient_quota"   # 900 + 101 > 1000
    assert _reserved(app, tenant_id) == 0


def test_a_new_month_starts_from_zero(any_app):
    app = any_app
    client = app.test_client()
    tenant_id, key = Admin(client).tenant(monthly_token_budget=1000)
    with Session(app.services.database) as s:      # last month's usage filled the budget
        s.execute(update(Tenant).where(Tenant.id == tenant_id).values(budget_period="2000-01", budget_used=10 ** 6))
        s.commit()
    job_id = client.post("/v1/jobs", json=BODY, headers=key).get_json()["id"]
    with Session(app.services.database) as s:
        token = jobs.start(s, job_id, "w").lease_token
        jobs.complete(s, job_id, token, output="x", output_token_ids=[1], prompt_tokens=1, completion_tokens=9,
                      finish_reason="stop")
        s.commit()
        t = s.get(Tenant, tenant_id)
        assert (t.budget_used, t.budget_reserved, len(t.budget_period)) == (10, 0, 7) and t.budget_period != "2000-01"
