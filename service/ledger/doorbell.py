"""Wakes idle workers the moment a job message is published, so an idle worker blocks instead of polling
its queues. The dispatcher rings after every publish: PUBLISH on a Redis channel (sent in the same round
trip as the message, see dispatch.py) and, for workers in this very process (embedded mode), a plain
in-process event. A ring says only "look at your queues"; a missed one costs at most the worker's fallback
poll interval, so nothing depends on it for correctness."""
import logging
import threading

CHANNEL = "tidepool:doorbell"
log = logging.getLogger(__name__)
_local: set[threading.Event] = set()
_lock = threading.Lock()


def ring_local() -> None:
    with _lock:
        events = list(_local)
    for event in events:
        event.set()


def register(event: threading.Event) -> None:
    """Set `event` whenever a job is published in this process."""
    with _lock:
        _local.add(event)


def unregister(event: threading.Event) -> None:
    with _lock:
        _local.discard(event)


def listen(url: str, event: threading.Event, stop: threading.Event) -> threading.Thread:
    """A daemon thread that sets `event` whenever the Redis doorbell rings, until `stop`; it reconnects after
    errors and sets `event` on every (re)subscription, for messages published while it was not listening."""

    def run():
        import redis
        while not stop.is_set():
            pubsub = None
            try:
                pubsub = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2).pubsub(
                    ignore_subscribe_messages=True)
                pubsub.subscribe(CHANNEL)
                event.set()
                while not stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
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
