"""A LoRA adapter belongs to its tenant: the API refuses another tenant's adapter at admission (404, as a missing
model), and the worker checks again when it claims the job, so even a job row that names another tenant's adapter
(written by hand, or by a bug) never runs with it: it fails with model_not_found and the adapter is never loaded.
The owner's own job runs with it. Driven step by step over Postgres + Redis."""
from sqlalchemy import update
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Job, JobStatus
from tidepool.workers.worker import Worker, WorkerConfig

from ..service.test_adapters import adapter_folder
from .test_intake import _close, _job, _run_engine


def _lora_worker(st, name: str) -> Worker:
    w = Worker(WorkerConfig(model=st.model, database_url=st.db_url, broker_url=st.redis_url, redis_url=st.redis_url,
                            device="cpu", name=name, lease_seconds=30, engine={"max_loras": 2, "max_lora_rank": 8}))
    w.connect()
    return w


def test_a_job_naming_another_tenants_adapter_never_runs_with_it(stack, tmp_path):
    st = stack
    client = st.app.test_client()
    admin = {"Authorization": "Bearer admin"}
    owner, owner_key = st.tenant()
    _, intruder_key = st.tenant()
    base = client.get("/v1/models", headers={"Authorization": f"Bearer {owner_key}"}).get_json()["data"][0]["id"]
    r = client.post("/v1/admin/adapters", headers=admin, json={
        "name": "owners-qv", "base_model": base, "source": adapter_folder(tmp_path / "qv"), "tenant_id": owner})
    assert r.status_code == 201, r.get_json()

    # admission: another tenant's adapter does not exist for the intruder
    r = client.post("/v1/jobs", headers={"Authorization": f"Bearer {intruder_key}"},
                    json={"model": "owners-qv", "prompt": "steal", "max_tokens": 2})
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found", r.get_json()

    # a job row of the intruder's that names it anyway
    [crafted] = st.submit(intruder_key, 1, prompt="steal", max_tokens=2)
    with Session(st.engine) as s:
        job = s.get(Job, crafted)
        s.execute(update(Job).where(Job.id == crafted).values(request={**job.request, "model": "owners-qv"}))
        s.commit()
    [own] = st.submit(owner_key, 1, model="owners-qv", prompt="mine", max_tokens=2)
    w = _lora_worker(st, "lora")
    try:
        while w.pull():
            pass
        assert list(w.inflight) == [own]          # the crafted job failed at claim, never entering the engine
        refused = _job(st, crafted)
        assert refused.status == JobStatus.failed and refused.error["code"] == "model_not_found", refused.error
        assert w.engine.lora.stats()["tokens"] == {}
        _run_engine(w)
        w.finish_done()
        assert _job(st, own).status == JobStatus.completed
        assert set(w.engine.lora.stats()["tokens"]) == {"owners-qv"}    # the owner's job ran with it
    finally:
        _close(w)
