"""Outbox: after a job row commits, publish a Celery message carrying only its id to its SLA queue,
then record dispatched_at. republish_undispatched() is what the sweeper calls for lost publishes.

dispatched_at only tells the sweeper not to republish. Recording it late or never costs at most one
duplicate message after TIDEPOOL_REPUBLISH_AFTER, which a worker drops at claim (jobs.start is a guarded
queued → running UPDATE, and completion is guarded by the lease). Recording it wrongly, for a queued job
whose message is gone, would strand the job. So the one-job hot path (publish_one, POST /v1/jobs on Postgres)
records it in the background, batched (MarkFlusher), and only on a row nobody changed since its INSERT
(same xmin) or that has left the queued state: a worker that claimed the job and handed it back for
republishing (throttled, retried) has changed the row, and its request wins."""
import atexit
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from datetime import timedelta

from celery import Celery
from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from . import affinity, cluster_queues, doorbell, fair as fair_queues, redis_conn
from .settings import Config
from .models import SLA_CLASSES, Batch, Job, JobStatus, Tenant, utcnow
from .wire import make_celery, publish_task as _publish_task, task_message  # noqa: F401 (make_celery: create_app)

log = logging.getLogger(__name__)


def queue_name(sla_class: str, model: str | None = None) -> str:
    """The broker queue of one SLA class of one model; every producer and consumer of a queue name comes here.
    model None is the deployment's default model (TIDEPOOL_MODEL), whose queues keep the bare class names, so a
    one-model deployment routes exactly as before the registry; any other registered model gets
    `<class>@<model>` (registry names never hold '@')."""
    return sla_class if model is None else f"{sla_class}@{model}"


# Marks one flush records (or skips): on a row left untouched since its INSERT (xmin) or no longer queued. The id
# range (the flush's smallest and largest id) lets Postgres skip every month partition but the marks' own.
_MARK_SQL = """
UPDATE jobs SET dispatched_at = m.at
FROM unnest(%(ids)s::varchar[], %(xmins)s::text[], %(ats)s::timestamptz[]) AS m(id, x, at)
WHERE jobs.id = m.id AND jobs.id BETWEEN %(lo)s AND %(hi)s AND jobs.dispatched_at IS NULL
  AND (jobs.status <> 'queued' OR jobs.xmin::text = m.x)
"""
MARK_INTERVAL = Config.mark_interval  # seconds between two flushes of dispatched_at marks (TIDEPOOL_MARK_INTERVAL)
MARK_HOLD = 1.0     # seconds a mark waits for its job to leave the queue (well inside TIDEPOOL_REPUBLISH_AFTER)


