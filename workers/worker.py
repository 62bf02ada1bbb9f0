"""The gpu and cpu workers: one long-lived process (or, embedded, one thread) that owns one LLMEngine.

Two threads. The engine thread only steps the engine and hands finished requests over. The intake
thread owns the broker channel and the ledger writes:

    pull message -> claim job (queued -> running, fresh lease) -> engine.add_request
    engine finishes -> complete/fail in one transaction guarded by the lease -> ack

Online queues are pulled eagerly; offline queues (batch, then deferrable) only while the engine's
waiting queue is below a low-water mark, one message at a time, so unstarted offline work stays in
the broker where any worker can take it. Messages are the Celery protocol-2 `tidepool.run_job(job_id)`
messages that service/ledger/dispatch.py publishes; they are taken one at a time (workers/broker.py: off the
queue and into the unacked set in one step) and acked late, so an unacked message of a dead worker
returns to its queue after the visibility timeout. Each attempt of a job is its own engine request
(`Inflight.request_id`), so nothing meant for an earlier attempt reaches a later one.

The Worker is composed of parts, each with its own state, around one table of attempts in flight
(workers/attempt.py: each attempt's lease, engine request and stream position): Intake (workers/intake.py: the
broker channel, take and claim, into the engine), EngineThread (workers/engine_thread.py: steps the engine),
Streaming (workers/streaming.py: token events) and Results (workers/results.py: the ledger writes of finished
attempts, acks, lease checks). A job's way, take -> claim -> engine -> result -> ack, is run() below: pull()
then finish_done(). Tests drive a worker without threads through connect(), pull(), engine_step(), finish_done(),
check_leases() and close().
"""
import json
import logging
import os
import signal
import socket
import threading
import time
from functools import partial
from dataclasses import dataclass, field

from tidepool.service.ledger import doorbell, redis_conn, token_stream
from tidepool.service.ledger.settings import Config
from tidepool.service.ledger.database import make_engine
from tidepool.service.ledger.dispatch import queue_name
from tidepool.service.ledger.models import ONLINE_CLASSES, SLA_CLASSES, SlaClass
from tidepool.service.ledger.snapshots import Heartbeats
from tidepool.workers.worker_affinity import WorkerAffinity
from tidepool.workers.attempt import Attempts, Inflight
from tidepool.workers.engine_thread import EngineThread
from tidepool.workers.intake import Intake
from tidepool.workers.metrics import DEFAULT_PORTS, EngineMetrics, SnapshotStore, bind_metrics_server
from tidepool.workers.results import Results
from tidepool.workers.streaming import Streaming

log = logging.getLogger(__name__)
DRAIN_SLACK = 5.0     # seconds after the drain's deadline for the handed-back attempts to leave the engine
QUEUES = {"gpu": SLA_CLASSES, "cpu": (SlaClass.deferrable.value,)}   # the SLA classes each kind of worker serves
KINDS = ("auto", *QUEUES)       # what `tidepool worker --kind` takes


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def host_workers(kind: str, device: str) -> list[tuple[str, str]]:
    """(kind, device) of each worker a `tidepool worker --kind KIND` process (and `tidepool serve`, as `auto`) runs.
    `auto`: every class on the host's device, plus, only where that device is a GPU, a cpu worker for deferrable
    work beside it; a host without a GPU runs one engine that serves every class."""
    if kind != "auto":
        return [(kind, device)]
    return [("gpu", device)] + ([("cpu", "cpu")] if device != "cpu" else [])


def role(kind: str, device: str) -> str:
    """What a worker's name says it is: `gpu` or `cpu` for one serving every class on that device,
    `cpu-deferrable` for a cpu worker (the deferrable queue only)."""
    if kind == "cpu":
        return "cpu-deferrable"
    return "gpu" if device.startswith("cuda") else "cpu"


