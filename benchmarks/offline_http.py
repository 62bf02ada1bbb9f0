"""Offline work through the front door: the same requests through the engine alone, `tidepool run-batch`, `tidepool
serve` over HTTP, the production shape over HTTP and, with --peer, any OpenAI-compatible server.

    python benchmarks/offline_http.py [--model DIR] [--requests 128] [--tokens 128] [--max-num-seqs 64]
                                      [--only a,b,c,d] [--peer URL [--peer-cmd CMD] [--peer-key KEY]]

Workload: --requests prompts of 16-512 token ids (lengths and ids drawn with random.Random(--seed), ids in
[100, vocab) of --model), --tokens output tokens each, greedy, ignore_eos, all of them handed over at once and
measured to the last completion. The same requests go down each path, one path after the other (never two at once):
  (a) engine      the engine alone in this process: LLM(model, max_num_seqs=--max-num-seqs).generate(...) after a
                  short warm-up; the engine is dropped and its OpenMP team ended before the next path;
  (b) run_batch   `tidepool run-batch --max-num-seqs N` (a process of its own, no server) on the same requests as
                  /v1/completions lines of a Batch file; the span is the run's own "seconds" (the model load and
                  the kernel load left out);
  (c) serve       `tidepool serve` started in a scratch folder (TIDEPOOL_MAX_NUM_SEQS=N, defaults otherwise): one
                  warm-up job, then the requests as POST /v1/jobs with "sla_class": "batch", one after another, and
                  GET /v1/jobs pages polled every second until all are completed; the span runs from the first POST
                  to the last job's finished_at in the ledger;
  (d) production  gunicorn web, `tidepool beat` and one `tidepool worker --kind gpu --device cpu` (N seats) over a
                  private Postgres cluster and redis-server (benchmarks/fairness.py's stack); measured as (c);
  (e) peer        with --peer URL: an OpenAI-compatible server (--peer-cmd starts it once the others are stopped and
                  stops it when measured): one warm-up request, then non-streamed /v1/completions, one connection
                  per request, all at once; the span runs to the last response.
Generated tok/s of a path = its completion tokens / its span; every request must come back with --tokens tokens.
The log on stderr names the process id of the started serve and of the production shape's worker (to attach a
sampling profiler such as `py-spy record --idle --threads --pid PID`).

Prints one JSON line: per path gen_tok_s, seconds and completion_tokens (the HTTP paths also cpu_s: the CPU seconds
each process used over the span, serve's one process; the production shape's worker, web, beat, postgres and
redis, so the service's share beside the engine is measured); the ratios of every path's gen tok/s over the engine
alone ("over_engine") and, with a peer, over the peer ("over_peer"). Goals: serve and the production shape >= 0.95x
the engine alone and >= 1.0x the peer.

A quick iteration: --requests 32 --tokens 32 --only a,c.
"""
import argparse
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from capacity import proc_cpu, tree  # noqa: E402
from fairness import Stack as ProductionStack  # noqa: E402
from hybrid_http import OfflineRun, Server, first_model, model_vocab, start_serve  # noqa: E402
from online_latency import _get, _stop, _wait, native_kernels_ready  # noqa: E402
from results import record  # noqa: E402

PATHS = {"a": "engine", "b": "run_batch", "c": "serve", "d": "production", "e": "peer"}
PROMPT_LEN = (16, 512)
MIN_TOKEN_ID = 100
WARMUP = [[MIN_TOKEN_ID] * 16]      # the HTTP paths' warm-up job: one short prompt, WARMUP_TOKENS tokens
WARMUP_TOKENS = 4
GOAL_OVER_ENGINE, GOAL_OVER_PEER = 0.95, 1.0


