"""Prefix-affinity routing: prefix-cache hit rate and throughput with and without it (service/ledger/affinity.py).

    python benchmarks/prefix_affinity.py [--model models/smollm2-135m | tiny] [--requests 512] [--groups 16]
                                         [--prefix-tokens 256] [--kv-blocks 160] [--max-tokens 8]

The production shape on private servers: a Postgres database on the local server (TIDEPOOL_BENCH_PG, dropped at
the end), a private redis-server, the web app in this process (its dispatcher publishes), and `tidepool worker`
processes. The workload: --requests batch lines in --groups groups; each group's prompts share a
--prefix-tokens-token prefix (its own system prompt) and end in a short question of their own; the lines are
shuffled, as a batch of mixed tasks or many users' chats arrive. Each worker's KV pool (--kv-blocks) holds about
half of the groups' prefixes, so where a group runs decides whether its prefix is still cached.

Three runs, each on freshly started workers (cold caches), in one process:
  single:       one worker with the three workers' KV pool together (3 x --kv-blocks): the hit rate one
                cache that sees every request reaches, the reference;
  no affinity:  three workers, every line in the shared queue (Dispatcher.affinity = False);
  affinity:     three workers, lines routed by prefix key to the worker holding (or placed with) their group.
Per run: the prefix-cache hit rate (prompt tokens found in the cache / prompt tokens looked up, summed over the
workers' engines) and the throughput (lines from the batch's creation until every line is completed). Goals:
affinity's hit rate >= 80% of single's, its throughput >= 1.3x no affinity's.
"""
import argparse
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from results import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PG = os.environ.get("TIDEPOOL_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
WORDS = ("order book shop parcel refund author novel poetry chapter delivery invoice customer shelf edition "
         "paperback hardcover review library reading history science children travel cooking garden music art "
         "letter address weekend opening hours closed holiday gift card voucher discount member account").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond, timeout: float, what: str, every: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"timed out waiting for {what}")


def ideal_hit_rate(tokenizer, pairs: list[tuple[int, str]], block_size: int = 16) -> float:
    """The hit rate of a cache that never evicts and sees every request after the first of its group has been
    computed: each later request finds the full blocks its group shares. An upper bound for the single run."""
    ids: dict[int, list[list[int]]] = {}
    for g, prompt in pairs:
        ids.setdefault(g, []).append(tokenizer.encode(prompt))
    hits = queries = 0
    for seqs in ids.values():
        first = seqs[0]
        for seq in seqs:
            queries += len(seq)
        for seq in seqs[1:]:
            common = next((i for i, (a, b) in enumerate(zip(first, seq)) if a != b), min(len(first), len(seq)))
            hits += min(common, len(seq) - 1) // block_size * block_size
    return hits / queries


