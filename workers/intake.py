"""The worker's intake (intake thread): the broker channel, the pull loop's one pass, and the claim of each message's
job (queued -> running under a fresh lease) that puts the job into the engine. Online queues are pulled eagerly;
offline ones one message at a time while the engine has room; only the queues the doorbell rang for since they were
last found empty, and every queue once per full poll. On Postgres a claim is one statement that also reads the job;
elsewhere an online job enters the engine before its claim commits (prefill and claim overlap) and a refused claim
drops that attempt unseen."""
import json
import logging
import secrets
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from kombu import Connection, Queue

from tidepool.service.ledger import affinity, cluster_queues, jobs, redis_conn
from tidepool.service.ledger.database import outside_transaction, session
from tidepool.service.ledger.models import ONLINE_CLASSES, cache_namespace
from tidepool.service.ledger.wire import job_id as message_job_id, transport_options
from tidepool.workers.attempt import Attempts, Inflight, build_request, utc
from tidepool.workers.broker import ClusterConnection, ClusterQueue, charge, take, unsort
from tidepool.workers.engine import LoRARequest, PromptTooLong
from tidepool.workers.engine.llm_engine import RequestOutput
from tidepool.workers.openai_bodies import echo_text
from tidepool.workers.results import Results, requeue
from tidepool.workers.streaming import Streaming

log = logging.getLogger("tidepool.workers.worker")


@dataclass
class Compiling:
    """A claimed attempt waiting for its grammar (compiled on a thread of its own, engine/structured.py) to enter the
    engine: a hard schema holds up neither this thread nor the engine's, only its own job, for at most the budget."""
    inf: Inflight
    job: jobs.Runnable
    prompt: list
    params: object
    grammar: Future


