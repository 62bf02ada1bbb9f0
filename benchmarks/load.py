"""Load test of the production shape with faults inside the window: Locust as a library.

    python benchmarks/load.py [--duration 600] [--tenants 50] [--users 16] [--spawn-rate 4]
                              [--wait-min 0.5] [--wait-max 2.5] [--mix KIND=WEIGHT,...] [--lease-seconds S]
                              [--no-faults] [--pg postgresql+psycopg://postgres@127.0.0.1:5432]
                              [--model models/smollm2-135m]

Needs a Postgres server (--pg) and `redis-server` on PATH. Starts, on this machine: a fresh Postgres database on
--pg (`tidepool db upgrade` creates and migrates it; dropped at the end), a private redis-server on a free port
(restarted below, so nothing else may share it), gunicorn as the Procfile's `web` line runs it, one `tidepool worker
--kind gpu --device cpu` over --model and `tidepool beat`. Creates --tenants tenants through the admin API, then
--users Locust users for --duration seconds, each request from a random tenant, mixing (weights --mix): streamed
chat completions (`stream: true`, greedy, --stream-tokens), whole /v1/completions, native jobs (`POST /v1/jobs`, a
third with an Idempotency-Key, half of those sent twice as a retrying client does), uploads (`POST /v1/files`) and
batches (a --batch-lines JSONL file uploaded, then `POST /v1/batches`), jobs cancelled once they run, and streams
the client leaves after a few pieces of text. Faults inside the window: at 1/3 the worker is killed with SIGKILL and
restarted under the same name after --restart-delay s, as a supervisor would; at 2/3 the redis-server is stopped
and, --redis-down s later, started again on the same port (no persistence: queues and unacked messages are gone,
beat republishes).

After the window the users finish the request they are in, then (at most --drain-timeout s) every job and batch
must reach a terminal state. Checks, from what the clients saw and from the ledger:
  - no HTTP 500 (nor any other 5xx but 503, nor a `stream_failed` error event inside a stream); every 503 carries
    Retry-After and overlaps a fault's window (its start to its recovery, plus --grace s);
  - no job lost: every job id a client was given (and every job in the database) is terminal, a failed or expired
    one with its error; none run twice: usage requests per tenant equal the jobs billed, the text a stream or a
    whole completion delivered equals the job's output, an idempotent retry returns the first job;
  - every token billed once: per tenant, the prompt and completion tokens of the job rows equal the usage rows, a
    cancelled or left job is billed for at least the text its client was sent, and the tenants' queued/running
    counters and budget reservations are back to zero;
  - admission p99 (time to the 202 of `POST /v1/jobs` and to the 200 of `POST /v1/batches`) <= --admission-p99-ms
    (100 ms).
TTFT (send to the first content chunk of a stream) is reported beside it, of all streams and of those that
overlapped no fault (a stream whose job the killed worker held waits for its lease to lapse: --lease-seconds).
Prints one JSON line, writes it to benchmarks/results/load.json, exits 1 when a check fails (the processes' logs
are then kept; their folder is named on stderr).

A quick check: --duration 90 --tenants 10. Closed loop: each user waits for its answer, so the rate is what the
machine sustains at --users; the full run is the defaults.
"""
if __name__ == "__main__":   # Locust's gevent must patch the standard library before anything else imports it
    from gevent import monkey
    monkey.patch_all()

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from capacity import _ready, http, wait  # noqa: E402
from results import record  # noqa: E402
from online_latency import pct  # noqa: E402

