"""TIDEPOOL_DATABASE_REPLICA_URL: listings, the admin panel's pages and usage reports read from the replica (here a
second database on the same server, filled differently, so what a page shows says where it read); everything that
writes, or reads what its client just wrote, stays on the primary."""
import re

import pytest
from sqlalchemy import create_engine, insert, select, text
from sqlalchemy.exc import DBAPIError

from tidepool.service import create_app
from tidepool.service.ledger.models import ApiKey, Batch, BatchStatus, File, Job, JobStatus, Quota, SlaClass, \
    Tenant, Usage, new_id, utcnow
from tidepool.service.ledger.quotas import period

from .conftest import ADMIN, Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8, "sla_class": "interactive"}
HTTPS = {"base_url": "https://localhost"}


@pytest.fixture
def replica_url(pg_databases):
    url = pg_databases.create()
    yield url
    pg_databases.drop(url)


def _copy_tenant(primary: str, replica: str, tenant_id: str) -> None:
    """The tenant as replication would have brought it over."""
    src, dst = create_engine(primary), create_engine(replica)
    try:
        with src.connect() as a, dst.begin() as b:
            for table in (Tenant.__table__, Quota.__table__, ApiKey.__table__):
                rows = [r._asdict() for r in a.execute(select(table).where(table.c.tenant_id == tenant_id
                                                                           if "tenant_id" in table.c
                                                                           else table.c.id == tenant_id))]
                b.execute(insert(table), rows)
    finally:
        src.dispose()
        dst.dispose()


def _fill_replica(replica: str, tenant_id: str) -> dict:
    """Rows only the replica has: a job, a file, a batch and this month's usage."""
    now = utcnow()
    ids = {"job": new_id("job_"), "file": new_id("file-"), "batch": new_id("batch_")}
    engine = create_engine(replica)
    try:
        with engine.begin() as conn:
            conn.execute(insert(Job).values(id=ids["job"], tenant_id=tenant_id, sla_class=SlaClass.interactive,
                                            status=JobStatus.completed, endpoint="/v1/completions",
                                            request={"prompt": "replica"}, hidden=False, estimated_tokens=1,
                                            attempts=0, created_at=now))
            conn.execute(insert(File).values(id=ids["file"], tenant_id=tenant_id, purpose="batch",
                                             filename="replica.jsonl", bytes=1, created_at=now))
            conn.execute(insert(Batch).values(id=ids["batch"], tenant_id=tenant_id, endpoint="/v1/completions",
                                              input_file_id=ids["file"], completion_window="24h",
                                              sla_class=SlaClass.batch, status=BatchStatus.completed,
                                              created_at=now))
            conn.execute(insert(Usage).values(tenant_id=tenant_id, period=period(), requests=3, prompt_tokens=700,
                                              completion_tokens=77))
    finally:
        engine.dispose()
    return ids


@pytest.mark.production_shape
def test_listings_panel_and_usage_read_the_replica_and_writes_stay_on_the_primary(pg_url, replica_url, redis_url,
                                                                                 tmp_path):
    app = create_app({"database_url": pg_url, "database_replica_url": replica_url, "redis_url": redis_url,
                      "storage_dir": str(tmp_path / "storage"), "admin_token": ADMIN})
    try:
        client = app.test_client()
        tenant_id, key = Admin(client).tenant()
        _copy_tenant(pg_url, replica_url, tenant_id)
        ids = _fill_replica(replica_url, tenant_id)
        submitted = client.post("/v1/jobs", json=PROMPT, headers=key)           # written to the primary
        assert submitted.status_code == 202
        own = submitted.get_json()["id"]

        assert [j["id"] for j in client.get("/v1/jobs", headers=key).get_json()["data"]] == [ids["job"]]
        assert [f["id"] for f in client.get("/v1/files", headers=key).get_json()["data"]] == [ids["file"]]
        assert [b["id"] for b in client.get("/v1/batches", headers=key).get_json()["data"]] == [ids["batch"]]
        assert client.get(f"/v1/jobs/{own}", headers=key).get_json()["status"] == "queued"     # its own write
        assert client.get(f"/v1/jobs/{ids['job']}", headers=key).status_code == 404            # not on the primary

        page = client.get("/admin/login", **HTTPS)
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        assert client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf}, **HTTPS).status_code == 302
        jobs_page = client.get("/admin/jobs", **HTTPS).text
        assert ids["job"] in jobs_page and own not in jobs_page
        tenants_page = client.get("/admin/tenants", **HTTPS).text
        assert re.search(r'data-label="Tokens this month" class="num">777\b', tenants_page)
        assert ids["batch"] in client.get("/admin/batches", **HTTPS).text

        with app.services.replica.connect() as conn:     # the replica's engine never writes
            with pytest.raises(DBAPIError, match="read-only transaction"):
                conn.execute(text("DELETE FROM usage"))
    finally:
        app.services.database.dispose()
        app.services.replica.dispose()


@pytest.mark.production_shape
def test_without_a_replica_everything_reads_the_primary(app):
    assert app.services.replica is app.services.database
    client = app.test_client()
    _, key = Admin(client).tenant()
    own = client.post("/v1/jobs", json=PROMPT, headers=key).get_json()["id"]
    assert [j["id"] for j in client.get("/v1/jobs", headers=key).get_json()["data"]] == [own]
