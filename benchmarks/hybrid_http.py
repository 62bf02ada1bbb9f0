"""Realtime and offline at once, over HTTP, as a user sees them: `tidepool serve` and any OpenAI-compatible peer.

    python benchmarks/hybrid_http.py [--url URL --key KEY] [--peer URL [--peer-cmd CMD]] [--rt-duration 60]
                                     [--offline 128]

Per server, one after the other (never two at once), three phases:
  (1) realtime alone: streamed /v1/completions, open loop at --rate per second for --rt-duration seconds (sent
      every 1 / rate s, or with --arrivals poisson at seeded exponential gaps),
      prompts of 32-128 token ids, --rt-tokens output tokens (greedy, ignore_eos); Tidepool: "sla_class":
      "realtime";
  (2) offline alone: --offline jobs of --offline-tokens tokens, all submitted at once (Tidepool: POST /v1/jobs
      at the batch class; a peer: non-streamed /v1/completions with "priority": 10, one connection each),
      measured to the last completion;
  (3) both: the same offline batch and, from the same moment, the realtime stream for at least (2)'s span (and
      --rt-duration), on until the batch is done (at most MIXED_SPANS spans), so offline tok/s is the batch's
      tokens over the span to its last completion (Tidepool: the ledger's finished_at), as in (2); a batch not
      done by then counts the jobs finished inside the window over the window. (Counting only the jobs finished
      inside a fixed window undercounts: jobs finish in waves of max_num_seqs, and a wave nearly done at the
      window's end counts nothing.)

TTFT runs from just before the client connects to the first chunk with text; inter-token gaps are the times
between consecutive chunks with text of one stream (what a reader of the stream sees). Without --url, the
script starts `tidepool serve` itself (defaults, --max-num-seqs 64, the model in --model) in a scratch folder
and stops it afterwards; with --peer URL the peer runs the same phases after it (--peer-cmd: started then, so
the two servers never run at once). One JSON line per server,
then, with a peer, one line of Tidepool / peer ratios. Goals: realtime alone, Tidepool TTFT p50 and
p99 and gap p50 and p99 <= the peer's; mixed, realtime TTFT p99 and gap p99 <= 1.5x Tidepool's realtime-alone
figures, offline tok/s >= 0.6x offline alone, no realtime request failed.

A quick iteration: --rt-duration 20 --offline 32.
"""
import argparse
import http.client
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from online_latency import _get, _stop, _wait, make_prompts, native_kernels_ready, paced, pct  # noqa: E402
from results import record  # noqa: E402

MIXED_SPANS = 4        # the mixed phase's realtime stream runs until the batch is done, at most this many spans


