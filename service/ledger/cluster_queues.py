"""The broker's queues on a Redis Cluster (Flask- and torch-free; the publisher, the workers' take and beat use it).

On one Redis server the queues ride kombu's Redis transport: a queue is a list named after it, and a taken message
waits in kombu's unacked hash and index, two keys for the whole server. A cluster spreads keys over its masters by
hash slot, and a Lua script (the take: workers/broker.py, service/ledger/fair.py TAKE) may only touch keys of one
slot. So here every key of one queue carries the same hash tag, its shared queue's name, `{<class>[@<model>]}`:

    the list                 {interactive@m}              (a lane: the shared queue, or a worker's private one:
                                                           {interactive@m}>worker, service/ledger/affinity.py)
    the fair take's sets     tidepool:fair:q:{interactive@m}|<tenant> ... (fair.py builds them from the lane's key)
    the unacked messages     tidepool:unacked:{interactive@m}             (delivery tag -> [message, exchange, lane])
    their index              tidepool:unacked_index:{interactive@m}       (delivery tag -> when taken)
    their owners             tidepool:unacked_owner:{interactive@m}       (delivery tag -> [worker, its start])
    its doorbell             tidepool:doorbell:{interactive@m}            (a sharded pub/sub channel: doorbell.py)

and each take, ack and restore is one script on one slot: the queues of different (model, class) pairs spread over
the masters, and each pair's traffic stays on one. Messages are the very entries kombu writes (wire.task_message), the
unacked records the very layout its transport keeps, so the worker's messages ack, reject and requeue as usual
(workers/broker.py ClusterChannel). What kombu's channel did for the unacked set, these functions do per queue: ack,
restore (a reject with requeue, a closing channel), the visibility timeout's restore and the return of a dead worker's
messages (workers/beat.py); the queues workers consume are listed in QUEUES_KEY so beat knows where to look."""
import json
import time
import weakref

from . import affinity

QUEUES_KEY = "tidepool:cluster:queues"     # the shared queues workers consume (a set; beat sweeps their unacked)
MASTERS_KEY = "tidepool:cluster:masters"   # the masters' replication ids as beat last saw them (JSON list)


def tag(queue: str) -> str:
    """The hash tag of a lane's keys: its shared queue's name in braces."""
    parts = affinity.split_private(queue)
    return "{" + (queue if parts is None else parts[0]) + "}"


def list_key(lane: str) -> str:
    """The list holding `lane`'s messages (a shared queue, or a worker's private one)."""
    parts = affinity.split_private(lane)
    return tag(lane) if parts is None else tag(lane) + affinity.SEP + parts[1]


def lane_of(key: str) -> str:
    """The lane whose list is `key` (list_key's inverse); a name without a hash tag is its own."""
    return key.replace("{", "", 1).replace("}", "", 1) if key.startswith("{") else key


def doorbell_channel(queue: str) -> str:
    """The doorbell of a queue (any lane of it): a sharded channel on the queue's slot (service/ledger/doorbell.py)."""
    return f"tidepool:doorbell:{tag(queue)}"


def unacked_keys(queue: str) -> tuple[str, str, str]:
    """(unacked messages, their index by time taken, their owners) of a shared queue (or any lane of it)."""
    t = tag(queue)
    return f"tidepool:unacked:{t}", f"tidepool:unacked_index:{t}", f"tidepool:unacked_owner:{t}"


# KEYS: unacked, index, owners; ARGV: delivery tag. Forgets a taken message (ack, or a reject without requeue).
ACK = """
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
"""

# KEYS: unacked, index, owners, the list of the lane the message came from; ARGV: delivery tag, '1' to push it on the
# list's far end (LPUSH: taken after what waits, as kombu's reject does) or '' on its consuming end (RPUSH: taken next,
# as kombu's restore of a closed channel and of the visibility timeout do). The message text goes back exactly as it was
# published: the unacked record is '[' .. message .. ',' .. exchange .. ',' .. lane .. ']' (the take's layout). Returns
# 1 if it was still unacked (and is now queued), 0 if it was acked or restored meanwhile.
RESTORE = """
local p = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if not p then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local rec = cjson.decode(p)
local tail = ',' .. cjson.encode(rec[2]) .. ',' .. cjson.encode(rec[3]) .. ']'
local raw = string.sub(p, 2, string.len(p) - string.len(tail))
if ARGV[2] == '1' then redis.call('LPUSH', KEYS[4], raw) else redis.call('RPUSH', KEYS[4], raw) end
return 1
"""


