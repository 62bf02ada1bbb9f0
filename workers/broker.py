"""Taking one message off a queue with no moment at which a crash of the worker loses it.

kombu's Redis `basic_get` pops the message (RPOP) and only afterwards, in a second round trip, records
it as unacked (ZADD unacked_index + HSET unacked). A worker killed between the two has removed the
message from the broker without leaving it anywhere the visibility timeout could restore it from,
while the ledger still says "queued, dispatched": nothing would ever run that job again. `take()`
does the pop and the unacked record in one Lua script, in kombu's own layout, so ack, reject, the
restore of a closing channel and `restore_visible` (beat's sweep) all treat the message as usual.
Other transports (the in-process `memory://` of embedded mode) go through `Queue.get`.

With fair intake on (TIDEPOOL_FAIR_INTAKE, the default) the script is service/ledger/fair.py's TAKE: the same
unacked record, but the message is the earliest job of the backlogged tenant with the least weighted service,
not the oldest message of the list.

On a Redis Cluster (service/ledger/cluster_queues.py) there is no kombu channel: `ClusterConnection` gives a
`ClusterChannel` whose lanes' keys carry their queue's hash tag, the same two scripts take onto the queue's own unacked
hash, index and owners, and the channel acks, rejects and restores on its close as kombu's does, one script each.
"""
import base64
import json
import time

from redis.exceptions import RedisError

from tidepool.service.ledger import cluster_queues, fair as fair_queues, redis_conn

from kombu.serialization import prepare_accept_content
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

# Which worker took each unacked message (delivery tag -> JSON [worker name, its started_at]), so beat can
# return the messages of a worker whose heartbeat is gone (workers/beat.py restore_orphans) at once instead of
# after the visibility timeout.
OWNERS_KEY = "tidepool:unacked_owner"

# KEYS: the queue's lists in priority order, then unacked, unacked_index, owners; ARGV[1]: now (the index
# score), ARGV[2]: the taking worker ('' for none).
_TAKE = """
local n = #KEYS - 3
for i = 1, n do
  local raw = redis.call('RPOP', KEYS[i])
  if raw then
    local props = cjson.decode(raw)['properties']
    local info = props['delivery_info']
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[n + 3], props['delivery_tag'], ARGV[2]) end
    redis.call('ZADD', KEYS[n + 2], ARGV[1], props['delivery_tag'])
    redis.call('HSET', KEYS[n + 1], props['delivery_tag'],
               '[' .. raw .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    return raw
  end
end
return false
"""


def _redis_channel(channel) -> bool:
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # no redis client installed: not a Redis broker either
        return False
    return isinstance(channel, kombu_redis.Channel) and not channel.global_keyprefix


class ClusterChannel:
    """What the worker needs of a kombu channel, over a Redis Cluster: its taken messages (delivery tag -> message)
    ack, reject and requeue through it (kombu's Message calls basic_ack and basic_reject), and close() restores those
    still unacked to their queues, as a closing kombu channel does."""
    no_ack_consumers = None

    def __init__(self, client):
        self.client = client
        self.delivered: dict[str, object] = {}

    @staticmethod
    def decode_body(body, encoding=None):
        return base64.b64decode(body) if encoding == "base64" else body

    @staticmethod
    def _lane(message) -> str:
        return message.delivery_info["routing_key"]

    def basic_ack(self, delivery_tag, multiple=False) -> None:
        message = self.delivered.pop(delivery_tag, None)
        if message is not None:
            cluster_queues.ack(self.client, self._lane(message), delivery_tag)

    def basic_reject(self, delivery_tag, requeue=False) -> None:
        message = self.delivered.pop(delivery_tag, None)
        if message is None:
            return
        if requeue:       # behind what waits, as kombu's reject puts it
            cluster_queues.restore(self.client, self._lane(message), delivery_tag, leftmost=True)
        else:
            cluster_queues.ack(self.client, self._lane(message), delivery_tag)

    def close(self) -> None:
        """Every message still unacked back to its queue (the worker stops or reconnects)."""
        delivered, self.delivered = self.delivered, {}
        for tag, message in delivered.items():
            try:
                cluster_queues.restore(self.client, self._lane(message), tag)
            except RedisError:   # unreachable: beat's sweep returns it (the owner is gone, or the visibility timeout)
                pass


class ClusterQueue:
    """A lane bound to a ClusterChannel (the `name` and `channel` of a bound kombu Queue)."""

    def __init__(self, name: str, channel: ClusterChannel):
        self.name, self.channel = name, channel


