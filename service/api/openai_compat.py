"""OpenAI-compatible online endpoints. Each request is a ledger job (class interactive, or realtime
with `sla_class`), dispatched like any other and answered from the worker's token stream, whose end event carries the
result the worker committed to the ledger (the source of truth, read when that event is missed)."""
import json
import logging
import time
from datetime import datetime, timezone

from flask import Blueprint, Response, g
from sqlalchemy.exc import InterfaceError, OperationalError

from tidepool.service.ledger import token_stream
from tidepool.service.ledger.database import read_only

from ..ledger import adapters, affinity, fair, jobs as transitions, quotas, registry
from ..protocol import CHAT, COMPLETIONS, EMBEDDINGS
from ..protocol import (embeddings, logprobs, openai_completions, request_bodies as bodies, sla_classes,
                        structured_output as structured)
from .. import admission
from ..auth import tenant_required
from ..protocol.errors import APIError, bad_request
from ..ledger.models import ONLINE_CLASSES, TERMINAL, Job, JobStatus, SlaClass, new_id, utcnow
from ..db import session
from . import MAX_JSON_BYTES, cfg, json_body
from ..app import services

bp = Blueprint("openai", __name__)
FLEX = SlaClass.batch.value   # service_tier "flex": the batch class, served online
QUIET = 1.0   # seconds without an event before the ledger is consulted (and an SSE keep-alive is sent)
log = logging.getLogger("tidepool.online")


def _hub():
    return token_stream.for_redis(services().redis)


@bp.get("/v1/models")
@tenant_required
def list_models():
    """Exactly the models the calling tenant may use: enabled, and on its allow-list (if it has one); then its
    LoRA adapters and the shared ones it may use, each with its base model as `parent`."""
    allowed = g.quota.allowed_models if g.quota is not None else None
    return {"object": "list", "data": [registry.public_json(e) for e in services().registry.allowed(g.quota)]
            + [adapters.public_json(a) for a in adapters.usable(session(), g.tenant.id, allowed)]}


@bp.get("/v1/models/<model_id>")
@tenant_required
def get_model(model_id):
    adapter = adapters.visible(session(), g.tenant.id, model_id) if services().registry.get(model_id) is None else None
    if adapter is not None:     # another tenant's adapter is not visible: it falls through to the 404 below
        allowed = g.quota.allowed_models if g.quota is not None else None
        if adapter in adapters.usable(session(), g.tenant.id, allowed):
            return adapters.public_json(adapter)
        raise APIError(403, f"This tenant may not use the model '{model_id}'.", "model_not_allowed", "model")
    entry = services().registry.resolve(g.quota, model_id)
    if entry.name is None:      # no model configured or registered at all
        raise APIError(404, f"The model '{model_id}' does not exist.", "model_not_found", "model")
    return registry.public_json(entry)


@bp.post("/v1/completions")
@tenant_required
def completions():
    return _serve(COMPLETIONS)


@bp.post("/v1/chat/completions")
@tenant_required
def chat_completions():
    return _serve(CHAT)


@bp.post("/v1/embeddings")
@tenant_required
def create_embeddings():
    """One ledger job for all the request's inputs, answered when the worker has written its vectors."""
    marks = {"recv": time.time()}
    body = json_body(MAX_JSON_BYTES)
    sla = online_class(body.pop("service_tier", None), body.pop("sla_class", None))
    models = services().registry
    model = models.resolve(g.quota, body.get("model"))    # 404 unknown, 403 disabled or not allowed
    models.check_endpoint(model, EMBEDDINGS)
    checked = bodies.check(body, EMBEDDINGS, served_model=None, max_tokens_cap=None,
                           embed_model=models.embed_model(model))
    job, waiter = submit(checked, sla, model, marks)
    try:
        final = waiter.finish()
    except LedgerUnavailable:
        waiter.close()
        raise
    except BaseException:
        waiter.close(cancel=True)
        raise
    if final.status != JobStatus.completed:
        raise _job_error(final)
    return embeddings.response_body(final.output, final.request, model.name or body.get("model"), final.prompt_tokens)


