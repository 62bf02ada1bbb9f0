"""OpenAI Responses API: a request is a chat job (service/protocol/openai_responses.py shapes it) admitted and
answered by the online core (service/api/openai_compat.py); `background` answers at once with the queued job, `store`
keeps the response (and its input items) for GET, input_items and `previous_response_id`."""
import json

from flask import Blueprint, g, request

from ..protocol import CHAT
from ..protocol import (openai_responses as shapes, request_bodies as bodies, sla_classes,
                        structured_output as structured)
from ..ledger import jobs as transitions
from ..auth import tenant_required
from ..db import session
from ..protocol.errors import APIError, bad_request
from ..ledger.models import Job, JobStatus, StoredResponse, new_id
from . import MAX_JSON_BYTES, json_body, limit_arg, owned
from ..app import services
from .openai_compat import _job_error, event_stream, first_event, online_class, submit
from .streams import text_deltas

bp = Blueprint("responses", __name__)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "not_found", param)


def _own(response_id: str, param: str | None = None) -> tuple[StoredResponse, Job]:
    row = owned(StoredResponse, response_id, _not_found(response_id, param))
    return row, session().get(Job, row.job_id)


def _render(response_id: str, job: Job, params: dict, **kw) -> dict:
    return shapes.render(response_id, job, params, model=job.model, created_at=int(job.created_at.timestamp()),
                         service_tier=sla_classes.tier(job.sla_class), **kw)


def _history(prev_id: str) -> list[dict]:
    row, job = _own(prev_id, "previous_response_id")
    if job.status != JobStatus.completed:
        raise APIError(409, f"Previous response '{prev_id}' is {shapes.STATUS[job.status.value]}; only a completed "
                            "response can be continued.", "response_not_completed", "previous_response_id")
    message, _ = structured.message(job.request, job.output or "", job.finish_reason, prev_id)
    return shapes.history(job.request["messages"], bool(row.params.get("instructions")), message)


@bp.post("/v1/responses")
@tenant_required
def create_response():
    body = json_body(MAX_JSON_BYTES)
    parsed = shapes.parse(body, new_id)
    store = body.get("store") is not False      # null or absent: stored
    background, stream = bool(body.get("background")), bool(body.get("stream"))
    if background and not store:
        raise bad_request("'background' needs 'store' (a background response is fetched later).", "background")
    if background and stream:
        raise bad_request("'stream' with 'background' is not supported: stream the request in the foreground, or "
                          "poll GET /v1/responses/{id}.", "stream", "unsupported_value")
    sla = online_class(body.get("service_tier"), body.get("sla_class"))
    prev = body.get("previous_response_id")
    history = _history(prev) if prev else None
    models = services().registry
    model = models.resolve(g.quota, body.get("model"))
    models.check_endpoint(model, CHAT)
    checked = shapes.check(parsed, history, lambda chat: bodies.check(
        chat, CHAT, served_model=None, max_tokens_cap=g.quota.max_tokens_per_request,
        context_len=models.context_len(model), count_tokens=models.token_counter(model)))
    job, waiter = submit(checked, sla, model, wait=not background, hidden=not store)
    response_id = shapes.response_id(job.id)
    kw = dict(background=background, store=store, previous_response_id=prev)
    if store:
        s = session()
        try:
            s.add(StoredResponse(id=response_id, tenant_id=g.tenant.id, job_id=job.id, previous_response_id=prev,
                                 background=background, params=parsed.params, input_items=parsed.items,
                                 created_at=job.created_at))
            s.commit()
        except BaseException:
            if waiter is not None:
                waiter.close(cancel=True)
            raise
    if background:
        return _render(response_id, job, parsed.params, **kw)
    first, final = first_event(waiter, whole=not stream)
    if final is not None and final.status != JobStatus.completed:
        raise _job_error(final)
    if not stream:
        return _render(response_id, final, parsed.params, **kw)
    return event_stream(_events(waiter, first, job, response_id, parsed.params, kw))


