"""Every generated token is billed once. A running job that is cancelled (POST /v1/jobs/{id}/cancel, a Responses
cancel, a batch cancel) or whose streaming client goes away is billed the prompt tokens it processed and the tokens
it generated: usage, the monthly budget and the job's own counts equal what the engine computed for it. Through the
public API with a real worker (on threads, as `tidepool serve` runs it) on Postgres + Redis and on the embedded
default (SQLite and the in-process broker); then the races, driven step by step: a cancel that beats a completion,
a completion that beats a cancel, a result written twice."""
import io
import json
import threading
import time
import uuid

import pytest
import requests
from kombu.transport.memory import Channel
from sqlalchemy import select
from sqlalchemy.orm import Session
from werkzeug.serving import make_server

from tidepool.service import create_app, migrate
from tidepool.service.ledger import jobs as transitions, tenants
from tidepool.service.ledger.models import Job, JobStatus, Tenant, Usage
from tidepool.workers.attempt import build_request
from tidepool.workers.worker import Worker, WorkerConfig

from .conftest import Stack, flush_redis
from .test_intake import _close, _job, _run_engine, _worker

STEP_PAUSE = 0.004      # seconds added to each engine step: a long job is still running when its cancel arrives


class Served:
    def __init__(self, db_url: str, broker: str | None, model: str, tmp):
        self.app = create_app({"database_url": db_url, "redis_url": broker, "storage_dir": str(tmp / "storage"),
                               "model": model, "admin_token": "admin"})
        self.db = self.app.services.database
        self.worker = Worker(WorkerConfig(model=model, database_url=db_url, broker_url=broker or "memory://",
                                          redis_url=broker, device="cpu", name=f"bill-{uuid.uuid4().hex[:6]}",
                                          check_interval=0.05))
        step = self.worker.engine.step

        def slow_step():
            time.sleep(STEP_PAUSE)
            return step()

        self.worker.engine.step = slow_step
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.worker.stop()
        self.thread.join(30)
        self.server.shutdown()
        self.db.dispose()

    def tenant(self) -> tuple[str, dict]:
        with Session(self.db) as s:
            t, key = tenants.create_tenant(s, f"t-{uuid.uuid4().hex[:8]}")
            s.commit()
            return t.id, {"Authorization": f"Bearer {key}"}

    def job(self, job_id: str) -> Job:
        with Session(self.db) as s:
            return s.get(Job, job_id)

    def generated(self) -> int:
        """Tokens the worker's engine has generated so far (every sequence, every request)."""
        return self.worker.engine.stats()["total_generation_tokens"]

    def idle(self) -> None:
        Stack.wait(lambda: not self.worker.inflight and not self.worker.engine.has_unfinished(), 30, "an idle worker")


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def served(request, tiny_model, tmp_path_factory, pg_databases, redis_server):
    tmp = tmp_path_factory.mktemp(f"billing-{request.param}")
    if request.param == "postgres":
        url, broker = pg_databases.create(), f"{redis_server}/4"     # not the step-by-step tests' db
        flush_redis(broker)
    else:
        url, broker = f"sqlite:///{tmp}/ledger.db", None
        migrate.upgrade(url)
        Channel.queues.clear()
    sv = Served(url, broker, tiny_model, tmp)
    yield sv
    sv.close()
    if broker:
        flush_redis(broker)
        pg_databases.drop(url)
    else:
        Channel.queues.clear()


def _prompt_tokens(sv: Served, job: Job) -> int:
    return len(build_request(sv.worker.engine.tokenizer, job.endpoint, job.request)[0])


def _settled(sv: Served, job_id: str) -> Job:
    """The job once the worker wrote what its attempt used."""
    return Stack.wait(lambda: (j := sv.job(job_id)).status == JobStatus.cancelled and j.completion_tokens is not None
                      and j, 30, f"{job_id} settled")