def _serve(endpoint: str):
    marks = {"recv": time.time()}
    body = json_body(MAX_JSON_BYTES)
    stream, options = body.pop("stream", None), body.pop("stream_options", None)
    if not isinstance(stream, (bool, type(None))):
        raise bad_request("'stream' must be a boolean.", "stream")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("'stream_options' must be an object with only 'include_usage'.", "stream_options")
    if not isinstance((options or {}).get("include_usage"), (bool, type(None))):
        raise bad_request("'stream_options.include_usage' must be a boolean.", "stream_options.include_usage")
    sla = online_class(body.pop("service_tier", None), body.pop("sla_class", None))
    models = services().registry
    model = adapters.resolve(session(), models, g.quota, g.tenant.id, body.get("model"))  # 404/403
    models.check_endpoint(model, endpoint)
    checked = bodies.check(body, endpoint, served_model=None, max_tokens_cap=g.quota.max_tokens_per_request,
                           context_len=models.context_len(model), vocab_size=models.vocab_size(model),
                           count_tokens=models.token_counter(model))
    if stream and (checked.body.get("best_of") or 1) > (checked.body.get("n") or 1):
        raise bad_request("'best_of' above 'n' cannot be streamed (the best are known only at the end).", "best_of")
    job, waiter = submit(checked, sla, model, marks)
    fmt = _Format(endpoint, job.id, int(job.created_at.timestamp()), model.name or body.get("model"),
                  bool((options or {}).get("include_usage")), logprobs.requested(endpoint, checked.body), checked.body)
    fmt.service_tier = sla_classes.tier(sla)
    first, final = first_event(waiter, whole=not stream)
    if final is not None:
        if final.status != JobStatus.completed:
            error = _job_error(final)
            if error.status == 400:     # refused by the engine (prompt past the context): bad input, no job left
                _forget_refused(final.id)
            raise error
        if not stream:
            return fmt.whole(final)
    return event_stream(_sse(waiter, fmt, first))


def online_class(service_tier, sla_class) -> str:
    """The class of an online request: `service_tier` and `sla_class` (service/protocol/sla_classes.py), the tenant's
    default when neither is given; `flex` runs in the batch class. 403 when the tenant's quota does not allow it."""
    if sla_class is not None and sla_class not in ONLINE_CLASSES and (service_tier, sla_class) != ("flex", FLEX):
        raise bad_request(f"'sla_class' must be one of {list(ONLINE_CLASSES)} here (service_tier 'flex' serves "
                          "the batch class online); queue other classes with /v1/jobs or /v1/batches.", "sla_class")
    sla = sla_classes.sla_class(service_tier, sla_class, g.tenant.default_sla_class or "interactive")
    quotas.check_class(g.quota, sla)
    return sla


def submit(checked: bodies.Checked, sla: str, model, marks: dict | None = None, wait: bool = True,
           hidden: bool = False):
    """A checked body as a ledger job of class `sla` on `model` (a registry entry): rate-checked, admitted (max_queued,
    budget), committed and dispatched. Returns (job, a _Waiter on its token stream), or (job, None) without wait.
    hidden: the job is not readable through /v1/jobs (a Responses request with `store: false`)."""
    marks = marks if marks is not None else {"recv": time.time()}
    slot = admission.hold_online_slot() if wait else None     # an answer waited for holds a web thread
    quotas.check_rate(services().limiter, g.quota, checked.estimated_tokens)
    marks["valid"] = time.time()
    now = utcnow()
    job = Job(id=new_id("job_"), tenant_id=g.tenant.id, sla_class=SlaClass(sla), model=model.name,
              status=JobStatus.queued, endpoint=checked.endpoint, request=checked.body, metadata_=None,
              idempotency_key=None, request_hash=None, estimated_tokens=checked.estimated_tokens, deadline=None,
              attempts=0, created_at=now, queued_at=now, hidden=hidden)
    xmin = admission.admit(job)    # counted against max_queued and the budget, inserted and committed: one statement
    marks["insert"] = time.time()
    hub = _hub()
    sub = hub.subscribe(job.id) if wait else None      # before dispatch, so no event can be missed
    dispatcher = services().dispatcher
    published = dispatcher.publish_one(
        job.id, dispatcher.queue(sla, model.name), xmin,    # a chat's history
        prefix=affinity.job_prefix_key(g.tenant.id, g.tenant.prefix_cache_group, checked.endpoint, checked.body),
        fair=fair.meta(g.tenant.id, g.tenant.weight, None, checked.estimated_tokens),
        reply_to=hub.inbox if wait else None)
    if published and not wait:
        job.dispatched_at = utcnow()
    marks["publish"] = time.time()
    if not wait:
        return job, None
    conf = cfg()
    return job, _Waiter(services().sessions, sub, job, conf.online_timeout, marks,
                        start_within=conf.flex_timeout if sla == FLEX else None, slot=slot,
                        left_queue=dispatcher.left_queue)


