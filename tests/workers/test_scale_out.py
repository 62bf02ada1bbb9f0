"""Several workers on one queue set: three gpu-kind workers and a cpu worker share one Postgres and one
Redis; a 2,000-line batch plus online traffic is spread over them, one is killed with -9 halfway and
restarted, another is drained with SIGTERM under load. Each ends in the ledger check: every accepted job
terminal once, usage equal to the completed work, attempts only where a dead worker held the job."""
import io
import json
import signal
import threading
import time

import requests
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Batch, BatchStatus, Job, JobStatus

from .conftest import Stack
from .test_chaos import ledger_check

GPU = ("scale-a", "scale-b", "scale-c")
LINES = 2000


class Online:
    """Online completions from two client threads, each answer's time and status kept."""

    def __init__(self, url: str, key: str, **body):
        self.url, self.headers, self.body = url, {"Authorization": f"Bearer {key}"}, body
        self.served: list[tuple[float, int, str | None]] = []     # (finished at, status, job id)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                r = requests.post(f"{self.url}/v1/completions", headers=self.headers, timeout=60,
                                  json={"prompt": f"online {i}", "max_tokens": 4, "ignore_eos": True, **self.body})
                self.served.append((time.monotonic(), r.status_code, r.json().get("id")))
            except requests.RequestException as exc:
                self.served.append((time.monotonic(), 0, repr(exc)))
            self.stop.wait(0.2)

    def between(self, t0: float, t1: float) -> list[int]:
        return [code for at, code, _ in self.served if t0 <= at < t1]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(90)


def _batch(st: Stack, key: str, n: int) -> str:
    client, headers = st.app.test_client(), {"Authorization": f"Bearer {key}"}
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": f"line {i}", "max_tokens": 2, "ignore_eos": True}}).encode()
                     + b"\n" for i in range(n))
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=headers).get_json()
    b = client.post("/v1/batches", headers=headers, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                            "completion_window": "24h"}).get_json()
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == n, b
    return b["id"]


def _per_worker(st: Stack, *where) -> dict[str, int]:
    with Session(st.engine) as s:
        return dict(s.execute(select(Job.worker, func.count()).where(*where).group_by(Job.worker)).all())


def _restart(st: Stack, name: str, **env):
    """Start a worker under the name of a dead one; its old heartbeat may still be there, so wait for the new."""
    old = st.heartbeat(name).get("started_at")
    proc = st.start("worker", "--kind", "gpu", "--device", "cpu", TIDEPOOL_WORKER_NAME=name, **env)
    st.wait(lambda: st.heartbeat(name).get("started_at") not in (None, old) or proc.poll() is not None, 60,
            f"{name} restarted")
    assert proc.poll() is None
    return proc