class Intake:
    def __init__(self, cfg, db, engine, affinity, attempts: Attempts, streaming: Streaming, results: Results,
                 counters: dict, started_at: float, wake=None):
        self.cfg = cfg
        self.db = db
        self.engine = engine
        self.affinity = affinity
        self.attempts = attempts
        self.streaming = streaming
        self.results = results      # a job that cannot start fails there
        self.counters = counters
        self.owner = json.dumps([cfg.name, started_at])     # who holds a taken message (workers/broker.py)
        self.conn = self.channel = None
        self.broker_errors: tuple = (OSError,)
        self.queues: dict = {}      # lane -> its kombu Queue, bound to the channel
        self.compiling: list[Compiling] = []
        self.wake = wake            # set when a grammar is compiled (the intake loop waits on it)
        self.one_statement_claims = db.dialect.name == "postgresql"     # jobs.claim
        # The queues that may hold messages: rung by the doorbell since their last take found them empty; every
        # queue after a ring for any queue and at each full poll (a message requeued or restored without a ring).
        self.unread: set[str] = set(cfg.queues)
        self.full_poll_at = 0.0

    def connect(self) -> None:
        self.queues, self.attempts.held = {}, []     # held messages belong to the old channel
        if self.conn is not None:
            try:
                self.conn.release()
            except Exception:
                pass
        if redis_conn.is_cluster(self.cfg.broker_url):     # service/ledger/cluster_queues.py
            self.conn = ClusterConnection(self.cfg.broker_url)
        else:
            self.conn = Connection(self.cfg.broker_url,
                                   transport_options=transport_options(self.cfg.visibility_timeout))
        self.broker_errors = (OSError, *self.conn.connection_errors, *self.conn.channel_errors)
        self.conn.ensure_connection(max_retries=3)
        self.channel = self.conn.channel()
        self.unread.update(self.cfg.queues)
        if isinstance(self.conn, ClusterConnection):
            cluster_queues.register(self.conn.client, self.cfg.queues)     # beat sweeps their unacked messages
            self.queues = {lane: ClusterQueue(lane, self.channel)
                           for name in self.cfg.queues for lane in self.affinity.lanes(name)}
        else:
            self.queues = {lane: Queue(lane, routing_key=lane).bind(self.channel)
                           for name in self.cfg.queues for lane in self.affinity.lanes(name)}
        if not self.cfg.fair_intake:      # FIFO: what a fair take sorted in earlier goes back onto the lists
            unsort(self.channel, list(self.queues))

    def rung(self, lane: str | None) -> None:
        """The doorbell rang for `lane` (None: any queue); any thread."""
        if lane is None:
            self.unread.update(self.cfg.queues)
            return
        private = affinity.split_private(lane)
        queue = lane if private is None else private[0]
        if queue in self.cfg.queues:
            self.unread.add(queue)

    def release(self) -> None:
        """Give back the broker connection: closing the channel restores its unacked messages to their queues."""
        if self.conn is not None:
            self.conn.release()

    def _offline_room(self, sla_class: str, fair: bool) -> list[str] | None:
        """Whether offline work of `sla_class` may be taken now: [] when there is spare capacity (free sequence
        slots outside the engine's online reserve, plus a low-water reserve of waiting requests so a finishing
        sequence is replaced in the very next step); with none, under fair intake, the tenants an over-take must
        pass over (`_over_share`); None: take nothing."""
        try:
            stats = self.engine.stats()
        except Exception:  # read racing the engine thread: try again next pass
            return None
        free_slots = stats["offline_seats_free"] if stats["offline_blocks_free"] else 0
        if stats["waiting"] < self.cfg.low_water + free_slots:
            return []
        return self._over_share(sla_class, stats["offline_seats"]) if fair else None

    def _over_share(self, sla_class: str, seats: int) -> list[str] | None:
        """The tenants holding at least an even split of the `seats` offline seats among this class's tenants here
        (two at least); None when no tenant holds more than that (no seat the engine could hand over: see the
        scheduler's `_rebalance`), so nothing is over-taken. A tenant whose flood filled the seats before another's
        jobs arrived thus gives up seats to them now, not when its running jobs finish."""
        counts = Counter(inf.tenant for inf in self.attempts.values() if inf.sla_class == sla_class)
        share = max(1, seats // max(2, len(counts)))
        if not any(n > share for n in counts.values()):
            return None
        return [t for t, n in counts.items() if n >= share]

    def pull(self, online_only: bool = False) -> bool:
        """One pass over the queues: take and claim what there is room for; True if anything was taken.
        online_only: the online queues alone (between two chunks of result writes, see workers/results.py)."""
        if not self.queues:
            raise ConnectionError("not connected to the broker")
        if self.compiling:
            self._enter_compiled()
        got = False
        now = time.monotonic()
        if now >= self.full_poll_at:
            self.full_poll_at = now + self.cfg.full_poll_interval
            self.unread.update(self.cfg.queues)
        if self.attempts.held:
            held, self.attempts.held = self.attempts.held, []
            for name, message in held:
                self._accept(name, message)
        for sla_class, name in zip(self.cfg.classes, self.cfg.queues):
            online = name in self.cfg.online_queues
            if online_only and not online or name not in self.unread:
                continue
            self.unread.discard(name)        # (before the take: a ring during it marks the queue again)
            took = drained = full = False
            try:
                took, drained, full = self._pull_queue(sla_class, name, online)
            finally:
                if not drained:              # (a failed claim's message went back to the queue too)
                    self.unread.add(name)
            got = got or took
            if full:                         # no spare capacity: offline work stays in the broker
                return got
        return got

    def _pull_queue(self, sla_class: str, name: str, online: bool) -> tuple[bool, bool, bool]:
        """Take and claim from one queue: (something was taken, the queue was found empty, offline work is left
        for lack of room)."""
        # its private queue (prefix affinity), then the shared one; by tenant share with fair intake
        lanes = [self.queues[lane] for lane in self.affinity.lanes(name)]
        fair = (name, self.cfg.fair_window) if self.cfg.fair_intake else None
        took = False
        while len(self.attempts) < self.cfg.max_inflight:
            exclude = None
            if not online:
                exclude = self._offline_room(sla_class, fair is not None)
                if exclude is None:
                    return took, False, True
                exclude = exclude or None     # [] (room): take anyone's
            message = take(lanes, accept=["json"], owner=self.owner, fair=fair, exclude=exclude)
            if message is None:
                # an over-take looked only at tenants under their share: others' work may wait
                return took, exclude is None, exclude is not None
            took = True
            self._accept(name, message, taken_at=time.time())
            if not online:
                return True, False, False     # one offline message per pass, then look at the online queues again
        return took, False, False             # as many attempts as it may hold: the rest waits

    def _accept(self, queue_name: str, message, taken_at: float | None = None) -> None:
        """Claim the message's job and run it: take -> (online: into the engine at once) -> claim -> engine."""
        try:
            job_id = message_job_id(message)
        except Exception:
            log.warning("worker %s: dropping malformed message on %s", self.cfg.name, queue_name)
            message.ack()
            return
        if job_id in self.attempts:
            # An earlier attempt of this job (its lease lapsed) is still leaving the engine: hold the
            # message (unacked) and claim it once that attempt is gone.
            self.attempts.held.append((queue_name, message))
            return
        token, early = secrets.token_hex(16), None
        try:
            if self.one_statement_claims:       # the claim reads the job too: nothing to overlap
                started, job = jobs.claim(self.db, job_id, self.cfg.name, self.cfg.lease_seconds, token)
            else:
                if queue_name in self.cfg.online_queues:     # prefill and claim overlap
                    early = self._start_early(job_id, token, message, taken_at)
                with session(self.db, expire_on_commit=False) as s:
                    started = jobs.start(s, job_id, self.cfg.name, self.cfg.lease_seconds, token=token,
                                         at=utc(early.entered_at) if early is not None else None)
                    job = None
                    if started.lease_token is not None:
                        job = jobs.runnable(s, job_id)
                    elif started.reason == "throttled":
                        # Over the tenant's max_running: hand the job back to the sweeper, which republishes it.
                        jobs.undispatch(s, job_id)
                    s.commit()
        except Exception:  # ledger unreachable: the message goes back to the queue, not into limbo here
            if early is not None:
                self._drop_early(early)
            requeue(self.cfg.name, job_id, message)
            raise
        claimed_at = time.time()
        if started.lease_token is None:
            if early is not None:
                self._drop_early(early)
            self.counters["throttled" if started.reason == "throttled" else "dropped"] += 1
            if self.cfg.fair_intake:     # served nothing: the estimate its take charged is given back
                try:
                    charge(message, queue_name, 0, self.cfg.fair_window)
                except self.broker_errors:
                    pass
            message.ack()        # duplicate, cancelled, expired or throttled: nothing to run
            return
        self.counters["claimed"] += 1
        self.affinity.claimed(job.tenant_id, job.cache_group, job.endpoint, job.request)
        if early is not None:
            early.queue_time = job.queue_time
            if early.marks:
                early.marks["claim"] = claimed_at
            self.streaming.release_held(early)
            return
        inf = Inflight(job_id, started.lease_token, job.sla_class, message, online=job.sla_class in ONLINE_CLASSES,
                       tenant=job.tenant_id, queue_time=job.queue_time)
        if inf.online and taken_at is not None:
            inf.marks = {"take": taken_at, "claim": claimed_at}
        try:
            self._enter(inf, job)
        except Exception as exc:
            self._refuse(inf, exc)

    def _refuse(self, inf: Inflight, exc: Exception) -> None:
        """A claimed attempt that cannot start fails now with the reason (not after its lease lapsed)."""
        if isinstance(exc, ValueError):     # the caller's input
            code = getattr(exc, "code", None) or (
                "context_length_exceeded" if isinstance(exc, PromptTooLong) else "invalid_prompt")
            self.results.finish_failed(inf, {"code": code, "message": f"This request cannot run: {exc}."})
            return
        log.error("worker %s: could not start %s", self.cfg.name, inf.job_id, exc_info=exc)   # a bug
        self.results.finish_failed(inf, {"code": "internal_error", "message": "The worker could not start this request."})

    def _enter(self, inf: Inflight, job: jobs.Runnable) -> None:
        """Put an attempt into the engine (and the attempts table); on any error it is in neither. One whose grammar
        is not compiled yet waits for it in `compiling` (in the attempts table, not yet in the engine)."""
        if job.refused is not None:
            raise job.refused
        try:
            prompt, params = build_request(self.engine.tokenizer, job.endpoint, job.request)
            inf.echo = echo_text(job.endpoint, job.request, self.engine.tokenizer, prompt)
            self.attempts.add(inf)
            inf.entered_at = time.time()
            spec = getattr(params, "structured", None)
            if spec is not None:
                grammar = self.engine.structured.prepare(spec, on_done=self._compiled)
                if not grammar.done():
                    self.compiling.append(Compiling(inf, job, prompt, params, grammar))
                    return
                grammar.result()       # a grammar that cannot be compiled: ValueError, the job fails
            self._add(inf, job, prompt, params)
        except Exception:
            self.attempts.forget(inf)
            raise

    def _add(self, inf: Inflight, job: jobs.Runnable, prompt, params) -> None:
        self.engine.add_request(inf.request_id, prompt, params, sla_class=job.sla_class, tenant=job.tenant_id,
                                weight=job.weight, on_token=partial(self.streaming.on_token, inf),
                                cache_namespace=cache_namespace(job.tenant_id, job.cache_group),
                                lora=None if job.adapter is None else LoRARequest(*job.adapter))
        if inf.marks:
            inf.marks["add"] = time.time()

    def _compiled(self, _grammar) -> None:
        if self.wake is not None:
            self.wake.set()

    def _enter_compiled(self) -> None:
        """Attempts whose grammar is compiled go into the engine; one whose grammar cannot be compiled, or took
        longer than cfg.grammar_budget seconds to compile, fails with the reason; one cancelled meanwhile ends as
        an abort (written by Results like any other)."""
        waiting, self.compiling = self.compiling, []
        now = time.monotonic()
        for c in waiting:
            inf = c.inf
            if inf.dropped or not self.attempts.current(inf):     # its claim was refused (an early attempt)
                self.attempts.forget(inf)
                continue
            if inf.aborted:     # its lease is gone: nothing ran, nothing to bill
                self.attempts.done.put(RequestOutput(inf.request_id, c.prompt, [], "", finished=True,
                                                     finish_reason="abort"))
                continue
            if not c.grammar.done():
                started = c.grammar.started
                if started is None or now - started <= self.cfg.grammar_budget:
                    self.compiling.append(c)
                    continue
                kind = c.params.structured.key[0]
                error = ValueError(f"structured output {kind} took longer than {self.cfg.grammar_budget:g} s to "
                                   "compile; simplify it (fewer or smaller repetition bounds in its patterns)")
            elif c.grammar.exception() is not None:
                error = c.grammar.exception()
            else:
                try:
                    self._add(inf, c.job, c.prompt, c.params)
                    continue
                except Exception as exc:
                    error = exc
            self.attempts.forget(inf)
            self._refuse(inf, error)

    def _start_early(self, job_id: str, token: str, message, taken_at: float | None) -> Inflight | None:
        """Put a queued job into the engine under the lease token its claim is about to get, unclaimed;
        None when it is not queued or cannot start (the claim then proceeds as usual). The job is read outside
        any transaction: one round trip, and on SQLite no wait for the write lock."""
        with outside_transaction(self.db) as conn:
            job = jobs.runnable(conn, job_id)
        if job is None or job.status != jobs.Q:
            return None
        inf = Inflight(job_id, token, job.sla_class, message, online=job.sla_class in ONLINE_CLASSES,
                       tenant=job.tenant_id, claimed=False, marks={"take": taken_at} if taken_at is not None else {})
        try:
            self._enter(inf, job)
        except Exception:  # a bad request fails at claim, as it would have without the head start
            return None
        return inf

    def _drop_early(self, inf: Inflight) -> None:
        """The claim of an early attempt was refused (or failed): nothing of it was streamed, nothing will be
        written; it leaves the engine through an abort and finish_done forgets it."""
        with inf.lock:
            inf.dropped, inf.held = True, []
        inf.aborted = True
        self.engine.abort(inf.request_id)
