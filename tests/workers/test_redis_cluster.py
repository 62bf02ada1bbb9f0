"""TIDEPOOL_REDIS_URL naming a Redis Cluster (a local one of three masters): the web app on a socket and a real worker
run in this process, over Postgres. Submit, stream, batch and cancel end to end; every queue's keys on one slot (its
hash tag), token streams and doorbells on sharded pub/sub; a taken message restored when its channel closes, when its
worker is gone and after the visibility timeout."""
import io
import json
import threading
import time
from functools import partial

import pytest
import requests
from sqlalchemy.orm import Session
from werkzeug.serving import make_server

from tidepool.service import create_app
from tidepool.service.ledger import cluster_queues, redis_conn, tenants, token_stream
from tidepool.service.ledger.models import Job, JobStatus
from tidepool.workers import beat
from tidepool.workers.engine import LLM, SamplingParams
from tidepool.workers.worker import Worker, WorkerConfig

from .conftest import Stack

WORKER = "cluster-gpu"


wait = partial(Stack.wait, every=0.05)


class ClusterStack:
    def __init__(self, db_url: str, model: str, tmp, cluster):
        self.cluster = cluster
        self.app = create_app({"database_url": db_url, "redis_url": cluster.url, "storage_dir": str(tmp / "storage"),
                               "model": model, "admin_token": "admin"})
        self.services = self.app.services
        self.engine = self.services.database
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.worker = Worker(WorkerConfig(model=model, database_url=db_url, broker_url=cluster.url,
                                          redis_url=cluster.url, device="cpu", name=WORKER, lease_seconds=30,
                                          check_interval=0.05))   # (a cancel reaches the engine within 50 ms)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def key(self) -> str:
        with Session(self.engine) as s:
            _, key = tenants.create_tenant(s, f"t{time.monotonic_ns()}", 1.0)
            s.commit()
        return key

    def job(self, job_id: str) -> Job:
        with Session(self.engine) as s:
            return s.get(Job, job_id)

    def close(self) -> None:
        self.worker.stop()
        self.thread.join(30)
        self.server.shutdown()
        self.engine.dispose()


@pytest.fixture(scope="module")
def st(redis_cluster, pg_databases, tiny_model, tmp_path_factory):
    redis_cluster.flush()
    url = pg_databases.create()
    stack = ClusterStack(url, tiny_model, tmp_path_factory.mktemp("cluster"), redis_cluster)
    yield stack
    stack.close()
    redis_cluster.flush()
    pg_databases.drop(url)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(tiny_model)


def test_the_url_of_any_node_names_the_cluster(redis_cluster, redis_url):
    assert all(redis_conn.is_cluster(f"redis://127.0.0.1:{p}") for p in redis_cluster.ports)
    assert redis_conn.on_cluster(redis_conn.client(f"redis://127.0.0.1:{redis_cluster.ports[2]}"))
    assert not redis_conn.is_cluster(redis_url) and not redis_conn.on_cluster(redis_conn.client(redis_url))


