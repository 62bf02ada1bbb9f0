"""The product's headline: one worker serving realtime requests and an offline batch at once.

Four scenarios on the same worker (embedded shape: SQLite ledger, in-process queue, the real Worker
class; timings come from the ledger, so they include queueing, claim and streaming bookkeeping):
  (a) offline batch alone                  -> offline generated tokens/s
  (b) realtime alone at a steady rate      -> realtime TTFT p50/p99
  (c) both at once                         -> both
  (d) both at once, class priority off     -> realtime submitted as `batch`: first come, first served

Goals: TTFT p99 (c) <= 1.5x (b); offline tokens/s (c) >= 90% of (a).

    python benchmarks/hybrid_sla.py [--model models/smollm2-135m] [--device cuda] [--offline 128]
"""
import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import select  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from service import create_app, migrate, tenants  # noqa: E402
from service.models import Job, JobStatus  # noqa: E402


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def scenario(name, args, offline: bool, realtime: bool, priority: bool = True) -> dict:
    from kombu.transport.memory import Channel

    from workers.worker import Worker, WorkerConfig
    Channel.queues.clear()
    tmp = Path(tempfile.mkdtemp(prefix="hybrid-"))
    url = f"sqlite:///{tmp / 'ledger.db'}"
    migrate.upgrade(url)
    app = create_app({"database_url": url, "redis_url": None, "storage_dir": str(tmp / "s"), "model": args.model})
    with Session(app.extensions["tidepool.engine"]) as s:
        _, key = tenants.create_tenant(s, "bench")
        s.commit()
    engine_kw = {"max_num_seqs": args.max_num_seqs}
    cfg = WorkerConfig(model=args.model, database_url=url, device=args.device, name=f"bench-{name}",
                       low_water=args.low_water, engine=engine_kw)
    worker = Worker(cfg)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}

    def submit(sla, prompt, tokens):
        r = client.post("/v1/jobs", headers=headers, json={
            "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "sla_class": sla})
        assert r.status_code == 202, r.get_json()
        return r.get_json()["id"]

    # warm up the engine (first step compiles/allocates)
    warm = submit("interactive", "warm up", 4)
    _wait(app, [warm])
    offline_ids, rt_ids = [], []
    t0 = time.time()
    if offline:
        offline_ids = [submit("batch", f"Document {i}: summarise the following text.", args.offline_tokens)
                       for i in range(args.offline)]
    if realtime:
        duration = args.rt_duration
        n = int(duration * args.rt_rate)
        for i in range(n):
            target = t0 + i / args.rt_rate
            time.sleep(max(0.0, target - time.time()))
            rt_ids.append(submit("realtime" if priority else "batch", f"Question {i}: what is up?", args.rt_tokens))
    _wait(app, offline_ids + rt_ids)
    with Session(app.extensions["tidepool.engine"]) as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(offline_ids + rt_ids)))}
    worker.stop()
    thread.join(30)
    out = {"name": name}
    if rt_ids:
        ttft = [(rows[i].first_token_at - rows[i].queued_at).total_seconds() * 1000 for i in rt_ids]
        claim = [(rows[i].started_at - rows[i].queued_at).total_seconds() * 1000 for i in rt_ids]
        out.update(ttft_p50=_pct(ttft, 0.5), ttft_p99=_pct(ttft, 0.99), rt_n=len(rt_ids), claim_p50=_pct(claim, 0.5))
    if offline_ids:
        jobs = [rows[i] for i in offline_ids]
        span = (max(j.finished_at for j in jobs) - min(j.queued_at for j in jobs)).total_seconds()
        out["offline_tok_s"] = sum(j.completion_tokens for j in jobs) / span
    out["preempted"] = dict(worker.preempted)
    return out


def _wait(app, ids, timeout=3600):
    end = time.time() + timeout
    while time.time() < end:
        with Session(app.extensions["tidepool.engine"]) as s:
            left = s.scalar(select(Job.id).where(Job.id.in_(ids), Job.status.in_(
                (JobStatus.queued, JobStatus.running))).limit(1))
        if left is None:
            return
        time.sleep(0.05)
    raise TimeoutError("jobs did not finish")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: models/smollm2-135m, else a tiny model)")
    p.add_argument("--device", default=None)
    p.add_argument("--offline", type=int, default=128, help="offline jobs in the batch")
    p.add_argument("--offline-tokens", type=int, default=128)
    p.add_argument("--rt-rate", type=float, default=4.0, help="realtime requests per second")
    p.add_argument("--rt-tokens", type=int, default=16)
    p.add_argument("--rt-duration", type=float, default=None, help="seconds of realtime load (default: (a)'s span)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--low-water", type=int, default=8)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.model is None:
        default = Path("models/smollm2-135m")
        if (default / "config.json").is_file():
            args.model = str(default)
        else:
            from workers.engine.tiny_model import make_tiny_model
            args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-") + "/tiny", seed=1))
    if args.device is None:
        from workers.worker import default_device
        args.device = default_device()
    print(f"model {args.model} on {args.device}; offline {args.offline} x {args.offline_tokens} tokens; "
          f"realtime {args.rt_rate}/s x {args.rt_tokens} tokens", flush=True)

    a = scenario("a offline alone", args, offline=True, realtime=False)
    if args.rt_duration is None:
        args.rt_duration = max(2.0, a["offline_tok_s"] and args.offline * args.offline_tokens / a["offline_tok_s"])
    b = scenario("b realtime alone", args, offline=False, realtime=True)
    c = scenario("c both", args, offline=True, realtime=True)
    d = scenario("d both, FCFS", args, offline=True, realtime=True, priority=False)
    print(f"\n{'scenario':<22}{'rt TTFT p50 ms':>16}{'rt TTFT p99 ms':>16}{'(claim p50 ms)':>16}"
          f"{'offline tok/s':>15}  offline preemptions")
    nan = float("nan")
    for r in (a, b, c, d):
        print(f"{r['name']:<22}{r.get('ttft_p50', nan):>16.1f}{r.get('ttft_p99', nan):>16.1f}"
              f"{r.get('claim_p50', nan):>16.1f}{r.get('offline_tok_s', nan):>15.1f}  {r['preempted']['batch']}")
    print(f"\nTTFT p99 (c)/(b) = {c['ttft_p99'] / b['ttft_p99']:.2f}  (goal <= 1.5)")
    print(f"offline tok/s (c)/(a) = {c['offline_tok_s'] / a['offline_tok_s']:.2f}  (goal >= 0.90)")
    print(f"TTFT p99 (d)/(b) = {d['ttft_p99'] / b['ttft_p99']:.2f}  (what FCFS costs realtime)")


if __name__ == "__main__":
    main()