def _assert_billed(sv: Served, tenant_id: str, job_ids: list[str], generated: int) -> None:
    """Usage, budget and the jobs' counts hold exactly what the engine computed for these jobs."""
    rows = [sv.job(j) for j in job_ids]
    assert all(r.status == JobStatus.cancelled for r in rows)
    assert sum(r.completion_tokens for r in rows) == generated > 0
    assert all(r.prompt_tokens == _prompt_tokens(sv, r) for r in rows if r.completion_tokens)
    prompt = sum(r.prompt_tokens for r in rows)
    with Session(sv.db) as s:
        usage = s.scalars(select(Usage).where(Usage.tenant_id == tenant_id)).all()
        tenant = s.get(Tenant, tenant_id)
    assert [(u.requests, u.prompt_tokens, u.completion_tokens) for u in usage] == \
        [(sum(1 for r in rows if r.prompt_tokens or r.completion_tokens), prompt, generated)]
    assert (tenant.budget_used, tenant.budget_reserved, tenant.running_count, tenant.queued_count) == \
        (prompt + generated, 0, 0, 0)


def _running(sv: Served, job_id: str) -> None:
    Stack.wait(lambda: sv.job(job_id).first_token_at is not None, 30, f"{job_id}'s first token")


def test_a_cancelled_running_job_is_billed_what_it_generated(served):
    sv = served
    sv.idle()
    tenant_id, headers = sv.tenant()
    before = sv.generated()
    job_id = requests.post(f"{sv.url}/v1/jobs", headers=headers, json={
        "prompt": "cancel me", "max_tokens": 1000, "ignore_eos": True}).json()["id"]
    _running(sv, job_id)
    r = requests.post(f"{sv.url}/v1/jobs/{job_id}/cancel", headers=headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    _settled(sv, job_id)
    sv.idle()
    _assert_billed(sv, tenant_id, [job_id], sv.generated() - before)
    usage = requests.get(f"{sv.url}/v1/jobs/{job_id}", headers=headers).json()["usage"]
    assert usage["completion_tokens"] == sv.job(job_id).completion_tokens     # the tenant sees what it is billed


def test_a_stream_whose_client_goes_away_is_billed_what_it_generated(served):
    sv = served
    sv.idle()
    tenant_id, headers = sv.tenant()
    before = sv.generated()
    with requests.post(f"{sv.url}/v1/chat/completions", headers=headers, stream=True, timeout=60, json={
            "messages": [{"role": "user", "content": "go away"}], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines(decode_unicode=True)
        first = next(ln for ln in lines if ln.startswith("data: "))
        next(lines)
    job_id = json.loads(first[6:])["id"]
    _settled(sv, job_id)
    sv.idle()
    _assert_billed(sv, tenant_id, [job_id], sv.generated() - before)


def test_a_cancelled_background_response_is_billed_what_it_generated(served):
    sv = served
    sv.idle()
    tenant_id, headers = sv.tenant()
    before = sv.generated()
    resp = requests.post(f"{sv.url}/v1/responses", headers=headers, json={
        "input": "in the background", "max_output_tokens": 1000, "background": True, "store": True,
        "temperature": 0}).json()
    with Session(sv.db) as s:
        job_id = s.scalar(select(Job.id).where(Job.tenant_id == tenant_id))
    _running(sv, job_id)
    r = requests.post(f"{sv.url}/v1/responses/{resp['id']}/cancel", headers=headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    _settled(sv, job_id)
    sv.idle()
    _assert_billed(sv, tenant_id, [job_id], sv.generated() - before)


def test_a_cancelled_batch_is_billed_what_its_running_jobs_generated(served):
    sv = served
    sv.idle()
    tenant_id, headers = sv.tenant()
    before = sv.generated()
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"long {i}", "max_tokens": 1000, "ignore_eos": True}}) for i in range(3)]
    f = requests.post(f"{sv.url}/v1/files", headers=headers, data={"purpose": "batch"},
                      files={"file": ("in.jsonl", io.BytesIO("\n".join(lines).encode()))}).json()
    batch = requests.post(f"{sv.url}/v1/batches", headers=headers, json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    with Session(sv.db) as s:
        ids = s.scalars(select(Job.id).where(Job.batch_id == batch["id"])).all()
    Stack.wait(lambda: sum(sv.job(j).status == JobStatus.running for j in ids) >= 2, 30, "two jobs running")
    Stack.wait(lambda: sv.generated() > before + 4, 30, "tokens generated")
    r = requests.post(f"{sv.url}/v1/batches/{batch['id']}/cancel", headers=headers)
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled"), r.text
    Stack.wait(lambda: all(sv.job(j).lease_token is None for j in ids), 30, "the batch's jobs settled")
    sv.idle()
    _assert_billed(sv, tenant_id, ids, sv.generated() - before)


# -- the races, step by step (Postgres + Redis) ---------------------------------------------------------------------

def _usage(st, tenant_id: str) -> list[tuple[int, int, int]]:
    with Session(st.engine) as s:
        return [(u.requests, u.prompt_tokens, u.completion_tokens)
                for u in s.scalars(select(Usage).where(Usage.tenant_id == tenant_id))]


def test_a_cancel_that_beats_the_completion_bills_the_whole_output_once(stack):
    st = stack
    tenant_id, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="raced", max_tokens=6, ignore_eos=True)
    w = _worker(st, "racer")
    try:
        assert w.pull()
        _run_engine(w)                       # finished in the engine; its result is not written yet
        with Session(st.engine) as s:        # the cancel lands first
            assert transitions.cancel(s, job_id)
            s.commit()
        [(inf, out)] = [(w.attempts.of_request(o.request_id), o) for o in w.attempts.drain(w.attempts.done)]
        assert w.results.write_results([(inf, out)]) == ["cancelled"]
        job = _job(st, job_id)
        assert (job.status, job.prompt_tokens, job.completion_tokens) == (JobStatus.cancelled, len(out.prompt_token_ids),
                                                                          6)
        assert _usage(st, tenant_id) == [(1, job.prompt_tokens, 6)]
        # the same result written again (a retry after an unknown commit outcome) bills nothing more
        assert w.results.write_results([(inf, out)]) == ["lost"]
        assert _usage(st, tenant_id) == [(1, job.prompt_tokens, 6)]
    finally:
        _close(w)


