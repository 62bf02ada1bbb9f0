"""Scaling with the tide, with real processes: workers started and stopped as `tidepool:desired_workers` says,
through a compressed tide, with the harness playing KEDA; nothing lost, nothing run twice, every drain inside its
grace period.

On this machine: a fresh Postgres database (`tidepool db upgrade`; dropped at the end), a private redis-server, the
web app in this process (jobs are submitted and `/metrics` is read through it), and `tidepool worker --kind auto
--device cpu` processes over a tiny random-weight model, SEATS sequences an engine (the `cpu` overlay's pool shape: TIDEPOOL_PLANNER_POOLS
`cpu=MAX`). Time is compressed: the planner's 15-minute intervals last --interval seconds (beat.plan_fleet with
those intervals; the recent-rate window is one interval), and beat's upkeep and plan run every --tick seconds.

The tide: phases of online (interactive) work, each at a level times one worker's measured tokens/s (its cost
model, as the planner reads it), which the planner forecasts from the last interval's arrivals; plus a batch job
each tick with a deadline DEADLINE_INTERVALS intervals after submission. The harness, as KEDA with the ScaledObject's behaviour: scale up at once to desired_workers,
scale down one worker per tick after --stabilise seconds below; a worker scaled down gets SIGTERM and drains
(TIDEPOOL_DRAIN_GRACE_S = --grace), and must exit within the pod's grace period (the manifests' margin: --grace +
20 s). At the end every worker is stopped the same way and the ledger is checked: every job terminal, none lost
(queued or running left), none run twice (usage equals completed work, no job with two attempts), and no drain
past its grace.

    python benchmarks/tide_fleet.py [--pg postgresql+psycopg://postgres@127.0.0.1:5432] [--interval 10]
        [--phases 0.3:30,2.2:50,0.2:70,1.4:40] [--max-workers 3] [--grace 6]
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "admin"
DEADLINE_INTERVALS = 16
SEATS = 4                     # sequences per engine: the planner's rate (a full batch of them) near what a worker does
POD_MARGIN_S = 20.0           # terminationGracePeriodSeconds - TIDEPOOL_DRAIN_GRACE_S in the manifests
JOB_TOKENS = 256              # a batch job's max_tokens
ONLINE_TOKENS = 64           # an online job's


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds standing for 15 minutes")
    ap.add_argument("--tick", type=float, default=2.0)
    ap.add_argument("--phases", default="0.3:30,2.2:50,0.2:70,1.4:40",
                    help="level:seconds,... (level: offered online tokens/s over one worker's measured tokens/s)")
    ap.add_argument("--max-workers", type=int, default=3)
    ap.add_argument("--grace", type=float, default=6.0)
    ap.add_argument("--stabilise", type=float, default=10.0)
    ap.add_argument("--no-record", action="store_true")
    return ap.parse_args(argv)


class Harness:
    def __init__(self, args, tmp: Path):
        from tests.servers import free_port, start_redis
        from tidepool.workers.tools.tiny_model import make_tiny_model
        self.args, self.tmp = args, tmp
        self.model = str(make_tiny_model(str(tmp / "tiny"), seed=1))
        self.redis_port = free_port()
        self.redis_proc = start_redis(self.redis_port, tmp)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.dbname = f"tidepool_tide_{os.getpid()}"
        self.db_url = f"{args.pg}/{self.dbname}"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")},
                    "TIDEPOOL_DATABASE_URL": self.db_url, "TIDEPOOL_REDIS_URL": self.redis_url,
                    "TIDEPOOL_MODEL": self.model, "TIDEPOOL_STORAGE_DIR": str(tmp / "storage"),
                    "TIDEPOOL_LOG_LEVEL": "INFO", "TIDEPOOL_LOG_FORMAT": "json", "OMP_NUM_THREADS": "1",
                    "TIDEPOOL_DRAIN_GRACE_S": str(args.grace), "TIDEPOOL_PLANNER_POOLS": f"cpu={args.max_workers}",
                    "TIDEPOOL_METRICS_PORT": "0", "TIDEPOOL_MAX_NUM_SEQS": str(SEATS),
                    "PYTHONPATH": str(ROOT)}
        up = subprocess.run([sys.executable, "-m", "tidepool.workers.cli", "db", "upgrade"], env=self.env,
                            capture_output=True, text=True, cwd=tmp)
        if up.returncode != 0:
            raise SystemExit(f"tidepool db upgrade failed:\n{up.stderr}")
        from tidepool.service import create_app
        self.app = create_app({"database_url": self.db_url, "redis_url": self.redis_url, "model": self.model,
                               "storage_dir": str(tmp / "storage"), "admin_token": ADMIN,
                               "planner_pools": f"cpu={args.max_workers}"})
        self.client = self.app.test_client()
        self.pool = f"{Path(self.model).name}/cpu"
        self.workers: list[dict] = []       # name, proc, started, term (monotonic), exited
        self.count = 0

    # -- KEDA's part ----------------------------------------------------------------------------------------
    def live(self) -> list[dict]:
        return [w for w in self.workers if w["term"] is None]

    def start_worker(self) -> None:
        self.count += 1
        name = f"tide-{self.count}"
        logf = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "worker", "--kind", "auto", "--device",
                                 "cpu"], env={**self.env, "TIDEPOOL_WORKER_NAME": name}, cwd=self.tmp, stdout=logf,
                                stderr=subprocess.STDOUT)
        self.workers.append({"name": name, "proc": proc, "started": time.monotonic(), "term": None, "exited": None,
                             "log": logf.name})
        log(f"scale up: {name}")

    def stop_worker(self, w: dict) -> None:
        w["term"] = time.monotonic()
        w["proc"].send_signal(signal.SIGTERM)
        log(f"scale down: {w['name']} (SIGTERM)")

    def reap(self) -> None:
        for w in self.workers:
            if w["exited"] is None and w["proc"].poll() is not None:
                w["exited"] = time.monotonic()

    def desired(self) -> int | None:
        text = self.client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        found = re.search(rf'^tidepool:desired_workers\{{pool="{re.escape(self.pool)}"\}} ([0-9.]+)$', text, re.M)
        return None if found is None else int(float(found.group(1)))

    # -- the ledger's part -----------------------------------------------------------------------------------
    def rate(self) -> float | None:
        from tidepool.service.ledger import fleet
        from tidepool.service.ledger.snapshots import Heartbeats
        rates = fleet.measured_rates(Heartbeats(self.app.services.redis).read(), Path(self.model).name)
        return rates.get(self.pool)

    def submit(self, key: str, n: int, max_tokens: int, sla_class: str, deadline: float | None) -> list[str]:
        ids = []
        for i in range(n):
            body = {"prompt": f"tide {self.count} {i} {time.time()}", "max_tokens": max_tokens, "ignore_eos": True,
                    "sla_class": sla_class}
            if deadline is not None:
                body["deadline"] = int(deadline)
            r = self.client.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 202:
                ids.append(r.get_json()["id"])
        return ids

    def upkeep(self) -> dict:
        from tidepool.workers import beat
        beat.sweep(self.app.services, republish_after=5.0)
        a = self.args
        durations = [a.interval] * 4 + [a.interval * 4] * 8
        return beat.plan_fleet(self.app.services, durations=durations)

    def ledger(self) -> dict:
        from sqlalchemy import func, select
        from sqlalchemy.orm import Session
        from tidepool.service.ledger.models import Job, JobStatus, Usage
        with Session(self.app.services.database) as s:
            states = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            completed = s.execute(select(func.count(), func.coalesce(func.sum(Job.prompt_tokens + Job.completion_tokens),
                                                                      0)).where(Job.status == JobStatus.completed)).one()
            usage = s.execute(select(func.coalesce(func.sum(Usage.requests), 0),
                                     func.coalesce(func.sum(Usage.prompt_tokens + Usage.completion_tokens), 0))).one()
            twice = s.scalar(select(func.count()).where(Job.attempts > 1))
        return {"states": {k.value: v for k, v in states.items()}, "completed": int(completed[0]),
                "completed_tokens": int(completed[1]), "usage_requests": int(usage[0]),
                "usage_tokens": int(usage[1]), "attempts_over_1": int(twice)}

    def close(self) -> None:
        for w in self.workers:
            if w["proc"].poll() is None:
                w["proc"].kill()
                w["proc"].wait()
        self.app.services.database.dispose()
        self.redis_proc.kill()
        self.redis_proc.wait()
        import psycopg
        admin = self.args.pg.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
        try:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {self.dbname} WITH (FORCE)")
        except psycopg.OperationalError as exc:
            log(f"could not drop database {self.dbname}: {exc}")


def run(h: Harness, args) -> dict:
    from tidepool.service.ledger import tenants
    from sqlalchemy.orm import Session
    with Session(h.app.services.database) as s:
        _, key = tenants.create_tenant(s, "tide", 1.0)
        s.commit()
    phases = [(float(level), float(secs)) for level, secs in (p.split(":") for p in args.phases.split(","))]
    h.start_worker()                                  # the hot model's floor
    t_wait = time.monotonic()
    while h.rate() is None:
        if time.monotonic() - t_wait > 300:
            raise SystemExit("the first worker did not report its cost model in 300 s")
        time.sleep(1.0)
    rate = h.rate()
    log(f"one worker's measured rate: {rate:.0f} tokens/s")
    ids, timeline, low_since = [], [], None
    t0 = time.monotonic()
    end_of_tide = t0 + sum(secs for _, secs in phases)
    carry = 0.0
    deadline_s = DEADLINE_INTERVALS * args.interval
    while True:
        now = time.monotonic()
        elapsed = now - t0
        level = next((lv for lv, end in _phase_ends(phases) if elapsed < end), None) if now < end_of_tide else None
        if level is not None:                         # the tide: online work at `level` workers' worth
            carry += level * rate * args.tick / (ONLINE_TOKENS + 8)
            n = int(carry)
            carry -= n
            ids += h.submit(key, n, ONLINE_TOKENS, "interactive", None)
            ids += h.submit(key, 1, JOB_TOKENS, "batch", time.time() + deadline_s)
        h.upkeep()
        desired = h.desired()
        h.reap()
        live = h.live()
        if desired is not None:
            if desired > len(live):
                for _ in range(desired - len(live)):
                    h.start_worker()
                low_since = None
            elif desired < len(live):
                low_since = low_since or now
                if now - low_since >= args.stabilise:     # one pod per tick after the stabilisation window
                    h.stop_worker(max(live, key=lambda w: w["started"]))
            else:
                low_since = None
        timeline.append({"t": round(elapsed, 1), "level": level, "desired": desired, "live": len(h.live())})
        open_jobs = h.ledger()["states"]
        pending = open_jobs.get("queued", 0) + open_jobs.get("running", 0)
        if len(timeline) % 5 == 0:
            log(f"t={elapsed:.0f} s level {level} desired {desired} live {len(h.live())} jobs {open_jobs}")
        if now >= end_of_tide and pending == 0:
            break
        if now >= end_of_tide + 300:
            log("open work left 300 s after the tide")
            break
        time.sleep(max(0.0, args.tick - (time.monotonic() - now)))
    for w in h.live():
        h.stop_worker(w)
    for w in h.workers:
        try:
            w["proc"].wait(args.grace + POD_MARGIN_S + 30)
        except subprocess.TimeoutExpired:
            pass
    h.reap()
    drains = []
    for w in h.workers:
        took = None if w["exited"] is None else round(w["exited"] - w["term"], 2)
        reported = None
        for line in Path(w["log"]).read_text().splitlines():
            if "drained in" in line:
                try:
                    reported = float(re.search(r"drained in ([0-9.]+) s", json.loads(line)["msg"]).group(1))
                except (ValueError, AttributeError, KeyError):
                    pass
        drains.append({"worker": w["name"], "exit_s": took, "drained_s": reported, "code": w["proc"].poll()})
    book = h.ledger()
    states = book["states"]
    lost = states.get("queued", 0) + states.get("running", 0)
    return {"jobs": len(ids), "ledger": book, "lost": lost,
            "run_twice": int(book["usage_requests"] != book["completed"] or
                             book["usage_tokens"] != book["completed_tokens"]) + book["attempts_over_1"],
            "workers_started": len(h.workers), "drains": drains,
            "drains_within_grace": sum(1 for d in drains if d["exit_s"] is not None and
                                       d["exit_s"] <= args.grace + POD_MARGIN_S),
            "drain_exit_s_max": max((d["exit_s"] or 0) for d in drains),
            "pod_grace_s": args.grace + POD_MARGIN_S, "drain_grace_s": args.grace,
            "worker_tokens_per_s": round(rate, 1), "interval_s": args.interval, "phases": args.phases,
            "max_desired": max((p["desired"] or 0) for p in timeline),
            "max_live": max(p["live"] for p in timeline), "timeline": timeline}


def _phase_ends(phases):
    end = 0.0
    for level, secs in phases:
        end += secs
        yield level, end


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tide-fleet-"))
    h = Harness(args, tmp)
    try:
        result = run(h, args)
    finally:
        h.close()
        shutil.rmtree(tmp, ignore_errors=True)
    ok = result["lost"] == 0 and result["run_twice"] == 0 and result["drains_within_grace"] == len(result["drains"])
    result["ok"] = ok
    log(f"{result['jobs']} jobs, ledger {result['ledger']['states']}; workers started {result['workers_started']}, "
        f"desired up to {result['max_desired']}; drains within the pod's grace {result['drains_within_grace']} of "
        f"{len(result['drains'])} (longest {result['drain_exit_s_max']} s of {result['pod_grace_s']} s); lost "
        f"{result['lost']}, run twice {result['run_twice']}")
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))
    if not args.no_record:
        from results import record
        record("tide_fleet", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
