"""A worker whose engine is a tensor-parallel group (TIDEPOOL_TENSOR_PARALLEL_SIZE=2: rank 0 in the worker process,
rank 1 its child) completes jobs through the ledger; kill -9 of rank 1 ends the worker within the collective
timeout, non-zero, and its jobs complete once on the next worker; kill -9 of the worker takes its rank with it."""
import signal
import time

import psutil
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Job, JobStatus, Usage
from tidepool.workers import beat

from .test_faults import _sweep_until

LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
TIMEOUT_S = 8


def ranks_of(worker) -> list[psutil.Process]:
    return [p for p in psutil.Process(worker.pid).children(recursive=True) if "follower_main" in " ".join(p.cmdline())]


def test_a_tp2_worker_serves_jobs_a_killed_rank_loses_none_and_runs_none_twice_and_a_killed_worker_ends_its_rank(
        stack):
    st = stack
    tenant_id, key = st.tenant()
    beat.sweep(st.app.services)
    tp = dict(TIDEPOOL_TENSOR_PARALLEL_SIZE=2, TIDEPOOL_COLLECTIVE_TIMEOUT_S=TIMEOUT_S, TIDEPOOL_LEASE_SECONDS=2)
    worker = st.worker("tp-1", **tp)
    first = st.submit(key, 3, prompt="hello", max_tokens=8, temperature=0)
    st.wait(lambda: st.count(Job.id.in_(first), Job.status == JobStatus.completed) == 3, 60, "first jobs")
    (rank1,) = ranks_of(worker)

    ids = st.submit(key, 6, **LONG)
    st.wait(lambda: st.count(Job.id.in_(ids), Job.status == JobStatus.running) >= 4, 60, "jobs in flight")
    rank1.send_signal(signal.SIGKILL)
    started = time.monotonic()
    code = worker.wait(TIMEOUT_S + 20)
    assert code != 0 and time.monotonic() - started < TIMEOUT_S + 20
    _sweep_until(st, lambda: st.count(Job.status == JobStatus.running) == 0 and not st.redis.hlen("unacked"),
                 visibility_timeout=1)

    again = st.worker("tp-2", **tp)
    st.wait(lambda: st.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids), 120, "completed")
    for job in st.jobs(Job.id.in_(ids)):
        assert job.completion_tokens == LONG["max_tokens"] and job.attempts in (1, 2), (job.id, job.attempts)
    with Session(st.engine) as s:
        usage = s.query(Usage).filter_by(tenant_id=tenant_id).one()
    assert usage.requests == 9 and usage.completion_tokens == 3 * 8 + 6 * LONG["max_tokens"]

    (rank1,) = ranks_of(again)           # kill -9 of the worker takes its rank with it
    again.send_signal(signal.SIGKILL)
    again.wait()
    rank1.wait(10)                       # psutil.TimeoutExpired if it outlives its parent
