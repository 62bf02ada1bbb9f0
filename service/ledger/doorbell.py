"""Wakes idle workers the moment a job message is published, so an idle worker blocks instead of polling
its queues. The dispatcher rings after every publish: PUBLISH on a Redis channel (sent in the same round
trip as the message, see dispatch.py) and, for workers in this very process (embedded mode), a plain
in-process event. A ring names the queue the message went to ("" or None: any queue), so a worker takes only from
the queues rung since it last found them empty; a missed ring costs at most the worker's fallback poll interval,
when it looks at every queue again, so nothing depends on it for correctness.

On a Redis Cluster the doorbell is one sharded channel per shared queue (cluster_queues.doorbell_channel:
SPUBLISH/SSUBSCRIBE, on the slot of the queue's own keys, so the publisher's LPUSH and its ring go to the same master in one round trip), and a
worker listens to the channels of the queues it consumes: rings spread over the masters with the queues, and no master
relays every ring to every worker."""
import logging
import threading

from .cluster_queues import doorbell_channel

CHANNEL = "tidepool:doorbell"
SHARD_POLL = 0.02     # seconds a listener waits on one master's connection before the next one's (a cluster)
log = logging.getLogger(__name__)
_local: dict[threading.Event, object] = {}
_lock = threading.Lock()


def _nothing(_queue) -> None:
    pass


def ring_local(queue: str | None = None) -> None:
    with _lock:
        rings = list(_local.items())
    for event, on_ring in rings:
        on_ring(queue)
        event.set()


def register(event: threading.Event, on_ring=_nothing) -> None:
    """Set `event` whenever a job is published in this process, after on_ring(the queue, or None for any)."""
    with _lock:
        _local[event] = on_ring


def unregister(event: threading.Event) -> None:
    with _lock:
        _local.pop(event, None)


def ring(client, queue: str = "") -> None:
    """Ring for a message put back on `queue` outside the dispatcher (a requeue, a restore; "" any: on a cluster, where
    each queue has its own doorbell, a ring for any queue rings none, and the workers' full poll finds the message);
    errors are the poll's."""
    from .redis_conn import on_cluster
    try:
        if not on_cluster(client):
            client.publish(CHANNEL, queue)
        elif queue:
            client.spublish(doorbell_channel(queue), queue)
    except Exception:
        pass


def listen(url: str, event: threading.Event, stop: threading.Event, on_ring=_nothing,
           queues=()) -> threading.Thread:
    """A daemon thread that sets `event` whenever the Redis doorbell rings, until `stop`, after on_ring(the queue it
    names, or None for any); it reconnects after errors and rings for any queue on every (re)subscription, for
    messages published while it was not listening. queues: the shared queues whose doorbells a worker hears on a Redis
    Cluster."""

    def run():
        from . import redis_conn
        while not stop.is_set():
            pubsub = None
            try:
                client = redis_conn.client(url, socket_timeout=5, socket_connect_timeout=2)
                cluster = redis_conn.on_cluster(client)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                if cluster:
                    pubsub.ssubscribe(*(doorbell_channel(q) for q in queues))
                else:
                    pubsub.subscribe(CHANNEL)
                on_ring(None)
                event.set()
                while not stop.is_set():
                    if cluster:    # redis-py polls the masters' connections in turn: briefly each, when several
                        several = len(pubsub.node_pubsub_mapping) > 1
                        msg = pubsub.get_sharded_message(ignore_subscribe_messages=True,
                                                         timeout=SHARD_POLL if several else 1.0)
                    else:
                        msg = pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        data = msg.get("data")
                        on_ring((data.decode() if isinstance(data, bytes) else str(data or "")) or None)
                        event.set()
            except Exception as exc:  # Redis restarting: the worker polls meanwhile
                log.debug("doorbell: %s; listening again in 1 s", exc)
                stop.wait(1.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass

    thread = threading.Thread(target=run, name="tidepool-doorbell", daemon=True)
    thread.start()
    return thread
