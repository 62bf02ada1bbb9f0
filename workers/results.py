"""The worker's ledger side (intake thread): finished attempts written through the guarded transitions of
service/ledger/jobs.py, then acked (or requeued) on the broker and announced on the token stream; first tokens; lease
checks and renewal; the hand-back at shutdown. A result the ledger refused (e.g. during a database restart) is
written again in place, the pause doubling from WRITE_RETRY_FIRST to WRITE_RETRY_MAX seconds, for up to
WRITE_PATIENCE seconds: the write is guarded by the lease, so it lands exactly once, or not at all if the sweeper
has requeued the job meanwhile. A wave of finished attempts (a batch's sequences end in the same step) is written
RESULT_CHUNK per transaction, online ones first, and `between_chunks` (the worker's online pull) runs between two
transactions: an arriving realtime job waits for one chunk, not for the wave."""
import logging
import time

from tidepool.service.ledger import affinity, jobs
from tidepool.service.ledger.database import one_statement, session
from tidepool.workers.attempt import Attempts, Inflight, ledger_text, utc
from tidepool.workers.broker import charge
from tidepool.workers.openai_bodies import ledger_result
from tidepool.workers.streaming import Streaming

log = logging.getLogger("tidepool.workers.worker")
WRITE_RETRY_FIRST, WRITE_RETRY_MAX, WRITE_PATIENCE = 0.25, 4.0, 300.0
RESULT_CHUNK = 8      # finished attempts written per ledger transaction (the online queues are pulled between two)
FIRST_TOKEN_AFTER = 1.0   # seconds an online attempt runs past its first token before that is written on its own