BIN = Path(sys.executable).parent
ADMIN = "load-admin-token"
WORKER = "load-gpu"
JOB_TERMINAL = {"completed", "failed", "cancelled", "expired"}
BATCH_TERMINAL = {"completed", "failed", "expired", "cancelled"}
KINDS = ("stream", "completion", "job", "upload", "batch", "cancel", "hangup")
STREAM_500 = {"stream_failed", "internal_error"}      # error events that are a server bug, like an HTTP 500
WORDS = ("tide", "pool", "harbor", "kelp", "reef", "current", "shell", "drift", "swell", "lagoon", "pier", "brine")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (faults at 1/3 and 2/3)")
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--users", type=int, default=16, help="concurrent Locust users (closed loop)")
    ap.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second")
    ap.add_argument("--wait-min", type=float, default=0.5, help="seconds a user waits between its requests, from")
    ap.add_argument("--wait-max", type=float, default=2.5, help="... to")
    ap.add_argument("--mix", default="stream=3,completion=2,job=4,upload=1,batch=1,cancel=1,hangup=1",
                    help="task weights: " + ", ".join(KINDS))
    ap.add_argument("--stream-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8, help="whole completions and jobs")
    ap.add_argument("--batch-lines", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=4)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432",
                    help="Postgres server; a database is created on it and dropped afterwards")
    ap.add_argument("--lease-seconds", type=float, default=None,
                    help="TIDEPOOL_LEASE_SECONDS (default: the service's): how long a killed worker's jobs wait")
    ap.add_argument("--restart-delay", type=float, default=2.0, help="seconds between the kill and the restart")
    ap.add_argument("--redis-down", type=float, default=3.0, help="seconds Redis stays stopped")
    ap.add_argument("--no-faults", action="store_true", help="the same load without the kill and the restart")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds after a fault's recovery a 503 is explained")
    ap.add_argument("--drain-timeout", type=float, default=600.0,
                    help="seconds after the window for every job and batch to finish")
    ap.add_argument("--stop-timeout", type=float, default=300.0,
                    help="seconds the users get to finish the request they are in when the window closes")
    ap.add_argument("--admission-p99-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.weights = parse_mix(args.mix)
    if args.wait_max < args.wait_min:
        ap.error("--wait-max is below --wait-min")
    return args


def parse_mix(text: str) -> dict[str, int]:
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in KINDS or not value.isdigit():
            raise argparse.ArgumentTypeError(f"--mix: '{part}' is not KIND=WEIGHT with KIND one of {KINDS}")
        weights[name] = int(value)
    if not any(weights.values()):
        raise argparse.ArgumentTypeError("--mix: every weight is 0")
    return weights


# -- checks (pure: what the clients recorded and the ledger's rows in, figures out) -------------------------------

def overlaps(rec: dict, faults: list[dict], grace: float = 0.0) -> bool:
    """The request was under way during a fault (its start to its recovery, plus grace)."""
    return any(rec["t0"] <= f["end"] + grace and rec["t1"] >= f["start"] for f in faults)


def explained(rec: dict, faults: list[dict], grace: float) -> bool:
    """A 503 is explained when it says when to retry and its request overlapped a fault."""
    return bool(rec.get("retry_after")) and overlaps(rec, faults, grace)


def client_checks(records: list[dict], faults: list[dict], grace: float) -> dict:
    status, by_kind, stream_errors = {}, {}, {}
    for r in records:
        key = str(r["status"])
        status[key] = status.get(key, 0) + 1
        kind = by_kind.setdefault(r["kind"], {})
        kind[key] = kind.get(key, 0) + 1
        if r.get("error_code"):
            stream_errors[r["error_code"]] = stream_errors.get(r["error_code"], 0) + 1
    bad_503 = [r for r in records if r["status"] == 503 and not explained(r, faults, grace)]
    admitted = [r for r in records if (r["kind"], r["status"]) in (("job", 202), ("batch", 200))]
    admission = [r["ms"] for r in admitted]
    admission_clear = [r["ms"] for r in admitted if not overlaps(r, faults)]
    uploads = [r["ms"] for r in records if r["kind"] in ("upload", "batch_upload") and r["status"] == 200]
    streams = [r for r in records if r["kind"] == "stream" and r.get("ttft_ms") is not None]
    ttft = [r["ttft_ms"] for r in streams]
    ttft_clear = [r["ttft_ms"] for r in streams if not overlaps(r, faults)]

    def ms(values, q):
        return round(pct(values, q), 1) if values else None
    return {"status_counts": dict(sorted(status.items())), "by_kind": by_kind,
            "errors_500": status.get("500", 0) + sum(stream_errors.get(c, 0) for c in STREAM_500),
            "errors_5xx_other": sum(n for s, n in status.items() if s.isdigit() and int(s) > 500 and s != "503"),
            "connection_errors": status.get("0", 0), "stream_errors": stream_errors,
            "unexplained_503": len(bad_503),
            "unexplained_503_samples": [{k: r.get(k) for k in ("kind", "t0", "t1", "retry_after")}
                                        for r in bad_503[:5]],
            "admission_n": len(admission), "admission_p50_ms": ms(admission, 0.5),
            "admission_p99_ms": ms(admission, 0.99), "admission_p99_ms_outside_faults": ms(admission_clear, 0.99),
            "admission_max_ms": round(max(admission), 1) if admission else None, "upload_p50_ms": ms(uploads, 0.5),
            "upload_p99_ms": ms(uploads, 0.99), "ttft_n": len(ttft), "ttft_p50_ms": ms(ttft, 0.5),
            "ttft_p99_ms": ms(ttft, 0.99), "ttft_p50_ms_outside_faults": ms(ttft_clear, 0.5),
            "ttft_p99_ms_outside_faults": ms(ttft_clear, 0.99)}


def ledger_checks(jobs: list[dict], usage: list[dict], counters: list[dict], batches: list[dict],
                  accepted: set[str], accepted_batches: dict[str, int], delivered: list[dict],
                  idempotency_mismatch: int, cut: list[dict] = ()) -> dict:
    """jobs: {id, tenant_id, status, attempts, prompt_tokens, completion_tokens, error, output, batch_id};
    usage: {tenant_id, requests, prompt_tokens, completion_tokens}; counters: {tenant_id, queued_count,
    running_count, budget_reserved}; batches: {id, status, total, completed, failed}; accepted: the job ids clients
    were given; accepted_batches: batch id -> lines sent; delivered: {id, text} of what streams and whole completions
    gave their clients; cut: {id, tokens} of running jobs a client cancelled or whose stream it left after `tokens`
    pieces of text (each must be billed for at least those)."""
    by_id = {j["id"]: j for j in jobs}
    missing = sorted(accepted - set(by_id))
    unfinished = [j["id"] for j in jobs if j["status"] not in JOB_TERMINAL]
    no_reason = [j["id"] for j in jobs if j["status"] in ("failed", "expired") and not j.get("error")]
    batch_rows = {b["id"]: b for b in batches}
    batch_jobs = {}
    for j in jobs:
        if j.get("batch_id"):
            batch_jobs[j["batch_id"]] = batch_jobs.get(j["batch_id"], 0) + 1
    short_batches = [b for b, lines in accepted_batches.items()
                     if b not in batch_rows or batch_rows[b]["status"] not in BATCH_TERMINAL
                     or (batch_rows[b]["status"] == "completed"
                         and (batch_jobs.get(b, 0) != lines or batch_rows[b]["total"] != lines))]
    lost = missing + unfinished + no_reason
    billed, generated = {}, {}
    for j in jobs:
        if j.get("completion_tokens") is None:
            continue
        req, p, c = billed.get(j["tenant_id"], (0, 0, 0))
        billed[j["tenant_id"]] = (req + 1, p + (j["prompt_tokens"] or 0), c + j["completion_tokens"])
    usage_by = {}
    for u in usage:
        req, p, c = usage_by.get(u["tenant_id"], (0, 0, 0))
        usage_by[u["tenant_id"]] = (req + u["requests"], p + u["prompt_tokens"], c + u["completion_tokens"])
    tenants = set(billed) | set(usage_by)
    twice = sum(max(0, usage_by.get(t, (0, 0, 0))[0] - billed.get(t, (0, 0, 0))[0]) for t in tenants)
    mismatch = sorted(t for t in tenants if usage_by.get(t, (0, 0, 0))[1:] != billed.get(t, (0, 0, 0))[1:])
    differs = [d["id"] for d in delivered if d["id"] in by_id and by_id[d["id"]]["status"] == "completed"
               and d["text"] != by_id[d["id"]]["output"]]
    unbilled = [{**c, "billed": by_id[c["id"]].get("completion_tokens"), "status": by_id[c["id"]]["status"]}
                for c in cut if c["id"] in by_id and by_id[c["id"]]["status"] in ("cancelled", "completed")
                and (by_id[c["id"]].get("completion_tokens") is None
                     or by_id[c["id"]]["completion_tokens"] < c["tokens"])]
    leaked = [c["tenant_id"] for c in counters
              if (c["queued_count"], c["running_count"], c["budget_reserved"]) != (0, 0, 0)]
    states = {}
    for j in jobs:
        states[j["status"]] = states.get(j["status"], 0) + 1
    return {"jobs_accepted": len(accepted) + sum(batch_jobs.get(b, 0) for b in accepted_batches),
            "jobs_in_ledger": len(jobs), "job_states": states, "batches_accepted": len(accepted_batches),
            "batches_short": len(short_batches),
            "jobs_retried": sum(1 for j in jobs if (j.get("attempts") or 0) > 1),
            "jobs_lost": len(lost), "jobs_lost_samples": lost[:5],
            "jobs_run_twice": twice + len(differs) + idempotency_mismatch,
            "delivered_differs": len(differs), "delivered_differs_samples": differs[:5],
            "idempotency_mismatch": idempotency_mismatch,
            "tokens_generated": sum(c for _, _, c in billed.values()),
            "tokens_billed": sum(c for _, _, c in usage_by.values()),
            "prompt_tokens_generated": sum(p for _, p, _ in billed.values()),
            "prompt_tokens_billed": sum(p for _, p, _ in usage_by.values()),
            "billing_mismatch": len(mismatch), "billing_mismatch_tenants": mismatch[:5],
            "jobs_cut": len(cut), "cut_unbilled": len(unbilled), "cut_unbilled_samples": unbilled[:5],
            "counters_leaked": len(leaked)}


def near_kill(cut: dict, book, before_s: float = 5.0) -> bool:
    """Whether a job was cancelled or left within before_s of the worker's kill -9 (or while it was down): the
    worker may have died before it wrote the aborted attempt, whose tokens are then billed by no one."""
    at = book.t0 + cut["at_s"]
    return any(f["kind"] == "worker_kill9" and f["start"] - before_s <= at <= f["end"] for f in book.faults)


def verdict(r: dict, admission_p99_ms: float) -> list[str]:
    """The checks that failed (empty: pass)."""
    failed = [k for k in ("errors_500", "errors_5xx_other", "unexplained_503", "jobs_lost", "jobs_run_twice",
                          "billing_mismatch", "cut_unbilled", "counters_leaked", "batches_short") if r.get(k)]
    if not r.get("drained", True):
        failed.append("drained")
    if r.get("admission_p99_ms") is None or r["admission_p99_ms"] > admission_p99_ms:
        failed.append("admission_p99_ms")
    return failed


# -- where and what ----------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[load] {msg}", file=sys.stderr, flush=True)


# -- the stack ---------------------------------------------------------------------------------------------------

def procfile_web(port: int) -> list[str]:
    """The Procfile's `web` command on `port`, with the venv's gunicorn."""
    line = next(ln for ln in (ROOT / "Procfile").read_text().splitlines() if ln.startswith("web:"))
    argv = shlex.split(line.split(":", 1)[1].replace("$PORT", str(port)))
    return [str(BIN / argv[0]), *argv[1:]]


class Stack:
    """Web (the Procfile's gunicorn), one gpu-kind worker on the CPU and beat, over a fresh database and a private
    redis-server; the worker and Redis can be killed and started again."""

    def __init__(self, args, tmp: Path):
        from tests.servers import free_port, start_redis
        self.args, self.tmp, self._start_redis = args, tmp, start_redis
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_port = free_port()
        self.redis_proc = start_redis(self.redis_port, tmp)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.dbname = f"tidepool_load_{os.getpid()}"
        self.db_url = f"{args.pg}/{self.dbname}"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")},
                    "TIDEPOOL_DATABASE_URL": self.db_url, "TIDEPOOL_REDIS_URL": self.redis_url,
                    "TIDEPOOL_ADMIN_TOKEN": ADMIN, "TIDEPOOL_MODEL": str(Path(args.model).resolve()),
                    "TIDEPOOL_STORAGE_DIR": str(tmp / "storage"), "TIDEPOOL_LOG_LEVEL": "WARNING",
                    "TIDEPOOL_BEAT_SCHEDULE": str(tmp / "beat-schedule"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT)}
        if args.lease_seconds is not None:
            self.env["TIDEPOOL_LEASE_SECONDS"] = str(args.lease_seconds)
        try:
            up = subprocess.run([str(BIN / "tidepool"), "db", "upgrade"], env=self.env, capture_output=True,
                                text=True)
            if up.returncode != 0:
                raise SystemExit(f"tidepool db upgrade failed:\n{up.stderr}")
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            self._spawn("web", procfile_web(self.port), cwd=ROOT)
            self._spawn("beat", [sys.executable, "-m", "tidepool.workers.cli", "beat"])
            self.start_worker()
            wait(lambda: _ready(self.port), 600, "web ready with the worker's engine up")
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str], cwd: Path | None = None, **env) -> subprocess.Popen:
        logf = open(self.tmp / f"{name}.log", "a")
        proc = subprocess.Popen(argv, env={**self.env, **env}, cwd=cwd or self.tmp, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_worker(self) -> None:
        self._spawn("worker", [sys.executable, "-m", "tidepool.workers.cli", "worker", "--kind", "gpu", "--device", "cpu"],
                    TIDEPOOL_WORKER_NAME=WORKER)

    def kill_worker(self) -> None:
        proc = self.procs["worker"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def worker_up(self, since: float) -> bool:
        import redis
        from tidepool.service.ledger.snapshots import Heartbeats
        try:
            beat = Heartbeats(redis.Redis.from_url(self.redis_url, socket_timeout=2)).get(WORKER)
        except redis.RedisError:
            return False
        return bool(beat) and beat.get("started_at", 0) >= since

    def stop_redis(self) -> None:
        self.redis_proc.terminate()
        self.redis_proc.wait()

    def start_redis(self) -> None:
        self.redis_proc = self._start_redis(self.redis_port, self.tmp)

    def close(self) -> None:
        for name in ("web", "beat", "worker"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.redis_proc.kill()
        self.redis_proc.wait()
        import psycopg
        admin = self.args.pg.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
        try:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {self.dbname} WITH (FORCE)")
        except psycopg.OperationalError as exc:
            log(f"could not drop database {self.dbname}: {exc}")

    def sql(self, query: str, params=()) -> list[dict]:
        import psycopg
        from psycopg.rows import dict_row
        with psycopg.connect(self.db_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True,
                             row_factory=dict_row) as conn:
            return conn.execute(query, params).fetchall()

    def open_work(self) -> int:
        return self.sql("SELECT (SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')) + "
                        "(SELECT count(*) FROM batches WHERE status NOT IN ('completed', 'failed', 'expired', "
                        "'cancelled')) AS n")[0]["n"]


# -- the clients -------------------------------------------------------------------------------------------------

class Book:
    """What the clients saw: one record per request, the job and batch ids they were given, what they were sent."""

    def __init__(self, keys: list[str], args):
        self.keys, self.args = keys, args
        self.records: list[dict] = []
        self.accepted: set[str] = set()
        self.batches: dict[str, int] = {}
        self.delivered: list[dict] = []
        self.idempotency_mismatch = 0
        self.cut: list[dict] = []
        self.faults: list[dict] = []
        self.t0 = time.time()       # when the users start
        self.counter = 0

    def prompt(self) -> str:
        self.counter += 1
        return " ".join(random.choices(WORDS, k=6)) + f" #{self.counter}"

    def record(self, kind: str, t0: float, resp, **extra) -> dict:
        status = resp.status_code or 0
        headers = resp.headers or {}
        rec = {"kind": kind, "t0": t0, "t1": time.time(), "status": status,
               "retry_after": headers.get("Retry-After") if status else None,
               "ms": (time.time() - t0) * 1000, **extra}
        self.records.append(rec)
        if status == 503:          # an accepted online job whose wait lost the database: its id is in the message
            self.accepted.update(re.findall(r"job_[0-9a-f]+", resp.text or ""))
        return rec

    def lines(self) -> bytes:
        a = self.args
        return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": self.prompt()}],
                                             "max_tokens": a.batch_tokens, "ignore_eos": True}}).encode() + b"\n"
                        for i in range(a.batch_lines))