class ClusterConnection:
    """The worker's broker connection on a Redis Cluster (Intake.connect); release() closes its channel."""
    connection_errors = (RedisError,)
    channel_errors = ()

    def __init__(self, url: str):
        self.client = redis_conn.client(url, socket_timeout=5, socket_connect_timeout=2)
        self._channel = None

    def ensure_connection(self, max_retries=None) -> "ClusterConnection":
        self.client.ping()
        return self

    def channel(self) -> ClusterChannel:
        self._channel = ClusterChannel(self.client)
        return self._channel

    def release(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self.client.close()


def _cluster_take(channel: ClusterChannel, queues, accept, owner, fair, limit, exclude):
    from kombu.transport.virtual import Message
    lanes = [cluster_queues.list_key(queue.name) for queue in queues]
    shared = queues[-1].name        # the class's shared queue (a private lane comes first)
    unacked = cluster_queues.unacked_keys(shared)
    client = channel.client
    if fair is None:
        raw = fair_queues.run_script(client, _TAKE, len(lanes) + 3, *lanes, *unacked, time.time(), owner)
    else:
        key = cluster_queues.list_key(fair[0])
        raw = fair_queues.run_script(client, fair_queues.TAKE, len(lanes) + 7, *lanes, *unacked,
                                     *fair_queues.service_keys(key), fair_queues.weights_key(key),
                                     fair_queues.seq_key(key), time.time(), owner, fair[1], limit, 1,
                                     json.dumps(sorted(exclude or ())), *lanes)
    if raw is None:
        return None
    message = Message(loads(bytes_to_str(raw)), channel=channel)
    channel.delivered[message.delivery_tag] = message
    if message.errors:
        message._reraise_error()
    message.accept = prepare_accept_content(accept)
    return message


def take(queues, accept: list[str], owner: str = "", fair: tuple[str, float] | None = None,
         limit: int = 1000, exclude=None):
    """Like `queue.get(no_ack=False, accept=accept)` over `queues` (bound kombu Queues, or one; the lanes of one
    class, in order): the next message, or None. owner (JSON [worker name, started_at]) is recorded with the
    unacked message on Redis. fair: (the class's shared queue, decay window in seconds) for the fair pick; None:
    the first lane's oldest message first. limit: most messages sorted in per take (fair). exclude: tenants the
    fair pick passes over (None: none); given, only a fair take on Redis can honour it, so other takes give None."""
    if not isinstance(queues, (list, tuple)):
        queues = [queues]
    channel = queues[0].channel
    if exclude is not None and fair is None:
        return None
    if isinstance(channel, ClusterChannel):
        return _cluster_take(channel, queues, accept, owner, fair, limit, exclude)
    if exclude is not None and not _redis_channel(channel):
        return None
    if not _redis_channel(channel):
        for queue in queues:
            message = queue.get(no_ack=False, accept=accept)
            if message is not None:
                return message
        return None
    steps = channel.priority_steps
    keys = [channel._q_for_pri(queue.name, pri) for queue in queues for pri in steps]
    with channel.conn_or_acquire() as client:
        if fair is None:
            raw = fair_queues.run_script(client, _TAKE, len(keys) + 3, *keys, channel.unacked_key,
                                         channel.unacked_index_key, OWNERS_KEY, time.time(), owner)
        else:
            raw = fair_queues.run_script(client, fair_queues.TAKE, len(keys) + 7, *keys, channel.unacked_key,
                                         channel.unacked_index_key, OWNERS_KEY, *fair_queues.service_keys(fair[0]),
                                         fair_queues.WEIGHTS_KEY, fair_queues.SEQ_KEY, time.time(), owner, fair[1],
                                         limit, len(steps), json.dumps(sorted(exclude or ())),
                                         *(queue.name for queue in queues))
    if raw is None:
        return None
    message = channel.Message(loads(bytes_to_str(raw)), channel=channel)
    # Redis holds it as unacked already; this is the channel's own bookkeeping (ack, reject, restore on close).
    virtual.QoS.append(channel.qos, message, message.delivery_tag)
    if message.errors:
        message._reraise_error()
    message.accept = prepare_accept_content(accept)
    return message


def charge(message, queue: str, tokens: int, window: float) -> None:
    """The tokens a taken message's job was served, for its tenant's service in class `queue` (fair intake): the
    estimate the take charged is replaced by `tokens`. Nothing on other transports or for a message without a
    fair header."""
    channel = getattr(message, "channel", None)
    info = (getattr(message, "headers", None) or {}).get("fair")
    if info and isinstance(channel, ClusterChannel):
        fair_queues.charge(channel.client, cluster_queues.list_key(queue), info[0], tokens - (info[3] or 0), window)
        return
    if not info or not _redis_channel(channel):
        return
    with channel.conn_or_acquire() as client:
        fair_queues.charge(client, queue, info[0], tokens - (info[3] or 0), window)


def unsort(channel, lanes: list[str]) -> int:
    """Put what the fair take sorted in for `lanes` back onto their lists (a worker taking FIFO); on Redis only."""
    if isinstance(channel, ClusterChannel):
        keys = [cluster_queues.list_key(lane) for lane in lanes]
        return sum(fair_queues.move_lane(channel.client, key, key) for key in keys)
    if not _redis_channel(channel):
        return 0
    with channel.conn_or_acquire() as client:
        return sum(fair_queues.move_lane(client, lane, lane) for lane in lanes)