class MarkFlusher:
    """Records dispatched_at for published jobs on a background thread. The mark of a job a request waits on waits
    `hold` seconds first: if the job left the queue meanwhile it needs none (`discard`: the waiting request heard it
    start). What is due goes in one UPDATE per flush, at most one flush per `interval`, committed without waiting
    for the WAL flush (a lost mark is a duplicate message, never a lost job). The thread starts on demand (also
    after a fork) and ends when idle; whatever is pending is flushed at interpreter exit."""

    def __init__(self, engine: Engine, interval: float = MARK_INTERVAL, idle_exit: float = 5.0,
                 hold: float = MARK_HOLD):
        self.engine, self.interval, self.idle_exit, self.hold = engine, interval, idle_exit, hold
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.pending: dict[str, tuple[str, object, float]] = {}    # job id -> (xmin, published at, due: monotonic)
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()
        self.background = True  # False: marks wait for an explicit flush() (tests)
        self.flushed = self.skipped = self.discarded = 0
        _flushers.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's thread is not running here and its lock may be held."""
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.pid, self.pending, self.thread = os.getpid(), {}, None

    def add(self, job_id: str, xmin: str, hold: bool = False) -> None:
        """hold: a request waits on the job, and discards its mark when it hears the job start."""
        with self.lock:
            self.pending[job_id] = (xmin, utcnow(), time.monotonic() + (self.hold if hold else 0.0))
            if self.thread is None and self.background:
                self.thread = threading.Thread(target=self._run, name="tidepool-mark-flusher", daemon=True)
                self.thread.start()
        self.wake.set()

    def discard(self, job_id: str) -> None:
        """The job left the queue: its mark is not needed."""
        with self.lock:
            if self.pending.pop(job_id, None) is not None:
                self.discarded += 1

    def _run(self) -> None:
        last = float("-inf")
        while True:
            with self.lock:
                due = min((mark[2] for mark in self.pending.values()), default=None)
                if due is None:
                    self.wake.clear()
            if due is None:
                if not self.wake.wait(self.idle_exit):
                    with self.lock:
                        if not self.pending:
                            self.thread = None
                            return
                continue
            delay = max(due, last + self.interval) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            last = time.monotonic()
            self.flush(due_only=True)

    def flush(self, due_only: bool = False) -> int:
        """Record the pending marks (due_only: those whose hold is over; else all) now; returns how many."""
        now = time.monotonic()
        with self.lock:
            due = [job_id for job_id, mark in self.pending.items() if not due_only or mark[2] <= now]
            batch = [(job_id, *self.pending.pop(job_id)[:2]) for job_id in due]
        if not batch:
            return 0
        ids, xmins, ats = (list(col) for col in zip(*batch))
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                marked = conn.exec_driver_sql(_MARK_SQL, {"ids": ids, "xmins": xmins, "ats": ats,
                                                            "lo": min(ids), "hi": max(ids)}).rowcount
            self.flushed += marked
            self.skipped += len(batch) - marked
        except Exception:  # the sweeper republishes them: one duplicate message each, dropped at claim
            log.exception("recording dispatched_at for %d jobs failed", len(batch))
        return len(batch)


_flushers: "weakref.WeakSet[MarkFlusher]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    for flusher in list(_flushers):
        flusher._after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


@atexit.register
def _flush_at_exit() -> None:
    for flusher in list(_flushers):
        if flusher.pid == os.getpid():
            try:
                flusher.flush()
            except Exception:
                pass


