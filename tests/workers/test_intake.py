"""The worker's intake driven step by step (no threads) over the real ledger and broker, to force the
interleavings that the process tests hit only by chance: every job a worker takes ends in a guarded
ledger write, a release back to the queue, or a message the sweeper can return to the queue."""
from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from tidepool.service.ledger.database import make_engine
from tidepool.service.ledger.models import Job, JobStatus, utcnow
from tidepool.workers import beat, broker
from tidepool.workers.worker import Worker, WorkerConfig


def _worker(st, name: str) -> Worker:
    """A worker driven step by step; it hears this process's doorbell (the app, the sweeper and its own requeues ring
    it), so its pulls look at the queues rung since they were found empty."""
    w = Worker(WorkerConfig(model=st.model, database_url=st.db_url, broker_url=st.redis_url, redis_url=st.redis_url,
                            device="cpu", name=name, lease_seconds=30))
    w.connect()
    return w


def _close(w: Worker) -> None:
    w.close()


def _drop(w: Worker) -> None:
    """What kill -9 leaves behind: nothing restored, nothing released."""
    w.db.dispose()


def _step(w: Worker) -> None:
    """One pass of the engine thread's loop."""
    w.engine_step()


def _run_engine(w: Worker) -> None:
    """The engine thread's loop, until the engine has nothing left."""
    while w.engine.has_unfinished():
        _step(w)


def _job(st, job_id: str) -> Job:
    [job] = st.jobs(Job.id == job_id)
    return job


def _lapse(st, job_id: str) -> None:
    """The lease lapses and the sweeper requeues and republishes the job."""
    with Session(st.engine) as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
    done = beat.sweep(st.app.services, republish_after=0)
    assert done["reclaimed"] == 1 and done["republished"] == 1, done


class Killed(BaseException):
    """SIGKILL at this point: nothing after it runs."""


def test_a_message_taken_by_a_worker_killed_before_it_claims_returns_to_the_queue(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    beat.sweep(st.app.services)                          # broker epoch recorded: a later sweep republishes nothing
    [job_id] = st.submit(key, 1, prompt="taken", max_tokens=2)
    w = _worker(st, "taker")

    def killed(*args, **kwargs):
        broker.take(*args, **kwargs)
        raise Killed

    # killed right after the broker handed the message over, before the worker could claim the job
    monkeypatch.setattr("tidepool.workers.intake.take", killed)
    with pytest.raises(Killed):
        w.pull()
    _drop(w)
    monkeypatch.undo()
    assert _job(st, job_id).status == JobStatus.queued

    # the sweeper returns a dead consumer's unacked messages to their queues; the next worker claims it
    assert beat.sweep(st.app.services, visibility_timeout=0)["republished"] == 0
    w2 = _worker(st, "next")
    try:
        assert w2.pull()
        job = _job(st, job_id)
        assert (job.status, job.worker, job.attempts) == (JobStatus.running, "next", 1)
        _run_engine(w2)
        w2.finish_done()
        job = _job(st, job_id)
        assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 1, 2)
    finally:
        _close(w2)


def test_an_abort_meant_for_a_lapsed_attempt_never_hits_the_next_one(stack):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="stale abort", max_tokens=3, ignore_eos=True)
    w = _worker(st, "w")
    try:
        assert w.pull()                       # attempt 1 claimed and in the engine
        _run_engine(w)                         # ... and finished there; its result waits for the intake
        _lapse(st, job_id)                     # meanwhile its lease lapsed: requeued and republished
        w.check_leases(renew=True)            # the intake notices and aborts attempt 1 (already gone)
        w.finish_done()                       # attempt 1's result is refused by the ledger (lease gone)
        assert _job(st, job_id).status == JobStatus.queued
        assert w.pull()                       # the republished message: attempt 2
        job = _job(st, job_id)
        assert (job.status, job.attempts) == (JobStatus.running, 2)
        _run_engine(w)
        w.finish_done()
        job = _job(st, job_id)
        assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 2, 3), \
            (job.status, w.counters)
        assert not w.inflight and (w.counters["completed"], w.counters["dropped"]) == (1, 1)
    finally:
        _close(w)


def test_an_abort_the_worker_did_not_ask_for_hands_the_job_back(stack):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="engine abort", max_tokens=3, ignore_eos=True)
    w = _worker(st, "w")
    try:
        assert w.pull()
        _step(w)
        [request_id] = w.engine.requests
        w.engine.abort(request_id)             # not a cancellation: the lease is still current
        _run_engine(w)
        w.finish_done()
        job = _job(st, job_id)
        assert (job.status, job.attempts, job.worker) == (JobStatus.queued, 0, None) and job.dispatched_at
        assert w.pull()                       # its message went back to the broker with it
        _run_engine(w)
        w.finish_done()
        job = _job(st, job_id)
        assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 1, 3)
    finally:
        _close(w)


def test_a_job_the_worker_cannot_start_fails_at_once(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="bug", max_tokens=2)
    w = _worker(st, "w")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the request mapping")

    monkeypatch.setattr("tidepool.workers.intake.build_request", broken)
    try:
        assert w.pull()
        job = _job(st, job_id)
        assert (job.status, job.error["code"], w.inflight) == (JobStatus.failed, "internal_error", {})
        assert not st.redis.hlen("unacked")     # acked
    finally:
        _close(w)


def test_a_message_whose_claim_fails_goes_back_to_the_queue(stack):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="ledger down", max_tokens=2)
    w = _worker(st, "w")
    ledger, w.db = w.db, make_engine("postgresql+psycopg://postgres@127.0.0.1:9/none?connect_timeout=1")
    try:
        with pytest.raises(OperationalError):
            w.pull()                           # the ledger is unreachable
        assert st.redis.llen("interactive") == 1 and not st.redis.hlen("unacked")
        w.db.dispose()
        w.db = ledger                           # back again: the message is still there to claim
        assert w.pull()
        assert _job(st, job_id).status == JobStatus.running
    finally:
        _close(w)
