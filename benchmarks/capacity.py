"""Capacity model: what one accepted job costs each shared part, and what one Postgres and one Redis carry.

    python benchmarks/capacity.py [--online 300] [--lines 2000] [--pg-cores 16] [--wal-mb-s 200]
                                  [--tokens-per-job 500] [--gpu-tokens-s 2500] [--clients 16] [--statements]
                                  [--redis-cluster N]

Runs the production shape on private servers, so the counters are this run's alone: a Postgres cluster
(initdb in a temporary folder, pg_stat_statements preloaded), a redis-server, gunicorn (the Procfile's web
process), one `tidepool worker` over a tiny random-weight model and `tidepool beat`. Two phases, each
measured from a quiet start until every job is terminal (a batch: until it is finalised): online
`/v1/completions` requests (twice: --max-tokens and --long-tokens, whose difference is the cost of each
streamed token, added for the projection's online jobs of --tokens-per-job; --clients requests at a time, so
that many streams share each worker step), and the lines of one batch. --statements lists each phase's
statements and Redis commands per job, by query and by command. Per job it prints web CPU, Postgres statements,
transactions, WAL bytes and backend CPU, Redis commands, network bytes and CPU (an idle window of the same
length, measured first, is subtracted: beat's sweeps and heartbeats). Then the projection: jobs/s (and
tokens/s at --tokens-per-job) that one Postgres with --pg-cores cores and --wal-mb-s of WAL, one Redis (one
core: Redis runs commands on one thread) and one web core carry, the GPU workers that rate feeds at
--gpu-tokens-s per worker, and the part that saturates first. CPU figures come from /proc (Linux); on a
shared machine they include its noise, the counts (statements, commands, bytes) do not.

--redis-cluster N runs a local Redis Cluster of N masters instead of the one redis-server (TIDEPOOL_REDIS_URL names
its first node; service/ledger/cluster_queues.py): Redis figures are summed over the masters, and the projection's
Redis limit is the cluster's, two ways: `Redis CPU`, the cluster's N cores with the load spread evenly over the masters
(a fleet's many (model, class) queues and web processes' inboxes hash over them), and `Redis busiest master`, one core
of the master this run loaded most (where this run's one model's queues and inboxes happened to hash).
"""
import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psycopg
import redis
from results import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ADMIN = "capacity-admin"
PG_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1] if Path("/usr/lib/postgresql").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree(pid: int) -> list[int]:
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                out += tree(int(child))
    except OSError:
        pass
    return out


