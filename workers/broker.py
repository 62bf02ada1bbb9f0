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
"""
import json
import time

from tidepool.service.ledger import fair as fair_queues

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
    if exclude is not None and (fair is None or not _redis_channel(channel)):
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
    if not info or not _redis_channel(channel):
        return
    with channel.conn_or_acquire() as client:
        fair_queues.charge(client, queue, info[0], tokens - (info[3] or 0), window)


def unsort(channel, lanes: list[str]) -> int:
    """Put what the fair take sorted in for `lanes` back onto their lists (a worker taking FIFO); on Redis only."""
    if not _redis_channel(channel):
        return 0
    with channel.conn_or_acquire() as client:
        return sum(fair_queues.move_lane(client, lane, lane) for lane in lanes)
