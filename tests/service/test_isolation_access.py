"""What a key may still do once it is revoked, and what a tenant can read back (OWASP API1/API5: object- and
function-level authorization): every admission checks the key in the database, whatever the cached
authentication says; what a tenant asked not to keep (`store: false`) or deleted is not readable as a job."""
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Batch, Job

from .conftest import Admin
from .fake_worker import FakeWorker

MESSAGE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


def _revoke_behind_the_cache(app, key: dict) -> None:
    """Revoke the key in the database only, as another web process does: this process's cached authentication
    (TIDEPOOL_AUTH_CACHE_TTL) still says it is live."""
    prefix = "_".join(key["Authorization"].split()[1].split("_")[:2])
    with app.services.database.begin() as conn:
        conn.execute(text("UPDATE api_keys SET revoked_at = CURRENT_TIMESTAMP WHERE prefix = :p"), {"p": prefix})


def test_a_revoked_key_creates_no_message_batch(any_app):
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    assert client.get("/v1/models", headers=key).status_code == 200     # the key is cached now
    _revoke_behind_the_cache(any_app, key)
    r = client.post("/v1/messages/batches", json={"requests": [{"custom_id": "a", "params": MESSAGE}]},
                    headers=key)
    assert r.status_code == 401 and r.get_json()["error"]["type"] == "authentication_error", r.get_json()
    with Session(any_app.services.database) as s:
        assert s.scalar(select(func.count()).select_from(Batch).where(Batch.tenant_id == tenant_id)) == 0
        assert s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)) == 0


def test_unstored_and_deleted_responses_are_not_readable_as_jobs(any_app):
    """A response's id names its job (resp_<x> runs as job_<x>): with `store: false`, or once the response is
    deleted, GET /v1/jobs/job_<x> is a 404 and the job is not listed."""
    client = any_app.test_client()
    tenant_id, key = Admin(client).tenant()
    with FakeWorker(any_app, tenant_id):
        unstored = client.post("/v1/responses", json={"input": "Hi", "store": False}, headers=key)
        stored = client.post("/v1/responses", json={"input": "Hi"}, headers=key)
    assert unstored.status_code == stored.status_code == 200, (unstored.get_json(), stored.get_json())
    job_of = {name: "job_" + r.get_json()["id"].split("_", 1)[1] for name, r in (("unstored", unstored),
                                                                                  ("stored", stored))}
    listed = lambda: {j["id"] for j in client.get("/v1/jobs", headers=key).get_json()["data"]}   # noqa: E731
    assert client.get(f"/v1/jobs/{job_of['stored']}", headers=key).status_code == 200
    assert client.get(f"/v1/jobs/{job_of['unstored']}", headers=key).status_code == 404
    assert listed() == {job_of["stored"]}
    assert client.delete(f"/v1/responses/{stored.get_json()['id']}", headers=key).status_code == 200
    assert client.get(f"/v1/jobs/{job_of['stored']}", headers=key).status_code == 404
    assert client.post(f"/v1/jobs/{job_of['stored']}/cancel", headers=key).status_code == 404
    assert listed() == set()
