"""Online and offline in one continuous batch: while offline work saturates the worker, realtime
requests are admitted at once and preempt offline sequences. Asserted from ledger timings, the broker
and the worker's engine stats, not from wall-clock thresholds."""
import threading

import openai

from tidepool.service.ledger import fair
from tidepool.service.ledger.models import Job, JobStatus, SlaClass

OFFLINE = 20
MAX_SEQS, LOW_WATER = 4, 3


def test_realtime_jumps_offline_backlog_and_preempts_it(stack):
    st = stack
    st.serve()
    _, key = st.tenant()
    st.worker("mixed", TIDEPOOL_MAX_NUM_SEQS=MAX_SEQS, TIDEPOOL_LOW_WATER=LOW_WATER)
    # Online work has just been here, so the engine is not quiet (workers/engine/pace.py): its offline steps keep the
    # idle cap and the reserve holds, the state in which a realtime request meets a standing offline backlog. (A
    # quiet engine's budget-sized steps are covered by tests/engine/test_step_cut.py.)
    warm = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60)
    warm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "warm"}], max_tokens=2,
                                 temperature=0, extra_body={"sla_class": "realtime"})
    offline = [st.submit(key, 1, sla_class="batch", max_tokens=200 + 8 * i, ignore_eos=True, temperature=0)[0]
               for i in range(OFFLINE)]     # staggered lengths: offline sequences don't finish in lockstep

    peak = {"running": 0}
    stop = threading.Event()

    def sample():     # how many offline jobs the worker holds at once (claimed = running in the ledger)
        while not stop.is_set():
            peak["running"] = max(peak["running"], st.count(Job.sla_class == SlaClass.batch,
                                                            Job.status == JobStatus.running))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    st.wait(lambda: st.count(Job.sla_class == SlaClass.batch, Job.status == JobStatus.running) >= MAX_SEQS,
            30, "offline saturating the worker", every=0.02)
    backlog = fair.lane_depth(st.redis, "batch")
    assert backlog > 0                      # unstarted offline work stays in the broker

    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60)
    realtime = []

    def ask(i):
        r = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"now {i}"}],
                                       max_tokens=8, temperature=0, extra_body={"sla_class": "realtime"})
        if r.usage.completion_tokens == 8:
            realtime.append(r.id)

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(60)
    assert len(realtime) == 3
    st.wait(lambda: st.count(Job.id.in_(offline), Job.status == JobStatus.completed) == OFFLINE, 120,
            "offline done")
    stop.set()
    sampler.join()

    off = st.jobs(Job.id.in_(offline))
    for rt in st.jobs(Job.id.in_(realtime)):
        assert rt.sla_class == SlaClass.realtime and rt.status == JobStatus.completed
        # offline jobs queued before it started after it: the realtime request jumped the backlog
        jumped = [o for o in off if o.queued_at < rt.queued_at and o.started_at > rt.started_at]
        assert jumped, "realtime waited behind offline work"
        # and it finished while offline work was still in flight
        assert any(o.started_at < rt.started_at and o.finished_at > rt.finished_at for o in off)
    # realtime waited less for its first token than offline jobs waited to start, on average
    rt_ttft = [(j.first_token_at - j.queued_at).total_seconds() for j in st.jobs(Job.id.in_(realtime))]
    off_wait = [(o.started_at - o.queued_at).total_seconds() for o in off]
    assert max(rt_ttft) < sum(off_wait) / len(off_wait)

    stats = st.wait(lambda: (h := st.heartbeat("mixed")) and h["completed"] >= OFFLINE + 3 and h, 10, "heartbeat")
    assert stats["preempted_by_class"]["batch"] > 0 and stats["preempted_by_class"]["realtime"] == 0
    assert stats["engine"]["preemptions"] >= stats["preempted_by_class"]["batch"]
    # offline pulled only below the low-water mark: never more than the engine's slots plus that
    assert peak["running"] <= MAX_SEQS + LOW_WATER + 1    # + one finished in the engine, not yet in the ledger
    print(f"offline backlog in broker at realtime arrival: {backlog}; realtime TTFT max {max(rt_ttft)*1000:.0f} ms;"
          f" offline mean wait to start {sum(off_wait) / len(off_wait) * 1000:.0f} ms;"
          f" batch preemptions {stats['preempted_by_class']['batch']}; peak offline claimed {peak['running']}")
