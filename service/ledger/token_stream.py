"""Token stream from a worker to the API process waiting on a job: Redis pub/sub, or an in-process hub
in embedded mode. Events are small dicts:

    {"t": "tok", "d": delta_text, "p": char offset of delta_text in the output}
        optional: "c" the choice index (n > 1; absent: 0), "l" the tokens' logprobs entries and "i" the first
        one's index in the choice's entries
    {"t": "end", "status": "completed" | "failed" | "cancelled" | "queued"}
        optional: "r" the result a completion wrote to the ledger (service/ledger/jobs.py complete's columns, with
        started_at, first_token_at and finished_at as Unix times), published after its commit

On Redis each web process has one inbox channel (`INBOX`), which its jobs' messages name as their reply_to: a worker
publishes at most one message per inbox per engine step (workers/streaming.py coalesces fast steps), a JSON list of
[job id, event] pairs for every stream of that process those steps advanced, and one listener thread per web process hands them to the waiting requests. A job whose
message names no inbox (one the sweeper republished) streams on its own channel (`CHANNEL`), which nobody listens
to: its waiter reads the ledger when the stream is quiet, as after any missed event.

On a Redis Cluster the same channels are sharded (SPUBLISH/SSUBSCRIBE): a channel lives on the master of its hash
slot, so the inboxes, whose names end in random hex, spread over the masters, and a message is relayed by its own
master alone (classic PUBLISH on a cluster goes to every node). A worker's pipeline of one step's inbox messages goes
to each master in one round trip.

Pub/sub is fire-and-forget: a waiter subscribes before its job is dispatched, and falls back to the
ledger (the source of truth) when the stream goes quiet. Never imports torch (the service uses it)."""
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time

CHANNEL = "tidepool:stream:{}"
INBOX = "tidepool:inbox:{}"

log = logging.getLogger(__name__)


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


class RedisStream:
    """Publishing (workers) and this process's inbox (web processes)."""

    def __init__(self, client):
        from .redis_conn import on_cluster
        self.client = client
        self.sharded = on_cluster(client)      # a Redis Cluster: SPUBLISH / SSUBSCRIBE
        self.lock = threading.Lock()
        self.pid, self.listener = None, None

    @property
    def hub(self) -> "LocalStream":
        return LOCAL     # the process's waiters, whichever inbox (or thread of this process) their events come by

    def publish(self, job_id: str, event: dict) -> None:
        """One event of a job whose message names no inbox: to its waiter in this process, else on its channel."""
        if self.hub.listening(job_id):
            self.hub.publish(job_id, event)
        else:
            (self.client.spublish if self.sharded else self.client.publish)(CHANNEL.format(job_id), dumps(event))

    def publish_inboxes(self, batches: dict[str, list]) -> None:
        """inbox -> [job id, event] pairs for the streams of that web process: one message per inbox, in one round
        trip."""
        if len(batches) == 1:
            [(inbox, pairs)] = batches.items()
            (self.client.spublish if self.sharded else self.client.publish)(inbox, dumps(pairs))
            return
        pipe = self.client.pipeline(transaction=False)
        for inbox, pairs in batches.items():
            (pipe.spublish if self.sharded else pipe.publish)(inbox, dumps(pairs))
        pipe.execute()

    def listening(self, job_id: str) -> bool:
        """Whether a request of this process waits on the job's events."""
        return self.hub.listening(job_id)

    @property
    def inbox(self) -> str | None:
        """This process's inbox (the reply_to of the jobs it waits on), its listener started; None when Redis cannot
        be reached now (the waiter then reads the ledger)."""
        with self.lock:
            if self.pid != os.getpid():         # first use, or a forked child (gunicorn's workers)
                self.pid, self.listener = os.getpid(), None
            if self.listener is None or not self.listener.alive():
                try:
                    self.listener = Inbox(self.client, self.hub)
                except Exception as exc:  # Redis unreachable right now: the waiter polls the ledger instead
                    log.warning("token stream: no inbox: %s", exc)
                    self.listener = None
                    return None
            return self.listener.channel

    def subscribe(self, job_id: str) -> "LocalSubscription | Quiet":
        """The job's events from this process's inbox (subscribe before the job is dispatched with `inbox`)."""
        if self.inbox is None:
            return Quiet()
        return self.hub.subscribe(job_id)


