"""The gpu and cpu workers: one long-lived process (or, embedded, one thread) that owns one LLMEngine.

Two threads. The engine thread only steps the engine and hands finished requests over. The intake
thread owns the broker channel and the ledger writes:

    pull message -> claim job (queued -> running, fresh lease) -> engine.add_request
    engine finishes -> complete/fail in one transaction guarded by the lease -> ack

Online queues are pulled eagerly; offline queues (batch, then deferrable) only while the engine's
waiting queue is below a low-water mark, one message at a time, so unstarted offline work stays in
the broker where any worker can take it. Messages are the Celery protocol-2 `tidepool.run_job(job_id)`
messages that service/dispatch.py publishes; they are taken one at a time (workers/broker.py: off the
queue and into the unacked set in one step) and acked late, so an unacked message of a dead worker
returns to its queue after the visibility timeout. Each attempt of a job is its own engine request
(`Inflight.request_id`), so nothing meant for an earlier attempt reaches a later one.

By concern: this module holds the configuration, the intake (broker, claims, token events) and the wiring;
workers/engine_thread.py the engine thread, workers/results.py the ledger writes of finished attempts and lease
checks, workers/attempt.py one attempt's state and the job-to-engine-request mapping. Tests drive a worker
without threads through connect(), pull(), engine_step(), finish_done(), check_leases() and close().
"""
import json
import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import partial

from kombu import Connection, Queue
from sqlalchemy import select
from sqlalchemy.orm import Session

from service import doorbell, jobs
from service.config import Config
from service.db import make_engine
from service.models import ONLINE_CLASSES, SLA_CLASSES, Job, JobStatus, SlaClass, Tenant, cache_namespace
from service import token_stream
from service.dispatch import queue_name
from service.wire import job_id as message_job_id, transport_options
from workers.affinity import WorkerAffinity
from workers.broker import take
from workers.engine import PromptTooLong
from service.snapshots import Heartbeats
from workers.metrics import DEFAULT_PORTS, EngineMetrics, SnapshotStore, bind_metrics_server
from workers.attempt import Inflight, build_request, ledger_text, utc
from workers.engine_thread import EngineThread
from workers.openai_bodies import echo_text, ledger_result, logprob_entries, prompt_entries
from workers.results import WRITE_RETRY_FIRST, Results

log = logging.getLogger(__name__)
QUEUES = {"gpu": SLA_CLASSES, "cpu": (SlaClass.deferrable.value,)}   # the SLA classes each kind of worker serves


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    metrics_port: int | None = None      # first port tried for /metrics; None: DEFAULT_PORTS[kind], 0: none
    max_inflight: int = 512
    poll_interval: float = 0.1           # idle intake looks at its queues this often even if no doorbell rang
    check_interval: float = 0.5          # cancellations reach the engine within this (plus one step)
    heartbeat_interval: float = 2.0
    engine: dict = field(default_factory=dict)   # EngineConfig overrides
    serves: str | None = None            # registry name of the model when it is not the deployment's default

    def __post_init__(self):
        if self.kind not in QUEUES:
            raise ValueError(f"kind must be one of {sorted(QUEUES)}, got {self.kind!r}")
        if not self.model:
            raise ValueError("no model: set TIDEPOOL_MODEL to a model folder")
        if self.lease_seconds <= 0 or self.low_water < 1:
            raise ValueError("lease_seconds must be positive and low_water at least 1")
        self.name = self.name or f"{self.kind}-{socket.gethostname()}-{os.getpid()}"

    @property
    def queues(self) -> tuple[str, ...]:
        return tuple(queue_name(c, self.serves) for c in QUEUES[self.kind])

    @property
    def online_queues(self) -> frozenset[str]:
        return frozenset(queue_name(c, self.serves) for c in ONLINE_CLASSES)

    @classmethod
    def from_env(cls, kind: str = "gpu", device: str | None = None, settings: Config | None = None,
                 **overrides) -> "WorkerConfig":
        """From the settings (service/config.py; read from the environment when not given)."""
        from workers.settings import worker_fields
        values = dict(worker_fields(settings or Config.from_env(), device or default_device()), kind=kind)
        values.update(overrides)
        return cls(**values)