def _lpush(client, key: str, value: str, ring: bool = False) -> None:
    """client.lpush(key, value) on one pooled connection without redis-py's per-command wrappers (retry,
    observability), about half its CPU; a connection that failed is disconnected before it goes back.
    ring: PUBLISH on the workers' doorbell too, in the same round trip."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        if ring:
            conn.send_packed_command(conn.pack_commands([("LPUSH", key, value), ("PUBLISH", doorbell.CHANNEL, key)]))
            conn.read_response()
        else:
            conn.send_command("LPUSH", key, value)
        conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class Dispatcher:
    def __init__(self, celery: Celery, engine: Engine, chunk_size: int = 1000,
                 mark_interval: float | None = None, default_model: str | None = None):
        self.celery, self.engine, self.chunk_size = celery, engine, chunk_size
        self.default_model = default_model   # its jobs keep the bare class queues (queue_name)
        if mark_interval is None:
            mark_interval = MARK_INTERVAL
        self.marks = MarkFlusher(engine, mark_interval) if engine.dialect.name == "postgresql" else None
        self._direct = None
        self._direct_lock = threading.Lock()
        self.affinity = True     # prefix-affinity routing of keyed jobs (service/ledger/affinity.py); False: shared queues
        self.router: affinity.Router | None = None
        self._cluster: bool | None = None

    def _direct_client(self):
        """A Redis client for publish_one when the broker is plain Redis (no transport options that change
        where or how kombu writes a message); None otherwise."""
        if self._direct is None:
            with self._direct_lock:
                if self._direct is None:
                    url = str(self.celery.conf.broker_url or "")
                    client = False
                    if url.startswith(("redis://", "rediss://", "unix://")) \
                            and not self.celery.conf.broker_transport_options:
                        client = redis_conn.client(url, socket_timeout=5, socket_connect_timeout=2)
                    self._direct = client
        return self._direct or None

    @property
    def cluster(self) -> bool:
        """Whether the broker is a Redis Cluster: then messages go straight onto their lists with their hash tags
        (service/ledger/cluster_queues.py), never through kombu's producer."""
        if self._cluster is None:
            self._cluster = redis_conn.on_cluster(self._direct_client())
        return self._cluster

    def route(self, queue: str, prefix: str | None) -> str:
        """Where a job of `queue` whose prompt has prefix key `prefix` (affinity.prefix_key) is published: the
        private queue of the worker holding that prefix, or `queue` itself (affinity.Router)."""
        if prefix is None or not self.affinity:
            return queue
        if self.router is None:
            client = self._direct_client()
            if client is None:   # embedded mode: one worker, nothing to choose
                return queue
            self.router = affinity.Router(client)
        return self.router.route(queue, prefix)

    def publish_one(self, job_id: str, queue: str, xmin: str | None = None, prefix: str | None = None,
                    fair: list | None = None, reply_to: str | None = None) -> bool:
        """Publish one job committed with the given xmin (Postgres) and record it dispatched in the
        background; True once the message is in the broker. Without an xmin or a plain Redis broker this is
        publish([(job_id, queue)]), which records dispatched_at before returning. prefix: the job's prefix
        key, for affinity routing; fair: its fair-intake header (fair.meta); reply_to: the inbox of the web process
        waiting on it (token_stream), on a plain Redis broker."""
        queue = self.route(queue, prefix)
        client = self._direct_client() if xmin is not None and self.marks is not None else None
        if client is None:
            return self.publish([(job_id, queue, None, fair)]) == 1
        try:
            message = task_message(job_id, queue, fair, reply_to or "")
            if self.cluster:
                cluster_queues.publish(client, [(queue, message)])
            else:
                _lpush(client, queue, message, ring=True)
        except Exception:  # the broker is down: the row stays undispatched and the sweeper retries
            log.exception("publishing job %s failed", job_id)
            return False
        doorbell.ring_local(queue)
        self.marks.add(job_id, xmin, hold=reply_to is not None)
        return True

    def publish(self, jobs: list[tuple]) -> int:
        """Publish (job_id, queue[, prefix key[, fair header]]) tuples (routed by prefix key), in chunks
        over one producer connection and mark each chunk dispatched once it reached the broker. Returns how many were published; a broker
        failure is logged and leaves the rest undispatched for the sweeper."""
        if self.cluster:
            return self._publish_cluster(jobs)
        sent = 0
        try:
            with self.celery.producer_or_acquire() as producer:
                for i in range(0, len(jobs), self.chunk_size):
                    chunk = jobs[i:i + self.chunk_size]
                    with producer.batch(max_size=self.chunk_size):
                        for job_id, lane, header in self._routed(chunk):
                            _publish_task(producer, job_id, lane, header)
                    self._ring()
                    self._mark([job[0] for job in chunk])
                    sent += len(chunk)
        except Exception:  # the broker is down: the rows stay undispatched and the sweeper retries
            log.exception("publishing %d jobs failed; %d published", len(jobs), sent)
        return sent

    def _routed(self, chunk: list[tuple]) -> list[tuple]:
        """publish()'s (job_id, queue[, prefix key[, fair header]]) rows -> (job_id, its lane, fair header)."""
        return [(job_id, self.route(queue, extra[0] if extra else None), extra[1] if len(extra) > 1 else None)
                for job_id, queue, *extra in chunk]

    def _publish_cluster(self, jobs: list[tuple]) -> int:
        """publish() on a Redis Cluster: each chunk in one pipeline (a round trip per master), rung per queue."""
        client, sent = self._direct_client(), 0
        try:
            for i in range(0, len(jobs), self.chunk_size):
                chunk = jobs[i:i + self.chunk_size]
                cluster_queues.publish(client, [(lane, task_message(job_id, lane, header))
                                                for job_id, lane, header in self._routed(chunk)])
                doorbell.ring_local()
                self._mark([job[0] for job in chunk])
                sent += len(chunk)
        except Exception:  # the broker is down: the rows stay undispatched and the sweeper retries
            log.exception("publishing %d jobs failed; %d published", len(jobs), sent)
        return sent

    def _ring(self) -> None:
        doorbell.ring_local()
        client = self._direct_client()
        if client is not None:
            try:
                client.publish(doorbell.CHANNEL, "")
            except Exception:  # workers fall back to polling their queues
                pass

    def left_queue(self, job_id: str) -> None:
        """A waiting request heard its job start or end: the job's dispatched mark is not needed (MarkFlusher)."""
        if self.marks is not None:
            self.marks.discard(job_id)

    def _mark(self, ids: list[str]) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(Job).where(Job.id.in_(ids)).values(dispatched_at=utcnow()))

    def queue(self, sla_class: str, model: str | None = None) -> str:
        """The queue of a job of this class for this registry model (None or the default model: bare class)."""
        return queue_name(sla_class, None if model is None or model == self.default_model else model)

    def republish_undispatched(self, older_than: float = 30.0, limit: int = 10_000) -> int:
        """Sweeper hook: queued jobs committed more than `older_than` seconds ago and never published."""
        cutoff = utcnow() - timedelta(seconds=older_than)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(Job.id, Job.sla_class, Job.model, Job.tenant_id, Tenant.weight, Job.deadline,
                       Batch.expires_at, Job.estimated_tokens)
                .join(Tenant, Tenant.id == Job.tenant_id).outerjoin(Batch, Batch.id == Job.batch_id)
                .where(Job.status == JobStatus.queued, Job.dispatched_at.is_(None), Job.queued_at <= cutoff)
                .order_by(Job.id).limit(limit)).all()
        return self.publish([(job_id, self.queue(sla.value, model), None,
                              fair_queues.meta(tenant, weight, deadline or expires, tokens))
                             for job_id, sla, model, tenant, weight, deadline, expires, tokens in rows])

    def model_depths(self, models) -> list[dict]:
        """Messages waiting per (model, SLA class) for the given registry model names."""
        pairs = [(m, c, self.queue(c, m)) for m in models for c in SLA_CLASSES]
        depths = self.queue_depths([q for _, _, q in pairs])
        return [{"model": m, "sla_class": c, "queue": q, "depth": depths.get(q, 0)} for m, c, q in pairs]

    def queue_depths(self, queues=SLA_CLASSES) -> dict[str, int]:
        """Messages waiting per shared queue, counting those routed to a worker's private queue of it."""
        depths = defaultdict(int)
        if self.cluster:      # (kombu has no cluster transport: the lists under their hash tags)
            for q in queues:
                try:
                    depths[q] = int(self._direct_client().llen(cluster_queues.list_key(q)))
                except Exception:
                    depths[q] = 0
        else:
            with self.celery.connection_for_read() as conn:
                channel = conn.default_channel
                for q in queues:
                    try:
                        depths[q] = int(channel._size(q))
                    except Exception:
                        depths[q] = 0
        for name, depth in self.private_depths().items():
            shared = affinity.split_private(name)[0]
            if shared in depths:
                depths[shared] += depth
        for lane, tenants in self.fair_backlogs().items():     # sorted in by the fair take (fair.py)
            parts = affinity.split_private(lane)
            shared = lane if parts is None else parts[0]
            if shared in depths:
                depths[shared] += sum(tenants.values())
        return dict(depths)

    def fair_backlogs(self) -> dict[str, dict[str, int]]:
        """lane -> {tenant: jobs waiting} of what the fair take sorted in; {} without a plain Redis broker."""
        if self.cluster:      # lanes by name, not by key ({queue})
            return {cluster_queues.lane_of(key): tenants
                    for key, tenants in self._direct_read(fair_queues.lane_backlogs).items()}
        return self._direct_read(fair_queues.lane_backlogs)

    def private_depths(self) -> dict[str, int]:
        """Messages waiting in each worker's private queue (affinity routing); {} without a plain Redis broker."""
        if self.cluster:      # lanes by name, not by key
            return self._direct_read(lambda client: affinity.private_depths(client, cluster_queues.lane_of))
        return self._direct_read(affinity.private_depths)

    def _direct_read(self, read) -> dict:
        client = self._direct_client()
        if client is None:
            return {}
        try:
            return read(client)
        except Exception:     # the broker is down: the shared depths say so already
            return {}

    def ping(self) -> None:
        if self.cluster:
            self._direct_client().ping()
            return
        with self.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
