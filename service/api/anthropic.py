"""Anthropic Messages and Message Batches: a message is a chat job (service/protocol/anthropic_messages.py shapes
it) answered by the online core (service/api/openai_compat.py); a message batch is a Tidepool batch of class `batch`
(its requests written as an input file and loaded by service/ledger/batches.py: same ledger, quotas, expiry, panel).
Errors on these routes are in Anthropic's shape (service/error_responses.py)."""
import json
import re
from datetime import datetime, timezone

from flask import Blueprint, Response, g, request

from ..protocol import CHAT, MESSAGES
from ..protocol import anthropic_messages as shapes, request_bodies as bodies, structured_output as structured
from ..ledger import batches as ledger, files, pages, quotas
from ..auth import tenant_required
from ..db import session
from ..error_responses import error_body
from ..protocol.errors import APIError, bad_request
from ..ledger.models import Batch, BatchStatus, File, Job, JobStatus, SlaClass, new_id, utcnow
from . import MAX_JSON_BYTES, cfg, json_body, owned
from ..app import services
from .openai_compat import _job_error, event_stream, first_event, online_class, submit
from .streams import text_deltas

bp = Blueprint("anthropic", __name__)
MAX_BATCH_REQUESTS = 100_000
MAX_BATCH_BYTES = 256 << 20
RESULTS_PAGE = 500     # results read per session while streaming a batch's results
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _checked(body: dict, fields=shapes.FIELDS):
    """(checked chat body, model entry) of a Messages request, or its 4xx."""
    chat, origin = shapes.to_chat(body, fields)
    models = services().registry
    model = models.resolve(g.quota, body.get("model"))
    models.check_endpoint(model, MESSAGES)
    checked = shapes.check(chat, origin, lambda c: bodies.check(
        c, CHAT, served_model=None, max_tokens_cap=g.quota.max_tokens_per_request,
        context_len=models.context_len(model), count_tokens=models.token_counter(model)))
    return checked, model


@bp.post("/v1/messages")
@tenant_required
def create_message():
    body = json_body(MAX_JSON_BYTES)
    if not isinstance(body.get("stream"), (bool, type(None))):
        raise bad_request("stream: must be a boolean.", "stream")
    stream = bool(body.get("stream"))
    checked, model = _checked(body)
    sla = online_class(None, body.get("sla_class"))
    job, waiter = submit(checked, sla, model)
    msg_id, name = shapes.message_id(job.id), model.name or body.get("model")
    first, final = first_event(waiter, whole=not stream)
    if final is not None and final.status != JobStatus.completed:
        raise _job_error(final)
    if not stream:
        return shapes.message(msg_id, name, final)
    return event_stream(_events(waiter, first, job, msg_id, name))


def _events(waiter, first, job: Job, msg_id: str, model: str):
    deltas = text_deltas(waiter, first)
    try:
        yield from _shaped(deltas, job, msg_id, model)
    finally:
        deltas.close()     # a client gone mid-stream: its job is cancelled


