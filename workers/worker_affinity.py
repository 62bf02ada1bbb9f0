"""A worker's side of prefix-affinity routing (service/ledger/affinity.py): the queues it consumes (its private queue
of each class before the shared one), the prefix keys of the jobs it claimed, what its heartbeat advertises,
and, when it stops, its private queues handed back to the shared ones. The worker translates ledger jobs into
keys here; the engine knows nothing of it."""
import logging

from tidepool.service.ledger import affinity, cluster_queues, fair, redis_conn

log = logging.getLogger(__name__)


class WorkerAffinity:
    def __init__(self, name: str, queues: tuple[str, ...], redis_client=None, broker_url: str = "",
                 seats: int = 1):
        self.name, self.queues, self.redis, self.seats = name, tuple(queues), redis_client, seats
        # Only over a Redis broker that the heartbeat's Redis can see: otherwise nobody can route here.
        self.on = redis_client is not None and broker_url.startswith(("redis://", "rediss://", "unix://"))
        # a queue's Redis key: its name, or on a Redis Cluster its name under the class's hash tag
        self.key = cluster_queues.list_key if redis_conn.on_cluster(redis_client) else str
        self.memory = affinity.PrefixMemory()

    def lanes(self, queue: str) -> tuple[str, ...]:
        """The queues to take class `queue`'s messages from, in order."""
        return (affinity.private_queue(queue, self.name), queue) if self.on else (queue,)

    def private_queues(self) -> list[str]:
        return [affinity.private_queue(q, self.name) for q in self.queues] if self.on else []

    def claimed(self, tenant_id: str, prefix_cache_group: str | None, endpoint: str, body: dict) -> None:
        if self.on:
            self.memory.add(affinity.job_prefix_key(tenant_id, prefix_cache_group, endpoint, body))

    def stats(self) -> dict:
        """Heartbeat fields: the newest prefix keys, the messages waiting in its private queues, its seats."""
        if not self.on:
            return {}
        backlog = 0
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for name in self.private_queues():
                    pipe.llen(self.key(name))
                backlog = sum(int(n or 0) for n in pipe.execute())
            keys = [self.key(name) for name in self.private_queues()]
            backlog += sum(sum(t.values()) for t in fair.lane_backlogs(self.redis, keys).values())
        except Exception:
            pass
        return {"prefixes": self.memory.newest(), "private_backlog": backlog, "seats": self.seats}

    def hand_back(self) -> int:
        """Stopping: what waits in the private queues goes to the shared ones (beat does it for the dead)."""
        moved = 0
        for name in self.private_queues():
            try:
                moved += affinity.move_private(self.redis, name, self.key)
            except Exception as exc:   # beat's drain_dead moves them once the heartbeat is gone
                log.warning("worker %s: handing back %s failed: %s", self.name, name, exc)
        return moved
