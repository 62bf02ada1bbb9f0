"""Where a claim is more than one statement (SQLite: it waits for the write lock), an online job enters the engine
before its claim commits (the claim overlaps the prefill), driven step by step here on a worker told to claim that
way (Postgres claims in one statement that also reads the job, so there is nothing to overlap): nothing of the attempt reaches the token stream before the claim succeeded, and an attempt whose claim
is refused leaves no trace (no stream event, no ledger write, its message acked)."""
from sqlalchemy.orm import Session

from tidepool.service.ledger import jobs as transitions
from tidepool.service.ledger.models import Job, JobStatus
from tidepool.service.ledger import token_stream

from .test_intake import _close, _job, _run_engine, _step, _worker


def _events(sub) -> list[dict]:
    out = []
    while (ev := sub.get(0.2)) is not None:
        out.append(ev)
    return out


def test_tokens_made_before_the_claim_commits_are_streamed_after_it(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="early", max_tokens=4, ignore_eos=True, sla_class="realtime", logprobs=1)
    w = _worker(st, "w")
    w.intake.one_statement_claims = False
    sub = token_stream.for_redis(st.redis).subscribe(job_id)
    real_start, seen = transitions.start, {}

    def start(s, *args, **kwargs):
        _step(w)                                  # the prefill runs while the claim is on its way
        [inf] = w.inflight.values()
        seen.update(claimed=inf.claimed, held=len(inf.held), events=_events(sub),
                    status=_job(st, job_id).status)
        return real_start(s, *args, **kwargs)

    monkeypatch.setattr("tidepool.service.ledger.jobs.start", start)
    try:
        assert w.pull()
        assert seen == {"claimed": False, "held": 1, "events": [], "status": JobStatus.queued}
        job = _job(st, job_id)
        assert job.status == JobStatus.running and job.lease_token == w.inflight[job_id].lease_token
        _run_engine(w)
        w.finish_done()
        events = _events(sub)
        toks = [e for e in events if e["t"] == "tok"]
        assert events[-1]["t"] == "end" and events[-1]["status"] == "completed"
        assert events[-1]["r"]["output"] == _job(st, job_id).output
        job = _job(st, job_id)
        assert "".join(e["d"] for e in toks) == job.output and toks[0]["p"] == 0
        assert job.status == JobStatus.completed and job.started_at <= job.first_token_at <= job.finished_at
    finally:
        sub.close()
        _close(w)


def test_an_attempt_whose_claim_is_refused_leaves_no_trace(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    [job_id] = st.submit(key, 1, prompt="refused", max_tokens=4, ignore_eos=True, sla_class="realtime")
    w = _worker(st, "w")
    w.intake.one_statement_claims = False
    sub = token_stream.for_redis(st.redis).subscribe(job_id)
    real_start = transitions.start

    def start(s, *args, **kwargs):
        _step(w)                                  # a first token exists already
        with Session(st.engine) as other:         # the client went away meanwhile
            assert transitions.cancel(other, job_id)
            other.commit()
        return real_start(s, *args, **kwargs)

    monkeypatch.setattr("tidepool.service.ledger.jobs.start", start)
    try:
        assert w.pull()
        assert w.inflight[job_id].dropped and w.counters["dropped"] == 1
        assert not st.redis.hlen("unacked")       # acked: nothing left to run
        _run_engine(w)                            # the engine drops it (abort)
        w.finish_done()
        assert w.inflight == {} and w.counters["completed"] == w.counters["aborted"] == 0
        assert _events(sub) == []
        job = _job(st, job_id)
        assert (job.status, job.attempts, job.started_at, job.output) == (JobStatus.cancelled, 0, None, None)
    finally:
        sub.close()
        _close(w)


def test_offline_jobs_are_claimed_before_they_enter_the_engine(stack, monkeypatch):
    st = stack
    _, key = st.tenant()
    st.submit(key, 1, prompt="offline", max_tokens=2, sla_class="batch")
    w = _worker(st, "w")
    real_claim, seen = transitions.claim, []

    def claim(*args, **kwargs):
        seen.append(dict(w.inflight))
        return real_claim(*args, **kwargs)

    monkeypatch.setattr("tidepool.service.ledger.jobs.claim", claim)
    try:
        assert w.pull()
        assert seen == [{}] and len(w.inflight) == 1
        _run_engine(w)
        w.finish_done()
        assert st.count(Job.status == JobStatus.completed) == 1
    finally:
        _close(w)
