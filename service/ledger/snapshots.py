"""Worker stats snapshots and heartbeats: what workers publish and what the API, the panel and beat read
(Flask- and torch-free).

Snapshots: Redis hash SNAPSHOT_KEY, one field per worker name, value the JSON of a worker's metrics snapshot
(`ts` in Unix seconds). Readers ignore snapshots older than SNAPSHOT_TTL.
Heartbeats: one Redis key per live worker, HEARTBEAT_KEY.format(name), value the JSON of Worker.stats()
(`name`, `at` in Unix seconds, `started_at`, `engine`: its engine's stats, ...), expiring unless renewed.
Without Redis (embedded mode) both live in process-local dicts.
"""
import json
import threading
import time

SNAPSHOT_KEY = "tidepool:worker_stats"
SNAPSHOT_TTL = 30.0
HEARTBEAT_KEY = "tidepool:worker:{}"


class SnapshotStore:
    """Where workers publish their latest stats: a Redis hash, or a process-local dict (embedded mode)."""

    _local: dict[str, str] = {}
    _lock = threading.Lock()

    def __init__(self, redis_client=None):
        self.redis = redis_client

    def put(self, snapshot: dict) -> None:
        data = json.dumps(snapshot)
        if self.redis is not None:
            self.redis.hset(SNAPSHOT_KEY, snapshot["worker"], data)
        else:
            with self._lock:
                self._local[snapshot["worker"]] = data

    def read(self, max_age: float = SNAPSHOT_TTL, now: float | None = None) -> list[dict]:
        if self.redis is not None:
            raw = list(self.redis.hgetall(SNAPSHOT_KEY).values())
        else:
            with self._lock:
                raw = list(self._local.values())
        now = time.time() if now is None else now
        snaps = [json.loads(r) for r in raw]
        return sorted((s for s in snaps if now - s.get("ts", 0) <= max_age), key=lambda s: s["worker"])

    def clear(self) -> None:
        if self.redis is not None:
            self.redis.delete(SNAPSHOT_KEY)
        else:
            with self._lock:
                self._local.clear()


class Heartbeats:
    """Live workers' heartbeats: a key each in Redis (expiring after `ttl` seconds), or a process-local dict."""

    _local: dict[str, dict] = {}
    _lock = threading.Lock()

    def __init__(self, redis_client=None):
        self.redis = redis_client

    def put(self, stats: dict, ttl: int) -> None:
        if self.redis is not None:
            self.redis.set(HEARTBEAT_KEY.format(stats["name"]), json.dumps(stats), ex=ttl)
        else:
            with self._lock:
                self._local[stats["name"]] = stats

    def get(self, name: str) -> dict | None:
        if self.redis is not None:
            raw = self.redis.get(HEARTBEAT_KEY.format(name))
            return json.loads(raw) if raw else None
        with self._lock:
            return self._local.get(name)

    def delete(self, name: str) -> None:
        if self.redis is not None:
            self.redis.delete(HEARTBEAT_KEY.format(name))
        else:
            with self._lock:
                self._local.pop(name, None)

    def read(self) -> list[dict]:
        """Every heartbeat there is (Redis: not yet expired)."""
        if self.redis is None:
            with self._lock:
                return list(self._local.values())
        return [json.loads(raw) for key in self.redis.scan_iter(HEARTBEAT_KEY.format("*"), count=100)
                if (raw := self.redis.get(key))]
