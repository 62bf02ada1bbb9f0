"""`tidepool serve` shares one process (and one GIL) between its HTTP server and the engine thread. Does serving
realtime requests over HTTP with SSE slow the engine down?

One process as `serve` builds it (SQLite ledger, in-process queue, the real Worker on a thread, waitress from
workers/embedded.py), the engine kept full by a pile of offline `batch` jobs. Realtime chat requests arrive at
--rate per second in alternating phases:
  http:       from a separate client process, over HTTP, streamed (SSE) through the `openai` client
  in-process: the same requests posted through the app in this process (Flask, no socket, no stream)
and the engine's own generated tokens/s (its counters) is compared between them, phase by phase.

Goal: http tokens/s >= 90% of in-process tokens/s.

    python benchmarks/embedded_http.py [--model models/smollm2-135m] [--rate 1.5] [--phase-seconds 30]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from results import record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [{"role": "user", "content": "Tell me about the tides."}]


def client_main(url: str, key: str, model: str, rate: float, seconds: float, max_tokens: int) -> None:
    """--client mode: realtime streaming chat requests at `rate`/s over HTTP; prints TTFTs (JSON) at the end."""
    import openai
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
    ttfts, threads = [], []

    def one():
        t0 = time.perf_counter()
        first = None
        for chunk in oa.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens, stream=True,
                                                extra_body={"sla_class": "realtime", "ignore_eos": True}):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
        ttfts.append(first)

    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < seconds:
        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
        n += 1
        time.sleep(max(0.0, start + n / rate - time.perf_counter()))
    for t in threads:
        t.join(120)
    print(json.dumps({"requests": n, "ttft": [x for x in ttfts if x is not None]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rate", type=float, default=1.5, help="realtime requests per second")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per realtime request")
    ap.add_argument("--phase-seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3, help="http / in-process phase pairs, alternating")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--offline", type=int, default=3000, help="offline batch jobs queued up front")
    ap.add_argument("--client", nargs=3, metavar=("URL", "KEY", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main(*args.client, args.rate, args.phase_seconds, args.max_tokens)

    from tidepool.service.ledger.logging import configure
    configure("WARNING")
    from kombu.transport.memory import Channel
    from sqlalchemy.orm import Session

    from tidepool.service import create_app, migrate
    from tidepool.service.ledger import tenants
    from tidepool.workers.embedded import http_server
    from tidepool.workers.worker import Worker, WorkerConfig

    Channel.queues.clear()
    tmp = Path(tempfile.mkdtemp(prefix="embedded-http-"))
    url = f"sqlite:///{tmp / 'ledger.db'}"
    migrate.upgrade(url)
    app = create_app({"database_url": url, "redis_url": None, "storage_dir": str(tmp / "s"), "model": args.model})
    with Session(app.services.database) as s:
        _, key = tenants.create_tenant(s, "bench")
        s.commit()
    worker = Worker(WorkerConfig(model=args.model, database_url=url, device=args.device, name="bench",
                                 engine={"max_num_seqs": args.max_num_seqs}))
    worker_thread = threading.Thread(target=worker.run, daemon=True)
    worker_thread.start()
    server = http_server(app, "127.0.0.1", 0, threads=32)
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{server.effective_port}"

    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    for i in range(args.offline):
        r = client.post("/v1/jobs", headers=headers, json={"prompt": f"Offline job {i}: once upon a time",
                                                           "max_tokens": 64, "ignore_eos": True, "sla_class": "batch"})
        assert r.status_code == 202, r.get_json()

    def generated() -> int:
        return worker.engine.stats()["total_generation_tokens"]

    def http_phase() -> dict:
        proc = subprocess.Popen([sys.executable, __file__, "--client", base, key, Path(args.model).name, "--rate", str(args.rate),
                                 "--phase-seconds", str(args.phase_seconds), "--max-tokens", str(args.max_tokens)],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)      # the client's interpreter and imports start outside the window
        t0, g0 = time.perf_counter(), generated()
        time.sleep(args.phase_seconds - 2.0)
        rate = (generated() - g0) / (time.perf_counter() - t0)
        out, _ = proc.communicate(timeout=300)
        result = json.loads(out.strip().splitlines()[-1])
        return {"tok_s": rate, "requests": result["requests"], "ttft": result["ttft"]}

    def inprocess_phase() -> dict:
        stop = threading.Event()
        sent = [0]

        def feed():
            start = time.perf_counter()
            while not stop.is_set():
                r = client.post("/v1/jobs", headers=headers, json={
                    "messages": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True, "sla_class": "realtime"})
                assert r.status_code == 202, r.get_json()
                sent[0] += 1
                stop.wait(max(0.0, start + sent[0] / args.rate - time.perf_counter()))
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(2.0)
        t0, g0 = time.perf_counter(), generated()
        time.sleep(args.phase_seconds - 2.0)
        rate = (generated() - g0) / (time.perf_counter() - t0)
        stop.set()
        feeder.join()
        return {"tok_s": rate, "requests": sent[0]}

    inprocess_phase()    # warm-up, not counted: the engine fills up with offline work, its cost model settles
    rows = []
    for i in range(args.rounds):     # alternate which goes first, so a drift in machine load favours neither
        pair = [("http+sse", http_phase), ("in-process", inprocess_phase)]
        for name, phase in (pair if i % 2 == 0 else pair[::-1]):
            rows.append((name, phase()))
    worker.stop()
    worker_thread.join(30)
    server.close()

    print(f"\nembedded serve, {Path(args.model).name} on {args.device}, max_num_seqs {args.max_num_seqs}, "
          f"offline batch load + realtime {args.rate}/s x {args.max_tokens} tokens, {args.phase_seconds:.0f} s phases")
    print(f"{'phase':<12} {'engine tok/s':>13} {'realtime reqs':>14} {'TTFT p50 ms':>12}")
    for name, r in rows:
        ttft = f"{statistics.median(r['ttft']) * 1000:.0f}" if r.get("ttft") else "-"
        print(f"{name:<12} {r['tok_s']:>13.1f} {r['requests']:>14d} {ttft:>12}")
    http = statistics.mean(r["tok_s"] for n, r in rows if n == "http+sse")
    local = statistics.mean(r["tok_s"] for n, r in rows if n == "in-process")
    by_round = [dict(rows[i:i + 2]) for i in range(0, len(rows), 2)]
    pairs = [r["http+sse"]["tok_s"] / r["in-process"]["tok_s"] for r in by_round]
    print(f"engine tok/s, http+sse / in-process: {http / local:.3f} (per round: "
          f"{', '.join(f'{p:.3f}' for p in pairs)}; median {statistics.median(pairs):.3f}); goal >= 0.90")
    record("embedded_http", {"model": Path(args.model).name, "device": args.device, "rate": args.rate,
                             "http_tok_s": http, "in_process_tok_s": local, "ratio": http / local,
                             "ratio_per_round": pairs})


if __name__ == "__main__":
    main()