def _ts(value) -> float:
    """A ledger timestamp (unix seconds, or ISO 8601) as unix seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Server:
    """One OpenAI-compatible server: how it takes a realtime request and an offline job, and how it reports them."""

    def __init__(self, name, base, key, model, tidepool, args):
        self.name, self.base, self.key, self.model, self.tidepool, self.args = name, base, key, model, tidepool, args
        u = urllib.parse.urlparse(base)
        self.host, self.port = u.hostname, u.port

    def _conn(self, timeout=600):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _post(self, path, body, timeout=600):
        conn = self._conn(timeout)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stream(self, ids) -> dict:
        """One realtime request: {"send", "chunks": [times of chunks with text], "error"}."""
        body = {"model": self.model, "prompt": ids, "max_tokens": self.args.rt_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        if self.tidepool:
            body["sla_class"] = "realtime"
        out = {"send": time.time(), "chunks": [], "error": None}
        conn = self._conn(120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            resp = conn.getresponse()
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return out
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:200]
                elif chunk.get("choices") and chunk["choices"][0].get("text"):
                    out["chunks"].append(time.time())
        except Exception as exc:
            out["error"] = repr(exc)[:200]
        finally:
            conn.close()
        if out["error"] is None and not out["chunks"]:
            out["error"] = "no text"
        return out

    def offline(self, prompts) -> "OfflineRun":
        return OfflineRun(self, prompts)


class OfflineRun:
    """An offline batch in flight: submitted at once; done_times() are the completions known so far."""

    def __init__(self, server: Server, prompts):
        self.server, self.start, self.tokens = server, time.time(), server.args.offline_tokens
        self.done: list[tuple[float, int]] = []         # (finish time, completion tokens)
        self.failed = 0
        self.ids: list[str] = []
        if server.tidepool:
            for ids in prompts:
                status, raw = server._post("/v1/jobs", {"model": server.model, "prompt": ids, "max_tokens": self.tokens,
                                                        "temperature": 0, "ignore_eos": True, "sla_class": "batch"})
                if status != 202:
                    raise RuntimeError(f"POST /v1/jobs: HTTP {status}: {raw[:200]!r}")
                self.ids.append(json.loads(raw)["id"])
        else:
            self.lock = threading.Lock()
            for ids in prompts:
                threading.Thread(target=self._one, args=(ids,), daemon=True).start()
        self.n = len(prompts)

    def _one(self, ids):
        status, raw = self.server._post("/v1/completions", {
            "model": self.server.model, "prompt": ids, "max_tokens": self.tokens, "temperature": 0,
            "ignore_eos": True, "priority": 10})
        with self.lock:
            if status == 200:
                self.done.append((time.time(), json.loads(raw)["usage"]["completion_tokens"]))
            else:
                self.failed += 1

    def poll(self) -> int:
        """Completions so far (Tidepool: read from the ledger, pages of up to 100 jobs)."""
        if self.server.tidepool:
            want, done, cursor = set(self.ids), [], None
            while True:
                path = "/v1/jobs?sla_class=batch&status=completed&limit=100" + (f"&cursor={cursor}" if cursor else "")
                status, raw = _get(self.server.base, path, self.server.key)
                page = json.loads(raw)
                for job in page["data"]:
                    if job["id"] in want:
                        done.append((_ts(job["finished_at"]), job["usage"]["completion_tokens"]))
                cursor = page.get("next_cursor")
                if not cursor:
                    break
            self.done = done
            return len(done)
        with self.lock:
            return len(self.done)

    def wait(self, until=None, every=1.0) -> None:
        while self.poll() + self.failed < self.n and (until is None or time.time() < until):
            time.sleep(every if until is None else max(0.0, min(every, until - time.time())))

    def rate(self, window_end=None) -> tuple[float, int]:
        """(generated tok/s, jobs finished) over [start, window_end], or to the last completion if all finished."""
        done = [(t, n) for t, n in self.done if window_end is None or t <= window_end]
        if not done:
            return 0.0, 0
        end = max(t for t, _ in done) if len(done) == self.n or window_end is None else window_end
        return sum(n for _, n in done) / max(1e-9, end - self.start), len(done)


def summary(results) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [(r["chunks"][0] - r["send"]) * 1000 for r in ok]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    errors = sorted({r["error"] for r in results if r["error"] is not None})
    return {"n": len(results), "failed": len(results) - len(ok),
            "ttft_ms": {f"p{q}": round(pct(ttft, q / 100), 1) for q in (50, 90, 99)},
            "gap_ms": {"p50": round(pct(gaps, 0.5), 1), "p99": round(pct(gaps, 0.99), 1),
                       "max": round(max(gaps, default=float("nan")), 1)},
            **({"errors": errors[:3]} if errors else {})}


def ttft_series(results, t0: float) -> list[list[float]]:
    """[seconds since t0 the request was sent, its TTFT in ms] per answered request, in send order."""
    return sorted([round(r["send"] - t0, 2), round((r["chunks"][0] - r["send"]) * 1000, 1)]
                  for r in results if r["error"] is None)


def model_vocab(model: str) -> int:
    """The vocabulary of the model folder (what the server accepts as prompt ids), else SmolLM2's."""
    config = Path(model, "config.json")
    return json.loads(config.read_text())["vocab_size"] if config.is_file() else 49152


