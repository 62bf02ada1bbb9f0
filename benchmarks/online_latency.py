"""Online time-to-first-token: what the service path adds to the engine's own TTFT.

    python benchmarks/online_latency.py [--shape embedded|production|both] [--peer URL] [--idle 40 --steady 30]

Streamed /v1/completions requests (prompts of 32-128 token ids, 16 output tokens, greedy, ignore_eos), first
idle and one at a time (a pause after each answer), then a steady open-loop stream of --rate per second, sent to

* the engine itself: LLMEngine in this process, the same prompts, TTFT = add_request to the first token;
* `tidepool serve` (embedded: one process, SQLite, in-process queue and token stream);
* production: gunicorn as the Procfile runs it + `tidepool worker` + Redis (db 7) + Postgres (its own database);
* --peer URL: any OpenAI-compatible server (e.g. vLLM's, see ../shared/bench/README.md), measured the same way.

The client's TTFT runs from just before it connects to the first `data:` chunk with text. Tidepool's web process
logs one `online.ttft` line per streamed request with the timestamps the path records (handler entry, validated,
ledger insert committed, published, worker took the message, claim committed, added to the engine, start of the
engine step that produced the first token, first token, published to the token stream, event received by the web
process, first chunk written), from which the stage table is built. Every server is started, measured and stopped
in turn, never two at once; the engine baseline runs first, on the same cores. Prints p50/p90/p99 per stage and
the service-path overhead (client TTFT minus the engine's own) per shape.
"""
import argparse
import gc
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from results import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PG = "postgresql://postgres@127.0.0.1:5432"
STAGES = [  # (label, from mark, to mark); "send" and "first_byte" are the client's own
    ("accept + validate", "send", "valid"),
    ("ledger insert", "valid", "insert"),
    ("publish", "insert", "publish"),
    ("worker take", "publish", "take"),
    ("claim / job read", "take", "add"),       # the job read alone when the claim overlaps the prefill
    ("engine queue", "add", "step"),            # includes the earlier chunks of a prompt split over steps
    ("prefill", "step", "tok"),                 # the step that produced the first token
    ("first token to stream", "tok", "pub"),
    ("stream to web", "pub", "event"),
    ("web writes chunk", "event", "write"),
    ("first byte at client", "write", "first_byte"),
    ("(claim committed, from take)", "take", "claim"),
    ("(HTTP accept + auth)", "send", "recv"),
    ("(validate)", "recv", "valid"),
]


def native_kernels_ready() -> str:
    """Build (or load) the native CPU kernels before anything is measured, so no phase runs on the torch path while
    a worker builds them on a thread beside its steps (kernels/cpu_ops.py; on a cold cache the build takes a core for
    tens of seconds, and a phase measured meanwhile runs slower than the later ones). The workers and servers
    the benchmarks start use the same cache (TIDEPOOL_KERNEL_CACHE, else the default folder)."""
    from tidepool.kernels import cpu_ops
    from tidepool.service.ledger.settings import Config
    cpu_ops.configure(cache_dir=Config.setting("kernel_cache"))      # None: the default folder, as the workers'
    started = time.perf_counter()
    state = cpu_ops.prepare()
    print(f"# native CPU kernels: {state} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    return state


def pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def make_prompts(n, vocab, seed, lo=32, hi=128):
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# -- the engine's own TTFT -------------------------------------------------------------------------------
def engine_ttft(model, prompts, steady, rate, max_tokens, kv_blocks, gap):
    from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_kv_blocks=kv_blocks))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first: dict[str, float] = {}

    def on_token(out):
        if out.token_ids and out.request_id not in first:
            first[out.request_id] = time.time()

    def run_one(rid, ids):
        t0 = time.time()
        engine.add_request(rid, ids, params, sla_class="realtime", on_token=on_token)
        while engine.has_unfinished():
            engine.step()
        return first[rid] - t0

    for i in range(3):
        run_one(f"warm{i}", prompts[i % len(prompts)][:40])
    idle = []
    for i, ids in enumerate(prompts):
        idle.append(run_one(f"idle{i}", ids))
        time.sleep(gap)
    # steady: open loop, requests added at their arrival times while the engine steps
    arrivals, start = {}, time.time() + 0.2
    pending = [(start + i / rate, f"steady{i}", ids) for i, ids in enumerate(steady)]
    while pending or engine.has_unfinished():
        now = time.time()
        while pending and pending[0][0] <= now:
            at, rid, ids = pending.pop(0)
            arrivals[rid] = at
            engine.add_request(rid, ids, params, sla_class="realtime", on_token=on_token)
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0][0] - time.time()))
    del engine
    gc.collect()
    return idle, [first[r] - at for r, at in arrivals.items()]


