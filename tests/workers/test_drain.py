"""Drain on scale-down (workers/worker.py Worker.drain): a real `tidepool worker` told to stop with SIGTERM in the
middle of a batch takes nothing new, hands the offline work its engine has not started back to the queue at once,
finishes what it runs for TIDEPOOL_DRAIN_GRACE_S, hands back what still runs then, and exits inside the grace
period. Another worker finishes the rest; the ledger check finds every job completed once, billed once, and no
attempt counted for a hand-back."""
import json
import re
import signal
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tidepool.service.ledger.models import Job, JobStatus

from .test_chaos import ledger_check

GRACE = 1.0
SLACK = 5.0      # workers/worker.py DRAIN_SLACK


def test_a_worker_told_to_stop_mid_batch_drains_and_loses_nothing(stack):
    st = stack
    t0 = time.monotonic()
    _, key = st.tenant()
    drained = st.worker("drain-a", TIDEPOOL_DRAIN_GRACE_S=GRACE, TIDEPOOL_MAX_NUM_SEQS=2, TIDEPOOL_LOG_LEVEL="INFO")
    ids = []
    for i in range(6):    # short jobs finish inside the grace period, long ones do not
        ids += st.submit(key, 1, sla_class="batch", max_tokens=8, ignore_eos=True)
        ids += st.submit(key, 1, sla_class="batch", max_tokens=400, ignore_eos=True)
    st.wait(lambda: st.count(Job.worker == "drain-a", Job.status == JobStatus.running) >= 2, 60, "drain-a busy",
            every=0.02)
    t_term, wall_term = time.monotonic(), datetime.now(timezone.utc)
    print(f"\nbusy after {t_term - t0:.1f} s")
    drained.send_signal(signal.SIGTERM)
    st.start("worker", "--kind", "gpu", "--device", "cpu", TIDEPOOL_WORKER_NAME="drain-b", TIDEPOOL_LEASE_SECONDS=4)
    assert drained.wait(GRACE + SLACK + 15) == 0
    took = time.monotonic() - t_term
    # drain-a gone, drain-b not yet taking work: every job completed, or queued with its message on the broker
    if not st.heartbeat("drain-b"):
        done = st.count(Job.id.in_(ids), Job.status == JobStatus.completed)
        queued = st.count(Job.id.in_(ids), Job.status == JobStatus.queued)
        assert done + queued == len(ids)
        assert sum(st.app.services.dispatcher.queue_depths().values()) == queued
    print(f"exited after {took:.1f} s")
    st.wait(lambda: st.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids), 90,
            "every job completed", every=0.25)
    print(f"all done after {time.monotonic() - t_term:.1f} s")
    states = ledger_check(st.engine, set(ids))
    assert states["completed"] == len(ids), states
    jobs = st.jobs(Job.id.in_(ids))
    assert {j.attempts for j in jobs} == {1}, "a hand-back counted as an attempt"
    mine = [j for j in jobs if j.worker == "drain-a"]
    # a pull under way when the signal came may still claim (the handler runs between two statements); none after
    assert all(j.started_at < wall_term + timedelta(seconds=0.5) for j in mine), "drain-a took work while draining"
    line = next(ln for ln in Path(drained.log_path).read_text().splitlines() if "drained in" in ln)
    report = json.loads(re.search(r"drained in [0-9.]+ s: (\{[^}]*\})", json.loads(line)["msg"]).group(1)
                        .replace("'", '"'))
    assert report["seconds"] <= GRACE + SLACK and took <= GRACE + SLACK + 15
    assert report["at_once"] + report["at_deadline"] >= 1, report        # handed back: not started, or too long
    finished_in_grace = [j for j in mine if j.finished_at >= wall_term]
    print(f"\ndrain: exited {took:.1f} s after SIGTERM ({report}); finished in the grace period "
          f"{len(finished_in_grace)}, by drain-a in all {len(mine)}, by drain-b {len(jobs) - len(mine)}")