def prompts(tokenizer, groups: int, per_group: list[int], prefix_tokens: int, seed: int = 0) -> list[tuple[int, str]]:
    """(group, prompt) pairs: each group's system prompt of at least prefix_tokens tokens, then a question."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        words = [f"You are assistant number {g} of the bookshop."]
        while len(tokenizer.encode(" ".join(words))) < prefix_tokens:
            words.append(rng.choice(WORDS))
        system = " ".join(words)
        for i in range(per_group[g]):
            out.append((g, f"{system}\nQuestion {i}: what about the {rng.choice(WORDS)} {rng.choice(WORDS)}?"))
    rng.shuffle(out)
    return out


class Run:
    def __init__(self, args, db_url: str, redis_url: str, model: str, tmp: Path):
        self.args, self.db_url, self.redis_url, self.model, self.tmp = args, db_url, redis_url, model, tmp
        self.redis = redis.Redis.from_url(redis_url)
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra) -> dict:
        env = dict(os.environ, TIDEPOOL_DATABASE_URL=self.db_url, TIDEPOOL_REDIS_URL=self.redis_url,
                   TIDEPOOL_MODEL=self.model, TIDEPOOL_STORAGE_DIR=str(self.tmp / "storage"),
                   TIDEPOOL_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   TIDEPOOL_MAX_NUM_SEQS=str(self.args.max_num_seqs), TIDEPOOL_METRICS_PORT="0")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def workers(self, names: list[str], kv_blocks: int) -> None:
        for name in names:
            log = open(self.tmp / f"{name}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tidepool.workers.cli", "worker", "--kind", "gpu", "--device", "cpu"], cwd=self.tmp,
                env=self.env(TIDEPOOL_WORKER_NAME=name, TIDEPOOL_NUM_KV_BLOCKS=kv_blocks), stdout=log,
                stderr=subprocess.STDOUT))
        wait(lambda: all(self.beat(n).get("engine") for n in names) or any(p.poll() is not None for p in self.procs),
             300, "workers up")
        if any(p.poll() is not None for p in self.procs):
            raise SystemExit("a worker exited; see its log in " + str(self.tmp))

    def beat(self, name: str) -> dict:
        raw = self.redis.get(f"tidepool:worker:{name}")
        return json.loads(raw) if raw else {}

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        self.redis.flushdb()


def scenario(name: str, run: Run, app, key: str, lines: bytes, n: int, workers: list[str], kv_blocks: int,
             affinity: bool) -> dict:
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from tidepool.service.ledger.models import Job, JobStatus
    run.workers(workers, kv_blocks)
    app.services.dispatcher.affinity = affinity
    router = app.services.dispatcher.router
    if router is not None:
        router.placed.clear()
        router.read_at = float("-inf")
    client, headers = app.test_client(), {"Authorization": f"Bearer {key}"}
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(lines), "in.jsonl")},
                    headers=headers).get_json()
    t0 = time.monotonic()
    b = client.post("/v1/batches", headers=headers, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                          "completion_window": "24h"}).get_json()
    assert b["status"] == "in_progress", b
    engine = app.services.database

    def done() -> int:
        with Session(engine) as s:
            return s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == b["id"],
                                                                        Job.status == JobStatus.completed))
    last = 0
    while (k := done()) < n:
        if time.monotonic() - t0 > run.args.timeout:
            raise SystemExit(f"{name}: {k}/{n} done after {run.args.timeout}s")
        if k // 64 != last // 64:
            print(f"  {name}: {k}/{n} after {time.monotonic() - t0:.0f}s", flush=True)
        last = k
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    t_end = time.time()
    wait(lambda: all(run.beat(w).get("at", 0) > t_end for w in workers), 30, "final heartbeats")
    beats = {w: run.beat(w) for w in workers}
    queries = sum(beat["engine"]["prefix_cache_queries"] for beat in beats.values())
    hits = sum(beat["engine"]["prefix_cache_hits"] for beat in beats.values())
    with Session(engine) as s:
        by_worker = dict(s.execute(select(Job.worker, func.count()).where(Job.batch_id == b["id"])
                                   .group_by(Job.worker)).all())
        prompt_tokens = s.scalar(select(func.sum(Job.prompt_tokens)).where(Job.batch_id == b["id"]))
        spread: dict[str, set] = {}      # group -> the workers its lines ran on
        for custom_id, worker in s.execute(select(Job.custom_id, Job.worker).where(Job.batch_id == b["id"])):
            spread.setdefault(custom_id.split("-")[0], set()).add(worker)
    router = app.services.dispatcher.router
    routed = dict(router.counts) if router is not None and affinity else {}
    if router is not None:
        router.counts = {k: 0 for k in router.counts}
    run.stop()
    worker_hit_rate = {w: round(bt["engine"]["prefix_cache_hits"] / bt["engine"]["prefix_cache_queries"], 3)
                       if bt["engine"]["prefix_cache_queries"] else 0.0 for w, bt in beats.items()}
    out = {"name": name, "seconds": elapsed, "lines_s": n / elapsed, "prompt_tokens_s": prompt_tokens / elapsed,
           "hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries,
           "by_worker": by_worker, "worker_hit_rate": worker_hit_rate, "routed": routed,
           "workers_per_group": sorted(len(v) for v in spread.values())}
    print(f"{name:12s} {elapsed:7.1f}s  {out['lines_s']:6.2f} lines/s  hit rate {out['hit_rate']:.3f} "
          f"({hits}/{queries} prompt tokens)  by worker {by_worker}  hit rate by worker {worker_hit_rate}  "
          f"workers per group {out['workers_per_group']}  {routed}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"),
                   help="model folder, or 'tiny' for a random-weight tiny model built here")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--kv-blocks", type=int, default=160, help="each of the three workers' KV pool, in 16-token blocks")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--skip-single", action="store_true", help="leave out the single-worker reference run (the "
                   "ideal hit rate, an upper bound of it, is printed either way)")
    args = p.parse_args()

    import psycopg

    from tidepool.service import create_app, migrate
    from tidepool.service.ledger import tenants
    from tidepool.workers.engine.tokenizer import Tokenizer

    # SIGTERM (a timeout, a kill) unwinds like Ctrl-C: workers stopped, redis-server killed, database dropped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="tidepool-affinity-"))
    model = args.model
    if model == "tiny":
        from tidepool.workers.tools.tiny_model import make_tiny_model
        model = str(make_tiny_model(str(tmp / "tiny"), seed=1))
    else:      # the workers run in the temp folder
        model = str(Path(model).resolve())
    port = free_port()
    rproc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=tmp)
    redis_url = f"redis://127.0.0.1:{port}/0"
    dbname = f"tidepool_bench_affinity_{os.getpid()}"
    admin = PG.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {dbname}")
    db_url = f"{PG}/{dbname}"
    app = run = None
    try:
        migrate.upgrade(db_url)
        wait(lambda: _ping(redis_url), 10, "redis-server")
        per = [args.requests // args.groups + (g < args.requests % args.groups) for g in range(args.groups)]
        tokenizer = Tokenizer(model)
        pairs = prompts(tokenizer, args.groups, per, args.prefix_tokens)
        ideal = ideal_hit_rate(tokenizer, pairs)
        lines = b"".join(json.dumps({"custom_id": f"g{g}-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True}})
                         .encode() + b"\n" for i, (g, prompt) in enumerate(pairs))
        app = create_app({"database_url": db_url, "redis_url": redis_url, "storage_dir": str(tmp / "storage"),
                          "model": model, "admin_token": "bench"})
        from sqlalchemy.orm import Session
        with Session(app.services.database) as s:
            _, key = tenants.create_tenant(s, "bench", 1.0)
            s.commit()
        run = Run(args, db_url, redis_url, model, tmp)
        three = ["aff-1", "aff-2", "aff-3"]
        print(f"model {model}; {args.requests} lines in {args.groups} groups, prefixes of >= {args.prefix_tokens} "
              f"tokens, {args.max_tokens} output tokens; KV {args.kv_blocks} blocks per worker, "
              f"{args.max_num_seqs} seats", flush=True)
        results = {}
        if not args.skip_single:
            results["single"] = scenario("single", run, app, key, lines, args.requests, ["aff-single"],
                                         3 * args.kv_blocks, affinity=False)
        results["no_affinity"] = scenario("no affinity", run, app, key, lines, args.requests, three,
                                          args.kv_blocks, affinity=False)
        results["affinity"] = scenario("affinity", run, app, key, lines, args.requests, three, args.kv_blocks,
                                       affinity=True)
        a, na = results["affinity"], results["no_affinity"]
        summary = {"throughput_x_no_affinity": a["lines_s"] / na["lines_s"],
                   "hit_rate_affinity": a["hit_rate"], "hit_rate_no_affinity": na["hit_rate"],
                   "hit_rate_ideal": ideal, "hit_rate_vs_ideal": a["hit_rate"] / ideal}
        if "single" in results:
            summary["hit_rate_vs_single"] = a["hit_rate"] / results["single"]["hit_rate"]
        print(json.dumps({"summary": summary, "runs": results}, indent=1))
        record("prefix_affinity", {"summary": summary, "runs": results})
        print(f"affinity: throughput {summary['throughput_x_no_affinity']:.2f}x no affinity (goal >= 1.3); hit rate "
              f"{a['hit_rate']:.3f} vs {na['hit_rate']:.3f} without"
              + (f", {summary['hit_rate_vs_single']:.2f} of single's {results['single']['hit_rate']:.3f} "
                 "(goal >= 0.8)" if "single" in results else "")
              + f"; {summary['hit_rate_vs_ideal']:.2f} of the ideal {ideal:.3f} (every group's prefix computed once)")
    finally:
        if run is not None and run.procs:
            run.stop()
        if app is not None:
            app.services.database.dispose()
        rproc.kill()
        rproc.wait()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        shutil.rmtree(tmp, ignore_errors=True)


def _ping(url: str) -> bool:
    try:
        return redis.Redis.from_url(url).ping()
    except redis.ConnectionError:
        return False


if __name__ == "__main__":
    main()