@dataclass
class WorkerConfig:
    model: str
    database_url: str
    broker_url: str = "memory://"
    redis_url: str | None = None
    kind: str = "gpu"
    device: str = "cpu"
    name: str = ""
    lease_seconds: float = Config.lease_seconds            # renewed every lease_seconds / 4 while running
    visibility_timeout: float = Config.visibility_timeout  # longer than the longest job
    low_water: int = Config.low_water    # offline work is pulled while fewer than this (+ free slots) wait
    fair_intake: bool = Config.fair_intake   # take by tenant share (service/ledger/fair.py); False: FIFO
    fair_window: float = Config.fair_window  # decay time constant of the tenants' service, seconds
    metrics_port: int | None = None      # first port tried for /metrics; None: DEFAULT_PORTS[kind], 0: none
    max_inflight: int = 512
    poll_interval: float = 0.1           # idle intake looks at the queues rung for this often
    full_poll_interval: float = 1.0      # and at every queue this often, even if no doorbell rang for it
    check_interval: float = 0.5          # cancellations reach the engine within this (plus one step)
    heartbeat_interval: float = 2.0
    grammar_budget: float = 10.0         # seconds a structured request's grammar may take to compile, else it fails
    drain_grace_s: float = Config.drain_grace_s   # told to stop: finish what runs for this long, then hand it back
    engine: dict = field(default_factory=dict)   # EngineConfig overrides
    serves: str | None = None            # registry name of the model when it is not the deployment's default

    def __post_init__(self):
        if self.kind not in QUEUES:
            raise ValueError(f"kind must be one of {sorted(QUEUES)}, got {self.kind!r}")
        if not self.model:
            raise ValueError("no model: set TIDEPOOL_MODEL to a model folder")
        if self.lease_seconds <= 0 or self.low_water < 1:
            raise ValueError("lease_seconds must be positive and low_water at least 1")
        self.name = self.name or f"{role(self.kind, self.device)}-{socket.gethostname()}-{os.getpid()}"

    @property
    def classes(self) -> tuple[str, ...]:
        """The SLA classes this worker serves, in the order of `queues`."""
        return tuple(QUEUES[self.kind])

    @property
    def queues(self) -> tuple[str, ...]:
        return tuple(queue_name(c, self.serves) for c in self.classes)

    @property
    def online_queues(self) -> frozenset[str]:
        return frozenset(queue_name(c, self.serves) for c in ONLINE_CLASSES)

    @classmethod
    def from_env(cls, kind: str = "gpu", device: str | None = None, settings: Config | None = None,
                 **overrides) -> "WorkerConfig":
        """From the settings (service/ledger/settings.py; read from the environment when not given)."""
        from tidepool.workers.config_fields import worker_fields
        values = dict(worker_fields(settings or Config.from_env(), device or default_device()), kind=kind)
        values.update(overrides)
        return cls(**values)


