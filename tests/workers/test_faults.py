"""Nothing lost: kill -9 mid-job, graceful shutdown, a lost publish, a Redis restart; every job still
completes exactly once (usage counts each completion, so it catches a second one)."""
import signal

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from tidepool.service.ledger import fair
from tidepool.service.ledger.models import Job, JobStatus, Tenant, Usage
from tidepool.workers import beat

from .conftest import Stack, free_port, start_redis

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}   # still running when 20 are in flight


def _usage(st: Stack, tenant_id: str) -> Usage:
    with Session(st.engine) as s:
        return s.query(Usage).filter_by(tenant_id=tenant_id).one()


def _counters(st: Stack, tenant_id: str) -> tuple[int, int]:
    with Session(st.engine) as s:
        t = s.get(Tenant, tenant_id)
        return t.queued_count, t.running_count


def _sweep_until(st: Stack, cond, timeout=60, **kwargs):
    def step():
        beat.sweep(st.app.services, republish_after=0, **kwargs)
        return cond()
    return st.wait(step, timeout, "sweeper recovery", every=0.5)


def _all_completed(st: Stack, ids):
    return st.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids)


def _by_status(st: Stack) -> dict:
    return {s.value: st.count(Job.status == s) for s in JobStatus}


def _unfinished(st: Stack, ids) -> list:
    return [(j.id, j.status.value, j.attempts, j.worker, j.dispatched_at, j.lease_expires_at)
            for j in st.jobs(Job.id.in_(ids), Job.status != JobStatus.completed)]


def test_kill_9_with_jobs_in_flight_then_restart_completes_each_once(stack):
    st = stack
    tenant_id, key = st.tenant()
    beat.sweep(st.app.services)                               # first sweep: broker epoch recorded
    ids = st.submit(key, 24, **LONG)                 # queued first: the worker takes them all at once
    worker = st.worker("crash-1", TIDEPOOL_LEASE_SECONDS=2, TIDEPOOL_MAX_NUM_SEQS=32)
    try:
        st.wait(lambda: st.count(Job.status == JobStatus.running) >= 20, 60, ">= 20 jobs in flight", every=0.02)
    except AssertionError:
        raise AssertionError(f"never >= 20 jobs in flight; ledger {_by_status(st)}") from None
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    in_flight = {j.id for j in st.jobs(Job.status == JobStatus.running)}
    assert len(in_flight) >= 20 and st.count(Job.status == JobStatus.completed) < 24, _by_status(st)

    # leases lapse -> the sweeper requeues and republishes, and returns the dead consumer's unacked
    # messages (also one it had taken but not yet claimed) to the queue; a new worker finishes everything
    _sweep_until(st, lambda: st.count(Job.status == JobStatus.running) == 0 and not st.redis.hlen("unacked"),
                 visibility_timeout=1)
    st.worker("crash-2")
    # no sweeping from here on: every job crash-2 takes must end in its own ledger write
    try:
        st.wait(lambda: _all_completed(st, ids), 90, "all jobs completed")
    except AssertionError:
        raise AssertionError(f"not completed: {_unfinished(st, ids)}; ledger {_by_status(st)}") from None
    for job in st.jobs(Job.id.in_(ids)):
        state = (job.id in in_flight, job.attempts, job.worker, job.completion_tokens, job.error)
        assert job.completion_tokens == LONG["max_tokens"] and job.worker in ("crash-1", "crash-2"), state
        # one attempt, or two when crash-1 had claimed it (a claim or a completion sent just before the
        # kill can still land after `in_flight` was read)
        expected = {1} if job.worker == "crash-1" else {2} if job.id in in_flight else {1, 2}
        assert job.attempts in expected, state
    usage = _usage(st, tenant_id)
    assert usage.requests == 24 and usage.completion_tokens == 24 * LONG["max_tokens"]
    assert _counters(st, tenant_id) == (0, 0)


def test_sigterm_releases_running_jobs_back_to_the_queue(stack):
    st = stack
    tenant_id, key = st.tenant()
    worker = st.worker("term-1", TIDEPOOL_DRAIN_GRACE_S=0)     # no grace: the drain hands everything back at once
    ids = st.submit(key, 4, **{**LONG, "max_tokens": 300})
    st.wait(lambda: st.count(Job.status == JobStatus.running) == 4, 30, "running")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    rows = st.jobs(Job.id.in_(ids))
    assert all(j.status == JobStatus.queued and j.attempts == 0 and j.dispatched_at for j in rows)
    assert st.redis.llen("interactive") == 4          # the messages went back to the broker, unacked
    st.worker("term-2")
    st.wait(lambda: _all_completed(st, ids), 90, "completed by the next worker")
    assert {j.attempts for j in st.jobs(Job.id.in_(ids))} == {1}
    assert _usage(st, tenant_id).requests == 4


