"""Token stream from a worker to the API process waiting on a job: Redis pub/sub, or an in-process hub
in embedded mode. Events are small dicts:

    {"t": "tok", "d": delta_text, "p": char offset of delta_text in the output}
        optional: "c" the choice index (n > 1; absent: 0), "l" the tokens' logprob entries and "i" the first
        one's index in the choice's entries
    {"t": "end", "status": "completed" | "failed" | "cancelled" | "queued"}

Pub/sub is fire-and-forget: a waiter subscribes before its job is dispatched, and falls back to the
ledger (the source of truth) when the stream goes quiet. Never imports torch (the service uses it)."""
import json
import queue
import threading
import time

CHANNEL = "tidepool:stream:{}"


class RedisStream:
    def __init__(self, client):
        self.client = client

    def publish(self, job_id: str, event: dict) -> None:
        self.client.publish(CHANNEL.format(job_id), json.dumps(event, separators=(",", ":")))

    def subscribe(self, job_id: str) -> "RedisSubscription | Quiet":
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CHANNEL.format(job_id))
        except Exception:  # Redis unreachable right now: the waiter polls the ledger instead
            pubsub.close()
            return Quiet()
        return RedisSubscription(pubsub)


class Quiet:
    """A subscription that never hears anything."""

    def get(self, timeout: float) -> None:
        time.sleep(timeout)

    def close(self) -> None:
        pass


class RedisSubscription:
    def __init__(self, pubsub):
        self.pubsub = pubsub

    def get(self, timeout: float) -> dict | None:
        try:
            msg = self.pubsub.get_message(timeout=timeout)
        except Exception:  # Redis restarting: the waiter falls back to the ledger meanwhile
            time.sleep(timeout)
            return None
        return json.loads(msg["data"]) if msg and msg.get("type") == "message" else None

    def close(self) -> None:
        try:
            self.pubsub.unsubscribe()
            self.pubsub.close()
        except Exception:  # the connection may already be gone; nothing to release then
            pass


class LocalStream:
    """The same interface between threads of one process (embedded mode)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subs: dict[str, list[queue.SimpleQueue]] = {}

    def publish(self, job_id: str, event: dict) -> None:
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
        for q in subs:
            q.put(event)

    def subscribe(self, job_id: str) -> "LocalSubscription":
        q = queue.SimpleQueue()
        with self._lock:
            self._subs.setdefault(job_id, []).append(q)
        return LocalSubscription(self, job_id, q)

    def _drop(self, job_id: str, q) -> None:
        with self._lock:
            subs = self._subs.get(job_id, [])
            if q in subs:
                subs.remove(q)
            if not subs:
                self._subs.pop(job_id, None)


class LocalSubscription:
    def __init__(self, hub: LocalStream, job_id: str, q: queue.SimpleQueue):
        self.hub, self.job_id, self.q = hub, job_id, q

    def get(self, timeout: float) -> dict | None:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.hub._drop(self.job_id, self.q)


LOCAL = LocalStream()


def for_redis(client) -> RedisStream | LocalStream:
    """The stream for a Redis client, or the process-wide in-process hub when there is none."""
    return RedisStream(client) if client is not None else LOCAL
