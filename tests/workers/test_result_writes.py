"""A wave of finished attempts is written to the ledger in chunks, online results first, and the online queues are
pulled between two chunks: a realtime job that arrives while offline results are being written is claimed before
the rest of the wave is written. Driven step by step (no threads, no timing) over the real ledger and broker; the
order is read from the ledger writes and claims themselves. A worker killed between two chunks loses nothing: what
was written stays written once, the rest runs again."""
from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from tidepool.service.ledger import jobs as transitions
from tidepool.service.ledger.models import Job, JobStatus, utcnow
from tidepool.workers import beat

from .test_intake import Killed, _close, _drop, _job, _run_engine, _worker

CHUNK = 2


def _take_all(w) -> None:
    while w.pull():     # offline messages come one per pass
        pass


def _record(w, monkeypatch, events: list, after_first_write=None) -> None:
    """events gets ("write", job ids) for each results transaction and ("claim", job id) for each claim."""
    write, real_claim = w.results.write_results, transitions.claim

    def write_results(done):
        statuses = write(done)
        events.append(("write", [inf.job_id for inf, _ in done]))
        if after_first_write is not None and len(events) == 1:
            after_first_write()
        return statuses

    def claim(engine, job_id, *args, **kwargs):
        events.append(("claim", job_id))
        return real_claim(engine, job_id, *args, **kwargs)

    monkeypatch.setattr(w.results, "write_results", write_results)
    monkeypatch.setattr("tidepool.service.ledger.jobs.claim", claim)


def test_a_realtime_job_arriving_during_a_wave_of_results_is_claimed_after_one_chunk(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    monkeypatch.setattr("tidepool.workers.results.RESULT_CHUNK", CHUNK)
    offline = st.submit(key, 5, prompt="wave", max_tokens=2, ignore_eos=True, sla_class="batch")
    [early] = st.submit(key, 1, prompt="early", max_tokens=2, ignore_eos=True, sla_class="realtime")
    w = _worker(st, "w")
    try:
        _take_all(w)
        assert set(w.inflight) == {*offline, early}
        _run_engine(w)                        # the whole wave finishes in the same steps
        late = []
        events = []
        _record(w, monkeypatch, events, after_first_write=lambda: late.extend(
            st.submit(key, 1, prompt="late", max_tokens=2, ignore_eos=True, sla_class="realtime")))
        assert w.finish_done()
        [late_id] = late
        writes = [ids for kind, ids in events if kind == "write"]
        # online results first; the late arrival claimed right after the first chunk, before the rest
        assert writes[0][0] == early and all(len(ids) <= CHUNK for ids in writes)
        assert events[1] == ("claim", late_id), events
        assert sorted(i for ids in writes for i in ids) == sorted([early, *offline])
        assert _job(st, late_id).status == JobStatus.running and late_id in w.inflight
        assert all(_job(st, i).status == JobStatus.completed for i in [early, *offline])
        assert st.redis.hlen("unacked") == 1     # only the late job's message: the others are acked
        _run_engine(w)
        w.finish_done()
        job = _job(st, late_id)
        assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 1, 2)
        assert w.counters["completed"] == 7 and not st.redis.hlen("unacked")
    finally:
        _close(w)


def test_a_worker_killed_between_two_chunks_leaves_each_job_completed_once(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    monkeypatch.setattr("tidepool.workers.results.RESULT_CHUNK", CHUNK)
    ids = st.submit(key, 5, prompt="killed", max_tokens=3, ignore_eos=True, sla_class="batch")
    w = _worker(st, "w")
    events = []
    _take_all(w)
    _run_engine(w)
    _record(w, monkeypatch, events)

    def killed():
        raise Killed

    monkeypatch.setattr(w.results, "between_chunks", killed)
    with pytest.raises(Killed):
        w.finish_done()                       # the first chunk committed and acked, then SIGKILL
    _drop(w)
    monkeypatch.undo()
    [(_, written)] = events
    rest = [i for i in ids if i not in written]
    assert all(_job(st, i).status == JobStatus.completed for i in written)
    assert all(_job(st, i).status == JobStatus.running for i in rest)
    assert st.redis.hlen("unacked") == len(rest)     # their messages wait for the sweeper

    # the leases lapse: the sweeper requeues and republishes the rest, another worker runs them
    with Session(st.engine) as s:
        s.execute(update(Job).where(Job.id.in_(rest)).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
    assert beat.sweep(st.app.services, republish_after=0, visibility_timeout=0)["reclaimed"] == len(rest)
    w2 = _worker(st, "w2")
    try:
        _take_all(w2)
        _run_engine(w2)
        w2.finish_done()
        for i in ids:
            job = _job(st, i)
            assert (job.status, job.completion_tokens, job.attempts) == \
                (JobStatus.completed, 3, 1 if i in written else 2), i
        w2.pull()      # the copies the sweeper republished (held while the first ran) are dropped and acked
        assert (w2.counters["completed"], w2.counters["dropped"]) == (len(rest), len(rest))
        assert not st.redis.hlen("unacked")
    finally:
        _close(w2)
        _close(w)      # the dead worker's socket (the sweeper took its unacked entries: nothing is restored)
