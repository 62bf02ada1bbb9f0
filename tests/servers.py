"""Private servers for the suites and the benchmarks: a free local port and a redis-server on it (no persistence,
so a restart on the same port comes back empty, as a crashed Redis without AOF does). Imports neither pytest nor
torch: benchmarks/load.py starts (and restarts) its Redis with these."""
import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, start: int = 7100, stop: int = 7200) -> int:
    """The first port from `start` with it and the next n - 1 free, their cluster bus ports (+10000) too."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    for base in range(start, stop - n + 1, n):
        if all(free(p) and free(p + 10000) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} free ports in {start}-{stop}")


def start_redis(port: int, cwd) -> subprocess.Popen:
    import redis
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=cwd)
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} did not come up")
            time.sleep(0.05)


class RedisCluster:
    """A local Redis Cluster of `masters` masters (each with `replicas` replicas) on consecutive ports from `port`,
    without persistence, created by `redis-cli --cluster create`; `url` names its first master (any node's URL names
    the cluster: service/ledger/redis_conn.py). close() stops every node and removes their files."""

    def __init__(self, port: int, cwd, masters: int = 3, replicas: int = 0):
        import redis
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="tidepool-cluster-", dir=cwd)
        self.ports = [port + i for i in range(masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for p in self.ports:
                self.start(p)
            for p in self.ports:
                self._wait(redis.Redis(port=p))
            subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
                            *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", str(replicas),
                            "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=30)
            deadline = time.monotonic() + 20
            while any(redis.Redis(port=p).info("cluster").get("cluster_enabled") != 1
                      or redis.Redis(port=p).cluster("info").get("cluster_state") != "ok" for p in self.ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not come up")
                time.sleep(0.05)
            # replicas in sync with their masters (a replica that never synced does not take over from its master)
            while any(redis.Redis(port=p).info("replication").get("master_link_status") not in (None, "up")
                      for p in self.ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster's replicas did not sync")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        self.url = f"redis://127.0.0.1:{self.ports[0]}"

    def start(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout",
             "1000", "--save", "", "--appendonly", "no", "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay",
             "0"], stdout=subprocess.DEVNULL, cwd=self.dir)

    @staticmethod
    def _wait(client) -> None:
        import redis
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("a cluster node did not come up")
                time.sleep(0.05)

    def flush(self) -> None:
        """Every master's keys gone (between tests)."""
        import redis
        for p in self.ports:
            client = redis.Redis(port=p)
            if client.info("replication").get("role") == "master":
                client.flushall()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