def first_event(waiter: "_Waiter", whole: bool) -> tuple[dict, Job | None]:
    """(the first event, the terminal job when `whole` or when the first event is the end, else None)."""
    try:
        first = waiter.next_event(keepalive=False)
        return first, waiter.finish(first) if whole or first["t"] == "end" else None
    except LedgerUnavailable:   # the job lives on: the client is told its id, to fetch it instead of resubmitting
        waiter.close()
        raise
    except BaseException:
        waiter.close(cancel=True)
        raise


def event_stream(events) -> Response:
    return Response(admission.streaming(events), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class LedgerUnavailable(APIError):
    def __init__(self, job_id: str):
        super().__init__(503, f"The database is unavailable. Job '{job_id}' was accepted and is not lost: fetch "
                              f"its result with GET /v1/jobs/{job_id} instead of sending the request again.",
                         "database_unavailable", retry_after=5)
        self.job_id = job_id


LEDGER_PATIENCE = 30.0   # seconds a waiting request retries ledger reads before answering 503


class _Waiter:
    """Events for one job from the token stream, with the ledger as fallback when it goes quiet. Ledger
    reads are retried with backoff through a database outage of up to LEDGER_PATIENCE seconds."""

    def __init__(self, sessions, sub, job: Job, timeout: float, marks: dict | None = None,
                 start_within: float | None = None, slot=None, left_queue=lambda job_id: None):
        self.sessions, self.sub, self.job, self.job_id = sessions, sub, job, job.id
        self.left_queue, self.heard = left_queue, False     # Dispatcher.left_queue
        self.slot = slot     # the request's concurrency slot (quotas.Slot), renewed while it waits
        self.marks = marks if marks is not None else {}   # stage timestamps up to the first token written
        self.deadline = time.monotonic() + timeout
        # flex: a job still queued after start_within seconds is withdrawn and the client answered 429
        self.start_by = None if start_within is None else time.monotonic() + start_within
        self.closed = False

    def _load(self, full: bool = False) -> Job:
        give_up, pause = time.monotonic() + LEDGER_PATIENCE, 0.1
        while True:
            try:
                with read_only(self.sessions.kw["bind"]) as s:
                    return transitions.read(s, self.job_id, whole=full)
            except (OperationalError, InterfaceError):
                if time.monotonic() + pause > give_up:
                    raise LedgerUnavailable(self.job_id) from None
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def next_event(self, keepalive: bool) -> dict | None:
        """The next event; None (keepalive=True) after a quiet second, so the caller can write a ping."""
        while True:
            if self.slot is not None:
                self.slot.renew()
            ev = self.sub.get(max(0.0, min(QUIET, self.deadline - time.monotonic())))   # never past the deadline
            if ev is not None:
                if not self.heard:     # a worker claimed the job: it left the queue
                    self.heard = True
                    self.left_queue(self.job_id)
                if "ts" in ev and "event" not in self.marks:
                    self.marks.update(ev["ts"], event=time.time())
                return ev
            job = self._load()
            if job.status in TERMINAL:
                return {"t": "end", "status": job.status.value}
            if self.start_by is not None and job.status != JobStatus.queued:
                self.start_by = None
            elif self.start_by is not None and time.monotonic() > self.start_by and self._withdraw():
                raise APIError(429, "Flex capacity could not start this request within "
                                    f"{cfg().flex_timeout:g} seconds; retry later, or use another service_tier.",
                               "resource_unavailable", retry_after=max(1, int(cfg().flex_timeout)))
            if time.monotonic() > self.deadline:
                self.close(cancel=True)
                raise APIError(504, "The request timed out waiting for a worker.", "timeout")
            if keepalive:
                return None

    def _withdraw(self) -> bool:
        """Cancel the job if it is still queued (guarded: one that started meanwhile runs on)."""
        with self.sessions() as s:
            if not transitions.cancel(s, self.job_id, running=False):
                return False
            s.commit()
        self.close()
        return True

    def finish(self, last: dict | None = None) -> Job:
        """The terminal job, once the stream ended (`last`: the event the caller read last). A completed attempt's
        end event carries its result, published after the worker's commit, so the job is that with no ledger
        read; any other end (or a quiet stream, where next_event reads the ledger) is read from the ledger."""
        ev = last
        while True:
            if ev is not None and ev["t"] == "end" and ev.get("status") != "queued":
                job = self._ended(ev) if "r" in ev else self._load(full=True)
                if job.status in TERMINAL:
                    break
            ev = self.next_event(keepalive=False)
        self.close()
        return job

    def _ended(self, ev: dict) -> Job:
        """The submitted job as the end event's result completed it (jobs.complete's columns)."""
        job, done = self.job, ev["r"]
        for column in ("output", "output_token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
                       "logprobs", "choices"):
            setattr(job, column, done.get(column))
        job.status = JobStatus.completed
        job.started_at, job.first_token_at, job.finished_at = (
            None if done.get(k) is None else datetime.fromtimestamp(done[k], timezone.utc)
            for k in ("started_at", "first_token_at", "finished_at"))
        return job

    def close(self, cancel: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.sub.close()
        if "write" in self.marks and log.isEnabledFor(logging.INFO):
            log.info("online.ttft %s", json.dumps({"job": self.job_id, **self.marks}, separators=(",", ":")))
        if cancel:   # the client went away (or we gave up): free the engine slot
            try:
                with self.sessions() as s:
                    if transitions.cancel(s, self.job_id):
                        s.commit()
            except (OperationalError, InterfaceError):   # ledger down: the job runs on, billed as usual
                log.warning("could not cancel job %s: the database is unavailable", self.job_id)


def _forget_refused(job_id: str) -> None:
    try:
        with services().sessions() as s:
            if transitions.forget_refused(s, job_id):
                s.commit()
    except (OperationalError, InterfaceError):   # ledger down: the failed job stays, as before
        log.warning("could not remove refused job %s: the database is unavailable", job_id)


def _job_error(job: Job) -> APIError:
    err = job.error or {}
    if job.status == JobStatus.failed and err.get("code") == "invalid_prompt" and "structured output" in \
            err.get("message", ""):     # the grammar library refused the schema (the API checked its keywords)
        return APIError(400, err["message"], "invalid_response_format", "response_format")
    if job.status == JobStatus.failed and err.get("code") in ("context_length_exceeded", "invalid_prompt"):
        return APIError(400, err.get("message", "Invalid request."), err["code"],
                        {CHAT: "messages", EMBEDDINGS: "input"}.get(job.endpoint, "prompt"))
    if job.status == JobStatus.cancelled:
        return APIError(409, "The request was cancelled.", "cancelled")
    if job.status == JobStatus.expired:
        return APIError(504, "The request expired before it ran.", "expired")
    return APIError(500, err.get("message", "The request failed."), err.get("code") or "internal_error")


def _usage(job: Job) -> dict:
    return openai_completions.usage(job.prompt_tokens, job.completion_tokens)


class _Format:
    def __init__(self, endpoint, job_id, created, model, include_usage, want_logprobs=False, body=None):
        self.endpoint, self.chat = endpoint, endpoint == CHAT
        self.body = body or {}
        self.splitters: dict = {}     # chat: per choice (n > 1), the content / tool-call splitter
        self.called: set = set()      # choices that streamed a tool call
        self.id, self.created, self.model, self.include_usage = job_id, created, model, include_usage
        self.want_logprobs = want_logprobs
        self.offsets: dict = {}       # per choice: completions text_offset of the next streamed logprobs entry
        self.service_tier = None

    def splitter(self, index: int = 0):
        if not self.chat:
            return None
        if index not in self.splitters:
            self.splitters[index] = structured.StreamSplitter(self.body,
                                                              openai_completions.call_id_base(self.id, index))
        return self.splitters[index]

    def _head(self, chunk: bool) -> dict:
        head = openai_completions.head(self.endpoint, self.id, self.created, self.model, chunk)
        return {**head, "service_tier": self.service_tier} if self.service_tier else head

    def whole(self, job: Job) -> dict:
        picked = openai_completions.choice_objects(job.endpoint, openai_completions.choices_of(job), self.body, self.id,
                                                   self.want_logprobs)
        return {**self._head(False), "choices": picked, "usage": _usage(job)}

    def tool_chunks(self, index: int = 0):
        """At the end of a chat stream: held-back content, then each tool call as one delta.tool_calls chunk."""
        splitter = self.splitter(index)
        if splitter is None:
            return
        rest, calls = splitter.finish()
        if rest:
            yield self.chunk(rest, raw=True, index=index)
        for i, call in enumerate(calls):
            self.called.add(index)
            yield _data({**self._head(True), "choices": [{"index": index,
                                                          "delta": {"tool_calls": [{"index": i, **call}]},
                                                          "logprobs": None, "finish_reason": None}]})

    def finish_reason(self, reason, index: int = 0):
        return "tool_calls" if index in self.called and reason == "stop" else reason

    def chunk(self, text: str | None = None, finish_reason=None, role=False, usage=None,
              entries: list | None = None, raw: bool = False, index: int = 0) -> str:
        splitter = self.splitter(index)
        if splitter is not None and text and not raw:
            text = splitter.feed(text)
        lps = None
        if self.want_logprobs and entries:
            lps = logprobs.shaped(self.endpoint, entries, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + logprobs.text_length(entries)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish_reason}
        out = {**self._head(True), "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return _data(out)

    def usage_chunk(self, usage: dict) -> str:
        return _data({**self._head(True), "choices": [], "usage": usage})


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _error_event(err: APIError) -> str:
    return _data({"error": {"message": err.message, "type": "api_error", "param": err.param, "code": err.code}})


def _restarted(job_id: str) -> APIError:
    return APIError(500, f"Job '{job_id}' was restarted after a worker failure and its new output differs from what "
                         f"this stream already sent; its result will be at GET /v1/jobs/{job_id}.", "job_restarted")


def _sse(waiter: _Waiter, fmt: _Format, first: dict):
    """The job's events as SSE chunks. A rerun of the job (a new attempt after a worker died) streams from
    offset 0 again: it continues this stream only while its text extends exactly what the client has, else
    the stream ends with a job_restarted error, never a splice of two attempts. Every stream ends with
    [DONE], after an error event when it did not complete."""
    # Per choice (an event's "c", 0 when absent; n > 1): the text and logprobs entries the client has, and the
    # streaming attempt's text as far as it arrived in order.
    sent, sent_lps, attempt, done = {}, {}, {}, False
    try:
        try:
            if fmt.chat:
                for c in range(fmt.body.get("n") or 1):
                    yield fmt.chunk(role=True, index=c)
            ev = first
            # an end event with status "queued" is an attempt handed back (SIGTERM): its rerun streams on
            while ev is None or ev["t"] != "end" or ev.get("status") == "queued":
                c = 0 if ev is None else ev.get("c", 0)
                if ev is None:
                    yield ": keep-alive\n\n"      # also how a closed connection is noticed
                elif ev["t"] == "tok" and ev["p"] <= len(attempt.get(c, "")):   # p == 0: a new attempt; beyond: a gap
                    attempt[c] = attempt.get(c, "")[:ev["p"]] + ev["d"]
                    had = sent.get(c, "")
                    if not attempt[c].startswith(had):
                        if not had.startswith(attempt[c]):
                            raise _restarted(waiter.job_id)
                        piece = ""                     # a rerun replaying what the client has
                    else:
                        piece = attempt[c][len(had):]
                    entries, at, got = ev.get("l") or [], ev.get("i", 0), sent_lps.get(c, 0)
                    entries = entries[got - at:] if fmt.want_logprobs and at <= got < at + len(entries) else []
                    if piece or entries:
                        waiter.marks.setdefault("write", time.time())
                        sent[c] = had + piece
                        sent_lps[c] = got + len(entries)
                        yield fmt.chunk(piece, entries=entries, index=c)
                ev = waiter.next_event(keepalive=True)
            job = waiter.finish(ev)
            every = openai_completions.choices_of(job) if job.status == JobStatus.completed else []
            if job.status != JobStatus.completed:
                yield _error_event(_job_error(job))
            elif not all((o["text"] or "").startswith(sent.get(c, "")) for c, o in enumerate(every)):
                yield _error_event(_restarted(job.id))
            else:
                usage = _usage(job)
                for c, o in enumerate(every):
                    rest = (o["text"] or "")[len(sent.get(c, "")):]
                    rest_lps = (o["logprobs"] or [])[sent_lps.get(c, 0):] if fmt.want_logprobs else []
                    if rest or rest_lps:
                        yield fmt.chunk(rest, entries=rest_lps, index=c)
                    yield from fmt.tool_chunks(c)
                    last = c == len(every) - 1
                    yield fmt.chunk(finish_reason=fmt.finish_reason(o["finish_reason"], c), index=c,
                                    usage=usage if last and not fmt.include_usage else None)
                if fmt.include_usage:
                    yield fmt.usage_chunk(usage)
        except APIError as err:          # restarted, ledger unavailable, timed out: the job id is in the message
            yield _error_event(err)
        except Exception:                # a bug: the client still gets an error and the end of the stream
            log.exception("stream of job %s failed", waiter.job_id)
            yield _error_event(APIError(500, f"The stream of job '{waiter.job_id}' failed; its result will be at "
                                             f"GET /v1/jobs/{waiter.job_id}.", "stream_failed"))
        yield "data: [DONE]\n\n"
        done = True
    finally:
        waiter.close(cancel=not done)
