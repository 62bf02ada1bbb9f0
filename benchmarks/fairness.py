"""One tenant's flood never stalls another: fair intake against the FIFO baseline, production shape.

    python benchmarks/fairness.py [--model DIR | --tiny] [--seats 16] [--backlog-s 60] [--rt-duration 90]

Private Postgres and redis-server, gunicorn (the Procfile's web), `tidepool beat` and one gpu-kind `tidepool worker`
with --seats sequences (TIDEPOOL_MAX_NUM_SEQS) over --model (SmolLM2-135M by default; --tiny: a random-weight
model, for a smoke run). Tenants of equal weight unless said. Phases, in this order:

  (1) FIFO worker (TIDEPOOL_FAIR_INTAKE=0): B's 8 batch-class jobs of 64 tokens alone (makespan from B's first
      submission to its last completion), then A's 96 queued just before B's 8 (B's makespan, and the makespan of
      all 104: the FIFO throughput on that work);
  (2) the worker restarted with fair intake (the default): the same flood, fresh prompts;
  (3) realtime, streamed /v1/completions: B alone at --b-rate per second for --rt-duration seconds, then B beside
      A at --a-rate: TTFT p95 of B alone, of B and of A while A floods;
  (4) three tenants of weights 1, 1, 2, each with a batch (created at once) of offline work larger than
      --backlog-s seconds drain: from --settle-s after their creation, for --backlog-s seconds, served tokens
      (prompt + completion of the jobs finished) per tenant, its shares, VTC's metric (the largest gap in
      accumulated weighted service between the backlogged tenants at every 10 s) and Jain's index of the
      weighted shares (share / weight share); the batches are cancelled after;
  (5) the take path in-process against the same Redis, the worker stopped: p50/p99 of one fair take with 1,000
      jobs over 100 tenants waiting (one pushed back per take, so 1,000 stay queued).

The native CPU kernels are built (or loaded) before anything starts: a worker on a cold kernel cache builds them
beside its first steps, which slowed the FIFO phase 2x and inflated fair-vs-FIFO throughput (1.97 on a fresh machine).

Prints one JSON line, and the goals met or not to stderr. Goals: B's offline makespan ratio <= 2.5; B's realtime
TTFT p95 ratio <= 1.3 and below A's; weighted shares within 10% of 1:1:2; Jain's index >= 0.95; fair throughput
>= 0.95x FIFO's on the same work; take p99 <= 2 ms at 1,000 queued jobs over 100 tenants.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from capacity import Postgres, _ping, _ready, free_port, http, wait  # noqa: E402
from hybrid_http import Server, summary  # noqa: E402
from online_latency import make_prompts, native_kernels_ready, paced, pct  # noqa: E402
from results import record  # noqa: E402

ADMIN = "fairness-admin"
VOCAB = 49152


def log(msg: str) -> None:
    print(f"[fairness] {msg}", file=sys.stderr, flush=True)


class Stack:
    def __init__(self, args, tmp: Path):
        self.args, self.tmp, self.procs, self.worker = args, tmp, [], None
        self.pg = Postgres(tmp)
        rport = free_port()
        self.procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                            "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=tmp))
        self.redis_url = f"redis://127.0.0.1:{rport}/0"
        self.redis = redis.Redis.from_url(self.redis_url)
        wait(lambda: _ping(self.redis), 10, "redis")
        if args.tiny:
            from tidepool.workers.tools.tiny_model import make_tiny_model
            model = str(make_tiny_model(str(tmp / "tiny"), seed=1))
        else:
            model = str(Path(args.model).resolve())
        global VOCAB       # prompts are random ids in [100, vocab)
        VOCAB = min(VOCAB, json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        self.db = f"postgresql://postgres@127.0.0.1:{self.pg.port}/tidepool"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")},
                    "TIDEPOOL_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{self.pg.port}/tidepool",
                    "TIDEPOOL_REDIS_URL": self.redis_url, "TIDEPOOL_ADMIN_TOKEN": ADMIN, "TIDEPOOL_MODEL": model,
                    "TIDEPOOL_STORAGE_DIR": str(tmp / "storage"), "TIDEPOOL_LOG_LEVEL": "WARNING",
                    "TIDEPOOL_BEAT_SCHEDULE": str(tmp / "beat-schedule"), "TIDEPOOL_MAX_NUM_SEQS": str(args.seats),
                    "PYTHONPATH": str(ROOT)}
        bindir = Path(sys.executable).parent
        subprocess.run([str(bindir / "tidepool"), "db", "upgrade"], env=self.env, check=True, capture_output=True)
        self.port = free_port()
        self.log = open(tmp / "processes.log", "w")
        self.procs.append(subprocess.Popen([str(bindir / "gunicorn"), "-w", "2", "-k", "gthread", "--threads", "32",
                                            "-b", f"127.0.0.1:{self.port}", "tidepool.service.wsgi:app"], env=self.env,
                                           stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT))
        self.procs.append(subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "beat"], env=self.env, stdout=self.log,
                                           stderr=subprocess.STDOUT, cwd=tmp))
        self.base = f"http://127.0.0.1:{self.port}"
        wait(lambda: _healthy(self.port), 120, "web up")

    def start_worker(self, fair: bool) -> None:
        from tidepool.service.ledger.snapshots import HEARTBEAT_KEY
        self.stop_worker()
        name = "gpu-fair" if fair else "gpu-fifo"
        self.worker = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "worker", "--kind", "gpu", "--device", "cpu"],
                                       env={**self.env, "TIDEPOOL_FAIR_INTAKE": "1" if fair else "0",
                                            "TIDEPOOL_WORKER_NAME": name},
                                       stdout=self.log, stderr=subprocess.STDOUT, cwd=self.tmp)
        wait(lambda: self.redis.exists(HEARTBEAT_KEY.format(name)) and _ready(self.port), 300,
             f"worker {name} up")
        self.model = http(self.port, "GET", "/v1/models", key=self.key0)["data"][0]["id"]

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.terminate()
            self.worker.wait(60)
            self.worker = None

    def tenant(self, name: str, weight: float = 1.0) -> str:
        return http(self.port, "POST", "/v1/admin/tenants", {"name": name, "weight": weight}, ADMIN)["api_key"]

    def close(self) -> None:
        self.stop_worker()
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.pg.stop()

    def finished(self, ids) -> dict[str, tuple]:
        """job id -> (finished_at unix, prompt_tokens + completion_tokens) of the completed ones."""
        with psycopg.connect(self.db, autocommit=True) as c:
            rows = c.execute("SELECT id, extract(epoch FROM finished_at), prompt_tokens + completion_tokens FROM jobs "
                             "WHERE id = ANY(%s) AND status = 'completed'", (list(ids),)).fetchall()
        return {r[0]: (float(r[1]), int(r[2])) for r in rows}


def _healthy(port) -> bool:
    try:
        http(port, "GET", "/healthz", timeout=2)
        return True
    except OSError:
        return False


def submit(st: Stack, key: str, prompts, max_tokens: int, threads: int = 8) -> list[str]:
    def one(ids):
        return http(st.port, "POST", "/v1/jobs", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, "sla_class": "batch"}, key)["id"]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, prompts))


def wait_done(st: Stack, ids, timeout: float) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        done = st.finished(ids)
        if len(done) == len(ids):
            return done
        time.sleep(0.5)
    raise RuntimeError(f"{len(st.finished(ids))} of {len(ids)} jobs done after {timeout} s")


def offline_flood(st: Stack, a_key: str, b_key: str, rng: random.Random, args) -> dict:
    prompts = lambda n: [[rng.randint(100, VOCAB - 1) for _ in range(32)] for _ in range(n)]   # noqa: E731
    t0 = time.time()
    a_ids = submit(st, a_key, prompts(args.flood), args.offline_tokens)
    tb = time.time()
    b_ids = submit(st, b_key, prompts(8), args.offline_tokens)
    done = wait_done(st, a_ids + b_ids, args.timeout)
    b_end = max(done[j][0] for j in b_ids)
    return {"b_makespan_s": round(b_end - tb, 2), "all_makespan_s": round(max(t for t, _ in done.values()) - t0, 2),
            "tokens": sum(n for _, n in done.values())}


def realtime(st: Stack, keys: dict, rates: dict, args, seed: int) -> dict:
    out, threads = {}, []
    for name, key in keys.items():
        server = Server(name, st.base, key, st.model, True, argparse.Namespace(rt_tokens=args.rt_tokens))
        prompts = make_prompts(max(1, int(args.rt_duration * rates[name])), VOCAB, seed + len(name) + ord(name[0]))

        def go(server=server, prompts=prompts, name=name):
            results = paced(server, prompts, rates[name])
            ok = [r for r in results if r["error"] is None]
            ttft = [(r["chunks"][0] - r["send"]) * 1000 for r in ok]
            out[name] = {**summary(results), "ttft_p95_ms": round(pct(ttft, 0.95), 1)}
        threads.append(threading.Thread(target=go))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def weighted(st: Stack, args, rng: random.Random) -> dict:
    weights = {"w1a": 1.0, "w1b": 1.0, "w2": 2.0}
    keys = {n: st.tenant(f"fair-{n}", w) for n, w in weights.items()}
    bodies = {}
    for n in weights:
        lines = b"".join(json.dumps({"custom_id": f"{n}-{i}", "method": "POST", "url": "/v1/completions", "body": {
            "prompt": [rng.randint(100, VOCAB - 1) for _ in range(32)], "max_tokens": args.backlog_tokens,
            "ignore_eos": True}}).encode() + b"\n" for i in range(int(args.backlog_jobs * weights[n])))
        boundary = "fairnessboundary"
        bodies[n] = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                     f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
                     f"Content-Type: application/jsonl\r\n\r\n").encode() + lines + f"\r\n--{boundary}--\r\n".encode()
    files = {n: http(st.port, "POST", "/v1/files", raw=bodies[n], key=keys[n],
                     ctype="multipart/form-data; boundary=fairnessboundary")["id"] for n in weights}

    def create(n):
        return n, http(st.port, "POST", "/v1/batches", {"input_file_id": files[n], "endpoint": "/v1/completions",
                                                        "completion_window": "24h"}, keys[n])["id"]
    with ThreadPoolExecutor(len(weights)) as pool:       # created together: no tenant gets a head start
        batches = dict(pool.map(create, weights))
    # the window opens once the seats hold work taken with all three backlogged (one job's run after creation)
    time.sleep(args.settle_s)
    t0 = time.time()
    time.sleep(args.backlog_s)
    t1 = time.time()
    eta = {n: http(st.port, "GET", f"/v1/batches/{b}", key=keys[n]).get("x_tidepool") for n, b in batches.items()}
    for n, b in batches.items():
        try:
            http(st.port, "POST", f"/v1/batches/{b}/cancel", {}, keys[n])
        except OSError as exc:      # 409: done already (then the tenant was not backlogged for the whole window)
            log(f"cancelling {n}'s batch: {exc}")
    with psycopg.connect(st.db, autocommit=True) as c:
        rows = c.execute("SELECT j.batch_id, extract(epoch FROM j.finished_at), j.prompt_tokens + j.completion_tokens "
                         "FROM jobs j WHERE j.batch_id = ANY(%s) AND j.status = 'completed'",
                         (list(batches.values()),)).fetchall()
    name_of = {b: n for n, b in batches.items()}
    windows = max(1, int(round(args.backlog_s / 10)))
    served = {n: 0 for n in weights}
    per_window = [{n: 0 for n in weights} for _ in range(windows)]
    for bid, at, tokens in rows:
        at = float(at)
        if t0 <= at <= t1:
            served[name_of[bid]] += tokens
            per_window[min(int((at - t0) // 10), windows - 1)][name_of[bid]] += tokens
    total = sum(served.values()) or 1
    shares = {n: served[n] / total for n in weights}
    wsum = sum(weights.values())
    x = [shares[n] / (weights[n] / wsum) for n in weights]          # 1.0 each when shares follow the weights
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x))
    # VTC's metric: the gap in accumulated weighted service between the backlogged tenants, at every 10 s
    acc, gaps = {n: 0.0 for n in weights}, []
    for w in per_window:
        for n in weights:
            acc[n] += w[n] / weights[n]
        gaps.append(max(acc.values()) - min(acc.values()))
    job_tokens = 32 + args.backlog_tokens
    return {"window_s": round(t1 - t0, 1), "served_tokens": served, "shares": {n: round(v, 3) for n, v in shares.items()},
            "share_error_max": round(max(abs(v - 1.0) for v in x), 3), "jain": round(jain, 4),
            "vtc_gap_tokens_max": round(max(gaps), 1), "vtc_gap_jobs_max": round(max(gaps) / job_tokens, 1),
            "vtc_gaps_per_10s": [round(g, 1) for g in gaps],
            "weighted_tokens_per_10s": [{n: round(w[n] / weights[n]) for n in weights} for w in per_window],
            "eta_at_cancel": eta}


def take_latency(st: Stack, n_tenants: int = 100, per: int = 10, takes: int = 1000) -> dict:
    from kombu import Connection, Queue

    from tidepool.service.ledger import fair
    from tidepool.service.ledger.wire import task_message, transport_options
    from tidepool.workers import broker
    q = "fairness-bench-take"       # no worker consumes it
    conn = Connection(st.redis_url, transport_options=transport_options(3600))
    ch = conn.channel()
    lane = Queue(q, routing_key=q).bind(ch)
    pipe = st.redis.pipeline(transaction=False)
    for i in range(per):
        for t in range(n_tenants):
            pipe.lpush(q, task_message(f"job-{t}-{i}", q, fair.meta(f"t{t:03d}", 1.0 + t % 3, None, 100)))
    pipe.execute()
    t0 = time.perf_counter()
    m = broker.take([lane], accept=["json"], fair=(q, 60.0))
    sort_in = time.perf_counter() - t0
    times = []
    for i in range(takes):
        m.ack()
        tenant = m.headers["fair"][0]
        st.redis.lpush(q, task_message(f"again-{i}", q, fair.meta(tenant, 1.0, None, 100)))   # 1,000 stay queued
        t0 = time.perf_counter()
        m = broker.take([lane], accept=["json"], fair=(q, 60.0))
        times.append(time.perf_counter() - t0)
    m.ack()
    conn.release()
    return {"queued": n_tenants * per, "tenants": n_tenants, "takes": takes,
            "p50_ms": round(pct(times, 0.5) * 1000, 3), "p99_ms": round(pct(times, 0.99) * 1000, 3),
            "first_take_sorting_in_1000_ms": round(sort_in * 1000, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--tiny", action="store_true", help="a random-weight tiny model (smoke run)")
    ap.add_argument("--seats", type=int, default=16)
    ap.add_argument("--flood", type=int, default=96, help="A's offline jobs queued before B's 8")
    ap.add_argument("--offline-tokens", type=int, default=64)
    ap.add_argument("--rt-duration", type=float, default=90.0,
                    help="seconds of each realtime phase (B at 0.5/s: 45 requests, so its p95 is not its maximum)")
    ap.add_argument("--rt-tokens", type=int, default=16)
    ap.add_argument("--a-rate", type=float, default=4.0)
    ap.add_argument("--b-rate", type=float, default=0.5)
    ap.add_argument("--backlog-s", type=float, default=60.0, help="seconds the three weighted tenants stay backlogged")
    ap.add_argument("--settle-s", type=float, default=10.0, help="seconds between the weighted batches' creation "
                    "and the window's start")
    ap.add_argument("--backlog-jobs", type=int, default=300, help="jobs per unit of weight in phase (4)")
    ap.add_argument("--backlog-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="tidepool-fairness-"))
    started = time.time()
    native_kernels_ready()
    st = Stack(args, tmp)
    try:
        a_key, b_key = st.tenant("flooder-a"), st.tenant("tenant-b")
        st.key0 = a_key
        warm = [[rng.randint(100, VOCAB - 1) for _ in range(32)] for _ in range(4)]

        log("FIFO worker: B alone, then A's flood with B's 8")
        st.start_worker(fair=False)
        wait_done(st, submit(st, a_key, warm, 8), 120)
        tb = time.time()
        b_alone_ids = submit(st, b_key, [[rng.randint(100, VOCAB - 1) for _ in range(32)] for _ in range(8)],
                             args.offline_tokens)
        b_alone = round(max(t for t, _ in wait_done(st, b_alone_ids, args.timeout).values()) - tb, 2)
        fifo = offline_flood(st, a_key, b_key, rng, args)
        log(f"B alone {b_alone} s; FIFO {fifo}")

        log("fair worker: A's flood with B's 8")
        st.start_worker(fair=True)
        wait_done(st, submit(st, a_key, warm, 8), 120)
        fair_run = offline_flood(st, a_key, b_key, rng, args)
        log(f"fair {fair_run}")

        log("realtime: B alone, then B beside A's flood")
        rt_alone = realtime(st, {"B": b_key}, {"B": args.b_rate}, args, args.seed)["B"]
        rt_mixed = realtime(st, {"A": a_key, "B": b_key}, {"A": args.a_rate, "B": args.b_rate}, args, args.seed + 7)
        log(f"realtime alone {rt_alone}; mixed {rt_mixed}")

        log(f"three tenants of weights 1, 1, 2 backlogged for {args.backlog_s} s")
        shares = weighted(st, args, rng)
        log(f"weighted {shares}")
        st.stop_worker()      # the take is timed alone: an idle worker's polls and heartbeats share the 2 cores
        take = take_latency(st)
        log(f"take {take}")
    except BaseException:
        st.log.flush()
        log("processes' log tail:\n" + "\n".join((tmp / "processes.log").read_text().splitlines()[-40:]))
        raise
    finally:
        st.close()
        shutil.rmtree(tmp, ignore_errors=True)

    offline = {"b_alone_makespan_s": b_alone, "b_flood_makespan_s": fair_run["b_makespan_s"],
               "ratio": round(fair_run["b_makespan_s"] / b_alone, 2),
               "fifo_b_flood_makespan_s": fifo["b_makespan_s"], "fifo_ratio": round(fifo["b_makespan_s"] / b_alone, 2),
               "all_makespan_s": fair_run["all_makespan_s"], "fifo_all_makespan_s": fifo["all_makespan_s"],
               "throughput_vs_fifo": round((fair_run["tokens"] / fair_run["all_makespan_s"])
                                           / (fifo["tokens"] / fifo["all_makespan_s"]), 3)}
    rt = {"b_alone_ttft_p95_ms": rt_alone["ttft_p95_ms"], "b_flood_ttft_p95_ms": rt_mixed["B"]["ttft_p95_ms"],
          "a_flood_ttft_p95_ms": rt_mixed["A"]["ttft_p95_ms"],
          "ratio": round(rt_mixed["B"]["ttft_p95_ms"] / rt_alone["ttft_p95_ms"], 2),
          "failed": rt_alone["failed"] + rt_mixed["A"]["failed"] + rt_mixed["B"]["failed"],
          "alone": rt_alone, "flood": rt_mixed}
    line = {"bench": "fairness", "model": "tiny" if args.tiny else Path(args.model).name, "seats": args.seats,
            "device": "cpu", "offline": offline, "realtime": rt, "weighted": shares, "take": take,
            "run_s": round(time.time() - started, 1)}
    goals = {"offline makespan ratio <= 2.5": offline["ratio"] <= 2.5,
             "realtime TTFT p95 ratio <= 1.3": rt["ratio"] <= 1.3,
             "B's realtime TTFT p95 below A's": rt["b_flood_ttft_p95_ms"] < rt["a_flood_ttft_p95_ms"],
             "weighted shares within 10% of 1:1:2": shares["share_error_max"] <= 0.10,
             "Jain's index >= 0.95": shares["jain"] >= 0.95,
             "throughput >= 0.95x FIFO": offline["throughput_vs_fifo"] >= 0.95,
             "take p99 <= 2 ms": take["p99_ms"] <= 2.0}
    line["goals"] = {k: bool(v) for k, v in goals.items()}
    print(json.dumps(line), flush=True)
    record("fairness", line)
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