def run(server: Server, args) -> dict:
    rng = random.Random(args.seed)
    n_rt = max(1, int(args.rt_duration * args.rate))
    vocab = args.vocab or model_vocab(args.model)                      # prompts are random ids in [100, vocab)
    rt_alone = make_prompts(n_rt, vocab, args.seed)
    offline_prompts = [[rng.randint(100, vocab - 1) for _ in range(32)] for _ in range(args.offline)]
    for ids in make_prompts(3, vocab, args.seed + 1):                  # warm-up
        server.stream(ids)
    print(f"[{server.name}] realtime alone: {n_rt} requests at {args.rate}/s", file=sys.stderr, flush=True)
    alone_results = paced(server, rt_alone, args.rate, arrivals=args.arrivals, seed=args.seed)
    alone = summary(alone_results)
    print(f"[{server.name}] realtime alone: {json.dumps(alone)}", file=sys.stderr, flush=True)
    print(f"[{server.name}] offline alone: {args.offline} x {args.offline_tokens} tokens", file=sys.stderr, flush=True)
    off = server.offline(offline_prompts)
    off.wait(until=off.start + args.timeout)
    off_alone, off_alone_done = off.rate()
    span = max(args.rt_duration, (max(t for t, _ in off.done) - off.start) if off.done else args.rt_duration)
    n_mixed = max(1, int(span * args.rate))
    print(f"[{server.name}] both: at least {n_mixed} realtime requests over {span:.0f} s beside the batch, on until "
          f"the batch is done (at most {MIXED_SPANS}x that)", file=sys.stderr, flush=True)
    mixed_prompts = make_prompts(n_mixed * MIXED_SPANS, vocab, args.seed + 2)
    off2 = server.offline([[t + 1 if t + 1 < vocab else 100 for t in ids] for ids in offline_prompts])  # no cache hits
    batch_done = threading.Event()
    threading.Thread(target=lambda: (off2.wait(until=off2.start + MIXED_SPANS * span, every=2.0), batch_done.set()),
                     daemon=True).start()
    mixed_results = paced(server, mixed_prompts, args.rate, stop=lambda i: i >= n_mixed and batch_done.is_set(),
                          arrivals=args.arrivals, seed=args.seed + 2)
    mixed = summary(mixed_results)
    window_end = time.time()
    off2.poll()
    off_mixed, off_mixed_done = off2.rate(window_end)
    return {"server": server.name, "arrivals": args.arrivals, "rt_alone": alone, "rt_mixed": mixed,
            "offline_alone_tok_s": round(off_alone, 1), "offline_alone_done": off_alone_done,
            "offline_mixed_tok_s": round(off_mixed, 1), "offline_mixed_done": off_mixed_done,
            "offline_jobs": args.offline, "mixed_window_s": round(window_end - off2.start, 1),
            "mixed_vs_alone": {
                "ttft_p99": round(mixed["ttft_ms"]["p99"] / alone["ttft_ms"]["p99"], 2),
                "gap_p99": round(mixed["gap_ms"]["p99"] / alone["gap_ms"]["p99"], 2),
                "offline_tok_s": round(off_mixed / off_alone, 2) if off_alone else None},
            "series": {"alone_ttft": ttft_series(alone_results, min((r["send"] for r in alone_results), default=0)),
                       "mixed_ttft": ttft_series(mixed_results, off2.start),
                       "mixed_offline_done": [[round(t - off2.start, 2), n] for t, n in sorted(off2.done)]}}


def printed(line: dict) -> dict:
    """A server's line as printed: without the per-request series (they go to the recorded result only)."""
    return {k: v for k, v in line.items() if k != "series"}


def start_serve(args, tmp: Path):
    import os
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_MODEL=str(Path(args.model).resolve()), TIDEPOOL_MAX_NUM_SEQS=str(args.max_num_seqs),
               PYTHONPATH=str(ROOT))
    for item in args.env:
        k, _, v = item.partition("=")
        env[k] = v
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(args.port)], cwd=tmp, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    _wait(lambda: "API key:" in log.read_text(), 180, "tidepool serve", proc, log)
    key = re.search(r"API key:\s+(\S+)", log.read_text()).group(1)
    return proc, f"http://127.0.0.1:{args.port}", key