def _run(client, script: str, keys, *args):
    from .fair import run_script
    return run_script(client, script, len(keys), *keys, *args)


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def publish(client, entries: list[tuple[str, str]], ring: bool = True) -> None:
    """Push (lane, message) entries (wire.task_message) onto their lists, in one pipeline (redis-py sends each master
    its share in one round trip); ring: each lane's doorbell too (doorbell_channel, on the lane's own slot)."""
    pipe = client.pipeline(transaction=False)
    for lane, message in entries:
        pipe.lpush(list_key(lane), message)
    if ring:
        for lane in dict.fromkeys(lane for lane, _ in entries):
            pipe.spublish(doorbell_channel(lane), lane)
    pipe.execute()


def ack(client, queue: str, delivery_tag: str) -> None:
    _run(client, ACK, unacked_keys(queue), delivery_tag)


def restore(client, lane: str, delivery_tag: str, leftmost: bool = False) -> bool:
    """A taken message of `lane` back onto its list (see RESTORE); False if it was no longer unacked."""
    return bool(_run(client, RESTORE, (*unacked_keys(lane), list_key(lane)), delivery_tag, "1" if leftmost else ""))


def register(client, queues) -> None:
    """A worker consumes `queues` (shared queue names): beat sweeps their unacked messages."""
    if queues:
        client.sadd(QUEUES_KEY, *queues)


def known(client) -> list[str]:
    return sorted(_text(q) for q in client.smembers(QUEUES_KEY))


def depth(client, queue: str) -> int:
    """Messages waiting in lane `queue` (on its list and sorted in by the fair take), on a cluster or one server."""
    from . import fair
    from .redis_conn import on_cluster
    return fair.lane_depth(client, list_key(queue) if on_cluster(client) else queue)


def _restore_tags(client, queue: str, tags, leftmost: bool) -> int:
    """Restore unacked messages of `queue` by delivery tag, each to the lane it was taken from."""
    unacked = unacked_keys(queue)[0]
    records = client.hmget(unacked, tags) if tags else []
    restored = 0
    for t, record in zip(tags, records):
        if record is None:
            continue
        lane = json.loads(record)[2]
        restored += restore(client, lane, _text(t), leftmost)
    return restored


def restore_visible(client, visibility_timeout: float, now: float | None = None) -> int:
    """Messages taken more than `visibility_timeout` seconds ago and never acked go back to their queues (kombu's
    restore_visible, per queue)."""
    now = time.time() if now is None else now
    restored = 0
    for queue in known(client):
        tags = client.zrangebyscore(unacked_keys(queue)[1], 0, now - visibility_timeout, start=0, num=1000)
        restored += _restore_tags(client, queue, tags, leftmost=False)
    return restored


def restore_orphans(client, is_gone, grace: float, now: float | None = None) -> int:
    """Unacked messages taken more than `grace` seconds ago by a worker that `is_gone(name, started_at)` go back to
    the front of their queues; owners of messages acked meanwhile are forgotten (workers/beat.py restore_orphans)."""
    now = time.time() if now is None else now
    restored = 0
    for queue in known(client):
        unacked, index, owners_key = unacked_keys(queue)
        tags = client.zrangebyscore(index, 0, now - grace)
        owners = client.hmget(owners_key, tags) if tags else []
        orphaned = [t for t, owner in zip(tags, owners) if owner is not None and is_gone(*json.loads(owner))]
        restored += _restore_tags(client, queue, orphaned, leftmost=True)
        listed = client.hkeys(owners_key)
        if listed:
            gone = [t for t, record in zip(listed, client.hmget(unacked, listed)) if record is None]
            if gone:
                client.hdel(owners_key, *gone)
    return restored


_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # client -> the ids it last wrote to MASTERS_KEY


def master_replaced(client) -> bool:
    """Whether a master of the cluster was replaced since the last call (beat's sweep): a replica promoted after its
    master failed, or a master restarted empty; either may have lost the writes of its last moments (replication is
    asynchronous), a published message among them, so beat then republishes every queued job (workers/beat.py; the
    duplicates are dropped at claim). A promoted replica, or a restarted master, starts a new replication id: the
    masters' ids are compared with those of the last call, kept in Redis (for the next beat process) and in this
    process (for when the master holding that key is the one that restarted empty). False at the first call and while
    the topology is moving (a node does not answer): the next sweep asks again."""
    from redis.cluster import RedisCluster
    try:
        ids = sorted(info["master_replid"] for info in
                     client.info("replication", target_nodes=RedisCluster.PRIMARIES).values()
                     if isinstance(info, dict) and info.get("role") == "master")
    except Exception:
        return False
    before = _seen.get(client)
    if before is None:
        stored = client.get(MASTERS_KEY)
        before = json.loads(stored) if stored else None
    client.set(MASTERS_KEY, json.dumps(ids))
    _seen[client] = ids
    return before is not None and not set(before) <= set(ids)
