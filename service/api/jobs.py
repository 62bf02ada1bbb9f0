"""Native jobs: submit, inspect, list and cancel the tenant's own jobs."""
import hashlib
import json

from flask import Blueprint, g, request
from sqlalchemy.exc import IntegrityError

from ..ledger import adapters, affinity, fair, jobs as transitions, pages, quotas
from ..protocol import CHAT, COMPLETIONS, EMBEDDINGS
from ..protocol import (embeddings, logprobs, openai_completions, request_bodies as bodies, sla_classes,
                        structured_output as structured)
from .. import admission
from ..auth import tenant_required
from ..db import reads, session
from ..protocol.errors import APIError, bad_request, not_found
from ..ledger.logging import log_job
from ..ledger.models import SLA_CLASSES, Job, JobStatus, SlaClass, new_id, utcnow
from . import MAX_JSON_BYTES, cfg, json_body, limit_arg, owned, page, ts
from ..app import services

bp = Blueprint("jobs", __name__)
MAX_PAGE = 100   # jobs in one page of a listing (OpenAI's lists stop at 100)


def _tool_calls(job: Job) -> dict:
    if job.endpoint != CHAT or not structured.uses_tools(job.request or {}):
        return {}
    return {"tool_calls": structured.parse(job.request, job.output or "", job.id)[1]}


