"""Service ingest benchmark: sustained POST /v1/jobs rate and latency against gunicorn + Postgres + Redis,
and the time to accept a 50,000-line batch (upload + validation + rows + dispatch).

    python benchmarks/service_ingest.py [--seconds 10] [--clients 16] [--workers 2] [--threads 32]

Goals: >= 1,000 jobs/s, p99 <= 50 ms, 50,000-line batch <= 10 s. Creates and drops its own database.
gunicorn runs as the Procfile's web process does (gthread, 2 workers x 32 threads) unless told otherwise.
Clients run for --warmup seconds before the measured --seconds. Besides the rate it prints the CPU time
each accepted job cost the web workers, the Postgres backends, Redis and the client (read from /proc, and
Redis INFO, on Linux with everything local); on a shared machine that is the steadier number. The server's
JSON log lines go to a file (its path is printed), not to this terminal.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import psycopg
import redis
from results import record  # noqa: E402

PG = "postgresql://postgres@127.0.0.1:5432"
DB = "tidepool_bench"
REDIS = "redis://127.0.0.1:6379/11"
ADMIN = "bench-admin"


def _pg(sql):
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def _request(conn, method, path, body=None, headers=None, raw=None, ctype="application/json"):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": ctype, **(headers or {})})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null")


def _proc_cpu(pid) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone or not on Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _children(pid) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class CpuMeter:
    """CPU seconds spent by the gunicorn master and workers, this database's Postgres backends (those alive
    at the end of the run; one that exits mid-run is missed), the Redis server (INFO; includes anyone else's
    use of it) and this client process."""

    def __init__(self, server_pid, redis_client):
        self.server_pid, self.redis = server_pid, redis_client

    def _backends(self) -> list[int]:
        try:
            with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
                return [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (DB,))]
        except Exception:
            return []

    def sample(self) -> dict:
        web = [self.server_pid] + _children(self.server_pid)
        info = self.redis.info("cpu")
        return {"web": {p: _proc_cpu(p) for p in web}, "pg": {p: _proc_cpu(p) for p in self._backends()},
                "redis": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                "client": time.process_time()}

    @staticmethod
    def per_job(a: dict, b: dict, jobs: int) -> str:
        def procs(key):
            return sum(cpu - a[key].get(pid, 0.0) for pid, cpu in b[key].items())
        parts = {"web": procs("web"), "postgres": procs("pg"), "redis": b["redis"] - a["redis"],
                 "client": b["client"] - a["client"]}
        total = sum(parts.values())
        return ("CPU per accepted job: " + ", ".join(f"{k} {v / jobs * 1000:.2f} ms" for k, v in parts.items())
                + f"; total {total / jobs * 1000:.2f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()

    _pg(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
    _pg(f"CREATE DATABASE {DB}")
    redis.Redis.from_url(REDIS).flushdb()
    env = {**os.environ, "TIDEPOOL_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{DB}",
           "TIDEPOOL_REDIS_URL": REDIS, "TIDEPOOL_ADMIN_TOKEN": ADMIN,
           "TIDEPOOL_STORAGE_DIR": tempfile.mkdtemp(prefix="tidepool-bench-")}
    bindir = os.path.dirname(sys.executable)
    subprocess.run([os.path.join(bindir, "tidepool"), "db", "upgrade"], env=env, check=True, capture_output=True)
    log_path = os.path.join(env["TIDEPOOL_STORAGE_DIR"], "server.log")
    server_log = open(log_path, "w")
    server = subprocess.Popen([os.path.join(bindir, "gunicorn"), "-w", str(args.workers), "-k", "gthread",
                               "--threads", str(args.threads), "--timeout", "120", "-b", f"127.0.0.1:{args.port}",
                               "tidepool.service.wsgi:app"], env=env, stdout=server_log, stderr=subprocess.STDOUT)
    print(f"gunicorn: {args.workers} workers x {args.threads} threads, {args.clients} clients; "
          f"server log {log_path}")
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", args.port)
        _, tenant = _request(conn, "POST", "/v1/admin/tenants", {"name": "bench"},
                             {"Authorization": f"Bearer {ADMIN}"})
        auth = {"Authorization": f"Bearer {tenant['api_key']}"}
        latencies = []
        meter = CpuMeter(server.pid, redis.Redis.from_url(REDIS))
        begin = time.perf_counter() + args.warmup
        stop = begin + args.seconds
        marks = {}
        barrier = threading.Barrier(args.clients, action=lambda: marks.update(start=time.perf_counter(),
                                                                                cpu=meter.sample()))

        def client():
            c = http.client.HTTPConnection("127.0.0.1", args.port)
            while time.perf_counter() < begin:  # warm-up: pools, prepared statements, caches
                status, _ = _request(c, "POST", "/v1/jobs", {"prompt": "Hello there", "max_tokens": 16}, auth)
                assert status == 202, status
            barrier.wait()
            mine = []
            while time.perf_counter() < stop:
                t = time.perf_counter()
                status, _ = _request(c, "POST", "/v1/jobs", {"prompt": "Hello there", "max_tokens": 16}, auth)
                assert status == 202, status
                mine.append(time.perf_counter() - t)
            latencies.extend(mine)

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - marks["start"]
        cpu_after = meter.sample()
        latencies.sort()
        rate = len(latencies) / elapsed
        p50, p99 = latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000
        print(f"POST /v1/jobs: {rate:.0f} jobs/s ({rate / 1000:.2f}x goal), p50 {p50:.1f} ms, "
              f"p99 {p99:.1f} ms ({50 / p99:.2f}x goal)")
        print(CpuMeter.per_job(marks["cpu"], cpu_after, len(latencies)))

        lines = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"prompt": "Hello there", "max_tokens": 16}}) for i in range(50_000))
        boundary = "benchboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + lines.encode() \
            + f"\r\n--{boundary}--\r\n".encode()
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
        t = time.perf_counter()
        status, f = _request(conn, "POST", "/v1/files", raw=body, headers=auth,
                             ctype=f"multipart/form-data; boundary={boundary}")
        assert status == 200, f
        status, b = _request(conn, "POST", "/v1/batches", {
            "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}, auth)
        dt = time.perf_counter() - t
        assert b["status"] == "in_progress" and b["request_counts"]["total"] == 50_000, b
        print(f"50,000-line batch accepted in {dt:.2f} s ({10 / dt:.2f}x goal)")
        record("service_ingest", {"workers": args.workers, "threads": args.threads, "clients": args.clients,
                                  "jobs_s": rate, "p50_ms": p50, "p99_ms": p99, "batch_50k_accept_s": dt})
    finally:
        server.terminate()
        server.wait(10)
        server_log.close()
        redis.Redis.from_url(REDIS).flushdb()
        _pg(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


if __name__ == "__main__":
    main()