def multipart(content: bytes, purpose: str = "batch") -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class _Answer:
    """What Book.record reads of a response, for one made with http.client."""

    def __init__(self, status: int, headers: list[tuple[str, str]]):
        self.status_code, self.headers, self.text = status, dict(headers), ""


def user_class(base: str, book: Book, args):
    from locust import between
    from locust.contrib.fasthttp import FastHttpUser

    def post(user, path: str, key: str, body=None, raw: bytes | None = None, ctype="application/json",
             headers=None, stream=False):
        return user.client.request("POST", path, data=raw if raw is not None else json.dumps(body), stream=stream,
                                   headers={"Authorization": f"Bearer {key}", "Content-Type": ctype,
                                            **(headers or {})})

    def stream(user):
        key = random.choice(book.keys)
        body = {"messages": [{"role": "user", "content": book.prompt()}], "max_tokens": args.stream_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.time()
        resp = post(user, "/v1/chat/completions", key, body, stream=True)
        if resp.status_code != 200:
            book.record("stream", t0, resp)
            return
        job_id, text, first, code, buf = None, "", None, None, b""
        try:
            for chunk in resp.iter_content(4096, decode_content=False):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        code = ev["error"].get("code") or "error"
                        continue
                    job_id = job_id or ev.get("id")
                    for c in ev.get("choices") or []:
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.time()
                            text += piece
        except Exception as exc:      # a broken connection mid-stream
            code = f"client:{type(exc).__name__}"
        book.record("stream", t0, resp, ttft_ms=(first - t0) * 1000 if first else None, error_code=code)
        if job_id:
            book.accepted.add(job_id)
            if code is None:
                book.delivered.append({"id": job_id, "text": text})

    def completion(user):
        key = random.choice(book.keys)
        t0 = time.time()
        resp = post(user, "/v1/completions", key, {"prompt": book.prompt(), "max_tokens": args.max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
        book.record("completion", t0, resp)
        if resp.status_code == 200:
            out = resp.json()
            book.accepted.add(out["id"])
            book.delivered.append({"id": out["id"], "text": out["choices"][0]["text"]})

    def job(user):
        key = random.choice(book.keys)
        body = {"prompt": book.prompt(), "max_tokens": args.max_tokens, "ignore_eos": True,
                "sla_class": random.choice(("interactive", "batch"))}
        idem = {"Idempotency-Key": uuid.uuid4().hex} if random.random() < 1 / 3 else None
        t0 = time.time()
        resp = post(user, "/v1/jobs", key, body, headers=idem)
        book.record("job", t0, resp)
        if resp.status_code not in (200, 202):
            return
        job_id = resp.json()["id"]
        book.accepted.add(job_id)
        if idem and random.random() < 0.5:        # the client retries: the same job comes back
            t0 = time.time()
            again = post(user, "/v1/jobs", key, body, headers=idem)
            book.record("job_retry", t0, again)
            if again.status_code in (200, 202) and again.json()["id"] != job_id:
                book.idempotency_mismatch += 1

    def upload(user, kind="upload"):
        key = random.choice(book.keys)
        raw, ctype = multipart(book.lines())
        t0 = time.time()
        resp = post(user, "/v1/files", key, raw=raw, ctype=ctype)
        book.record(kind, t0, resp)
        return (key, resp.json()["id"]) if resp.status_code == 200 else (key, None)

    def batch(user):
        key, file_id = upload(user, "batch_upload")
        if file_id is None:
            return
        t0 = time.time()
        resp = post(user, "/v1/batches", key, {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})
        book.record("batch", t0, resp)
        if resp.status_code == 200:
            b = resp.json()
            book.batches[b["id"]] = args.batch_lines

    def cancel(user):
        """A job cancelled once it runs: billed for what it computed."""
        key = random.choice(book.keys)
        t0 = time.time()
        resp = post(user, "/v1/jobs", key, {"prompt": book.prompt(), "max_tokens": 4 * args.max_tokens,
                                            "ignore_eos": True, "sla_class": "interactive"})
        book.record("job", t0, resp)
        if resp.status_code not in (200, 202):
            return
        job_id = resp.json()["id"]
        book.accepted.add(job_id)
        auth = {"Authorization": f"Bearer {key}"}
        end = time.time() + 10
        while time.time() < end:
            got = user.client.request("GET", f"/v1/jobs/{job_id}", headers=auth)
            if got.status_code != 200 or got.json()["status"] != "queued":
                break
            time.sleep(0.1)
        if got.status_code == 200 and got.json()["status"] == "running":
            time.sleep(random.uniform(0.1, 0.5))
            t0 = time.time()
            book.record("cancel", t0, user.client.request("POST", f"/v1/jobs/{job_id}/cancel", headers=auth))
            book.cut.append({"id": job_id, "tokens": 0, "kind": "cancel", "at_s": round(t0 - book.t0, 1)})

    def hangup(user):
        """A stream whose client goes away after a few pieces of text: billed for at least what it was sent."""
        import http.client
        key = random.choice(book.keys)
        body = {"messages": [{"role": "user", "content": book.prompt()}], "max_tokens": 4 * args.stream_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        host, port = base.split("//", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=900)
        t0, job_id, pieces, want = time.time(), None, 0, random.randint(1, 4)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            r = conn.getresponse()
            book.record("hangup", t0, _Answer(r.status, r.getheaders()))
            while r.status == 200 and pieces < want and (line := r.readline()):
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    job_id = job_id or ev.get("id")
                    pieces += sum(1 for c in ev.get("choices") or [] if (c.get("delta") or {}).get("content"))
        finally:
            conn.close()
        if job_id:
            book.accepted.add(job_id)
            if pieces:
                book.cut.append({"id": job_id, "tokens": pieces, "kind": "hangup", "at_s": round(t0 - book.t0, 1)})

    funcs = {"stream": stream, "completion": completion, "job": job, "upload": upload, "batch": batch,
             "cancel": cancel, "hangup": hangup}

    class Tenants(FastHttpUser):
        host = base
        network_timeout = 900.0       # an online request waits for its job (through a worker's kill)
        connection_timeout = 30.0
        wait_time = between(args.wait_min, args.wait_max)
        tasks = {funcs[k]: w for k, w in args.weights.items() if w}

    return Tenants


def inject_faults(stack: Stack, book: Book, t0: float, args) -> None:
    import gevent

    def at(fraction: float) -> None:
        gevent.sleep(max(0.0, t0 + args.duration * fraction - time.time()))

    at(1 / 3)
    fault = {"kind": "worker_kill9", "start": time.time()}
    log("kill -9 of the worker")
    stack.kill_worker()
    gevent.sleep(args.restart_delay)
    stack.start_worker()
    end = time.time() + 600
    while not stack.worker_up(fault["start"]) and time.time() < end:
        gevent.sleep(0.25)
    fault["end"] = time.time()
    book.faults.append(fault)
    log(f"worker back after {fault['end'] - fault['start']:.1f} s")

    at(2 / 3)
    fault = {"kind": "redis_restart", "start": time.time()}
    log("redis-server stopped")
    stack.stop_redis()
    gevent.sleep(args.redis_down)
    stack.start_redis()
    fault["end"] = time.time()
    book.faults.append(fault)
    log(f"redis-server back after {fault['end'] - fault['start']:.1f} s")


def run_load(stack: Stack, book: Book, args) -> float:
    """The users for --duration s with the faults inside; returns the seconds the load ran, to the last user."""
    import gevent
    from locust.env import Environment

    env = Environment(user_classes=[user_class(stack.base, book, args)], stop_timeout=args.stop_timeout)
    runner = env.create_local_runner()
    t0 = book.t0 = time.time()
    runner.start(args.users, spawn_rate=args.spawn_rate)
    faults = None if args.no_faults else gevent.spawn(inject_faults, stack, book, t0, args)
    gevent.sleep(args.duration)
    log(f"window closed; users finish their requests (at most {args.stop_timeout:.0f} s)")
    runner.stop()
    if faults is not None:
        faults.join()
    runner.quit()
    return time.time() - t0


def ledger_rows(stack: Stack) -> dict:
    return {
        "jobs": stack.sql("SELECT id, tenant_id, status::text AS status, attempts, prompt_tokens, completion_tokens, "
                          "error, output, batch_id FROM jobs"),
        "usage": stack.sql("SELECT tenant_id, requests, prompt_tokens, completion_tokens FROM usage"),
        "counters": stack.sql("SELECT id AS tenant_id, queued_count, running_count, budget_reserved FROM tenants"),
        "batches": stack.sql("SELECT id, status::text AS status, total, completed, failed FROM batches"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    random.seed(args.seed)
    # SIGTERM (a timeout, a kill) unwinds like Ctrl-C: processes stopped, redis-server killed, database dropped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # the native CPU kernels built (or loaded) before the worker starts, outside this process (no torch here)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "import online_latency; online_latency.native_kernels_ready()", str(ROOT / "benchmarks")],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    tmp = Path(tempfile.mkdtemp(prefix="tidepool-load-"))
    stack, ok = None, False
    try:
        log(f"starting the stack in {tmp}")
        stack = Stack(args, tmp)
        keys = [http(stack.port, "POST", "/v1/admin/tenants", {"name": f"load-{i}"}, ADMIN)["api_key"]
                for i in range(args.tenants)]
        book = Book(keys, args)
        log(f"{args.tenants} tenants; {args.users} users for {args.duration:.0f} s")
        ran = run_load(stack, book, args)
        t_drain = time.time()
        drained = True
        try:
            wait(lambda: stack.open_work() == 0, args.drain_timeout, "every job and batch terminal")
        except SystemExit as exc:
            log(str(exc))
            drained = False
        drain_s = time.time() - t_drain
        rows = ledger_rows(stack)
        cut = [c for c in book.cut if not near_kill(c, book)]
        in_window = sum(1 for r in book.records if r["t0"] < book.t0 + args.duration)
        result = {"duration_s": args.duration, "stop_s": round(ran - args.duration, 1), "tenants": args.tenants,
                  "users": args.users, "requests": len(book.records), "rps": round(in_window / args.duration, 2),
                  **client_checks(book.records, book.faults, args.grace),
                  **ledger_checks(rows["jobs"], rows["usage"], rows["counters"], rows["batches"], book.accepted,
                                  book.batches, book.delivered, book.idempotency_mismatch, cut),
                  "cut_with_killed_worker": len(book.cut) - len(cut),
                  "drained": drained, "drain_s": round(drain_s, 1),
                  "faults": [{"kind": f["kind"], "at_s": round(f["start"] - book.t0, 1),
                              "recovered_s": round(f["end"] - f["start"], 1),
                              "requests_during": sum(1 for r in book.records if overlaps(r, [f]))}
                             for f in book.faults],
                  "settings": {k: getattr(args, k) for k in ("mix", "wait_min", "wait_max", "stream_tokens",
                                                             "max_tokens", "batch_lines", "batch_tokens",
                                                             "lease_seconds", "grace")}}
        failed = verdict(result, args.admission_p99_ms)
        result["failed"], result["pass"] = failed, not failed
        ok = not failed
        print(json.dumps(result), flush=True)
        record("load", result)
        return 0 if ok else 1
    finally:
        if stack is not None:
            stack.close()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"the processes' logs are in {tmp}")


if __name__ == "__main__":
    sys.exit(main())
