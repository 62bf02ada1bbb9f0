"""Periodic upkeep that keeps the ledger and the broker consistent: the sweeper and the batch finaliser; and the
fleet planner, which sizes every pool once a minute (service/ledger/fleet.py, service/ledger/planner.py).
Plain functions over a process's services (service/ledger/services.py: ledger database, dispatcher, storage,
Redis); `tidepool beat` runs them as Celery beat tasks, embedded mode runs them on a thread."""
import json
import logging
import time
from datetime import datetime, timedelta, timezone

from kombu import Connection

from tidepool.service.ledger import (batches, cluster_queues, doorbell, files, fleet, jobs, partitions, planner,
                                     redis_conn)
from tidepool.service.ledger.database import session
from tidepool.service.ledger.services import Services

log = logging.getLogger(__name__)
EPOCH_KEY = "tidepool:broker_epoch"
STALE_VALIDATING = 600.0   # seconds after which a batch still validating is failed
ORPHAN_GRACE = 10.0   # seconds a taken message may wait for its worker's first heartbeat


def sweep(services: Services, republish_after: float = 30.0, max_attempts: int = 3,
          visibility_timeout: float | None = None, orphan_grace: float = ORPHAN_GRACE) -> dict:
    """Requeue (or fail) running jobs whose lease lapsed, expire overdue jobs and batches, delete expired files,
    return unacked messages of dead consumers to their queues, and republish what never reached the broker."""
    done = {"reclaimed": 0, "expired": 0, "batches_expired": 0, "batches_failed": 0, "restored_broker": 0, "restored_orphans": 0,
            "republished": 0, "private_drained": 0, "files_expired": 0}
    with session(services.database) as s:
        done["reclaimed"] = jobs.reclaim_lapsed(s, max_attempts=max_attempts)
        done["expired"] = jobs.expire_overdue(s)
        done["batches_failed"] = batches.fail_stale_validating(s, timedelta(seconds=STALE_VALIDATING))
        done["batches_expired"] = batches.expire_overdue(s)
        s.commit()
        done["files_expired"] = files.delete_expired(s, services.storage)
    if visibility_timeout is not None:
        _restore_visible(services, visibility_timeout)
    done["restored_orphans"] = restore_orphans(services, grace=orphan_grace)
    done["private_drained"] = drain_private_queues(services)
    done["restored_broker"] = _check_broker_epoch(services)
    done["republished"] = services.dispatcher.republish_undispatched(older_than=republish_after)
    if any(done.values()):
        log.info("sweep: %s", done)
    return done


def _restore_visible(services: Services, visibility_timeout: float) -> None:
    from tidepool.service.ledger.wire import transport_options
    url = services.config.broker_url
    if not url.startswith("redis"):
        return
    if redis_conn.on_cluster(services.redis):     # each queue's unacked set (service/ledger/cluster_queues.py)
        if cluster_queues.restore_visible(services.redis, visibility_timeout):
            doorbell.ring(services.redis)
        return
    with Connection(url, transport_options=transport_options(visibility_timeout)) as conn:
        conn.default_channel.qos.restore_visible(num=1000, interval=1)


def restore_orphans(services: Services, grace: float = ORPHAN_GRACE) -> int:
    """Unacked messages (taken more than `grace` seconds ago) of a worker whose heartbeat is gone, or belongs
    to a later start of a worker of that name, go back to the front of their queues now: a worker killed
    between taking a message and claiming its job would otherwise strand the job until the visibility
    timeout (6 h). A message of a live worker restored by mistake costs a duplicate, dropped at claim."""
    from tidepool.workers.broker import OWNERS_KEY
    from tidepool.service.ledger.snapshots import Heartbeats
    from tidepool.service.ledger.wire import transport_options
    client, url = services.redis, services.config.broker_url
    if client is None or not url.startswith("redis"):
        return 0
    restored = 0
    heartbeats = Heartbeats(client)
    if redis_conn.on_cluster(client):      # each queue's unacked set and owners (service/ledger/cluster_queues.py)
        started: dict[str, float | None] = {}

        def gone(name: str, started_at: float) -> bool:
            if name not in started:
                beat = heartbeats.get(name)
                started[name] = beat.get("started_at") if beat else None
            return started[name] != started_at

        restored = cluster_queues.restore_orphans(client, gone, grace)
        if restored:
            log.warning("returned %d unacked messages of dead workers to their queues", restored)
        return restored
    with Connection(url, transport_options=transport_options(6 * 3600)) as conn:
        qos = conn.default_channel.qos
        tags = client.zrangebyscore(qos.unacked_index_key, 0, time.time() - grace)
        owners = client.hmget(OWNERS_KEY, tags) if tags else []
        started: dict[str, float | None] = {}
        for tag, owner in zip(tags, owners):
            if owner is None:
                continue
            name, started_at = json.loads(owner)
            if name not in started:
                beat = heartbeats.get(name)
                started[name] = beat.get("started_at") if beat else None
            if started[name] != started_at:
                qos.restore_by_tag(tag, client, leftmost=True)
                client.hdel(OWNERS_KEY, tag)
                restored += 1
        # owners of messages acked (or restored) meanwhile
        known = client.hkeys(OWNERS_KEY)
        if known:
            live = client.hmget(qos.unacked_key, known)
            gone = [tag for tag, payload in zip(known, live) if payload is None]
            if gone:
                client.hdel(OWNERS_KEY, *gone)
    if restored:
        doorbell.ring(client)
        log.warning("returned %d unacked messages of dead workers to their queues", restored)
    return restored


