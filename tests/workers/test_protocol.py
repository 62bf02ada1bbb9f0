"""The facts the API, the workers and the engine share are defined once: the engine, which imports nothing of the
ledger, keeps its own names for its priority ranks, and these tests hold them equal to the ledger's enum."""
from tidepool.service.ledger.models import ONLINE_CLASSES, SLA_CLASSES, SlaClass
from tidepool.workers.engine import SLA_CLASSES as ENGINE_CLASSES
from tidepool.workers.engine.config import ONLINE_CLASSES as ENGINE_ONLINE
from tidepool.workers.engine.sequence import CLASS_RANK, ONLINE_RANKS
from tidepool.workers.worker import QUEUES


def test_engine_classes_are_the_ledger_enum_in_priority_order():
    assert ENGINE_CLASSES == SLA_CLASSES == tuple(c.value for c in SlaClass)
    assert [CLASS_RANK[c] for c in SLA_CLASSES] == list(range(len(SLA_CLASSES)))


def test_engine_online_classes_are_the_ledgers():
    assert ENGINE_ONLINE == ONLINE_CLASSES
    assert tuple(c for c in SLA_CLASSES if CLASS_RANK[c] in ONLINE_RANKS) == ONLINE_CLASSES


def test_gpu_workers_serve_every_class_and_cpu_workers_a_subset():
    assert QUEUES["gpu"] == SLA_CLASSES and set(QUEUES["cpu"]) <= set(SLA_CLASSES)


def test_heartbeats_round_trip_in_redis_and_in_process(stack):
    from tidepool.service.ledger.snapshots import HEARTBEAT_KEY, Heartbeats
    for store in (Heartbeats(stack.redis), Heartbeats(None)):
        store.put({"name": "hb-1", "at": 1.0}, ttl=30)
        assert store.get("hb-1") == {"name": "hb-1", "at": 1.0} and {"name": "hb-1", "at": 1.0} in store.read()
        store.delete("hb-1")
        assert store.get("hb-1") is None and all(b["name"] != "hb-1" for b in store.read())
    Heartbeats(stack.redis).put({"name": "hb-2"}, ttl=30)
    assert 0 < stack.redis.ttl(HEARTBEAT_KEY.format("hb-2")) <= 30