def log(msg: str) -> None:
    print(f"[offline_http] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of every request")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch, on every path")
    ap.add_argument("--only", default=None, metavar="a,b,c,d,e",
                    help="the paths to run: " + ", ".join(f"{k} {v}" for k, v in PATHS.items())
                    + " (default: a-d, and e with --peer)")
    ap.add_argument("--peer", help="base URL of an OpenAI-compatible server, measured last")
    ap.add_argument("--peer-cmd", help="shell command that starts the peer once the other paths are done (stopped "
                    "with SIGTERM to its process group when measured)")
    ap.add_argument("--peer-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                    help="API key for --peer (default: $OPENAI_API_KEY, else 'none')")
    ap.add_argument("--peer-model", help="model name for --peer (default: the first of its /v1/models)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a variable for the started serve and the production shape's worker (repeatable)")
    ap.add_argument("--port", type=int, default=8321, help="port of the started serve")
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn below this (default: --model's "
                    "vocab_size, else SmolLM2's 49152)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="most seconds a path may take")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    letters = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else \
        ["a", "b", "c", "d"] + (["e"] if args.peer else [])
    unknown = [p for p in letters if p not in PATHS]
    if unknown or not letters:
        ap.error(f"--only takes letters of {', '.join(PATHS)}, got {args.only!r}")
    if "e" in letters and not args.peer:
        ap.error("path e (the peer) needs --peer URL")
    if args.requests < 1 or args.tokens < 1 or args.max_num_seqs < 1:
        ap.error("--requests, --tokens and --max-num-seqs must be positive")
    args.paths = [PATHS[p] for p in PATHS if p in letters]      # in the order a..e
    return args


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of PROMPT_LEN token ids in [MIN_TOKEN_ID, vocab), drawn with random.Random(seed)."""
    rng = random.Random(seed)
    return [[rng.randint(MIN_TOKEN_ID, vocab - 1) for _ in range(rng.randint(*PROMPT_LEN))] for _ in range(n)]


def figures(tokens: int, seconds: float, **extra) -> dict:
    return {"gen_tok_s": round(tokens / seconds, 1) if seconds > 0 else None, "seconds": round(seconds, 2),
            "completion_tokens": tokens, **extra}


def ratios(paths: dict[str, dict], over: str) -> dict[str, float]:
    """Every other path's gen tok/s over path `over`'s (empty when that path was not measured)."""
    base = (paths.get(over) or {}).get("gen_tok_s")
    return {name: round(p["gen_tok_s"] / base, 3) for name, p in paths.items()
            if name != over and base and p.get("gen_tok_s")} if base else {}


def goals(line: dict) -> dict[str, bool]:
    out = {}
    for name in ("serve", "production"):
        if name in line["over_engine"]:
            out[f"{name} >= {GOAL_OVER_ENGINE}x the engine"] = line["over_engine"][name] >= GOAL_OVER_ENGINE
        if name in line.get("over_peer", {}):
            out[f"{name} >= {GOAL_OVER_PEER}x the peer"] = line["over_peer"][name] >= GOAL_OVER_PEER
    return out


def _checked(name: str, per_request: list[int], args) -> int:
    short = [n for n in per_request if n != args.tokens]
    if len(per_request) != args.requests or short:
        raise RuntimeError(f"{name}: {len(per_request)} of {args.requests} requests came back, {len(short)} of them "
                           f"not with {args.tokens} tokens ({short[:5]})")
    return sum(per_request)


# -- the paths ---------------------------------------------------------------------------------------------------

def engine_alone(args, prompts) -> dict:
    from tidepool.workers.engine import LLM, SamplingParams
    from tidepool.workers.engine.openmp import release_team
    started = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    load_s = time.perf_counter() - started
    llm.generate(WARMUP, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    tokens = _checked("engine", [len(o.token_ids) for o in outs], args)
    del llm, outs
    gc.collect()
    release_team()          # no idle OpenMP team of this process beside the next path's engine
    return figures(tokens, seconds, load_s=round(load_s, 1))


def _env(args, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def run_batch(args, prompts) -> dict:
    model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory(prefix="offline-http-batch-") as tmp:
        src, dst = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                           "body": {"model": Path(model).name, "prompt": ids,
                                                    "max_tokens": args.tokens, "temperature": 0,
                                                    "ignore_eos": True}}) + "\n" for i, ids in enumerate(prompts)))
        cmd = [sys.executable, "-m", "tidepool.workers.cli", "run-batch", "-i", str(src), "-o", str(dst), "--model",
               model, "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--no-progress"]
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, env=_env(args), capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"run-batch exited {done.returncode}:\n{done.stderr[-3000:]}")
        counts = json.loads(done.stdout.strip().splitlines()[-1])
        per_request = [json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                       for line in dst.read_text().splitlines()]
    tokens = _checked("run_batch", per_request, args)
    return figures(tokens, counts["seconds"], process_s=round(wall, 1))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, children included) each named process tree has used so far."""
    return {name: sum(proc_cpu(p) for p in tree(pid)) for name, pid in pids.items()}


def through_jobs(name: str, base: str, key: str, model: str, args, prompts, pids: dict[str, int]) -> dict:
    """One warm-up job, then `prompts` as batch-class jobs, polled until all are completed (hybrid_http's
    OfflineRun: POST /v1/jobs one after another, then GET /v1/jobs pages every second). pids: the processes whose
    CPU seconds over the measured span are reported (`cpu_s`; the engine's process first)."""
    warm = OfflineRun(Server(name, base, key, model, True, SimpleNamespace(offline_tokens=WARMUP_TOKENS)), WARMUP)
    warm.wait(until=warm.start + 300)
    if len(warm.done) != 1:
        raise RuntimeError(f"{name}: the warm-up job did not complete in 300 s")
    log(f"{name}: {len(prompts)} jobs")
    before = cpu_seconds(pids)
    run = OfflineRun(Server(name, base, key, model, True, SimpleNamespace(offline_tokens=args.tokens)), prompts)
    submitted = time.time() - run.start
    run.wait(until=run.start + args.timeout)
    used = {k: round(v - before[k], 1) for k, v in cpu_seconds(pids).items()}
    tokens = _checked(name, [n for _, n in run.done], args)
    return figures(tokens, max(t for t, _ in run.done) - run.start, submit_s=round(submitted, 2), cpu_s=used)


def serve(args, prompts) -> dict:
    with tempfile.TemporaryDirectory(prefix="offline-http-serve-") as tmp:
        proc, base, key = start_serve(args, Path(tmp))
        log(f"serve: pid {proc.pid}, {base}")
        try:
            return through_jobs("serve", base, key, first_model(base, key), args, prompts, {"serve": proc.pid})
        finally:
            _stop([proc])


def production(args, prompts) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="offline-http-production-"))
    try:
        st = ProductionStack(SimpleNamespace(tiny=False, model=args.model, seats=args.max_num_seqs), tmp)
        try:
            st.env.update(dict(item.partition("=")[::2] for item in args.env))     # the worker's, started next
            st.key0 = st.tenant("offline-http")
            st.start_worker(fair=True)
            log(f"production: worker pid {st.worker.pid}, {st.base}")
            pids = {"worker": st.worker.pid, "web": st.procs[1].pid, "beat": st.procs[2].pid, "postgres": st.pg.pid(),
                    "redis": st.procs[0].pid}
            return through_jobs("production", st.base, st.key0, st.model, args, prompts, pids)
        finally:
            st.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def peer(args, prompts) -> dict:
    proc = None
    if args.peer_cmd:
        proc = subprocess.Popen(args.peer_cmd, shell=True, start_new_session=True)
        _wait(lambda: _get(args.peer, "/v1/models", args.peer_key)[0] == 200, 600, "the peer", proc)
    try:
        base = args.peer.rstrip("/")
        server = Server("peer", base, args.peer_key, args.peer_model or first_model(base, args.peer_key), False, args)
        body = {"model": server.model, "temperature": 0, "ignore_eos": True}
        status, raw = server._post("/v1/completions", {**body, "prompt": WARMUP[0], "max_tokens": WARMUP_TOKENS})
        if status != 200:
            raise RuntimeError(f"peer: HTTP {status}: {raw[:300]!r}")
        done, failed, lock = [], [], threading.Lock()

        def one(ids):
            try:
                status, raw = server._post("/v1/completions", {**body, "prompt": ids, "max_tokens": args.tokens},
                                           timeout=args.timeout)
                got = json.loads(raw)["usage"]["completion_tokens"] if status == 200 else None
            except Exception as exc:        # a refused or broken connection fails the path below
                status, raw, got = 0, repr(exc).encode(), None
            with lock:
                (done.append((time.time(), got)) if got is not None else failed.append(f"{status}: {raw[:200]!r}"))

        threads = [threading.Thread(target=one, args=(ids,), daemon=True) for ids in prompts]
        started = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise RuntimeError(f"peer: {len(failed)} requests failed, e.g. {failed[0]}")
        tokens = _checked("peer", [n for _, n in done], args)
        return figures(tokens, max(t for t, _ in done) - started)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


RUNNERS = {"engine": engine_alone, "run_batch": run_batch, "serve": serve, "production": production, "peer": peer}


def main(argv=None) -> int:
    args = parse_args(argv)
    vocab = args.vocab or model_vocab(args.model)
    prompts = workload(args.requests, vocab, args.seed)
    if set(args.paths) - {"peer"}:
        native_kernels_ready()          # built or loaded once, before any path is measured
    paths = {}
    for name in args.paths:
        log(f"{name}: {args.requests} requests x {args.tokens} tokens")
        paths[name] = RUNNERS[name](args, prompts)
        log(f"{name}: {json.dumps(paths[name])}")
    line = {"model": Path(args.model).name, "requests": args.requests, "tokens": args.tokens,
            "prompt_tokens": sum(len(p) for p in prompts), "max_num_seqs": args.max_num_seqs, "paths": paths,
            "over_engine": ratios(paths, "engine")}
    if "peer" in paths:
        line["over_peer"] = ratios(paths, "peer")
    print(json.dumps(line), flush=True)
    record("offline_http", line)
    met = goals(line)
    if met:
        print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in met.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
