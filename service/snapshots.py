"""Worker stats snapshots: what workers publish and what the API and panel read (Flask- and torch-free).

Contract: Redis hash SNAPSHOT_KEY, one field per worker name, value the JSON of a worker's snapshot
(`ts` in Unix seconds). Readers ignore snapshots older than SNAPSHOT_TTL. Without Redis (embedded mode)
the snapshots live in a process-local dict.
"""
import json
import threading
import time

SNAPSHOT_KEY = "tidepool:worker_stats"
SNAPSHOT_TTL = 30.0


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