def first_model(base, key):
    status, raw = _get(base, "/v1/models", key)
    return json.loads(raw)["data"][0]["id"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running Tidepool (default: start `tidepool serve` here)")
    ap.add_argument("--key", help="its API key (with --url)")
    ap.add_argument("--peer", help="base URL of an OpenAI-compatible server, measured after Tidepool")
    ap.add_argument("--peer-model", help="model name for --peer (default: the first of its /v1/models)")
    ap.add_argument("--peer-cmd", help="shell command that starts the peer, run once Tidepool is stopped (so the two "
                    "never run at once) and stopped (SIGTERM to its process group) when measured")
    ap.add_argument("--no-tidepool", action="store_true", help="measure only --peer")
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the started serve (repeatable)")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--rate", type=float, default=1.5, help="realtime requests per second")
    ap.add_argument("--arrivals", choices=("paced", "poisson"), default="paced",
                    help="realtime send times: paced (every 1 / rate s) or poisson (seeded exponential gaps)")
    ap.add_argument("--rt-duration", type=float, default=60.0, help="seconds of realtime alone (and the least of (3))")
    ap.add_argument("--rt-tokens", type=int, default=16)
    ap.add_argument("--offline", type=int, default=128, help="offline jobs")
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn below this (default: --model's "
                    "vocab_size, else SmolLM2's 49152)")
    ap.add_argument("--offline-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900.0, help="most seconds to wait for the offline batch alone")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lines = []
    if not args.no_tidepool:
        if args.url:
            server = Server("tidepool", args.url, args.key, first_model(args.url, args.key), True, args)
            lines.append(run(server, args))
        else:
            native_kernels_ready()
            with tempfile.TemporaryDirectory(prefix="hybrid-http-") as tmp:
                proc, base, key = start_serve(args, Path(tmp))
                try:
                    lines.append(run(Server("tidepool", base, key, first_model(base, key), True, args), args))
                finally:
                    _stop([proc])
        print(json.dumps(printed(lines[-1])), flush=True)
    if args.peer:
        peer = None
        if args.peer_cmd:
            import os
            import signal
            peer = subprocess.Popen(args.peer_cmd, shell=True, start_new_session=True)
            _wait(lambda: _get(args.peer, "/v1/models")[0] == 200, 600, "the peer", peer)
        try:
            model = args.peer_model or first_model(args.peer, "none")
            lines.append(run(Server("peer", args.peer.rstrip("/"), "none", model, False, args), args))
        finally:
            if peer is not None:
                os.killpg(peer.pid, signal.SIGTERM)
                peer.wait(60)
        print(json.dumps(printed(lines[-1])), flush=True)
    if len(lines) == 2:
        t, p = lines
        ratios = {f"rt_alone_{m}_{q}": round(t["rt_alone"][m][q] / p["rt_alone"][m][q], 2)
                  for m in ("ttft_ms", "gap_ms") for q in ("p50", "p99")}
        ratios["offline_alone_tok_s"] = round(t["offline_alone_tok_s"] / p["offline_alone_tok_s"], 2)
        print(json.dumps({"tidepool_over_peer": ratios}), flush=True)
    record("hybrid_http", {"servers": lines, **({"tidepool_over_peer": ratios} if len(lines) == 2 else {})})
    for line in lines:
        if line["server"] != "tidepool":
            continue
        m = line["mixed_vs_alone"]
        goals = {"mixed ttft_p99 <= 1.5x alone": m["ttft_p99"] <= 1.5, "mixed gap_p99 <= 1.5x alone": m["gap_p99"] <= 1.5,
                 "offline mixed >= 0.6x alone": (m["offline_tok_s"] or 0) >= 0.6,
                 "no realtime request failed": line["rt_alone"]["failed"] + line["rt_mixed"]["failed"] == 0}
        if len(lines) == 2:
            goals.update({f"alone {k} <= peer": v <= 1.0 for k, v in ratios.items() if k.startswith("rt_alone")})
        print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
