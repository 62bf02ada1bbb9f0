"""Prefix-affinity routing with real workers (service/ledger/affinity.py): a group sharing a long prefix goes to the
worker that already ran it, and a worker killed with work in its private queue loses nothing and repeats
nothing: beat returns its unacked messages and moves its private queue to the shared one."""
import io
import json
import signal
import time

from tidepool.service.ledger import fair
from tidepool.service.ledger.affinity import job_prefix_key, private_queue
from tidepool.service.ledger.models import Job, JobStatus

from .test_chaos import ledger_check

SYSTEM = ("You are the support assistant of a small bookshop. Answer briefly, politely and only about books, "
          "orders and opening hours. ") * 6          # ~700 characters shared by a group


def test_a_shared_prefix_group_goes_to_the_worker_holding_it(stack):
    st = stack
    tenant_id, key = st.tenant()
    for name in ("aff-a", "aff-b", "aff-c"):
        st.worker(name)
    first = st.submit(key, 1, prompt=SYSTEM + "Question 0?", sla_class="batch", max_tokens=2)[0]
    st.wait(lambda: st.count(Job.id == first, Job.status == JobStatus.completed), 60, "the first job done")
    holder = st.jobs(Job.id == first)[0].worker
    prefix = job_prefix_key(tenant_id, None, "/v1/completions", {"prompt": SYSTEM})
    st.wait(lambda: prefix in st.heartbeat(holder).get("prefixes", []), 30, "the holder advertising the prefix")
    hits_before = st.heartbeat(holder)["engine"]["prefix_cache_hits"]
    st.wait(lambda: all("prefixes" in st.heartbeat(n) for n in ("aff-a", "aff-b", "aff-c")), 30, "heartbeats")

    group = [st.app.test_client().post("/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json={
        "prompt": SYSTEM + f"Question {i}?", "sla_class": "batch", "max_tokens": 2}).get_json()["id"]
        for i in range(1, 9)]
    # a group of short prompts has no key: the shared queue, any worker
    others = st.submit(key, 6, sla_class="batch", max_tokens=2)
    st.wait(lambda: st.count(Job.id.in_(group + others), Job.status == JobStatus.completed) == 14, 90, "all done")
    assert {j.worker for j in st.jobs(Job.id.in_(group))} == {holder}
    # the group's prompts found the prefix in the holder's KV cache (the next heartbeat carries its stats)
    st.wait(lambda: st.heartbeat(holder)["engine"]["prefix_cache_hits"] > hits_before, 15, "prefix-cache hits")
    assert st.app.services.dispatcher.router.counts["private"] >= 8
    ledger_check(st.engine, set(group + others + [first]))


def test_a_killed_workers_private_queue_is_drained_and_every_job_completes_once(stack):
    st = stack
    _, key = st.tenant()
    st.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_REPUBLISH_AFTER=2, TIDEPOOL_BEAT_SCHEDULE=st.tmp / "beat")
    names = ("kill-a", "kill-b", "kill-c")
    # two seats and a low-water mark of one: each worker pulls slowly, so its group waits in its private queue
    procs = {n: st.worker(n, TIDEPOOL_MAX_NUM_SEQS=2, TIDEPOOL_LOW_WATER=1) for n in names}
    st.wait(lambda: all("prefixes" in st.heartbeat(n) for n in names), 30, "heartbeats")
    groups, per = 3, 12
    lines = b"".join(json.dumps({"custom_id": f"g{g}-{i}", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": f"Group {g}. " + SYSTEM + f"Line {i}.", "max_tokens": 24, "ignore_eos": True}}).encode() + b"\n"
        for i in range(per) for g in range(groups))     # interleaved: each group placed on its own worker
    client, headers = st.app.test_client(), {"Authorization": f"Bearer {key}"}
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=headers).get_json()
    b = client.post("/v1/batches", headers=headers, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                          "completion_window": "24h"}).get_json()
    assert b["status"] == "in_progress", b
    depths = {n: fair.lane_depth(st.redis, private_queue("batch", n)) for n in names}
    # routed, not shared: all but what the workers took already (each may have filled its two seats and, with a
    # low-water mark of one, one more waiting: a CI run saw 9 + 9 + 11 of 36 left) waits in the private queues
    assert sum(depths.values()) >= groups * per - 3 * len(names) and all(depths.values()), depths

    victim = names[0]
    st.wait(lambda: st.count(Job.worker == victim, Job.status == JobStatus.running) >= 1, 60, "victim busy",
            every=0.02)
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait()
    left = fair.lane_depth(st.redis, private_queue("batch", victim))
    assert left > 0, "the victim's private queue was empty at the kill: nothing to drain"
    time.sleep(0.5)
    held = {j.id for j in st.jobs(Job.worker == victim, Job.status == JobStatus.running)}
    st.wait(lambda: st.count(Job.batch_id == b["id"], Job.status == JobStatus.completed) == groups * per, 150,
            "the whole batch done", every=0.25)
    assert fair.lane_depth(st.redis, private_queue("batch", victim)) == 0        # moved to the shared queue by beat
    states = ledger_check(st.engine, {j.id for j in st.jobs()})
    assert states["completed"] == groups * per, states
    again = {j.id for j in st.jobs(Job.attempts != 1)}
    assert again == held and all(j.attempts == 2 for j in st.jobs(Job.id.in_(list(held)))), (again, held)
    by_worker = {}
    for j in st.jobs():
        by_worker[j.worker] = by_worker.get(j.worker, 0) + 1
    print(f"\naffinity kill: private depths after publish {depths}; victim {victim} killed with {left} waiting in "
          f"its private queue and {len(held)} running; completed by worker {by_worker}; ledger {states}")
