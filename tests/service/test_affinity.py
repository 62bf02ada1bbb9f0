"""Prefix-affinity routing (service/ledger/affinity.py) against a real Redis: stable keys, the router's choice between
a worker's private queue and the shared one, and moving a dead worker's private queue back. The heartbeats are
written in the contract's shape (what Worker.stats() sends); tests/workers/test_affinity.py runs real workers."""
import json
import subprocess
import sys
import time

from tidepool.service.ledger import affinity
from tidepool.service.ledger.affinity import HEARTBEAT_KEY, Router, job_prefix_key, prefix_key, private_queue

from .conftest import ADMIN

SYSTEM = "You are a careful assistant. " * 30       # 870 characters: a long shared prefix


def _beat(client, name, queues=("realtime", "interactive", "batch", "deferrable"), prefixes=(), inflight=0,
          backlog=0, seats=4):
    client.set(HEARTBEAT_KEY.format(name), json.dumps({
        "name": name, "queues": list(queues), "prefixes": list(prefixes), "inflight": inflight,
        "private_backlog": backlog, "seats": seats, "at": time.time()}), ex=30)


def test_prefix_key_is_stable_across_processes_and_namespaced():
    body = {"prompt": SYSTEM + "question 1"}
    key = prefix_key("tenant:a", "/v1/completions", body)
    # Python's hash() of a str differs per process; the key must not
    code = ("from tidepool.service.ledger.affinity import prefix_key; "
            f"print(prefix_key('tenant:a', '/v1/completions', {{'prompt': {body['prompt']!r}}}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".").stdout.strip()
    assert key == other and len(key) == 20
    assert prefix_key("tenant:a", "/v1/completions", {"prompt": SYSTEM + "another question"}) == key
    assert prefix_key("tenant:b", "/v1/completions", body) != key            # another tenant's cache
    assert prefix_key("tenant:a", "/v1/completions", {"prompt": "short"}) is None
    assert prefix_key("tenant:a", "/v1/completions", {"prompt": "x" + SYSTEM}) != key
    assert job_prefix_key("a", None, "/v1/completions", body) == key
    assert job_prefix_key("a", "org", "/v1/completions", body) == job_prefix_key("b", "org", "/v1/completions", body)
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                          {"role": "user", "content": "bye"}]}
    ck = prefix_key("tenant:a", "/v1/chat/completions", chat)
    assert ck is not None and ck == prefix_key("tenant:a", "/v1/chat/completions", parts) != key
    assert prefix_key("tenant:a", "/v1/completions", {"prompt": list(range(400))}) is not None


def test_private_queue_names_round_trip():
    assert affinity.split_private(private_queue("batch@other-model", "gpu-a")) == ("batch@other-model", "gpu-a")
    assert affinity.split_private("batch") is None and affinity.split_private("batch@m") is None


def test_router_prefers_the_holder_places_new_keys_and_overflows_to_shared(redis_client):
    r = redis_client
    k1, k2, k3 = (prefix_key("tenant:a", "/v1/completions", {"prompt": f"{i}" + SYSTEM}) for i in range(3))
    _beat(r, "w1", prefixes=[k1])
    _beat(r, "w2")
    _beat(r, "cpu", queues=("deferrable",), prefixes=[k2])
    router = Router(r, refresh=3600)
    assert router.route("batch", None) == "batch"                        # no key: shared
    assert router.route("batch", k1) == private_queue("batch", "w1")     # the holder
    # a key nobody holds goes to the least-loaded worker (w2: w1 was just given one), and its group follows
    assert router.route("batch", k3) == private_queue("batch", "w2")
    assert router.route("batch", k3) == private_queue("batch", "w2")
    # the cpu worker does not consume batch: k2 is placed among the gpu workers
    assert router.route("batch", k2) in (private_queue("batch", "w1"), private_queue("batch", "w2"))
    assert router.route("deferrable", k2) == private_queue("deferrable", "cpu")
    # load balance: the holder gets its group until it is a whole engine (seats=4) ahead of the least loaded
    router = Router(r, refresh=3600)
    got = [router.route("batch", k1) for _ in range(10)]
    assert got[:4] == [private_queue("batch", "w1")] * 4 and got[4] == "batch", got
    assert router.counts["overflow"] == got.count("batch")