def test_a_completion_that_beats_the_cancel_is_billed_once_and_the_cancel_refused(stack):
    st = stack
    tenant_id, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="first", max_tokens=5, ignore_eos=True)
    w = _worker(st, "finisher")
    try:
        assert w.pull()
        _run_engine(w)
        w.finish_done()
        r = st.app.test_client().post(f"/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 409
        job = _job(st, job_id)
        assert (job.status, job.completion_tokens) == (JobStatus.completed, 5)
        assert _usage(st, tenant_id) == [(1, job.prompt_tokens, 5)]
    finally:
        _close(w)


def test_an_abort_seen_twice_bills_once(stack):
    st = stack
    tenant_id, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="twice aborted", max_tokens=500, ignore_eos=True)
    w = _worker(st, "aborter")
    try:
        assert w.pull()
        for _ in range(4):
            w.engine_step()
        with Session(st.engine) as s:
            assert transitions.cancel(s, job_id)
            s.commit()
        w.check_leases(renew=False)          # the worker learns of the cancel and aborts
        w.engine_step()
        [out] = w.attempts.drain(w.attempts.done)
        inf = w.attempts.of_request(out.request_id)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500
        assert w.results.write_results([(inf, out)]) == ["cancelled"]
        assert w.results.write_results([(inf, out)]) == ["cancelled"]      # redelivered: nothing more
        job = _job(st, job_id)
        assert (job.prompt_tokens, job.completion_tokens, job.lease_token) == \
            (len(out.prompt_token_ids), len(out.token_ids), None)
        assert _usage(st, tenant_id) == [(1, job.prompt_tokens, len(out.token_ids))]
    finally:
        _close(w)