def _events(waiter, first, job: Job, response_id: str, params: dict, kw: dict):
    """The Responses streaming events of one job (text as it comes; function calls whole at the end)."""
    deltas = text_deltas(waiter, first)
    try:
        yield from _shaped(deltas, job, response_id, params, kw)
    finally:
        deltas.close()     # a client gone mid-stream: its job is cancelled


def _shaped(deltas, job: Job, response_id: str, params: dict, kw: dict):
    seq = iter(range(1 << 62))

    def ev(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

    yield ev("response.created", response=_render(response_id, job, params, status="in_progress", **kw))
    yield ev("response.in_progress", response=_render(response_id, job, params, status="in_progress", **kw))
    splitter = structured.StreamSplitter(job.request, response_id)
    msg = shapes.message_item(response_id, "", "in_progress")
    head = dict(item_id=msg["id"], output_index=0, content_index=0)
    opened = False

    def text(delta: str):
        nonlocal opened
        if not opened:
            opened = True
            yield ev("response.output_item.added", output_index=0, item={**msg, "content": []})
            yield ev("response.content_part.added", part={**msg["content"][0], "text": ""}, **head)
        if delta:
            yield ev("response.output_text.delta", delta=delta, logprobs=[], **head)

    try:
        while True:
            piece = next(deltas)
            if piece is None:
                yield ": keep-alive\n\n"
            elif splitter.active or piece:
                out = splitter.feed(piece)
                if out:
                    yield from text(out)
    except StopIteration as stop:
        final = stop.value
    except APIError as err:
        error = {"code": err.code or "server_error", "message": err.message}
        yield ev("response.failed", response={**_render(response_id, job, params, status="failed", **kw), "error": error})
        return
    rest, _ = splitter.finish()
    whole = _render(response_id, final, params, **kw)
    items = whole["output"]
    if items and items[0]["type"] == "message":
        yield from text(rest)
    for index, item in enumerate(items):
        if item["type"] == "message":
            yield ev("response.output_text.done", text=item["content"][0]["text"], logprobs=[], **head)
            yield ev("response.content_part.done", part=item["content"][0], **head)
        else:
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
        yield ev("response.output_item.done", output_index=index, item=item)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(whole["status"],
                                                                                       "response.failed")
    yield ev(kind, response=whole)


@bp.get("/v1/responses/<response_id>")
@tenant_required
def get_response(response_id):
    row, job = _own(response_id)
    return _render(row.id, job, row.params, background=row.background, previous_response_id=row.previous_response_id)


@bp.delete("/v1/responses/<response_id>")
@tenant_required
def delete_response(response_id):
    row, _ = _own(response_id)
    s = session()
    s.delete(row)
    transitions.hide(s, row.job_id)    # nor readable as its job
    s.commit()
    return {"id": response_id, "object": "response", "deleted": True}


@bp.post("/v1/responses/<response_id>/cancel")
@tenant_required
def cancel_response(response_id):
    row, job = _own(response_id)
    if not row.background:
        raise APIError(409, "Only a response created with 'background': true can be cancelled.",
                       "response_not_cancellable")
    s = session()
    if transitions.cancel(s, job.id, g.tenant.id):
        s.commit()
    s.refresh(job)
    if job.status != JobStatus.cancelled:
        raise APIError(409, f"Response '{response_id}' is already {shapes.STATUS[job.status.value]} and cannot be "
                            "cancelled.", "response_not_cancellable")
    return _render(row.id, job, row.params, background=True, previous_response_id=row.previous_response_id)


@bp.get("/v1/responses/<response_id>/input_items")
@tenant_required
def input_items(response_id):
    row, _ = _own(response_id)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'.", "order")
    its = list(row.input_items) if order == "asc" else list(reversed(row.input_items))
    after = request.args.get("after")
    if after is not None:
        ids = [it["id"] for it in its]
        if after not in ids:
            raise APIError(404, f"'after' names no input item of response '{response_id}'.", "not_found", "after")
        its = its[ids.index(after) + 1:]
    limit = limit_arg(20, 100)
    data = its[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(its) > limit}