def drain_private_queues(services: Services) -> int:
    """Messages waiting in the private queue of a worker whose heartbeat is gone (prefix affinity,
    service/ledger/affinity.py) go to the shared queue, where any worker takes them. Runs after restore_orphans, which
    returns a dead worker's unacked messages to the queue they came from, its private one among them."""
    from tidepool.service.ledger import affinity
    client, url = services.redis, services.config.broker_url
    if client is None or not url.startswith("redis"):
        return 0
    if redis_conn.on_cluster(client):      # the queues' keys under their hash tags
        moved = affinity.drain_dead(client, cluster_queues.list_key, cluster_queues.lane_of)
    else:
        moved = affinity.drain_dead(client)
    if moved:
        doorbell.ring(client)
        log.warning("moved %d messages from dead workers' private queues to the shared queues", moved)
    return moved


def _check_broker_epoch(services: Services) -> int:
    """A Redis without persistence that restarted has lost its queues: the epoch key is gone with them. On a Redis
    Cluster, a master replaced by its replica (or restarted) may have lost its last writes: its replication id
    changes (cluster_queues.master_replaced). Then every queued job is republished (duplicates of messages that
    survived are dropped at claim)."""
    client = services.redis
    if client is None:
        return 0
    lost = bool(client.set(EPOCH_KEY, str(time.time()), nx=True))
    if redis_conn.on_cluster(client) and cluster_queues.master_replaced(client):
        log.warning("a Redis Cluster master was replaced: republishing every queued job")
        lost = True
    if not lost:
        return 0
    with session(services.database) as s:
        n = jobs.undispatch_all(s)
        s.commit()
    if n:
        log.warning("broker epoch missing (new or restarted broker): republishing %d queued jobs", n)
        services.dispatcher.republish_undispatched(older_than=0)
    return n


def finalize_batches(services: Services) -> int:
    """Write output and error files for every batch whose jobs are all terminal."""
    storage, model = services.storage, services.config.served_model_name
    closed = 0
    with session(services.database) as s:
        for batch_id in batches.open_ids(s):
            batch = batches.locked(s, batch_id)
            if batch is not None and batches.finalize(s, storage, batch, model):
                closed += 1
            s.commit()
    return closed


def plan_fleet(services: Services, time_limit: float = planner.DEFAULT_TIME_LIMIT, now: float | None = None,
               durations: list[float] | None = None) -> dict:
    """Decide the workers of every pool over the next day (or the given intervals: a compressed tide) and store the
    plan, which the web's /metrics exports as tidepool:desired_workers{pool}; returns the stored plan."""
    from tidepool.service.ledger.models import utcnow
    from tidepool.service.ledger.snapshots import Heartbeats
    cfg = services.config
    default = cfg.served_model_name
    models = {e.name: e.tier for e in services.registry.entries().values() if e.enabled}
    store = fleet.PlanStore(services.redis)
    beats = Heartbeats(services.redis).read()
    stored, previous = store.rates()
    rates = stored | fleet.measured_rates(beats, default)
    served, samples = fleet.served_rates(beats, previous, default)
    for pool, rate in served.items():
        rates[pool] = min(rates.get(pool, rate), rate)
    at = utcnow() if now is None else datetime.fromtimestamp(now, timezone.utc)
    with session(services.database) as s:
        history = fleet.arrival_history(s, at, default)
        recent = fleet.recent_rates(s, at, default, durations[0] if durations else fleet.RECENT_S)
        work = fleet.queued_work(s, default)
    problem, starts = fleet.build(models, fleet.parse_pools(cfg.planner_pools), rates, history, recent, work,
                                  at.timestamp(), durations)
    result = planner.plan(problem, time_limit)
    plan = fleet.plan_json(problem, result, starts, at.timestamp(), samples)
    store.put(plan)
    log.info("fleet plan (%s, %.3f s): %s", result.method, result.solve_s, result.desired)
    return plan


def create_partitions(services: Services) -> list[str]:
    """Postgres: the current month's job partition and the next few, where missing (service/ledger/partitions.py)."""
    return partitions.ensure_ahead(services.database)


def run_forever(services: Services, interval: float = 5.0, stop=None, **sweep_kwargs) -> None:
    """Embedded mode: the same upkeep on a thread (the fleet plan too: the panel shows it)."""
    next_plan = 0.0
    while stop is None or not stop.is_set():
        try:
            sweep(services, **sweep_kwargs)
            finalize_batches(services)
            if time.monotonic() >= next_plan:
                next_plan = time.monotonic() + fleet.PLAN_INTERVAL
                plan_fleet(services)
            create_partitions(services)
        except Exception:
            log.exception("upkeep failed; retrying")
        if stop is not None:
            stop.wait(interval)
        else:
            time.sleep(interval)
