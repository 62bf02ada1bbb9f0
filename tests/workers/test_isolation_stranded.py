"""A worker killed between taking a message and claiming its job leaves the message only in Redis's unacked
set. Beat returns it to its queue as soon as the worker's heartbeat is gone (not after the 6 h visibility
timeout), and never while the worker is alive; the job then completes exactly once."""
import time

import pytest

from tidepool.service.ledger.models import JobStatus
from tidepool.workers import beat
from tidepool.workers.broker import OWNERS_KEY
from tidepool.service.ledger.snapshots import HEARTBEAT_KEY

from .test_intake import Killed, _close, _drop, _job, _run_engine, _worker


def _kill_between_take_and_claim(st, name: str):
    w = _worker(st, name)
    w._heartbeat()                            # a live worker: its heartbeat names its start

    def killed(*args, **kwargs):
        raise Killed

    w.intake.channel.Message = killed               # SIGKILL right after the take, before the claim
    with pytest.raises(Killed):
        w.pull()
    _drop(w)
    return w


def _complete_on_a_new_worker(st, job_id):
    w2 = _worker(st, "next")
    try:
        assert w2.pull()
        _run_engine(w2)
        w2.finish_done()
    finally:
        _close(w2)
    job = _job(st, job_id)
    assert (job.status, job.attempts, job.completion_tokens) == (JobStatus.completed, 1, 2)


def test_the_message_of_a_worker_whose_heartbeat_is_gone_returns_at_once(stack):
    st = stack
    _, key = st.tenant()
    beat.sweep(st.app.services)                        # broker epoch recorded
    [job_id] = st.submit(key, 1, prompt="stranded", max_tokens=2, ignore_eos=True)
    _kill_between_take_and_claim(st, "taker")
    assert st.redis.hlen("unacked") == 1 and st.redis.hlen(OWNERS_KEY) == 1
    assert _job(st, job_id).status == JobStatus.queued

    # the heartbeat is still there (it lapses a few seconds after the kill): nothing is touched
    assert beat.sweep(st.app.services, orphan_grace=0)["restored_orphans"] == 0
    assert st.redis.hlen("unacked") == 1
    st.redis.delete(HEARTBEAT_KEY.format("taker"))   # its TTL ran out
    done = beat.sweep(st.app.services, orphan_grace=0)
    assert (done["restored_orphans"], done["republished"]) == (1, 0)
    assert st.redis.llen("interactive") == 1 and not st.redis.hlen("unacked") and not st.redis.hlen(OWNERS_KEY)
    _complete_on_a_new_worker(st, job_id)


def test_a_restart_under_the_same_name_does_not_keep_the_old_messages(stack):
    st = stack
    _, key = st.tenant()
    beat.sweep(st.app.services)
    [job_id] = st.submit(key, 1, prompt="same name", max_tokens=2, ignore_eos=True)
    _kill_between_take_and_claim(st, "w1")
    time.sleep(0.01)
    again = _worker(st, "w1")                 # restarted with the same TIDEPOOL_WORKER_NAME
    try:
        again._heartbeat()
        assert beat.sweep(st.app.services, orphan_grace=0)["restored_orphans"] == 1
    finally:
        _close(again)
    _complete_on_a_new_worker(st, job_id)


def test_messages_of_live_workers_and_fresh_takes_are_left_alone(stack):
    st = stack
    _, key = st.tenant()
    beat.sweep(st.app.services)
    st.submit(key, 2, prompt="live", max_tokens=2)
    w = _worker(st, "alive")
    try:
        assert w.pull()
        assert st.redis.hlen(OWNERS_KEY) == 2
        # no heartbeat yet, but taken within the grace period
        assert beat.sweep(st.app.services)["restored_orphans"] == 0
        w._heartbeat()
        assert beat.sweep(st.app.services, orphan_grace=0)["restored_orphans"] == 0
        _run_engine(w)
        w.finish_done()                      # acked: their owner records are dropped by the next sweep
        beat.sweep(st.app.services, orphan_grace=0)
        assert not st.redis.hlen(OWNERS_KEY) and not st.redis.hlen("unacked")
    finally:
        _close(w)
