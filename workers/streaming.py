"""The worker's token events (engine thread): each step's new text, logprobs and, with `echo`, the prompt go out on
the token stream (service/ledger/token_stream.py) as "tok" events for online attempts, gathered per web process
(the inbox its job's message names) and published after a step (`flush`): at once when the step gave an attempt its
first token or ended one, else at most every COALESCE_S, so steps faster than that (a small model, a fast device)
share one message per web process. An attempt that entered the engine before its claim committed holds its events
until the claim succeeded. The intake thread announces each online attempt's end ("end" event), after the step that
ended it flushed. A waiter that misses an event falls back to the ledger."""
import threading
import time

from tidepool.service.ledger.wire import reply_to
from tidepool.workers.attempt import Attempts, Inflight, ledger_text
from tidepool.workers.openai_bodies import logprob_entries, prompt_entries

COALESCE_S = 0.01    # the longest a middle token waits for later steps' tokens to share its message


class Streaming:
    def __init__(self, tokenizer, stream, attempts: Attempts, wake: threading.Event, step_began):
        self.tokenizer = tokenizer
        self.stream = stream
        self.attempts = attempts
        self.wake = wake                # first tokens are written by the intake thread
        self.step_began = step_began    # () -> when the engine's current step began (stage marks)
        self.inboxes = hasattr(stream, "publish_inboxes")     # Redis: one message per web process per step
        self.pending: dict[str, list] = {}    # inbox -> [job id, event] pairs not published yet (engine thread)
        self.urgent = False                   # pending holds a first token: publish it after this step
        self.flushed_at = 0.0                 # monotonic

    def on_token(self, inf: Inflight, out) -> None:
        if not self.attempts.current(inf):
            return
        first = inf.first_token_at is None and bool(out.token_ids or out.embeddings)
        if first:
            inf.first_token_at = out.first_token_time or time.time()
            if inf.online:    # offline first tokens go into the completion transaction instead
                self.attempts.firsts.put(inf)
                self.wake.set()
        # Logprobs of this step's tokens ride along; "i" is the first one's index in the output.
        new_lps = out.logprobs[-len(out.new_token_ids):] if out.logprobs and out.new_token_ids else None
        echo = inf.echo is not None and out.index not in inf.pos     # a choice's first piece starts with the prompt
        if inf.online and (out.delta_text or new_lps or echo):
            delta = (inf.echo if echo else "") + out.delta_text
            event = {"t": "tok", "d": ledger_text(delta), "p": inf.pos.get(out.index, 0)}
            if out.index:
                event["c"] = out.index        # the choice (n > 1) this piece belongs to
            if inf.marks:
                event["ts"] = {**inf.marks, "step": self.step_began(), "tok": inf.first_token_at, "pub": time.time()}
                inf.marks = {}
            if new_lps:
                entries = logprob_entries(self.tokenizer, new_lps)
                head = len(out.prompt_token_ids) if inf.echo is not None and out.prompt_logprobs else 0
                if echo and head:
                    entries = prompt_entries(self.tokenizer, out) + entries
                event.update(l=entries, i=0 if echo else head + len(out.token_ids) - len(new_lps))
            inf.pos[out.index] = inf.pos.get(out.index, 0) + len(delta)
            with inf.lock:
                if inf.claimed:
                    inbox = reply_to(inf.message) if self.inboxes else None
                    if inbox is None:
                        self.publish(inf, event)
                    else:
                        self.pending.setdefault(inbox, []).append([inf.job_id, event])
                        self.urgent = self.urgent or first
                elif not inf.dropped:
                    inf.held.append(event)

    def flush(self, ended: bool = False) -> None:
        """The events gathered so far, one message per web process (engine thread, after each step; ended: the
        step ended attempts, whose events must go out before their ends)."""
        if not self.pending:
            return
        now = time.monotonic()
        if not (ended or self.urgent or now - self.flushed_at >= COALESCE_S):
            return
        pending, self.pending, self.urgent, self.flushed_at = self.pending, {}, False, now
        try:
            self.stream.publish_inboxes(pending)
        except Exception:  # the waiters fall back to the ledger
            pass

    def publish(self, inf: Inflight, event: dict) -> None:
        """One event now (the intake thread's: held events, ends)."""
        inbox = reply_to(inf.message) if self.inboxes else None
        try:
            if inbox is None:
                self.stream.publish(inf.job_id, event)
            else:
                self.stream.publish_inboxes({inbox: [[inf.job_id, event]]})
        except Exception:  # the waiter falls back to the ledger
            pass

    def release_held(self, inf: Inflight) -> None:
        """An early attempt's claim committed: what it streamed meanwhile goes out, and from now on at once."""
        with inf.lock:
            inf.claimed = True
            for event in inf.held:
                self.publish(inf, event)
            inf.held = []

    def publish_end(self, inf: Inflight, status: str, result: dict | None = None) -> None:
        """After the ledger write: result, what a completion wrote (the waiting request answers from it)."""
        if inf.online:
            self.publish(inf, {"t": "end", "status": status, **({"r": result} if result is not None else {})})