def test_a_streamed_request_and_a_plain_one_match_the_engine(st, reference):
    headers = {"Authorization": f"Bearer {st.key()}"}
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    ref = reference.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    plain = requests.post(f"{st.url}/v1/completions", headers=headers, json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["text"] == ref.text
    deltas = []
    with requests.post(f"{st.url}/v1/completions", headers=headers, json={**body, "stream": True}, timeout=60,
                       stream=True) as r:
        assert r.status_code == 200
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                deltas += [c["text"] for c in chunk.get("choices") or []]
    assert len([d for d in deltas if d]) > 1 and "".join(deltas) == ref.text     # token by token, not at the end
    # the web process's inbox is a sharded channel: one subscriber, on the master of its slot
    client = st.services.redis
    inbox = token_stream.for_redis(client).inbox
    assert client.execute_command("PUBSUB SHARDNUMSUB", inbox, target_nodes=client.get_node_from_key(inbox)) == \
        [(inbox.encode(), 1)]


def test_every_key_of_a_queue_shares_its_hash_tag(st):
    headers = {"Authorization": f"Bearer {st.key()}"}
    ids = [requests.post(f"{st.url}/v1/jobs", headers=headers, timeout=30,
                         json={"prompt": f"tag {i}", "max_tokens": 2, "sla_class": c}).json()["id"]
           for i, c in enumerate(("interactive", "batch", "deferrable"))]
    wait(lambda: all(st.job(i).status == JobStatus.completed for i in ids), 60, "completion")
    client = st.services.redis
    keys = {k.decode() for k in client.scan_iter(match="*", count=1000)}
    queued = [k for k in keys if "{" in k]
    assert queued and all(k[k.index("{"):k.index("}") + 1] in {"{interactive}", "{batch}", "{deferrable}",
                                                                 "{realtime}"} for k in queued), queued
    assert not {"unacked", "unacked_index", "tidepool:unacked_owner", "interactive", "batch"} & keys
    assert st.services.dispatcher.queue_depths() == {"realtime": 0, "interactive": 0, "batch": 0, "deferrable": 0}
    for queue in ("interactive", "batch", "deferrable"):       # each queue's keys on one slot
        assert len({client.keyslot(k) for k in queued if "{%s}" % queue in k}) == 1
    assert set(cluster_queues.known(client)) == {"realtime", "interactive", "batch", "deferrable"}


def test_a_batch_runs_to_its_output_file(st, reference):
    headers = {"Authorization": f"Bearer {st.key()}"}
    prompts = [f"Item {i}:" for i in range(4)]
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": p, "max_tokens": 5, "temperature": 0}})
             for i, p in enumerate(prompts)]
    f = requests.post(f"{st.url}/v1/files", headers=headers, data={"purpose": "batch"},
                      files={"file": ("in.jsonl", io.BytesIO("\n".join(lines).encode()))}).json()
    batch = requests.post(f"{st.url}/v1/batches", headers=headers, json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()

    def done():
        beat.finalize_batches(st.services)
        b = requests.get(f"{st.url}/v1/batches/{batch['id']}", headers=headers).json()
        return b if b["status"] == "completed" else None

    b = wait(done, 90, "the batch", every=0.2)
    assert b["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    out = requests.get(f"{st.url}/v1/files/{b['output_file_id']}/content", headers=headers).text.splitlines()
    refs = reference.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in map(json.loads, out)}
    assert got == {f"r{i}": ref.text for i, ref in enumerate(refs)}


def test_cancel_reaches_the_running_engine(st):
    headers = {"Authorization": f"Bearer {st.key()}"}
    job = requests.post(f"{st.url}/v1/jobs", headers=headers, timeout=30, json={
        "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}).json()
    wait(lambda: st.job(job["id"]).first_token_at, 30, "first token")
    aborted = st.worker.counters["aborted"]
    r = requests.post(f"{st.url}/v1/jobs/{job['id']}/cancel", headers=headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    wait(lambda: st.worker.counters["aborted"] > aborted, 15, "the abort")
    row = st.job(job["id"])
    assert row.status == JobStatus.cancelled and row.output is None and row.completion_tokens > 0


def test_taken_messages_come_back_from_a_closed_channel_a_dead_worker_and_the_visibility_timeout(st, tiny_model):
    """A second worker, driven by hand, on the queue of a model nobody else serves."""
    from tidepool.service.ledger import fair
    from tidepool.service.ledger.wire import task_message
    from tidepool.workers.broker import take
    client, queue = st.services.redis, "deferrable@idle"
    cluster_queues.publish(client, [(queue, task_message(f"job-{i}", queue, fair.meta("t", 1.0, None, 2)))
                                    for i in range(2)])
    assert cluster_queues.depth(client, queue) == 2
    cpu = Worker(WorkerConfig(model=tiny_model, database_url=st.engine.url.render_as_string(hide_password=False),
                              broker_url=st.cluster.url, redis_url=st.cluster.url, device="cpu", name="cluster-cpu",
                              kind="cpu", serves="idle", lease_seconds=30), engine=st.worker.engine)
    unacked, index, owners = cluster_queues.unacked_keys(queue)
    owner = json.dumps(["cluster-cpu", 1.0])
    try:
        cpu.connect()
        lanes = [cpu.intake.queues[queue]]
        m = take(lanes, accept=["json"], owner=owner, fair=(queue, 60.0))
        assert m is not None and m.headers["fair"][0] == "t" and m.decode()[0][0] in ("job-0", "job-1")
        assert client.hlen(unacked) == 1 and client.zcard(index) == 1 and client.hlen(owners) == 1
        assert cluster_queues.depth(client, queue) == 1
        cpu.intake.release()           # a closing channel restores what it took
        assert client.hlen(unacked) == 0 and client.zcard(index) == 0 and client.hlen(owners) == 0
        assert cluster_queues.depth(client, queue) == 2
        cpu.intake.connect()
        lanes = [cpu.intake.queues[queue]]
        m1 = take(lanes, accept=["json"], owner=owner, fair=(queue, 60.0))
        m2 = take(lanes, accept=["json"], owner="", fair=(queue, 60.0))
        assert m1 is not None and m2 is not None and client.hlen(unacked) == 2
        assert {m1.decode()[0][0], m2.decode()[0][0]} == {"job-0", "job-1"}
        cpu.intake.channel.delivered.clear()        # as if the worker died: nothing restores them on its side
        # no heartbeat of its start: the owned message comes back; the unowned one waits for the visibility timeout
        assert beat.restore_orphans(st.services, grace=0.0) == 1
        assert client.hlen(unacked) == 1 and client.hlen(owners) == 0
        assert cluster_queues.restore_visible(client, 3600) == 0
        assert cluster_queues.restore_visible(client, 0.0, now=time.time() + 1) == 1
        assert client.hlen(unacked) == 0 and client.zcard(index) == 0
        assert cluster_queues.depth(client, queue) == 2
        m = take(lanes, accept=["json"], owner="", fair=(queue, 60.0))   # acked: gone for good
        m.ack()
        assert client.hlen(unacked) == 0 and cluster_queues.depth(client, queue) == 1
        m = take(lanes, accept=["json"], owner="", fair=(queue, 60.0))   # requeued: back in the list
        m.requeue()
        assert client.hlen(unacked) == 0 and cluster_queues.depth(client, queue) == 1
    finally:
        cpu.intake.channel.delivered.clear()
        cpu.close()


def test_upkeep_and_the_operators_views_work_on_the_cluster(st):
    """Beat's sweep (each queue's unacked set), the admin queue depths and /metrics' fair-intake figures (by queue
    name, not by key) on the cluster."""
    done = beat.sweep(st.services, visibility_timeout=3600)
    assert done["restored_orphans"] == 0 and done["private_drained"] == 0
    admin = {"Authorization": "Bearer admin"}
    depths = requests.get(f"{st.url}/v1/admin/queues", headers=admin).json()
    assert depths["queues"] == {"realtime": 0, "interactive": 0, "batch": 0, "deferrable": 0}
    assert {(m["sla_class"], m["depth"], m["served"]) for m in depths["models"]} >= {("interactive", 0, True)}
    metrics = requests.get(f"{st.url}/metrics", headers=admin).text
    assert 'tidepool:fair_service_gap{sla_class="interactive"}' in metrics and "{interactive}" not in metrics


def test_a_publish_rings_the_doorbell_of_its_queue_on_its_own_slot(redis_cluster):
    """The doorbell on a cluster: a sharded channel per queue, on the queue's slot; a worker hears the queues it
    consumes, and a publish to another queue rings nothing there."""
    from tidepool.service.ledger import doorbell
    from tidepool.service.ledger.wire import task_message
    client = redis_conn.client(redis_cluster.url)
    assert client.keyslot(cluster_queues.doorbell_channel("batch@m>w1")) == \
        client.keyslot(cluster_queues.list_key("batch@m"))
    rung, event, stop = [], threading.Event(), threading.Event()
    thread = doorbell.listen(redis_cluster.url, event, stop, rung.append, queues=["interactive@m", "batch@m"])
    try:
        wait(lambda: rung == [None], 10, "the subscription")      # (a ring for any queue on subscribing)
        for queue in ("realtime@m", "batch@m", "interactive@m"):
            cluster_queues.publish(client, [(queue, task_message("job-x", queue))])
        wait(lambda: len(rung) == 3, 10, "the rings")
        assert sorted(rung[1:]) == ["batch@m", "interactive@m"]
    finally:
        stop.set()
        thread.join(5)
        for queue in ("realtime@m", "batch@m", "interactive@m"):
            client.delete(cluster_queues.list_key(queue))


def test_prefix_affinity_routes_takes_and_drains_private_queues_on_their_queues_slot(st, tiny_model):
    """A keyed job goes to the private queue of the worker holding its prefix, under the class's hash tag (so a take
    over private and shared lane stays one script); a dead worker's private queue goes to the shared one."""
    from tidepool.service.ledger import affinity, fair
    from tidepool.service.ledger.snapshots import Heartbeats
    from tidepool.service.ledger.wire import task_message
    from tidepool.workers.broker import take
    client, queue, dispatcher = st.services.redis, "batch@aff", st.services.dispatcher
    key = affinity.prefix_key("tenant:a", "/v1/completions", {"prompt": "p" * affinity.PREFIX_CHARS})
    for name, prefixes in (("aff-1", [key]), ("aff-2", [])):
        Heartbeats(client).put({"name": name, "queues": [queue], "prefixes": prefixes, "inflight": 0, "seats": 4,
                                "at": time.time()}, ttl=60)
    lane = affinity.Router(client, refresh=3600).route(queue, key)
    assert lane == affinity.private_queue(queue, "aff-1")
    assert client.keyslot(cluster_queues.list_key(lane)) == client.keyslot(cluster_queues.list_key(queue))
    cluster_queues.publish(client, [(lane, task_message(f"job-{i}", lane, fair.meta("t", 1.0, None, 1)))
                                    for i in range(3)])
    assert dispatcher.private_depths() == {lane: 3}
    assert dispatcher.queue_depths([queue]) == {queue: 3}
    w = Worker(WorkerConfig(model=tiny_model, database_url=st.engine.url.render_as_string(hide_password=False),
                            broker_url=st.cluster.url, redis_url=st.cluster.url, device="cpu", name="aff-1",
                            serves="aff", lease_seconds=30), engine=st.worker.engine)
    try:
        w.connect()
        lanes = [w.intake.queues[name] for name in w.affinity.lanes(queue)]
        assert [q.name for q in lanes] == [lane, queue]
        m = take(lanes, accept=["json"], owner="", fair=(queue, 60.0))
        assert m.delivery_info["routing_key"] == lane and m.decode()[0][0] == "job-0"
        assert w.affinity.stats()["private_backlog"] == 2
        m.ack()
        Heartbeats(client).delete("aff-1")          # dead: beat moves its private queue to the shared one
        assert beat.drain_private_queues(st.services) == 2
        assert dispatcher.private_depths() == {} and cluster_queues.depth(client, queue) == 2
        assert {take(lanes, accept=["json"], owner="", fair=(queue, 60.0)).decode()[0][0] for _ in range(2)} == \
            {"job-1", "job-2"}
    finally:
        w.intake.channel.delivered.clear()
        w.close()


def test_a_master_restarted_empty_is_seen_replaced(tmp_path):
    """A master that comes back without its data (no persistence, no replica) has a new replication id: beat's sweep
    sees it (cluster_queues.master_replaced) and republishes every queued job; the chaos suite does the same with a
    replica promoted under load."""
    from tests.servers import RedisCluster, free_ports
    cluster = RedisCluster(free_ports(3, start=7190, stop=7200), tmp_path)
    try:
        client = redis_conn.client(cluster.url)
        assert not cluster_queues.master_replaced(client) and not cluster_queues.master_replaced(client)
        victim = client.get_node_from_key(cluster_queues.MASTERS_KEY).port    # the record of the ids lost too
        cluster.procs[victim].kill()
        cluster.procs[victim].wait()
        cluster.start(victim)                      # empty, back in its slots (its nodes file kept)
        assert wait(lambda: cluster_queues.master_replaced(client), 20, "the replacement seen")
        assert not cluster_queues.master_replaced(client)      # once
    finally:
        cluster.close()
