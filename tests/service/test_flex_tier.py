"""service_tier "flex" without capacity: the job is withdrawn once it has waited TIDEPOOL_FLEX_TIMEOUT seconds without
starting, and the client gets 429 resource_unavailable with Retry-After; nothing stays reserved or billed."""
from kombu.transport.memory import Channel
from sqlalchemy import select
from sqlalchemy.orm import Session

from tidepool.service import create_app
from tidepool.service.ledger.models import Job, JobStatus, Tenant, Usage

from .conftest import ADMIN, Admin


def test_flex_request_nobody_starts_is_withdrawn_with_a_429(sqlite_url, tmp_path):
    Channel.queues.clear()
    app = create_app({"database_url": sqlite_url, "redis_url": None, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN, "flex_timeout": 1.0})
    try:
        client = app.test_client()
        tenant_id, key = Admin(client).tenant()
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/responses", {"input": "Hi"})):
            r = client.post(path, json={**body, "service_tier": "flex"}, headers=key)     # no worker runs here
            assert r.status_code == 429, r.get_json()
            assert r.get_json()["error"]["code"] == "resource_unavailable" and int(r.headers["Retry-After"]) >= 1
        with Session(app.services.database) as s:
            jobs = s.scalars(select(Job).where(Job.tenant_id == tenant_id)).all()
            assert [(j.sla_class.value, j.status) for j in jobs] == [("batch", JobStatus.cancelled)] * 2
            t = s.get(Tenant, tenant_id)
            assert (t.queued_count, t.running_count, t.budget_reserved) == (0, 0, 0)
            assert s.scalar(select(Usage).where(Usage.tenant_id == tenant_id)) is None
    finally:
        app.services.database.dispose()
        Channel.queues.clear()