def _choices(job: Job, one: bool) -> dict:
    """One job's GET of a request with n > 1: output.choices lists every choice (output.text is the first's)."""
    if not one or not job.choices:
        return {}
    want = logprobs.requested(job.endpoint, job.request)
    return {"choices": [{"index": i, "text": c["text"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"],
                         **({"logprobs": logprobs.shaped(job.endpoint, c["logprobs"])} if want else {})}
                        for i, c in enumerate(openai_completions.choices_of(job))]}


def job_json(job: Job, with_logprobs: bool = False, with_request: bool = True) -> dict:
    """A job as JSON; with_logprobs (one job's GET) adds output.logprobs when the request asked for them; without
    with_request (a listing that did not ask for it) the request body is left out."""
    usage = None
    if job.prompt_tokens is not None:
        usage = embeddings.usage(job.prompt_tokens) if job.endpoint == EMBEDDINGS else \
            openai_completions.usage(job.prompt_tokens, job.completion_tokens)
    return {"id": job.id, "object": "job", "status": job.status.value, "sla_class": job.sla_class.value,
            "service_tier": sla_classes.tier(job.sla_class),
            "model": job.model, "endpoint": job.endpoint, **({"request": job.request} if with_request else {}),
            "metadata": job.metadata_,
            "batch_id": job.batch_id, "custom_id": job.custom_id, "deadline": ts(job.deadline),
            "created_at": ts(job.created_at), "queued_at": ts(job.queued_at),
            "dispatched_at": ts(job.dispatched_at), "started_at": ts(job.started_at),
            "first_token_at": ts(job.first_token_at), "finished_at": ts(job.finished_at),
            "attempts": job.attempts, "worker": job.worker, "usage": usage,
            "output": None if job.status != JobStatus.completed else
            {"data": embeddings.data(job.output, job.request)} if job.endpoint == EMBEDDINGS else
            {"text": job.output, "token_ids": job.output_token_ids, **_tool_calls(job), **_choices(job, with_logprobs),
             **({"logprobs": logprobs.shaped(job.endpoint, job.logprobs)}
                if with_logprobs and logprobs.requested(job.endpoint, job.request) else {})},
            "finish_reason": job.finish_reason, "error": job.error}


def list_args() -> tuple[int, bool]:
    """A job listing's `limit` (at most MAX_PAGE) and whether `include=request` asks for the request bodies."""
    include = request.args.get("include")
    if include not in (None, "", "request"):
        raise bad_request("'include' may only be 'request' (adds each job's request body).", "include")
    return limit_arg(cfg().page_size, MAX_PAGE), include == "request"


def _own_job(job_id: str) -> Job:
    """The calling tenant's job (one hidden with its deleted stored response is not), or 404."""
    return owned(Job, job_id, not_found("job", job_id), hidden=False)


def _replay(job: Job | None, request_hash: str):
    if job is None:
        return None
    if job.request_hash != request_hash:
        raise APIError(409, "This Idempotency-Key was already used with a different request body.",
                       "idempotency_conflict")
    return job_json(job), 200


@bp.post("/v1/jobs")
@tenant_required
def create_job():
    body = json_body(MAX_JSON_BYTES)
    quota, conf = g.quota, cfg()
    if "prompt" in body and "messages" in body:
        raise bad_request("Send either 'prompt' or 'messages', not both.", "messages")
    if "input" in body and ("prompt" in body or "messages" in body):
        raise bad_request("Send one of 'input' (embeddings), 'prompt' or 'messages'.", "input")
    endpoint = EMBEDDINGS if "input" in body else CHAT if "messages" in body else COMPLETIONS
    models = services().registry
    model = adapters.resolve(session(), models, quota, g.tenant.id, body.get("model"))  # 404/403
    models.check_endpoint(model, endpoint)
    checked = bodies.check(body, endpoint, served_model=None,
                           max_tokens_cap=quota.max_tokens_per_request, extra_allowed=bodies.NATIVE_EXTRA,
                           context_len=models.context_len(model), vocab_size=models.vocab_size(model),
                           embed_model=models.embed_model(model),
                           count_tokens=models.token_counter(model))
    sla = sla_classes.sla_class(body.get("service_tier"), body.get("sla_class"),
                          g.tenant.default_sla_class or "interactive" if body.get("service_tier") == "auto"
                          else "interactive")
    if sla not in SLA_CLASSES:
        raise bad_request(f"'sla_class' must be one of {list(SLA_CLASSES)}.", "sla_class")
    quotas.check_class(quota, sla)
    deadline = bodies.parse_deadline(body.get("deadline"))
    metadata = bodies.check_metadata(body.get("metadata"))

    key = request.headers.get("Idempotency-Key")
    request_hash = None
    if key is not None:
        if not key or len(key) > 255 or bodies.bad_text(key):
            raise bad_request("Idempotency-Key must be 1 to 255 characters, with no NUL or lone surrogates.",
                              "Idempotency-Key")
        request_hash = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        replay = _replay(transitions.by_idempotency_key(session(), g.tenant.id, key), request_hash)
        if replay:
            return replay

    now = utcnow()
    job = Job(id=new_id("job_"), tenant_id=g.tenant.id, sla_class=SlaClass(sla), model=model.name,
              status=JobStatus.queued, endpoint=endpoint, request=checked.body, metadata_=metadata, idempotency_key=key,
              request_hash=request_hash, estimated_tokens=checked.estimated_tokens, deadline=deadline, attempts=0,
              created_at=now, queued_at=now)
    quotas.check_rate(services().limiter, quota, checked.estimated_tokens)
    try:
        # Counts the job against max_queued and reserves its tokens against the monthly budget (checking, in
        # the database, that the key is live and the tenant enabled) and inserts it; committed before this returns. On Postgres one statement, shared with
        # the same key's concurrent submissions (quotas.GroupAdmission).
        xmin = admission.admit(job)
    except IntegrityError:  # a concurrent retry with the same Idempotency-Key won the insert
        if key is None:
            raise
        s = session()
        s.rollback()
        replay = _replay(transitions.by_idempotency_key(s, g.tenant.id, key), request_hash)
        if replay:
            return replay
        raise
    prefix = affinity.job_prefix_key(g.tenant.id, g.tenant.prefix_cache_group, endpoint, checked.body)
    fair_meta = fair.meta(g.tenant.id, g.tenant.weight, deadline, checked.estimated_tokens)
    dispatcher = services().dispatcher
    if dispatcher.publish_one(job.id, dispatcher.queue(sla, model.name), xmin, prefix=prefix, fair=fair_meta):
        job.dispatched_at = utcnow()
    log_job("job.queued", job)
    return job_json(job), 202


@bp.get("/v1/jobs/<job_id>")
@tenant_required
def get_job(job_id):
    return job_json(_own_job(job_id), with_logprobs=True)


@bp.get("/v1/jobs")
@tenant_required
def list_jobs():
    status, sla, cursor = request.args.get("status"), request.args.get("sla_class"), request.args.get("cursor")
    filters = {}
    if status:
        if status not in JobStatus.__members__:
            raise bad_request(f"'status' must be one of {list(JobStatus.__members__)}.", "status")
        filters["status"] = JobStatus(status)
    if sla:
        if sla not in SLA_CLASSES:
            raise bad_request(f"'sla_class' must be one of {list(SLA_CLASSES)}.", "sla_class")
        filters["sla_class"] = sla
    limit, with_request = list_args()
    rows = pages.page(reads(), Job, limit, after=cursor, tenant_id=g.tenant.id, hidden=False, **filters)
    out = page(rows, limit, lambda j: job_json(j, with_request=with_request))
    out["next_cursor"] = out["last_id"] if out["has_more"] else None
    return out


@bp.post("/v1/jobs/<job_id>/cancel")
@tenant_required
def cancel_job(job_id):
    s = session()
    job = _own_job(job_id)
    if not transitions.cancel(s, job_id, g.tenant.id):
        s.rollback()
        raise APIError(409, f"Job '{job_id}' is already {job.status.value}.", "job_not_cancellable")
    s.commit()
    s.refresh(job)
    log_job("job.cancelled", job, actor="tenant")
    return job_json(job)