def test_three_gpu_workers_share_a_batch_and_survive_a_kill_9(stack):
    st = stack
    st.serve()
    _, key = st.tenant()
    st.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_REPUBLISH_AFTER=2, TIDEPOOL_BEAT_SCHEDULE=st.tmp / "beat")
    procs = {name: st.worker(name) for name in GPU}
    st.worker("scale-cpu", kind="cpu")
    deferrable = st.submit(key, 20, sla_class="deferrable", max_tokens=2, ignore_eos=True)
    batch_id = _batch(st, key, LINES)
    t_start = time.monotonic()
    with Online(st.url, key) as online:
        st.wait(lambda: st.count(Job.batch_id == batch_id, Job.status == JobStatus.completed) >= LINES // 2, 120,
                "half the batch done", every=0.1)
        victim = GPU[1]
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        t_kill = time.monotonic()
        time.sleep(0.5)         # a claim or completion in flight at the kill has committed or rolled back by now
        # the victim's jobs: still running under its name, or already reclaimed by the sweeper (its lease lapsed
        # within the 0.5 s): queued again with the attempt counted, or claimed by another worker for a second one
        held = {j.id for j in st.jobs(or_(and_(Job.worker == victim, Job.status == JobStatus.running),
                                          and_(Job.status == JobStatus.queued, Job.attempts >= 1),
                                          Job.attempts >= 2))}
        with Session(st.engine) as s:
            while_three = dict(s.execute(select(Job.worker, func.count()).where(
                Job.batch_id == batch_id, Job.status == JobStatus.completed).group_by(Job.worker)).all())
        time.sleep(4)           # longer than republish (2 s) + a sweep (1 s): an online request the victim held is
        _restart(st, victim)    # answered by the others while it is down, so that phase cannot come out empty
        t_back = time.monotonic()
        st.wait(lambda: st.count(Job.batch_id == batch_id, Job.status == JobStatus.completed) == LINES, 180,
                "the whole batch done", every=0.25)
        time.sleep(1)
    t_end = time.monotonic()

    st.wait(lambda: st.count(Job.status.not_in([JobStatus.completed, JobStatus.failed, JobStatus.cancelled,
                                                JobStatus.expired])) == 0, 60, "every job terminal")
    online_ids = {job for _, code, job in online.served if code == 200}
    states = ledger_check(st.engine, online_ids | set(deferrable))
    assert states["failed"] == states["expired"] == states["cancelled"] == 0, states
    # attempts: 2 for exactly the jobs the killed worker held, 1 for all others
    again = {j.id for j in st.jobs(Job.attempts != 1)}
    assert again == held and all(j.attempts == 2 for j in st.jobs(Job.id.in_(list(held)))), (len(again), len(held))
    # the batch's output has each line once
    b = st.wait(lambda: (x := st.app.test_client().get(f"/v1/batches/{batch_id}",
                                                      headers={"Authorization": f"Bearer {key}"}).get_json())
                ["status"] == "completed" and x, 60, "batch finalised")
    out = st.app.test_client().get(f"/v1/files/{b['output_file_id']}/content",
                                   headers={"Authorization": f"Bearer {key}"}).data.decode().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == sorted(f"c{i}" for i in range(LINES))
    # spread: while three gpu workers were up, none did more than 60% of the batch work done by then
    done = sum(while_three.values())
    assert set(while_three) <= set(GPU) | {"scale-cpu"}, while_three
    assert max(while_three.values()) <= 0.6 * done, while_three
    # online requests answered before the kill, while the victim was down, and after its restart
    codes = [code for _, code, _ in online.served]
    assert set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    phases = [online.between(t_start, t_kill), online.between(t_kill, t_back), online.between(t_back, t_end)]
    assert all(phases), [len(p) for p in phases]
    print(f"\nscale out: {LINES} batch lines + {len(online_ids)} online + {len(deferrable)} deferrable on 3 gpu + "
          f"1 cpu workers; batch work while three up {while_three}; victim held {len(held)} (rerun, attempts 2); "
          f"online served before/while down/after {[len(p) for p in phases]}; whole run {t_end - t_start:.1f}s; "
          f"by worker at the end {_per_worker(st)}; ledger {states}")


def test_drain_under_load_loses_and_repeats_nothing(stack):
    st = stack
    st.serve()
    _, key = st.tenant()
    st.start("beat", TIDEPOOL_SWEEP_INTERVAL=1, TIDEPOOL_REPUBLISH_AFTER=2, TIDEPOOL_BEAT_SCHEDULE=st.tmp / "beat")
    drained = st.worker("drain-a")
    st.worker("drain-b")
    # long enough that the drained worker is mid-generation on several of them when SIGTERM arrives
    ids = st.submit(key, 60, sla_class="batch", max_tokens=40, ignore_eos=True)
    with Online(st.url, key) as online:
        st.wait(lambda: st.count(Job.worker == "drain-a", Job.status == JobStatus.running) >= 2, 60,
                "drain-a busy", every=0.02)
        held = {j.id for j in st.jobs(Job.worker == "drain-a", Job.status == JobStatus.running)}
        t_term = time.monotonic()
        drained.send_signal(signal.SIGTERM)
        assert drained.wait(30) == 0
        t_gone = time.monotonic()
        st.wait(lambda: st.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids), 120,
                "all jobs done by the remaining worker", every=0.25)
        time.sleep(1)
    online_ids = {job for _, code, job in online.served if code == 200}
    states = ledger_check(st.engine, online_ids | set(ids))
    assert states["completed"] == len(ids) + len(online_ids), states
    assert {j.attempts for j in st.jobs()} == {1}           # a drained job goes back unattempted
    codes = [code for _, code, _ in online.served]
    assert set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    assert online.between(t_term, float("inf")), "no online request served after the drain began"
    by_worker = _per_worker(st, Job.id.in_(ids))
    handed_over = _per_worker(st, Job.id.in_(list(held))).get("drain-b", 0)
    assert by_worker.get("drain-b", 0) > 0, by_worker
    print(f"\ndrain under load: drain-a exited 0 {t_gone - t_term:.1f}s after SIGTERM; of the {len(held)} jobs it "
          f"ran at SIGTERM {handed_over} were finished by drain-b; batch jobs by worker {by_worker}; online served "
          f"{len(online_ids)}; ledger {states}")