class Postgres:
    """A private cluster; as root, initdb and postgres run as the `postgres` user."""

    def __init__(self, tmp: Path):
        self.dir, self.port = tmp / "pg", free_port()
        self.dir.mkdir()
        pre = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if pre:
            shutil.chown(tmp, "postgres")
            shutil.chown(self.dir, "postgres")
        subprocess.run(pre + [str(PG_BIN / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres", "-A", "trust"],
                       check=True, capture_output=True)
        self.proc = subprocess.Popen(pre + [str(PG_BIN / "postgres"), "-D", str(self.dir / "data"), "-p",
                                            str(self.port), "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1",
                                            "-c", "shared_preload_libraries=pg_stat_statements",
                                            "-c", "max_connections=200"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "w"))
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}"
        for _ in range(100):
            try:
                psycopg.connect(f"{self.dsn}/postgres").close()
                break
            except psycopg.OperationalError:
                time.sleep(0.1)
        with psycopg.connect(f"{self.dsn}/postgres", autocommit=True) as c:
            c.execute("CREATE DATABASE tidepool")
        with psycopg.connect(f"{self.dsn}/tidepool", autocommit=True) as c:
            c.execute("CREATE EXTENSION pg_stat_statements")

    def pid(self) -> int:
        return int((self.dir / "data" / "postmaster.pid").read_text().split()[0])

    def sample(self) -> dict:
        cpu = sum(proc_cpu(p) for p in tree(self.pid()))
        with psycopg.connect(f"{self.dsn}/tidepool", autocommit=True) as c:   # one statement, kept out of the sums
            calls, xacts, lsn = c.execute(
                "SELECT (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat%'),"
                " (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = 'tidepool'),"
                " pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        return {"pg_cpu": cpu, "pg_statements": float(calls), "pg_wal_bytes": float(lsn), "pg_xacts": float(xacts)}

    def statements(self) -> dict[str, float]:
        """Calls so far by normalised query text (pg_stat_statements)."""
        with psycopg.connect(f"{self.dsn}/tidepool", autocommit=True) as c:
            rows = c.execute("SELECT query, sum(calls) FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat%'"
                             " GROUP BY query").fetchall()
        return {q: float(n) for q, n in rows}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)


def redis_commands(nodes) -> dict[str, float]:
    """Calls so far by command, summed over `nodes` (redis.Redis clients: the server, or each master of a cluster)."""
    out: dict[str, float] = {}
    for client in nodes:
        for k, v in client.info("commandstats").items():
            out[k.removeprefix("cmdstat_")] = out.get(k.removeprefix("cmdstat_"), 0.0) + float(v["calls"])
    return out


def breakdown(before: dict, after: dict, n: int, top: int = 25) -> list[tuple[float, str]]:
    """(calls per job, name) of what grew between two counts, most first."""
    rows = [((after[k] - before.get(k, 0.0)) / n, k) for k in after]
    return sorted((r for r in rows if r[0] >= 0.005), reverse=True)[:top]


def redis_sample(nodes) -> dict:
    """CPU, commands and bytes summed over `nodes`, and each node's CPU (`redis_cpu@i`: the busiest master's load)."""
    out = {"redis_cpu": 0.0, "redis_commands": 0.0, "redis_bytes": 0.0}
    for i, client in enumerate(nodes):
        stats, cpu, cmds = client.info("stats"), client.info("cpu"), client.info("commandstats")
        calls = sum(v["calls"] for k, v in cmds.items() if k not in ("cmdstat_info", "cmdstat_cluster"))
        out[f"redis_cpu@{i}"] = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
        out["redis_cpu"] += out[f"redis_cpu@{i}"]
        out["redis_commands"] += float(calls)
        out["redis_bytes"] += float(stats["total_net_input_bytes"] + stats["total_net_output_bytes"])
    return out


class Meter:
    def __init__(self, pg: Postgres, rc: list, web_pid: int):
        self.pg, self.redis, self.web_pid = pg, rc, web_pid

    def sample(self) -> dict:
        return {"web_cpu": sum(proc_cpu(p) for p in tree(self.web_pid)), **self.pg.sample(),
                **redis_sample(self.redis), "t": time.monotonic()}

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {k: b[k] - a[k] for k in a}


def wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def http(port, method, path, body=None, key=None, raw=None, ctype="application/json", timeout=120):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": ctype, **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def unfinished(pg: Postgres) -> int:
    with psycopg.connect(f"{pg.dsn}/tidepool", autocommit=True) as c:
        return c.execute("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')").fetchone()[0]


FIELDS = [("web_cpu", "web CPU ms", 1000), ("pg_statements", "Postgres statements", 1), ("pg_xacts", "Postgres "
          "transactions", 1), ("pg_wal_bytes", "Postgres WAL bytes", 1), ("pg_cpu", "Postgres CPU ms", 1000),
          ("redis_commands", "Redis commands", 1), ("redis_bytes", "Redis bytes in+out", 1),
          ("redis_cpu", "Redis CPU ms", 1000)]


def per_job(d: dict, idle: dict, n: int) -> dict:
    """Per-job cost, the idle rate over the phase's duration taken off first (never below zero)."""
    rate = {k: idle[k] / idle["t"] for k in idle if k != "t"}
    return {k: max(0.0, (d[k] - rate[k] * d["t"])) / n for k in d if k != "t"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--online", type=int, default=300)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=36)
    ap.add_argument("--pg-cores", type=float, default=16)
    ap.add_argument("--wal-mb-s", type=float, default=200)
    ap.add_argument("--tokens-per-job", type=float, default=500)
    ap.add_argument("--gpu-tokens-s", type=float, default=2500)
    ap.add_argument("--idle", type=float, default=6)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--statements", action="store_true")
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="a local Redis Cluster of N masters instead of one redis-server")
    args = ap.parse_args()
    if PG_BIN is None:
        raise SystemExit("needs a local PostgreSQL installation (/usr/lib/postgresql/*/bin)")

    tmp = Path(tempfile.mkdtemp(prefix="tidepool-capacity-"))
    procs, pg, cluster = [], None, None
    try:
        pg = Postgres(tmp)
        if args.redis_cluster:
            from tests.servers import RedisCluster, free_ports
            cluster = RedisCluster(free_ports(args.redis_cluster, start=7100), tmp, masters=args.redis_cluster)
            rurl, rc = cluster.url, [redis.Redis(port=p) for p in cluster.ports]
        else:
            rport = free_port()
            procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=tmp))
            rurl = f"redis://127.0.0.1:{rport}/0"
            rc = [redis.Redis.from_url(rurl)]
            wait(lambda: _ping(rc[0]), 10, "redis")
        from tidepool.workers.tools.tiny_model import make_tiny_model
        model = str(make_tiny_model(str(tmp / "tiny"), seed=1))
        env = {**os.environ, "TIDEPOOL_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/tidepool",
               "TIDEPOOL_REDIS_URL": rurl, "TIDEPOOL_ADMIN_TOKEN": ADMIN, "TIDEPOOL_MODEL": model,
               "TIDEPOOL_STORAGE_DIR": str(tmp / "storage"), "TIDEPOOL_LOG_LEVEL": "WARNING",
               "TIDEPOOL_BEAT_SCHEDULE": str(tmp / "beat-schedule"), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        bindir = Path(sys.executable).parent
        subprocess.run([str(bindir / "tidepool"), "db", "upgrade"], env=env, check=True, capture_output=True)
        port = free_port()
        log = open(tmp / "processes.log", "w")
        web = subprocess.Popen([str(bindir / "gunicorn"), "-w", "2", "-k", "gthread", "--threads", "16", "-b",
                                f"127.0.0.1:{port}", "tidepool.service.wsgi:app"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append(web)
        for cmd in (["worker", "--kind", "gpu", "--device", "cpu"], ["beat"]):
            procs.append(subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", *cmd], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=tmp))
        wait(lambda: _ready(port), 120, "web ready with a worker engine up")
        key = http(port, "POST", "/v1/admin/tenants", {"name": "capacity"}, ADMIN)["api_key"]
        meter = Meter(pg, rc, web.pid)
        for i in range(20):     # warm-up: pools, caches, prepared statements
            http(port, "POST", "/v1/completions", {"prompt": f"warm {i}", "max_tokens": args.max_tokens}, key)
        time.sleep(2)

        a = meter.sample()
        time.sleep(args.idle)
        idle = Meter.delta(a, meter.sample())

        def online_phase(max_tokens: int) -> dict:      # completions from --clients threads
            a = meter.sample()
            queries, commands = pg.statements(), redis_commands(rc)
            todo = iter(range(args.online))
            lock = threading.Lock()

            def client():
                while True:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    http(port, "POST", "/v1/completions", {"prompt": f"online {i}", "max_tokens": max_tokens,
                                                           "ignore_eos": True}, key)
            threads = [threading.Thread(target=client) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wait(lambda: unfinished(pg) == 0, 300, "online jobs terminal")
            time.sleep(0.5)         # acks
            cost = per_job(Meter.delta(a, meter.sample()), idle, args.online)
            if args.statements:
                print_breakdown(f"per online job of {max_tokens} tokens", queries, pg.statements(), commands,
                                redis_commands(rc), args.online)
            return cost

        online = online_phase(args.max_tokens)
        longer = online_phase(args.long_tokens)
        # an online answer is streamed token by token (Redis PUBLISH): its cost per extra token
        per_token = {k: max(0.0, longer[k] - online[k]) / (args.long_tokens - args.max_tokens) for k in online}

        # batch: upload, create, run, finalise
        lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": f"line {i}", "max_tokens": args.max_tokens,
                                              "ignore_eos": True}}).encode() + b"\n" for i in range(args.lines))
        boundary = "capacityboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + lines + f"\r\n--{boundary}--\r\n".encode()
        a = meter.sample()
        queries, commands = pg.statements(), redis_commands(rc)
        f = http(port, "POST", "/v1/files", raw=body, key=key, ctype=f"multipart/form-data; boundary={boundary}")
        b = http(port, "POST", "/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/completions",
                                              "completion_window": "24h"}, key)
        wait(lambda: http(port, "GET", f"/v1/batches/{b['id']}", key=key)["status"] == "completed", 600,
             "batch finalised")
        batch = per_job(Meter.delta(a, meter.sample()), idle, args.lines)
        if args.statements:
            print_breakdown(f"per batch line of {args.max_tokens} tokens", queries, pg.statements(), commands,
                            redis_commands(rc), args.lines)
        report(args, online, batch, idle, per_token)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if pg is not None:
            pg.stop()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