class Results:
    def __init__(self, name: str, db, engine, attempts: Attempts, streaming: Streaming, counters: dict,
                 preempted: dict, between_chunks=lambda: None, fair_window: float | None = None):
        self.name = name
        self.db = db
        self.engine = engine
        self.attempts = attempts
        self.streaming = streaming
        self.counters = counters
        self.preempted = preempted      # engine preemptions suffered, by SLA class
        self.between_chunks = between_chunks
        self.fair_window = fair_window  # fair intake: each settled job's served tokens charged to its tenant
        self.unwritten: list[tuple[Inflight, object, float]] = []   # results the ledger refused: (inf, out, since)
        self.firsts: list[Inflight] = []     # online attempts whose first token is not in the ledger yet
        self.rung = lambda lane: None        # a message went back to `lane` (the worker rings the doorbell)
        self.retry_at, self.retry_pause = 0.0, WRITE_RETRY_FIRST

    def finish_failed(self, inf: Inflight, error: dict) -> None:
        with session(self.db) as s:
            jobs.fail(s, inf.job_id, inf.lease_token, error)
            s.commit()
        self.counters["failed"] += 1
        self.ack(inf)
        self.streaming.publish_end(inf, "failed")

    def finish_done(self) -> bool:
        """Write every finished request to the ledger, then ack: online results first, RESULT_CHUNK per
        transaction, with a look at the online queues between two transactions, so an online job that arrives
        while a wave of offline results is written is claimed after one chunk, not after the whole wave."""
        done = []
        for out in self.attempts.drain(self.attempts.done):
            inf = self.attempts.of_request(out.request_id)
            if inf is not None:
                self.attempts.forget(inf)
                if inf.dropped:
                    continue
                self.preempted[inf.sla_class] += out.num_preemptions
                done.append((inf, out))
        if self.unwritten and (done or time.monotonic() >= self.retry_at):
            done = [(inf, out) for inf, out, _ in self.unwritten] + done
        if not done:
            return False
        done.sort(key=lambda item: not item[0].online)     # their callers are waiting on them
        since = {inf.job_id: at for inf, _, at in self.unwritten}
        self.unwritten, now = [], time.monotonic()
        landed = True
        for start in range(0, len(done), RESULT_CHUNK):
            if start and landed:      # (a ledger that refused the last chunk would refuse the claims too)
                self.between_chunks()
            landed = self._settle(done[start:start + RESULT_CHUNK], since, now)
        if self.unwritten:
            self.retry_at = now + self.retry_pause
            self.retry_pause = min(self.retry_pause * 2, WRITE_RETRY_MAX)
        else:
            self.retry_pause = WRITE_RETRY_FIRST
        return True

    def _settle(self, chunk: list, since: dict, now: float) -> bool:
        """One transaction for a chunk of (attempt, output); then each is acked (or requeued) and announced, or
        kept for a retry in place when the ledger did not take it. False if the ledger refused any."""
        try:
            statuses = self.write_results(chunk)
        except Exception:  # one bad row must not sink the others: retry one transaction each
            log.exception("worker %s: writing %d results failed; retrying one by one", self.name, len(chunk))
            statuses = [self._write_one(item) for item in chunk]
        for (inf, out), status in zip(chunk, statuses):
            if status is None:    # not in the ledger (database down?): retried in place, with backoff
                first = since.get(inf.job_id, now)
                if now - first < WRITE_PATIENCE:
                    self.unwritten.append((inf, out, first))
                else:             # given up: no ack; the lease lapses and the sweeper requeues the job
                    log.error("worker %s: gave up writing the result of %s", self.name, inf.job_id)
                continue
            self.counters[{"completed": "completed", "lost": "dropped"}.get(status, "aborted")] += 1
            self.charge(inf, out)
            if status == "released":
                requeue(self.name, inf.job_id, inf.message)    # back to the broker: the job is queued again
                self.rung(getattr(inf.message, "delivery_info", {}).get("routing_key"))
            else:
                self.ack(inf)        # only now: the result (or the cancellation) is in the ledger
            self.streaming.publish_end(inf, "queued" if status == "released" else status, inf.result)
        return None not in statuses

    def write_results(self, done: list) -> list[str]:
        """One transaction for a list of (attempt, output): each result written through the guarded transitions;
        per item "completed", "lost" (the lease is gone), "released" or "cancelled" (an abort, or a completion the
        job's cancel came before). A cancelled job is billed what its attempt computed, once (settle_cancelled)."""
        if len(done) == 1 and done[0][1].finish_reason != "abort" and self.db.dialect.name == "postgresql":
            # one completion (a batch's lines mostly end one at a time): its one statement commits itself
            with one_statement(self.db) as s:
                inf, out = done[0]
                if self._complete(s, inf, self._result(inf, out)):
                    return ["completed"]      # else nothing was written: the path below settles it
        statuses = []
        with session(self.db) as s:
            for inf, out in done:
                if out.finish_reason == "abort":
                    # check_leases aborts an attempt whose lease is gone (cancelled, or requeued by the
                    # sweeper): a cancelled job is billed what the attempt computed. Any other abort hands it back.
                    if jobs.release(s, inf.job_id, inf.lease_token):
                        statuses.append("released")
                    else:
                        jobs.settle_cancelled(s, inf.job_id, inf.lease_token, out.num_prompt_processed,
                                              out.generated_tokens or len(out.token_ids))
                        statuses.append("cancelled")
                    continue
                result = self._result(inf, out)
                if self._complete(s, inf, result):
                    statuses.append("completed")
                elif jobs.settle_cancelled(s, inf.job_id, inf.lease_token, result["prompt_tokens"],
                                           result["completion_tokens"]):
                    statuses.append("cancelled")
                else:
                    statuses.append("lost")
            s.commit()
        return statuses

    def _result(self, inf: Inflight, out) -> dict:
        return ledger_result(out, self.engine.tokenizer, ledger_text, echo=inf.echo)

    def _complete(self, s, inf: Inflight, result: dict) -> bool:
        """The attempt's result written (jobs.complete); False (nothing written) when its lease is not current."""
        first = utc(inf.first_token_at) if inf.first_token_at is not None and not inf.first_recorded else None
        finished = time.time()
        if not jobs.complete(s, inf.job_id, inf.lease_token, **result, first_token_at=first,
                             finished_at=utc(finished)):
            return False
        if inf.online:     # its end event carries it: the waiting request reads no row
            inf.result = {**result, "first_token_at": inf.first_token_at, "finished_at": finished,
                          "started_at": inf.entered_at}
        return True

    def _write_one(self, item) -> str | None:
        try:
            return self.write_results([item])[0]
        except Exception:
            log.exception("worker %s: writing the result of %s failed", self.name, item[0].job_id)
            return None

    def record_first_tokens(self) -> None:
        """The first token of an online attempt still running FIRST_TOKEN_AFTER seconds later goes to the ledger
        (GET /v1/jobs shows it while the job runs); a shorter one's goes with its completion, in the same UPDATE."""
        self.firsts += self.attempts.drain(self.attempts.firsts)
        due = time.time() - FIRST_TOKEN_AFTER
        pending = [inf for inf in self.firsts if inf.first_token_at <= due]
        if not pending:
            return
        self.firsts = [inf for inf in self.firsts if inf.first_token_at > due]
        pending = [inf for inf in pending if self.attempts.current(inf) and inf.claimed and not inf.dropped]
        if not pending:
            return
        with session(self.db) as s:
            for inf in pending:
                jobs.first_token(s, inf.job_id, inf.lease_token, utc(inf.first_token_at))
                inf.first_recorded = True
            s.commit()

    def check_leases(self, lease_seconds: float | None) -> None:
        """Abort what was cancelled (or lost its lease) in the ledger; renew the other leases by lease_seconds
        (None: no renewal this time)."""
        current = self.attempts.values()
        with session(self.db) as s:
            live = jobs.current_leases(s, {i.job_id: i.lease_token for i in current}, renew_seconds=lease_seconds)
            s.commit()
        for inf in current:
            if inf.job_id not in live and not inf.aborted:
                inf.aborted = True
                self.engine.abort(inf.request_id)

    def release_all(self) -> None:
        """Shutdown: what is still running goes back to queued (its message back to the broker)."""
        self.finish_done()
        if not len(self.attempts):
            return
        with session(self.db) as s:
            for inf in self.attempts.values():
                jobs.release(s, inf.job_id, inf.lease_token)
            s.commit()
        self.attempts.by_job.clear()

    def charge(self, inf: Inflight, out) -> None:
        """The tokens the device served this attempt, in place of the estimate its take charged (fair intake)."""
        if self.fair_window is None:
            return
        try:
            lane = inf.message.delivery_info["routing_key"]
            shared = affinity.split_private(lane)
            served = len(out.prompt_token_ids) + len(out.token_ids)    # as the job's usage counts them
            charge(inf.message, lane if shared is None else shared[0], served, self.fair_window)
        except Exception as exc:  # fairness is only delayed: the take charged the estimate already
            log.warning("worker %s: charging %s failed: %s", self.name, inf.job_id, exc)

    def ack(self, inf: Inflight) -> None:
        try:
            inf.message.ack()
        except Exception as exc:  # the broker restarted: the message is gone, the ledger holds the result
            log.warning("worker %s: ack of %s failed: %s", self.name, inf.job_id, exc)


def requeue(worker: str, job_id: str, message) -> None:
    """The message back to its queue (unacked, its job not run here)."""
    try:
        message.requeue()
    except Exception as exc:  # broker gone: the message is restored with its channel, or republished
        log.warning("worker %s: requeue of %s failed: %s", worker, job_id, exc)