class Worker(EngineThread, Results):
    def __init__(self, cfg: WorkerConfig, engine=None, redis_client=None):
        from workers.engine import EngineConfig, LLMEngine
        self.cfg = cfg
        self.engine = engine or LLMEngine(EngineConfig(model=cfg.model, device=cfg.device, **cfg.engine))
        self.db = make_engine(cfg.database_url)
        if redis_client is None and cfg.redis_url:
            import redis
            redis_client = redis.Redis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.redis = redis_client
        self.stream = token_stream.for_redis(redis_client)
        # Gauges and counters move in the engine thread; the dashboard snapshot goes out with the heartbeat.
        self.metrics = EngineMetrics(worker=cfg.name, device=cfg.device, model=cfg.model)
        self.snapshots = SnapshotStore(redis_client)
        self.heartbeats = Heartbeats(redis_client)
        # Prefix affinity: its private queues, the prefix keys of what it claimed (heartbeat), their hand-back.
        self.affinity = WorkerAffinity(cfg.name, cfg.queues, redis_client, cfg.broker_url,
                                       seats=getattr(getattr(self.engine, "config", None), "max_num_seqs", 1))
        self.inflight: dict[str, Inflight] = {}
        self.counters = {"claimed": 0, "completed": 0, "failed": 0, "aborted": 0, "dropped": 0, "throttled": 0}
        self.preempted = {c: 0 for c in QUEUES["gpu"]}   # engine preemptions suffered, by SLA class
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._firsts: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wake = threading.Event()      # wakes the intake loop: doorbell, finished requests, first tokens, stop
        self._step_at = 0.0      # when the engine's current step began (engine thread)
        self._error: BaseException | None = None
        self._conn = self._channel = None
        self._broker_errors: tuple = (OSError,)
        self._queues: dict[str, Queue] = {}
        self._held: list[tuple[str, object]] = []      # messages waiting for an earlier attempt to leave
        self._unwritten: list[tuple[Inflight, object, float]] = []   # results the ledger refused: (inf, out, since)
        self._retry_at, self._retry_pause = 0.0, WRITE_RETRY_FIRST
        self._next_check = self._next_renew = self._next_beat = 0.0
        self.started_at = time.time()
        self.metrics_port: int | None = None     # its own /metrics (process mode), shown in the heartbeat

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine stats plus this worker's own counters (also written to the heartbeat)."""
        try:
            engine = self.engine.stats()
        except Exception:  # read racing the engine thread; the next heartbeat gets it
            engine = {}
        return {"name": self.cfg.name, "kind": self.cfg.kind, "device": self.cfg.device, "model": self.cfg.model,
                "queues": list(self.cfg.queues), "inflight": len(self.inflight), "started_at": self.started_at,
                "at": time.time(), "metrics_port": self.metrics_port, **self.counters,
                "preempted_by_class": dict(self.preempted), "engine": engine, **self.affinity.stats()}

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Without run() (tests drive connect, pull, engine_step, finish_done): give back the broker connection
        (its unacked messages return to their queues) and the ledger's connections."""
        if self._conn is not None:
            self._conn.release()
        self.db.dispose()

    def run(self) -> None:
        """Serve until stop(); in-flight jobs are then released back to the queue."""
        engine_thread = threading.Thread(target=self._engine_loop, name=f"{self.cfg.name}-engine", daemon=True)
        engine_thread.start()
        doorbell.register(self._wake)
        if self.cfg.broker_url.startswith(("redis://", "rediss://", "unix://")):
            doorbell.listen(self.cfg.broker_url, self._wake, self._stop)
        log.info("worker %s: %s on %s, queues %s", self.cfg.name, self.cfg.model, self.cfg.device, self.cfg.queues)
        try:
            self.connect()
            while not self._stop.is_set():
                busy = False
                self._wake.clear()            # a ring from here on makes the wait below return at once
                try:
                    busy = self.pull()       # online first: bookkeeping of offline work can wait
                except self._broker_errors as exc:  # broker gone (restart, network): reconnect, carry on
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
                    self._record_first_tokens()
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
            self._release_all()
            try:
                self.heartbeats.delete(self.cfg.name)
            except Exception:
                pass
            if self._conn is not None:
                self._conn.release()    # closing the channel restores its unacked messages to their queues
                self.affinity.hand_back()    # then its private queues go to the shared ones
            self.db.dispose()
        if self._error is not None:
            raise RuntimeError(f"engine loop failed: {self._error!r}") from self._error

    def _on_token(self, inf: Inflight, out) -> None:
        if self.inflight.get(inf.job_id) is not inf:
            return
        if inf.first_token_at is None and out.token_ids:
            inf.first_token_at = out.first_token_time or time.time()
            if inf.online:    # offline first tokens go into the completion transaction instead
                self._firsts.put(inf)
                self._wake.set()
        # Logprobs of this step's tokens ride along; "i" is the first one's index in the output.
        new_lps = out.logprobs[-len(out.new_token_ids):] if out.logprobs and out.new_token_ids else None
        echo = inf.echo is not None and out.index not in inf.pos     # a choice's first piece starts with the prompt
        if inf.online and (out.delta_text or new_lps or echo):
            delta = (inf.echo if echo else "") + out.delta_text
            event = {"t": "tok", "d": ledger_text(delta), "p": inf.pos.get(out.index, 0)}
            if out.index:
                event["c"] = out.index        # the choice (n > 1) this piece belongs to
            if inf.marks:
                event["ts"] = {**inf.marks, "step": self._step_at, "tok": inf.first_token_at, "pub": time.time()}
                inf.marks = {}
            if new_lps:
                entries = logprob_entries(self.engine.tokenizer, new_lps)
                head = len(out.prompt_token_ids) if inf.echo is not None and out.prompt_logprobs else 0
                if echo and head:
                    entries = prompt_entries(self.engine.tokenizer, out) + entries
                event.update(l=entries, i=0 if echo else head + len(out.token_ids) - len(new_lps))
            inf.pos[out.index] = inf.pos.get(out.index, 0) + len(delta)
            with inf.lock:
                if inf.claimed:
                    self._publish_tok(inf, event)
                elif not inf.dropped:
                    inf.held.append(event)

    def _publish_tok(self, inf: Inflight, event: dict) -> None:
        try:
            self.stream.publish(inf.job_id, event)
        except Exception:  # the waiter falls back to the ledger
            pass

    # -- broker -----------------------------------------------------------------------------------
    def connect(self) -> None:
        self._queues, self._held = {}, []     # held messages belong to the old channel
        if self._conn is not None:
            try:
                self._conn.release()
            except Exception:
                pass
        self._conn = Connection(self.cfg.broker_url,
                                transport_options=transport_options(self.cfg.visibility_timeout))
        self._broker_errors = (OSError, *self._conn.connection_errors, *self._conn.channel_errors)
        self._conn.ensure_connection(max_retries=3)
        self._channel = self._conn.channel()
        self._queues = {lane: Queue(lane, routing_key=lane).bind(self._channel)
                        for name in self.cfg.queues for lane in self.affinity.lanes(name)}

    def _has_room(self) -> bool:
        """Spare capacity for offline work: free sequence slots outside the engine's online reserve, plus a
        low-water reserve of waiting requests so a finishing sequence is replaced in the very next step."""
        try:
            stats = self.engine.stats()
        except Exception:  # read racing the engine thread: try again next pass
            return False
        free_slots = stats["offline_seats_free"] if stats["offline_blocks_free"] else 0
        return stats["waiting"] < self.cfg.low_water + free_slots

    def pull(self) -> bool:
        if not self._queues:
            raise ConnectionError("not connected to the broker")
        got = False
        if self._held:
            held, self._held = self._held, []
            for name, message in held:
                self._accept(name, message)
        for name in self.cfg.queues:
            online = name in self.cfg.online_queues
            for lane in self.affinity.lanes(name):   # its private queue (prefix affinity), then the shared one
                message = None
                while len(self.inflight) < self.cfg.max_inflight:
                    if not online and not self._has_room():
                        return got       # no spare capacity: leave offline work in the broker
                    message = take(self._queues[lane], accept=["json"],
                                   owner=json.dumps([self.cfg.name, self.started_at]))
                    if message is None:
                        break
                    got = True
                    self._accept(name, message, taken_at=time.time())
                    if not online:
                        break            # one offline message per pass, then look at the online queues again
                if message is not None and not online:
                    break
        return got

    def _accept(self, queue_name: str, message, taken_at: float | None = None) -> None:
        try:
            job_id = message_job_id(message)
        except Exception:
            log.warning("worker %s: dropping malformed message on %s", self.cfg.name, queue_name)
            message.ack()
            return
        if job_id in self.inflight:
            # An earlier attempt of this job (its lease lapsed) is still leaving the engine: hold the
            # message (unacked) and claim it once that attempt is gone.
            self._held.append((queue_name, message))
            return
        token, early = secrets.token_hex(16), None
        try:
            if queue_name in self.cfg.online_queues:     # prefill and claim overlap
                early = self._start_early(job_id, token, message, taken_at)
            with Session(self.db, expire_on_commit=False) as s:
                started = jobs.start(s, job_id, self.cfg.name, self.cfg.lease_seconds, token=token,
                                     at=utc(early.entered_at) if early is not None else None)
                job = weight = group = None
                if started.lease_token is not None:
                    job = s.get(Job, job_id)
                    weight, group = s.execute(select(Tenant.weight, Tenant.prefix_cache_group)
                                              .where(Tenant.id == job.tenant_id)).one()
                elif started.reason == "throttled":
                    # Over the tenant's max_running: hand the job back to the sweeper, which republishes it.
                    jobs.undispatch(s, job_id)
                s.commit()
        except Exception:  # ledger unreachable: the message goes back to the queue, not into limbo here
            if early is not None:
                self._drop_early(early)
            self._requeue(job_id, message)
            raise
        claimed_at = time.time()
        if started.lease_token is None:
            if early is not None:
                self._drop_early(early)
            self.counters["throttled" if started.reason == "throttled" else "dropped"] += 1
            message.ack()        # duplicate, cancelled, expired or throttled: nothing to run
            return
        self.counters["claimed"] += 1
        self.affinity.claimed(job.tenant_id, group, job.endpoint, job.request)
        sla = job.sla_class.value
        queue_time = ((job.started_at - job.queued_at).total_seconds()
                      if job.started_at is not None and job.queued_at is not None else None)
        if early is not None:
            early.queue_time = queue_time
            if early.marks:
                early.marks["claim"] = claimed_at
            with early.lock:
                early.claimed = True
                for event in early.held:
                    self._publish_tok(early, event)
                early.held = []
            return
        inf = Inflight(job_id, started.lease_token, sla, message, online=sla in ONLINE_CLASSES, tenant=job.tenant_id,
                       queue_time=queue_time)
        if inf.online and taken_at is not None:
            inf.marks = {"take": taken_at, "claim": claimed_at}
        try:
            prompt, params = build_request(self.engine.tokenizer, job.endpoint, job.request)
            inf.echo = echo_text(job.endpoint, job.request, self.engine.tokenizer, prompt)
            self.inflight[job_id] = inf
            self.engine.add_request(inf.request_id, prompt, params, sla_class=sla, tenant=job.tenant_id,
                                    weight=weight or 1.0, on_token=partial(self._on_token, inf),
                                    cache_namespace=cache_namespace(job.tenant_id, group))
            if inf.marks:
                inf.marks["add"] = time.time()
        except ValueError as exc:
            self.inflight.pop(job_id, None)
            code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else "invalid_prompt"
            self._finish_failed(inf, {"code": code, "message": f"This request cannot run: {exc}."})
            return
        except Exception:  # a bug, not the caller's input: the claimed job must not wait for its lease to lapse
            log.exception("worker %s: could not start %s", self.cfg.name, job_id)
            self.inflight.pop(job_id, None)
            self._finish_failed(inf, {"code": "internal_error", "message": "The worker could not start this request."})
            return

    def _start_early(self, job_id: str, token: str, message, taken_at: float | None) -> Inflight | None:
        """Put a queued job into the engine under the lease token its claim is about to get, unclaimed;
        None when it is not queued or cannot start (the claim then proceeds as usual). The job is read outside
        any transaction: one round trip, and on SQLite no wait for the write lock."""
        read = (select(Job.status, Job.endpoint, Job.request, Job.sla_class, Job.tenant_id, Tenant.weight,
                       Tenant.prefix_cache_group).join(Tenant, Tenant.id == Job.tenant_id).where(Job.id == job_id))
        with self.db.connect() as conn:
            row = conn.execution_options(isolation_level="AUTOCOMMIT").execute(read).first()
        if row is None or row.status != JobStatus.queued:
            return None
        sla = row.sla_class.value
        inf = Inflight(job_id, token, sla, message, online=sla in ONLINE_CLASSES, tenant=row.tenant_id, claimed=False,
                       marks={"take": taken_at} if taken_at is not None else {})
        try:
            prompt, params = build_request(self.engine.tokenizer, row.endpoint, row.request)
            inf.echo = echo_text(row.endpoint, row.request, self.engine.tokenizer, prompt)
            self.inflight[job_id] = inf
            inf.entered_at = time.time()
            self.engine.add_request(inf.request_id, prompt, params, sla_class=sla, tenant=row.tenant_id,
                                    weight=row.weight or 1.0, on_token=partial(self._on_token, inf),
                                    cache_namespace=cache_namespace(row.tenant_id, row.prefix_cache_group))
        except Exception:  # a bad request fails at claim, as it would have without the head start
            self.inflight.pop(job_id, None)
            return None
        if inf.marks:
            inf.marks["add"] = time.time()
        return inf

    def _drop_early(self, inf: Inflight) -> None:
        """The claim of an early attempt was refused (or failed): nothing of it was streamed, nothing will be
        written; it leaves the engine through an abort and _finish_done forgets it."""
        with inf.lock:
            inf.dropped, inf.held = True, []
        inf.aborted = True
        self.engine.abort(inf.request_id)

    def _write_results(self, done: list) -> list[str]:
        statuses = []
        with Session(self.db) as s:
            for inf, out in done:
                if out.finish_reason == "abort":
                    # _check_leases aborts an attempt whose lease is gone (cancelled, or requeued by the
                    # sweeper): then there is nothing to write. Any other abort hands the job back.
                    released = jobs.release(s, inf.job_id, inf.lease_token)
                    statuses.append("released" if released else "cancelled")
                    continue
                if inf.first_token_at is not None and not inf.first_recorded:
                    jobs.first_token(s, inf.job_id, inf.lease_token, utc(inf.first_token_at))
                ok = jobs.complete(s, inf.job_id, inf.lease_token,
                                   **ledger_result(out, self.engine.tokenizer, ledger_text, echo=inf.echo))
                statuses.append("completed" if ok else "lost")
            s.commit()
        return statuses

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
    cfg = WorkerConfig.from_env(kind=args.kind, device=args.device)
    cfg.engine.update(getattr(args, "engine", None) or {})     # --kv-blocks etc. over the TIDEPOOL_* knobs
    log.info("worker %s: loading %s on %s (the engine is ready when the next line says so)", cfg.name, cfg.model,
             cfg.device, extra={"worker": cfg.name, "event": "worker.loading"})
    started = time.perf_counter()
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
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
    worker.run()
    return 0