class Worker:
    def __init__(self, cfg: WorkerConfig, engine=None, redis_client=None):
        from tidepool.workers.engine import EngineConfig, LLMEngine
        self.cfg = cfg
        self.engine = engine or LLMEngine(EngineConfig(model=cfg.model, device=cfg.device, **cfg.engine))
        self._db = make_engine(cfg.database_url)
        if redis_client is None and cfg.redis_url:
            redis_client = redis_conn.client(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.redis = redis_client
        # Gauges and counters move in the engine thread; the dashboard snapshot goes out with the heartbeat.
        self.metrics = EngineMetrics(worker=cfg.name, device=cfg.device, model=cfg.model)
        self.snapshots = SnapshotStore(redis_client)
        self.heartbeats = Heartbeats(redis_client)
        # Prefix affinity: its private queues, the prefix keys of what it claimed (heartbeat), their hand-back.
        self.affinity = WorkerAffinity(cfg.name, cfg.queues, redis_client, cfg.broker_url,
                                       seats=getattr(getattr(self.engine, "config", None), "max_num_seqs", 1))
        self.started_at = time.time()
        self.counters = {"claimed": 0, "completed": 0, "failed": 0, "aborted": 0, "dropped": 0, "throttled": 0}
        self.preempted = {c: 0 for c in QUEUES["gpu"]}   # engine preemptions suffered, by SLA class
        self._stop = threading.Event()
        self._wake = threading.Event()      # wakes the intake loop: doorbell, finished requests, first tokens, stop
        self._drain_until: float | None = None   # monotonic: draining (drain()) until then
        self._drain_started = False
        self.drained: dict = {}             # what the drain did: handed back at once / at the deadline, seconds
        self.attempts = Attempts()
        self.engine_thread = EngineThread(cfg.name, self.engine, self.metrics, self.attempts, self._wake, self._stop)
        self.streaming = Streaming(self.engine.tokenizer, token_stream.for_redis(redis_client), self.attempts,
                                   self._wake, lambda: self.engine_thread.step_at)
        self.engine_thread.after_step = self.streaming.flush
        self.results = Results(cfg.name, self._db, self.engine, self.attempts, self.streaming, self.counters,
                               self.preempted, between_chunks=self._pull_between_writes,
                               fair_window=cfg.fair_window if cfg.fair_intake else None)
        self.intake = Intake(cfg, self._db, self.engine, self.affinity, self.attempts, self.streaming, self.results,
                             self.counters, self.started_at, wake=self._wake)
        self.results.rung = partial(self._requeued, redis_client)
        doorbell.register(self._wake, self.intake.rung)     # publishes of this process (embedded mode, the tests)
        self._next_check = self._next_renew = self._next_beat = 0.0
        self.metrics_port: int | None = None     # its own /metrics (process mode), shown in the heartbeat

    @property
    def db(self):
        """The ledger's database engine, which the intake and the results share."""
        return self._db

    @db.setter
    def db(self, engine) -> None:
        self._db = self.intake.db = self.results.db = engine

    @property
    def inflight(self) -> dict[str, Inflight]:
        return self.attempts.by_job

    @property
    def stepper(self):
        return self.engine_thread.stepper

    @stepper.setter
    def stepper(self, stepper) -> None:
        self.engine_thread.stepper = stepper

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine stats plus this worker's own counters (also written to the heartbeat)."""
        try:
            engine = self.engine.stats()
        except Exception:  # read racing the engine thread; the next heartbeat gets it
            engine = {}
        return {"name": self.cfg.name, "kind": self.cfg.kind, "device": self.cfg.device, "model": self.cfg.model,
                "queues": list(self.cfg.queues), "inflight": len(self.inflight), "started_at": self.started_at,
                "serves": self.cfg.serves, "draining": self.draining, "seats": getattr(getattr(self.engine, "config", None), "max_num_seqs", None),
                "at": time.time(), "metrics_port": self.metrics_port, **self.counters,
                "preempted_by_class": dict(self.preempted), "engine": engine, **self.affinity.stats()}

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def drain(self, grace: float | None = None) -> None:
        """Told to stop (SIGTERM; thread-safe): take nothing new, hand offline work the engine has not started back
        to the queue at once, let the rest finish for up to `grace` seconds (TIDEPOOL_DRAIN_GRACE_S), then hand back
        what still runs and stop. A hand-back is the release at shutdown: the job is queued again, its message back on
        the broker, the attempt not counted; the tokens it had computed are lost (an engine's KV cache does not
        leave its process), which is why the drain lets started work finish first."""
        if self._drain_until is None:
            self._drain_until = time.monotonic() + (self.cfg.drain_grace_s if grace is None else grace)
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    # -- the flow: take -> claim -> engine (pull); finished -> ledger -> ack (finish_done) ------------------
    def connect(self) -> None:
        self.intake.connect()

    def pull(self, online_only: bool = False) -> bool:
        return self.intake.pull(online_only)

    def engine_step(self) -> None:
        self.engine_thread.step()

    def finish_done(self) -> bool:
        return self.results.finish_done()

    def check_leases(self, renew: bool) -> None:
        self.results.check_leases(self.cfg.lease_seconds if renew else None)

    def _requeued(self, redis_client, lane: str | None) -> None:
        """A message went back to `lane`: this worker and the others look at it again."""
        self.intake.rung(lane)
        if redis_client is not None:
            doorbell.ring(redis_client, lane or "")

    def _pull_between_writes(self) -> None:
        """Claim what arrived on the online queues between two chunks of result writes (not while stopping:
        release_all would hand it straight back). A broker or ledger error here must not strand the results still
        to write: the intake loop's next pull meets it again and reconnects."""
        if self._stop.is_set() or self.draining:
            return
        try:
            self.intake.pull(online_only=True)
        except Exception as exc:
            log.warning("worker %s: online pull between result writes failed: %s", self.cfg.name, exc)

    def close(self) -> None:
        """Without run() (tests drive connect, pull, engine_step, finish_done): give back the broker connection
        (its unacked messages return to their queues) and the ledger's connections."""
        doorbell.unregister(self._wake)
        self.intake.release()
        self.db.dispose()

    def run(self) -> None:
        """Serve until stop(); in-flight jobs are then released back to the queue."""
        engine_thread = self.engine_thread.start()
        doorbell.register(self._wake, self.intake.rung)
        if self.cfg.broker_url.startswith(("redis://", "rediss://", "unix://")):
            doorbell.listen(self.cfg.broker_url, self._wake, self._stop, self.intake.rung, queues=self.cfg.queues)
        log.info("worker %s: %s on %s, queues %s", self.cfg.name, self.cfg.model, self.cfg.device, self.cfg.queues)
        try:
            self.connect()
            while not self._stop.is_set():
                busy = False
                self._wake.clear()            # a ring from here on makes the wait below return at once
                try:
                    if self.draining:
                        self._drain_step()
                    else:
                        busy = self.pull()       # online first: bookkeeping of offline work can wait
                except self.intake.broker_errors as exc:  # broker gone (restart, network): reconnect, carry on
                    log.warning("worker %s: broker error %s; reconnecting", self.cfg.name, exc)
                    time.sleep(1.0)
                    try:
                        self.connect()
                    except Exception as again:  # still down: the next pass tries again
                        log.warning("worker %s: reconnect failed: %s", self.cfg.name, again)
                except Exception:  # a claimed job's lease lapses and the sweeper requeues it
                    log.exception("worker %s: intake failed", self.cfg.name)
                    time.sleep(self.cfg.poll_interval)
                try:
                    busy = self.finish_done() or busy
                    self.results.record_first_tokens()
                    self._housekeeping()
                except Exception:  # ledger unreachable: unacked messages and lapsing leases cover it
                    log.exception("worker %s: ledger update failed", self.cfg.name)
                    time.sleep(1.0)
                if not busy:
                    self._wake.wait(self.cfg.poll_interval)
        finally:
            self._stop.set()
            doorbell.unregister(self._wake)
            engine_thread.join(10)
            self.results.release_all()
            try:
                self.heartbeats.delete(self.cfg.name)
            except Exception:
                pass
            if self.intake.conn is not None:
                self.intake.release()       # its unacked messages return to their queues
                self.affinity.hand_back()    # then its private queues go to the shared ones
            self.db.dispose()
            self.engine_thread.join_warmup(30)
        if self.engine_thread.error is not None:
            raise RuntimeError(f"engine loop failed: {self.engine_thread.error!r}") from self.engine_thread.error

    def _drain_step(self) -> None:
        """One pass of the drain (intake thread): at its start, hand back the offline attempts not started; at its
        deadline, every attempt; stop once none is left (or DRAIN_SLACK after the deadline, whatever the engine
        still holds: the shutdown's release covers it)."""
        now = time.monotonic()
        if not self._drain_started:
            self._drain_started = True
            self.drained = {"at_once": 0, "at_deadline": 0, "running": len(self.attempts), "started": now}
            for inf in self.attempts.values():
                if not inf.online and not self._started(inf):
                    self._hand_back(inf)
                    self.drained["at_once"] += 1
            log.info("worker %s: draining: %d attempts running, %d not started handed back, %.0f s to finish",
                     self.cfg.name, len(self.attempts), self.drained["at_once"], self._drain_until - now,
                     extra={"worker": self.cfg.name, "event": "worker.drain"})
        if now >= self._drain_until:
            for inf in self.attempts.values():
                if not inf.aborted:
                    self._hand_back(inf)
                    self.drained["at_deadline"] += 1
        if not len(self.attempts) and not self.results.unwritten or now >= self._drain_until + DRAIN_SLACK:
            self.drained["seconds"] = round(now - self.drained["started"], 3)
            log.info("worker %s: drained in %.1f s: %s", self.cfg.name, self.drained["seconds"], self.drained,
                     extra={"worker": self.cfg.name, "event": "worker.drained"})
            self._stop.set()

    def _started(self, inf: Inflight) -> bool:
        """The engine has begun the attempt (computed some of it); not yet in the engine or waiting untouched: not.
        Read without the engine's lock: a dict lookup and two fields, and a stale answer only delays a hand-back."""
        request = getattr(self.engine, "requests", {}).get(inf.request_id)
        if request is None:
            return False
        seq = getattr(request, "seq", None) or request.seqs[0]     # a generation, or an embedding's first input
        return seq.num_computed_tokens > 0 or seq.status.name != "WAITING"

    def _hand_back(self, inf: Inflight) -> None:
        """Abort the attempt in the engine; its output (reason abort) is written as a release and its message
        requeued (workers/results.py)."""
        inf.aborted = True
        self.engine.abort(inf.request_id)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._next_check and self.inflight:
            self._next_check = now + self.cfg.check_interval
            self.check_leases(renew=now >= self._next_renew)
            if now >= self._next_renew:
                self._next_renew = now + self.cfg.lease_seconds / 4
        if now >= self._next_beat:
            self._next_beat = now + self.cfg.heartbeat_interval
            self._heartbeat()

    def _heartbeat(self) -> None:
        try:
            self.snapshots.put(self.metrics.snapshot(self.engine.stats()))
        except Exception as exc:
            log.warning("worker %s: stats snapshot failed: %s", self.cfg.name, exc)
        try:
            self.heartbeats.put(self.stats(), ttl=int(self.cfg.heartbeat_interval * 5) + 1)
        except Exception as exc:
            log.warning("worker %s: heartbeat failed: %s", self.cfg.name, exc)


def main(args) -> int:
    """`tidepool worker --kind KIND`: the workers host_workers() gives, each with its engine and /metrics, until
    SIGTERM. Two of them (a GPU host under `auto`) run side by side on threads of this process."""
    from tidepool.workers.config_fields import refuse_unstartable
    settings = Config.from_env()
    device = args.device or default_device()
    pairs = host_workers(args.kind, device)
    workers = []
    for kind, dev in pairs:
        cfg = WorkerConfig.from_env(kind=kind, device=dev, settings=settings)
        if len(pairs) > 1 and kind == "cpu" and settings.worker_name:
            cfg.name = f"{settings.worker_name}-deferrable"       # TIDEPOOL_WORKER_NAME names the gpu worker
        cfg.engine.update(getattr(args, "engine", None) or {})     # --num-kv-blocks etc. over the TIDEPOOL_* knobs
        refuse_unstartable(cfg.model, cfg.device, cfg.engine, "worker")
        log.info("worker %s: loading %s on %s (the engine is ready when the next line says so)", cfg.name,
                 cfg.model, cfg.device, extra={"worker": cfg.name, "event": "worker.loading"})
        started = time.perf_counter()
        worker = Worker(cfg)
        port = DEFAULT_PORTS[cfg.kind] if cfg.metrics_port is None else cfg.metrics_port
        if port:
            try:
                port = bind_metrics_server(port, worker.metrics.registry)
            except OSError as exc:
                log.warning("worker %s: no /metrics: %s", cfg.name, exc, extra={"worker": cfg.name})
                port = None
        worker.metrics_port = port
        log.info("worker %s: engine up in %.1f s, consuming %s, /metrics on port %s", cfg.name,
                 time.perf_counter() - started, ",".join(cfg.queues), port,
                 extra={"worker": cfg.name, "event": "worker.ready"})
        print(json.dumps({"worker": cfg.name, "kind": cfg.kind, "device": cfg.device, "model": cfg.model,
                          "queues": list(cfg.queues), "metrics_port": port}), flush=True)
        workers.append(worker)
    # SIGTERM (a pod scaled down, a rolling update): drain, inside TIDEPOOL_DRAIN_GRACE_S; SIGINT (Ctrl-C): stop now
    signal.signal(signal.SIGTERM, lambda *_: [w.drain() for w in workers])
    signal.signal(signal.SIGINT, lambda *_: [w.stop() for w in workers])
    if len(workers) == 1:
        workers[0].run()
        return 0
    failed = []

    def serve(w):
        try:
            w.run()
        except Exception:
            log.exception("worker %s failed", w.cfg.name)
            failed.append(w)
        finally:
            for other in workers:      # one gone: the process ends, so a supervisor restarts both
                other.stop()

    threads = [threading.Thread(target=serve, args=(w,), name=w.cfg.name) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    return 1 if failed else 0