class Inbox:
    """One web process's inbox: subscribed before the constructor returns, then read by a thread that hands each
    [job id, event] pair to the hub's waiters. Through a Redis restart it resubscribes; events published meanwhile
    are lost, and their waiters read the ledger. On a Redis Cluster an error ends it instead (its master failed over,
    say), and the next request opens a new inbox."""

    def __init__(self, client, hub: "LocalStream"):
        from .redis_conn import on_cluster
        self.hub = hub
        self.channel = INBOX.format(f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}")
        self.sharded = on_cluster(client)
        self.pubsub = client.pubsub(ignore_subscribe_messages=False)
        (self.pubsub.ssubscribe if self.sharded else self.pubsub.subscribe)(self.channel)
        end = time.monotonic() + 5
        while True:                # confirmed, so no event published after this returns can be missed
            msg = self._get(timeout=max(0.0, end - time.monotonic()))
            if msg is not None and msg.get("type") in ("subscribe", "ssubscribe"):
                break
            if time.monotonic() > end:
                self.pubsub.close()
                raise TimeoutError("the inbox subscription was not confirmed")
        self.stopped = False
        self.thread = threading.Thread(target=self._listen, name="tidepool-inbox", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def _close(self) -> None:
        self.stopped = True
        try:
            self.pubsub.close()
        except Exception:
            pass

    def _get(self, timeout):
        if self.sharded:     # (one channel: one master's connection)
            return self.pubsub.get_sharded_message(timeout=1.0 if timeout is None else timeout)
        return self.pubsub.get_message(timeout=timeout)

    def _listen(self) -> None:
        while not self.stopped:
            try:
                msg = self._get(timeout=None)     # blocks until a message (or the client's timeout)
            except Exception:  # Redis restarting, or quiet past the socket timeout: redis-py resubscribes on the next read
                if self.sharded:    # a cluster's master gone: this inbox ends, the next request opens a new one
                    self._close()
                    return
                time.sleep(0.1)
                continue
            if msg is None or msg.get("type") not in ("message", "smessage"):
                continue
            try:
                pairs = json.loads(msg["data"])
            except ValueError:
                continue
            for job_id, event in pairs:
                self.hub.publish(job_id, event)


class Quiet:
    """A subscription that never hears anything."""

    def get(self, timeout: float) -> None:
        time.sleep(timeout)

    def close(self) -> None:
        pass


class LocalStream:
    """The same interface between threads of one process (embedded mode)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subs: dict[str, list[queue.SimpleQueue]] = {}

    inbox = None     # one process: nothing to name in a job's message

    def publish(self, job_id: str, event: dict) -> None:
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
        for q in subs:
            q.put(event)

    def listening(self, job_id: str) -> bool:
        with self._lock:
            return bool(self._subs.get(job_id))

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


_streams: dict[tuple, RedisStream] = {}


def for_redis(client) -> RedisStream | LocalStream:
    """The stream over a Redis client's server (one per server and process, so a process has one inbox per Redis),
    or the process-wide in-process hub when there is none."""
    if client is None:
        return LOCAL
    pool = getattr(client, "connection_pool", None)
    if pool is None:     # a Redis Cluster: one stream per client (a process keeps one client of its cluster)
        server = ("cluster", id(client))
    else:
        kw = pool.connection_kwargs
        server = tuple(kw.get(k) for k in ("host", "port", "path", "db", "username"))
    stream = _streams.get(server)
    if stream is None:
        stream = _streams.setdefault(server, RedisStream(client))
    return stream