def print_breakdown(what: str, queries: dict, queries_after: dict, commands: dict, commands_after: dict,
                    jobs: int) -> None:
    print(f"\n{what}, Postgres statements:")
    for n, q in breakdown(queries, queries_after, jobs):
        print(f"  {n:6.2f}  {' '.join(q.split())[:160]}")
    print("Redis commands:")
    for n, c in breakdown(commands, commands_after, jobs):
        print(f"  {n:6.2f}  {c}")


def _ping(rc) -> bool:
    try:
        return rc.ping()
    except redis.ConnectionError:
        return False


def _ready(port) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
        return True
    except OSError:
        return False


def report(args, online: dict, batch: dict, idle: dict, per_token: dict) -> None:
    print(f"idle background per second (beat sweeps, heartbeats): "
          + ", ".join(f"{label} {idle[k] / idle['t'] * scale:.1f}" for k, label, scale in FIELDS))
    print(f"\n| cost per accepted job | online request ({args.max_tokens} tokens) | each further streamed token |"
          f" batch line ({args.max_tokens} tokens) |\n|---|---:|---:|---:|")
    for k, label, scale in FIELDS:
        print(f"| {label} | {online[k] * scale:.2f} | {per_token[k] * scale:.3f} | {batch[k] * scale:.2f} |")
    extra = max(0.0, args.tokens_per_job - args.max_tokens)
    online = {k: online[k] + per_token[k] * extra for k in online}      # streamed answers of --tokens-per-job
    redis_part = f"a Redis Cluster of {args.redis_cluster} masters" if args.redis_cluster else "Redis one core"
    print(f"\nprojection: Postgres {args.pg_cores:g} cores and {args.wal_mb_s:g} MB/s WAL, {redis_part}, "
          f"{args.tokens_per_job:g} tokens per job, {args.gpu_tokens_s:g} tokens/s per GPU worker")
    print("\n| limit | online jobs/s | batch jobs/s | online tokens/s | batch tokens/s | GPU workers fed (online) |"
          " GPU workers fed (batch) |\n|---|---:|---:|---:|---:|---:|---:|")
    limits = {}
    for name, fn in (("Postgres CPU", lambda c: args.pg_cores / c["pg_cpu"]),
                     ("Postgres WAL", lambda c: args.wal_mb_s * 1e6 / c["pg_wal_bytes"]),
                     ("Redis CPU", lambda c: max(1, args.redis_cluster) / c["redis_cpu"]),
                     *([("Redis busiest master", lambda c: 1.0 / max(v for k, v in c.items()
                                                                      if k.startswith("redis_cpu@")))]
                       if args.redis_cluster else []),
                     ("web, per core", lambda c: 1.0 / c["web_cpu"])):
        row = []
        for c in (online, batch):
            try:
                row.append(fn(c))
            except ZeroDivisionError:
                row.append(float("inf"))
        limits[name] = row
        tok = [r * args.tokens_per_job for r in row]
        print(f"| {name} | {row[0]:,.0f} | {row[1]:,.0f} | {tok[0]:,.0f} | {tok[1]:,.0f} | "
              f"{tok[0] / args.gpu_tokens_s:,.0f} | {tok[1] / args.gpu_tokens_s:,.0f} |")
    idle_redis = idle["redis_cpu"] / idle["t"]
    print(f"\nfixed load of one worker + beat (idle): {idle['redis_commands'] / idle['t']:,.0f} Redis commands/s, "
          f"{idle_redis * 100:.2f}% of a Redis core: ~{1 / idle_redis if idle_redis else float('inf'):,.0f} idle "
          f"workers fill one Redis with polling alone")
    shared = {k: v for k, v in limits.items() if not k.startswith("web")}     # web scales out by adding processes
    for i, kind in enumerate(("online", "batch")):
        first = min(shared, key=lambda k: shared[k][i])
        print(f"first bottleneck ({kind}): {first} at {shared[first][i]:,.0f} jobs/s")
    line = {"online": online, "batch": batch, "online_per_token": per_token, "redis_cluster": args.redis_cluster,
            "limits_jobs_s": {k: {"online": v[0], "batch": v[1]} for k, v in limits.items()}}
    print(json.dumps(line))
    record(f"capacity{'_cluster' if args.redis_cluster else ''}", line)     # (one result file each)


if __name__ == "__main__":
    main()