def test_router_sees_load_and_holders_in_fresh_heartbeats(redis_client):
    r = redis_client
    k1 = prefix_key("tenant:a", "/v1/completions", {"prompt": SYSTEM})
    _beat(r, "w1", prefixes=[k1], backlog=9, seats=4)
    _beat(r, "w2", seats=4)
    router = Router(r, refresh=0)
    assert router.route("batch", k1) == "batch"          # the holder's queue is 9 deep, w2's empty
    _beat(r, "w1", prefixes=[k1], backlog=1, seats=4)
    assert router.route("batch", k1) == private_queue("batch", "w1")
    r.delete(HEARTBEAT_KEY.format("w2"))                  # one worker left: nothing to choose, shared queue
    assert router.route("batch", k1) == "batch"


def test_drain_dead_moves_a_dead_workers_private_queue_oldest_first(redis_client):
    r = redis_client
    _beat(r, "alive")
    for i in range(5):                                   # publishers LPUSH, consumers RPOP
        r.lpush(private_queue("batch", "dead"), f"m{i}")
        r.lpush(private_queue("batch", "alive"), f"a{i}")
    r.lpush("batch", "newer")
    assert affinity.drain_dead(r) == 5
    assert not r.exists(private_queue("batch", "dead")) and r.llen(private_queue("batch", "alive")) == 5
    assert [r.rpop("batch").decode() for _ in range(6)] == ["m0", "m1", "m2", "m3", "m4", "newer"]


def test_dispatcher_routes_jobs_and_batch_lines_by_prefix(pg_url, redis_url, redis_client, tmp_path):
    """POST /v1/jobs and a batch publish keyed lines to the holder's private queue; short prompts stay shared."""
    import io

    from sqlalchemy.orm import Session

    from tidepool.service import create_app
    from tidepool.service.ledger import tenants
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                      "model": str(tmp_path / "served"), "admin_token": ADMIN})
    with Session(app.services.database) as s:
        tenant, key = tenants.create_tenant(s, "aff", 1.0)
        s.commit()
        tenant_id = tenant.id
    held = job_prefix_key(tenant_id, None, "/v1/completions", {"prompt": SYSTEM})
    _beat(redis_client, "w1", prefixes=[held], seats=64)
    _beat(redis_client, "w2", seats=64)
    client, headers = app.test_client(), {"Authorization": f"Bearer {key}"}
    for prompt in (SYSTEM + "one", SYSTEM + "two", "short"):
        r = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 2, "sla_class": "batch"}, headers=headers)
        assert r.status_code == 202, r.get_json()
    assert redis_client.llen(private_queue("batch", "w1")) == 2 and redis_client.llen("batch") == 1
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": SYSTEM + f"line {i}", "max_tokens": 2}}).encode() + b"\n"
                     for i in range(3))
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=headers).get_json()
    b = client.post("/v1/batches", headers=headers, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                            "completion_window": "24h"}).get_json()
    assert b["status"] == "in_progress", b
    assert redis_client.llen(private_queue("batch", "w1")) == 5
    app.services.dispatcher.affinity = False
    r = client.post("/v1/jobs", json={"prompt": SYSTEM, "max_tokens": 2, "sla_class": "batch"}, headers=headers)
    assert r.status_code == 202 and redis_client.llen("batch") == 2
    # the message names the queue it sits in (a restore after a crash returns it there)
    raw = json.loads(redis_client.lindex(private_queue("batch", "w1"), 0))
    assert raw["properties"]["delivery_info"]["routing_key"] == private_queue("batch", "w1")
    # the admin queues view and /metrics count what waits in private queues under its shared queue
    view = client.get("/v1/admin/queues", headers={"Authorization": f"Bearer {ADMIN}"}).get_json()
    assert view["queues"]["batch"] == 7
    assert view["private"] == [{"queue": private_queue("batch", "w1"), "shared": "batch", "worker": "w1",
                                "depth": 5}]
    assert 'tidepool:queue_depth{model="served",sla_class="batch"} 7.0' in client.get(
        "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    app.services.database.dispose()


def test_prefix_memory_is_bounded_newest_first():
    m = affinity.PrefixMemory(size=3)
    for k in "abcda":
        m.add(k)
    m.add(None)
    assert m.newest() == ["a", "d", "c"]