def _shaped(deltas, job: Job, msg_id: str, model: str):
    def ev(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    yield ev("message_start", message={"id": msg_id, "type": "message", "role": "assistant", "model": model,
                                       "content": [], "stop_reason": None, "stop_sequence": None,
                                       "usage": {"input_tokens": 0, "output_tokens": 0}})
    yield ev("ping")
    splitter = structured.StreamSplitter(job.request, msg_id)
    opened = False

    def text(delta: str):
        nonlocal opened
        if not opened:
            opened = True
            yield ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
        if delta:
            yield ev("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})

    try:
        while True:
            piece = next(deltas)
            if piece is None:
                yield ev("ping")
            else:
                out = splitter.feed(piece)
                if out:
                    yield from text(out)
    except StopIteration as stop:
        final = stop.value
    except APIError as err:
        yield ev("error", error=error_body(err.status, err.message)["error"])
        return
    rest, _ = splitter.finish()
    msg = shapes.message(msg_id, model, final)
    blocks = msg["content"]
    index = 0
    if blocks and blocks[0]["type"] == "text":
        yield from text(rest)
    if opened:         # (streamed text with no text block in the end is whitespace before a tool call)
        yield ev("content_block_stop", index=0)
        index = 1
    for block in (b for b in blocks if b["type"] == "tool_use"):
        yield ev("content_block_start", index=index, content_block={**block, "input": {}})
        yield ev("content_block_delta", index=index,
                 delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        yield ev("content_block_stop", index=index)
        index += 1
    yield ev("message_delta", delta={"stop_reason": msg["stop_reason"], "stop_sequence": None},
             usage={"input_tokens": msg["usage"]["input_tokens"], "output_tokens": msg["usage"]["output_tokens"]})
    yield ev("message_stop")


# ---- message batches -------------------------------------------------------------------------------------

def _rfc3339(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


PROCESSING = {BatchStatus.validating: "in_progress", BatchStatus.in_progress: "in_progress",
              BatchStatus.finalizing: "in_progress", BatchStatus.cancelling: "canceling"}


def _batch_json(b: Batch) -> dict:
    counts = ledger.status_counts(session(), b.id)
    status = PROCESSING.get(b.status, "ended")
    ended = b.cancelled_at or b.completed_at or b.failed_at or (b.finalizing_at if status == "ended" else None)
    return {"id": b.id, "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": counts.get(JobStatus.queued, 0) + counts.get(JobStatus.running, 0),
                               "succeeded": counts.get(JobStatus.completed, 0),
                               "errored": counts.get(JobStatus.failed, 0),
                               "canceled": counts.get(JobStatus.cancelled, 0),
                               "expired": counts.get(JobStatus.expired, 0)},
            "ended_at": _rfc3339(ended), "created_at": _rfc3339(b.created_at), "expires_at": _rfc3339(b.expires_at),
            "archived_at": None, "cancel_initiated_at": _rfc3339(b.cancelling_at),
            "results_url": f"{request.host_url.rstrip('/')}/v1/messages/batches/{b.id}/results"
            if status == "ended" else None}


def _message_batch(batch_id: str) -> Batch:
    """The calling tenant's batch of /v1/messages requests, or Anthropic's 404."""
    return owned(Batch, batch_id, APIError(404, f"No message batch found with id '{batch_id}'.", "not_found"),
                 endpoint=MESSAGES)


def _request(i: int, r, seen: set) -> dict:
    """The i-th item of `requests`, checked: {custom_id, params}, a new custom_id, no streaming."""
    where = f"requests.{i}"
    if i >= MAX_BATCH_REQUESTS:
        raise bad_request(f"requests: at most {MAX_BATCH_REQUESTS} requests per batch.", "requests")
    if not isinstance(r, dict) or set(r) - {"custom_id", "params"}:
        raise bad_request(f"{where}: must be {{custom_id, params}}.", where)
    bodies.check_text(r, f"requests[{i}]")
    cid = r.get("custom_id")
    if not isinstance(cid, str) or not CUSTOM_ID.fullmatch(cid):
        raise bad_request(f"{where}.custom_id: must be 1-64 letters, digits, '_' or '-'.", f"{where}.custom_id")
    if cid in seen:
        raise bad_request(f"{where}.custom_id: '{cid}' appears more than once.", f"{where}.custom_id")
    seen.add(cid)
    if not isinstance(r.get("params"), dict):
        raise bad_request(f"{where}.params: Field required (an object).", f"{where}.params")
    if "stream" in r["params"]:
        raise bad_request(f"{where}.params.stream: streaming is not available in a batch.",
                          f"{where}.params.stream")
    return bodies.integral(r)


def _write_requests(storage, file_id: str) -> int:
    """The body's requests, checked one at a time as they are read (the body, up to MAX_BATCH_BYTES, is never held
    whole), written to the batch's input file; its size in bytes. Nothing is left on disk when it fails."""
    if request.content_length is not None and request.content_length > MAX_BATCH_BYTES:
        raise APIError(413, f"The request body is larger than {MAX_BATCH_BYTES} bytes.", "request_too_large")
    request.max_content_length = MAX_BATCH_BYTES     # a body sent without a length is cut off there
    seen: set = set()
    lines = (json.dumps({"custom_id": r["custom_id"], "method": "POST", "url": MESSAGES, "body": r["params"]})
             for r in (_request(i, r, seen) for i, r in enumerate(
                 bodies.array_items(request.stream, "requests", MAX_JSON_BYTES))))
    try:
        size = storage.write_lines(file_id, lines)
    except BaseException:
        storage.delete(file_id)
        raise
    if not seen:
        storage.delete(file_id)
        raise bad_request("requests: Field required (a non-empty list of {custom_id, params}).", "requests")
    return size


@bp.post("/v1/messages/batches")
@tenant_required
def create_batch():
    quota, conf = g.quota, cfg()
    quotas.check_class(quota, SlaClass.batch.value)
    s, storage, now = session(), services().storage, utcnow()
    file_id = new_id("file-")
    size = _write_requests(storage, file_id)
    batch = Batch(id=new_id("msgbatch_"), tenant_id=g.tenant.id, endpoint=MESSAGES, input_file_id=file_id,
                  completion_window="24h", sla_class=SlaClass.batch, status=BatchStatus.validating, metadata_=None,
                  total=0, completed=0, failed=0, created_at=now, expires_at=ledger.default_expiry(now))
    try:
        errors, created = ledger.load_jobs(s, storage, batch, quota, served_model=conf.served_model_name,
                                           max_lines=MAX_BATCH_REQUESTS, chunk_size=conf.batch_chunk_size,
                                           cache_group=g.tenant.prefix_cache_group, models=services().registry,
                                           route=services().dispatcher.queue, key_id=g.get("api_key_id"))
    except APIError:
        s.rollback()
        storage.delete(file_id)
        raise
    if errors:     # nothing is kept: the client gets the first bad request's error, naming its field
        s.rollback()
        storage.delete(file_id)
        e = errors[0]
        where = f"requests.{e['line'] - 1}" if e.get("line") else "requests"
        param = (e.get("param") or "").removeprefix("body.").removeprefix("body")
        status = {"model_not_found": 404, "model_not_supported": 404, "model_disabled": 403,
                  "model_not_allowed": 403}.get(e.get("code"), 400)
        raise APIError(status, f"{where}.params: {e['message']}", e.get("code"),
                       f"{where}.params" + (f".{param}" if param else ""))
    try:      # the requests are a file the tenant keeps with the batch, counted against its storage (last: the check
        # locks the tenant's row until the commit, as the admission in load_jobs does)
        files.add(s, File(id=file_id, tenant_id=g.tenant.id, purpose="batch", filename="message_batch_requests.jsonl",
                          bytes=size, created_at=now), quota)
    except APIError:
        s.rollback()
        storage.delete(file_id)
        raise
    batch.status, batch.in_progress_at, batch.total = BatchStatus.in_progress, utcnow(), len(created)
    s.commit()
    services().dispatcher.publish(created)
    return _batch_json(batch)


@bp.get("/v1/messages/batches")
@tenant_required
def list_batches():
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise bad_request("limit: must be an integer in [1, 1000].", "limit")
    rows = pages.page(session(), Batch, limit, after=request.args.get("after_id"), before=request.args.get("before_id"),
                      tenant_id=g.tenant.id, endpoint=MESSAGES)
    data = [_batch_json(b) for b in rows[:limit]]
    return {"data": data, "has_more": len(rows) > limit, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@bp.get("/v1/messages/batches/<batch_id>")
@tenant_required
def get_batch(batch_id):
    return _batch_json(_message_batch(batch_id))


@bp.post("/v1/messages/batches/<batch_id>/cancel")
@tenant_required
def cancel_batch(batch_id):
    s, batch = session(), _message_batch(batch_id)
    if batch.status in (BatchStatus.validating, BatchStatus.in_progress) and ledger.cancel(s, batch):
        ledger.finalize(s, services().storage, batch, cfg().served_model_name)
        s.commit()
    return _batch_json(batch)


def _result(job: Job, model: str | None) -> dict:
    if job.status == JobStatus.completed:
        return {"type": "succeeded", "message": ledger.result_body(job, model, MESSAGES)}
    if job.status in (JobStatus.cancelled, JobStatus.expired):
        return {"type": "canceled" if job.status == JobStatus.cancelled else "expired"}
    err = job.error or {}
    kind = "invalid_request_error" if err.get("code") in ("invalid_prompt", "context_length_exceeded") else "api_error"
    return {"type": "errored", "error": {"type": "error", "error": {"type": kind,
                                                                    "message": err.get("message", "Request failed.")}}}


@bp.get("/v1/messages/batches/<batch_id>/results")
@tenant_required
def batch_results(batch_id):
    batch = _message_batch(batch_id)
    if PROCESSING.get(batch.status) is not None:
        raise APIError(409, f"Message batch '{batch_id}' is still processing; its results are available once it "
                            "has ended.", "batch_not_ended")
    model, sessions = cfg().served_model_name, services().sessions

    def lines():
        """A page of results at a time, each read in its own short session that is closed (its connection back in
        the pool, no lock held) before the page is written to the client, however slowly it reads."""
        after = ""
        while True:
            with sessions() as s:
                jobs = ledger.results_page(s, batch_id, after, RESULTS_PAGE)
                text = "".join(json.dumps({"custom_id": j.custom_id, "result": _result(j, model)}) + "\n"
                               for j in jobs)
            if not jobs:
                return
            yield text
            if len(jobs) < RESULTS_PAGE:
                return
            after = jobs[-1].id

    return Response(lines(), mimetype="application/x-jsonl")


@bp.delete("/v1/messages/batches/<batch_id>")
@tenant_required
def delete_batch(batch_id):
    s, batch = session(), _message_batch(batch_id)
    if PROCESSING.get(batch.status) is not None:
        raise APIError(409, f"Message batch '{batch_id}' is still processing; cancel it and wait for it to end "
                            "before deleting it.", "batch_not_ended")
    files = ledger.remove(s, batch)
    s.commit()
    for f in files:
        services().storage.delete(f)
    return {"id": batch_id, "type": "message_batch_deleted"}
