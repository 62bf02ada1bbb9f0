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