def test_lost_publish_is_recovered_by_the_beat_process(stack):
    st = stack
    _, key = stack.tenant()
    ids = st.submit(key, 3, prompt="lost", max_tokens=4)
    st.redis.delete("interactive")                    # the publish "never happened"
    with st.engine.begin() as conn:
        conn.execute(update(Job).where(Job.id.in_(ids)).values(dispatched_at=None))
    st.worker("lost-1")
    st.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_REPUBLISH_AFTER=0,
             TIDEPOOL_BEAT_SCHEDULE=st.tmp / "beat-schedule")
    st.wait(lambda: _all_completed(st, ids), 60, "republished and completed")
    assert all(j.attempts == 1 for j in st.jobs(Job.id.in_(ids)))


def test_cpu_worker_takes_deferrable_only(stack):
    st = stack
    _, key = stack.tenant()
    deferrable = st.submit(key, 3, sla_class="deferrable", max_tokens=4)
    interactive = st.submit(key, 1, max_tokens=4)
    st.worker("cpu-1", kind="cpu")
    st.wait(lambda: _all_completed(st, deferrable), 60, "deferrable done")
    assert {j.worker for j in st.jobs(Job.id.in_(deferrable))} == {"cpu-1"}
    assert st.jobs(Job.id.in_(interactive))[0].status == JobStatus.queued
    assert st.app.services.dispatcher.queue_depths()["interactive"] == 1


@pytest.fixture
def private_redis(tmp_path):
    port = free_port()

    class Server:
        url = f"redis://127.0.0.1:{port}/0"

        def start(self):
            self.proc = start_redis(port, tmp_path)

        def restart(self):
            self.proc.kill()
            self.proc.wait()
            self.start()

    server = Server()
    server.start()
    yield server
    server.proc.kill()
    server.proc.wait()


def test_redis_restart_mid_run_loses_no_accepted_job(pg_url, tiny_model, tmp_path, private_redis):
    st = Stack(pg_url, tiny_model, tmp_path, redis_url=private_redis.url)
    try:
        tenant_id, key = st.tenant()
        other_id, other_key = st.tenant()             # two tenants: the fair take sorts them apart
        beat.sweep(st.app.services)                            # broker epoch recorded
        st.worker("restart-1", TIDEPOOL_MAX_NUM_SEQS=4, TIDEPOOL_LOW_WATER=1)
        # 24 jobs for 4 seats: several waves must still wait in the broker when the first completion is seen,
        # even when the tiny model finishes waves between two polls (12 x 40 tokens left none once, on a fast CPU)
        ids = [j for k in (key, other_key) for j in st.submit(k, 12, sla_class="batch", **{**LONG, "max_tokens": 100})]
        st.wait(lambda: st.count(Job.status == JobStatus.completed) >= 1, 60, "first completion")
        assert fair.lane_depth(st.redis, "batch") > 0             # offline work still waits in the broker
        private_redis.restart()                       # no persistence: every queued message is gone
        assert fair.lane_depth(st.redis, "batch") == 0
        _sweep_until(st, lambda: _all_completed(st, ids), 120)
        assert all(j.attempts == 1 for j in st.jobs(Job.id.in_(ids)))
        assert _usage(st, tenant_id).requests == _usage(st, other_id).requests == 12
    finally:
        st.close()



def test_output_with_nul_characters_is_stored_on_postgres(stack):
    """Byte-level tokens can decode to NUL, which Postgres text refuses; the worker's result must still land."""
    from tidepool.service.ledger import jobs
    from tidepool.workers.attempt import ledger_text
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="nul", max_tokens=4)
    with Session(st.engine) as s:
        started = jobs.start(s, job_id, "w", 30)
        s.commit()
    with Session(st.engine) as s:
        assert jobs.complete(s, job_id, started.lease_token, output=ledger_text("a\x00b"), output_token_ids=[1, 0, 2],
                             prompt_tokens=1, completion_tokens=3, finish_reason="length")
        s.commit()
    [job] = st.jobs(Job.id == job_id)
    assert job.status == JobStatus.completed and job.output == "a\ufffdb"