# -- the client ------------------------------------------------------------------------------------------
class Client:
    def __init__(self, base, key, model, max_tokens, extra=None):
        u = urllib.parse.urlparse(base)
        self.host, self.port, self.key, self.model = u.hostname, u.port, key, model
        self.max_tokens, self.extra = max_tokens, extra or {}

    def stream(self, ids) -> dict:
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": self.max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True, **self.extra}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        send = time.time()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            out = {"send": send, "first_byte": None, "id": None}
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if out["first_byte"] is None:
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        out["first_byte"], out["id"] = time.time(), chunk.get("id")
            out["end"] = time.time()
            return out
        finally:
            conn.close()


def measure(client, idle_prompts, steady_prompts, rate, gap, warmup):
    for ids in warmup:
        client.stream(ids)
    idle = []
    for ids in idle_prompts:
        idle.append(client.stream(ids))
        time.sleep(gap)
    return idle, paced(client, steady_prompts, rate)


def arrival_offsets(n: int, rate: float, arrivals: str = "paced", seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests at `rate` a second: "paced", the i-th at i / rate (a steady
    stream); "poisson", exponential gaps of mean 1 / rate from a seeded generator (independent users, as vLLM's
    serving benchmark sends them by default: requests now and then arrive close together)."""
    if arrivals == "paced":
        return [i / rate for i in range(n)]
    if arrivals != "poisson":
        raise ValueError(f"arrivals must be 'paced' or 'poisson', got {arrivals!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def paced(client, prompts, rate, stop=None, arrivals="paced", seed=0) -> list[dict]:
    """Stream each prompt through client.stream, the i-th sent at its arrival_offsets time (paced: i / rate);
    with stop, the i-th is not sent once stop(i) is true (the stream ends early, and the threads of the requests
    not sent return then, not at their time: hybrid_http's mixed phase idled 3 minutes for them)."""
    results, threads, start = [None] * len(prompts), [], time.time() + 0.2
    offsets = arrival_offsets(len(prompts), rate, arrivals, seed)

    def one(i, ids):
        while (left := start + offsets[i] - time.time()) > 0:
            if stop is not None and stop(i):
                return     # (stop stays true once it is: a request not sent at its time is never sent later)
            time.sleep(min(left, 0.5))
        if stop is None or not stop(i):
            results[i] = client.stream(ids)

    for i, ids in enumerate(prompts):
        t = threading.Thread(target=one, args=(i, ids), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


# -- servers ---------------------------------------------------------------------------------------------
def _wait(cond, timeout, what, proc=None, log=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited\n{Path(log).read_text()[-3000:] if log else ''}")
        try:
            if cond():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _get(base, path, key=None):
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _env(args, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=str(Path(args.model).resolve()), TIDEPOOL_LOG_LEVEL="INFO",
               TIDEPOOL_NUM_KV_BLOCKS=str(args.kv_blocks), PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class Embedded:
    name = "embedded"

    def __init__(self, args, tmp):
        self.args, self.tmp = args, Path(tmp)
        self.log = self.tmp / "serve.log"
        self.base = f"http://127.0.0.1:{args.port}"

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(self.args.port)],
                                     cwd=self.tmp, env=_env(self.args), stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)
        _wait(lambda: "API key:" in self.log.read_text(), 120, "tidepool serve", self.proc, self.log)
        self.key = re.search(r"API key:\s+(\S+)", self.log.read_text()).group(1)
        return self

    def __exit__(self, *exc):
        _stop([self.proc])

    def logs(self):
        return [self.log]


class Production:
    name = "production"

    def __init__(self, args, tmp):
        self.args, self.tmp = args, Path(tmp)
        self.base = f"http://127.0.0.1:{args.port}"
        self.procs = []

    def __enter__(self):
        import psycopg
        import redis
        a, db = self.args, self.args.database
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{db}"')
        redis.Redis.from_url(a.redis_url).flushdb()
        self.env = _env(a, TIDEPOOL_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}",
                        TIDEPOOL_REDIS_URL=a.redis_url, TIDEPOOL_STORAGE_DIR=str(self.tmp / "storage"),
                        TIDEPOOL_METRICS_PORT=str(a.metrics_port), TIDEPOOL_WORKER_NAME="bench-online",
                        PROMETHEUS_MULTIPROC_DIR=str(self.tmp / "prom"))
        (self.tmp / "prom").mkdir()
        cli = [sys.executable, "-m", "tidepool.workers.cli"]
        subprocess.run(cli + ["db", "upgrade"], env=self.env, check=True, capture_output=True, cwd=self.tmp)
        out = subprocess.run(cli + ["tenants", "create", "bench"], env=self.env, check=True, capture_output=True,
                             cwd=self.tmp, text=True).stdout
        self.key = json.loads(out.strip().splitlines()[-1])["api_key"]
        self.worker_log, self.web_log = self.tmp / "worker.log", self.tmp / "web.log"
        self.procs.append(subprocess.Popen(cli + ["worker", "--kind", "gpu", "--device", "cpu"], cwd=self.tmp,
                                           env=self.env, stdout=open(self.worker_log, "w"), stderr=subprocess.STDOUT))
        gunicorn = str(Path(sys.executable).with_name("gunicorn"))
        self.procs.append(subprocess.Popen(
            [gunicorn, "-c", "python:tidepool.service.gunicorn_conf", "--worker-class", "gthread", "--workers", "2", "--threads",
             "32", "--timeout", "120", "--bind", f"127.0.0.1:{a.port}", "tidepool.service.wsgi:app"],
            cwd=self.tmp, env=self.env, stdout=open(self.web_log, "w"), stderr=subprocess.STDOUT))
        client = redis.Redis.from_url(a.redis_url)
        from tidepool.service.ledger.snapshots import HEARTBEAT_KEY
        _wait(lambda: client.exists(HEARTBEAT_KEY.format("bench-online")), 120, "worker heartbeat", self.procs[0],
              self.worker_log)
        _wait(lambda: _get(self.base, "/healthz")[0] == 200, 60, "gunicorn", self.procs[1], self.web_log)
        return self

    def __exit__(self, *exc):
        _stop(self.procs)

    def logs(self):
        return [self.web_log]


def read_marks(paths) -> dict[str, dict]:
    marks = {}
    for path in paths:
        for line in Path(path).read_text(errors="replace").splitlines():
            if "online.ttft" not in line:
                continue
            if line.startswith("{"):
                try:
                    line = json.loads(line)["msg"]
                except (ValueError, KeyError):
                    continue
            m = re.search(r"online\.ttft (\{.*\})", line)
            if m:
                rec = json.loads(m.group(1))
                marks[rec["job"]] = rec
    return marks


# -- report ----------------------------------------------------------------------------------------------
def ms(x):
    return f"{x * 1000:7.1f}"


def ttft_row(label, values, base=None):
    p50, p90, p99 = (pct(values, q) for q in (0.5, 0.9, 0.99))
    row = f"| {label:<34} | {ms(p50)} | {ms(p90)} | {ms(p99)} |"
    if base:
        row += f" {ms(p50 - pct(base, 0.5))} | {ms(p99 - pct(base, 0.99))} | {p50 / pct(base, 0.5):5.2f}x |"
    else:
        row += "         |         |  1.00x |"
    return row + f" {len(values):3d} |"


def stage_table(results, marks):
    rows = []
    for label, a, b in STAGES:
        vals = []
        for r in results:
            m = {**marks.get(r["id"], {}), "send": r["send"], "first_byte": r["first_byte"]}
            if m.get(a) is not None and m.get(b) is not None:
                vals.append(m[b] - m[a])
        rows.append(f"| {label:<24} | {ms(pct(vals, 0.5))} | {ms(pct(vals, 0.99))} | {len(vals):3d} |")
    # Per request, so a slow prefill (a busy machine) does not hide in the percentiles of a subtraction: the
    # client's TTFT minus the engine's own part of it (added to the engine -> first token, which also covers
    # the earlier chunks of a prompt the engine splits over several steps).
    path = [(r["first_byte"] - r["send"]) - (marks[r["id"]]["tok"] - marks[r["id"]]["add"]) for r in results
            if r["id"] in marks and "tok" in marks[r["id"]] and "add" in marks[r["id"]]]
    rows.append(f"| {'TTFT minus engine':<24} | {ms(pct(path, 0.5))} | {ms(pct(path, 0.99))} | {len(path):3d} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["embedded", "production", "both", "none"], default="both")
    ap.add_argument("--peer", help="base URL of an OpenAI-compatible server to measure the same way")
    ap.add_argument("--peer-model", help="model name for --peer (default: the first of its /v1/models)")
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--idle", type=int, default=40, help="idle one-at-a-time requests")
    ap.add_argument("--steady", type=int, default=30, help="requests of the steady stream")
    ap.add_argument("--rate", type=float, default=1.5, help="steady stream, requests per second")
    ap.add_argument("--gap", type=float, default=0.3, help="pause after each idle request (s)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--metrics-port", type=int, default=9311)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    ap.add_argument("--database", default="tidepool_bench_online")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-engine", action="store_true", help="no in-process engine baseline (stages only)")
    ap.add_argument("--raw", help="also write every request's timestamps (client and stages) to this JSON file")
    args = ap.parse_args()

    native_kernels_ready()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    idle_prompts = make_prompts(args.idle, vocab, args.seed)
    steady_prompts = make_prompts(args.steady, vocab, args.seed + 1)
    warmup = make_prompts(3, vocab, args.seed + 2)
    print(f"# {args.idle} idle requests ({args.gap}s apart), then {args.steady} at {args.rate}/s; prompts of 32-128 "
          f"token ids, {args.max_tokens} output tokens, greedy, ignore_eos; model {args.model}", flush=True)

    eng_idle, eng_steady = ([], []) if args.skip_engine else engine_ttft(
        args.model, idle_prompts, steady_prompts, args.rate, args.max_tokens, args.kv_blocks, args.gap)
    runs = []     # (name, idle results, steady results, marks)
    shapes = {"embedded": [Embedded], "production": [Production], "both": [Embedded, Production], "none": []}
    for shape in shapes[args.shape]:
        with tempfile.TemporaryDirectory(prefix=f"online-{shape.name}-") as tmp, shape(args, tmp) as srv:
            model = Path(args.model).name
            idle, steady = measure(Client(srv.base, srv.key, model, args.max_tokens, {"sla_class": "realtime"}),
                                   idle_prompts, steady_prompts, args.rate, args.gap, warmup)
            time.sleep(0.5)
            runs.append((shape.name, idle, steady, read_marks(srv.logs())))
    if args.peer:
        status, raw = _get(args.peer, "/v1/models")
        model = args.peer_model or json.loads(raw)["data"][0]["id"]
        idle, steady = measure(Client(args.peer, "none", model, args.max_tokens), idle_prompts, steady_prompts,
                               args.rate, args.gap, warmup)
        runs.append((f"peer {args.peer}", idle, steady, {}))

    if args.raw:
        Path(args.raw).write_text(json.dumps({"engine": {"idle": eng_idle, "steady": eng_steady}, "runs": [
            {"name": n, "idle": i, "steady": st, "marks": m} for n, i, st, m in runs]}))

    def ttfts(results):
        return [r["first_byte"] - r["send"] for r in results if r and r["first_byte"]]

    print("\n## TTFT (ms); overhead = client TTFT minus the engine's own, at p50 and at p99\n")
    print(f"| {'server':<34} | {'p50':>7} | {'p90':>7} | {'p99':>7} | {'ovh p50':>7} | {'ovh p99':>7} | p50/eng |   n |")
    print(f"|{'-' * 36}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 9}|---------|-----|")
    print(ttft_row("engine (LLMEngine) idle", eng_idle))
    for name, idle, _, _ in runs:
        print(ttft_row(f"{name} idle", ttfts(idle), eng_idle))
    print(ttft_row(f"engine (LLMEngine) {args.rate}/s", eng_steady))
    for name, _, steady, _ in runs:
        print(ttft_row(f"{name} {args.rate}/s", ttfts(steady), eng_steady))
    for name, idle, steady, marks in runs:
        if not marks:
            continue
        for label, results in (("idle", idle), (f"{args.rate}/s", steady)):
            print(f"\n## {name}, {label}: stages (ms)\n")
            print(f"| {'stage':<24} | {'p50':>7} | {'p99':>7} |   n |")
            print(f"|{'-' * 26}|{'-' * 9}|{'-' * 9}|-----|")
            print("\n".join(stage_table([r for r in results if r and r["first_byte"]], marks)))

    def ttft_ms(values):
        return {f"p{q}": round(pct(values, q / 100) * 1000, 1) if values else None for q in (50, 90, 99)} | \
            {"n": len(values)}
    record("online_latency", {"rate": args.rate, "max_tokens": args.max_tokens, "ttft_ms": {
        "engine idle": ttft_ms(eng_idle), f"engine {args.rate}/s": ttft_ms(eng_steady),
        **{f"{name} idle": ttft_ms(ttfts(idle)) for name, idle, _, _ in runs},
        **{f"{name} {args.rate}/s": ttft_ms(ttfts(steady)) for name, _, steady, _ in runs}}})


if __name__ == "__main__":
    main()
