"""OpenAI Batch API: streaming validation of the input file into job rows, cancellation, finalisation."""
import json
import tempfile
from datetime import timedelta

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session, undefer
from sqlalchemy.orm.attributes import set_committed_value

from . import adapters, affinity, fair, quotas
from .. import protocol
from ..protocol import CHAT, EMBEDDINGS, MESSAGES, RESPONSES
from ..protocol import (anthropic_messages, embeddings, logprobs, openai_completions, openai_responses,
                         request_bodies as bodies)
from .models import Batch, BatchStatus, File, Job, JobStatus, Quota, Tenant, new_id, utcnow
from .storage import Storage

ENDPOINTS = (*protocol.ENDPOINTS, RESPONSES)    # OpenAI batches; message batches are /v1/messages
MAX_ERRORS = 100   # line errors a failed batch keeps; past them, one more entry counts the rest
ACTIVE = (BatchStatus.validating, BatchStatus.in_progress, BatchStatus.finalizing, BatchStatus.cancelling)


def _line_error(line: int, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def check_line(endpoint: str, body, **limits) -> bodies.Checked:
    """One batch line's body, checked as bodies.check does; a /v1/responses or /v1/messages body becomes the chat
    body it stands for (its Checked.endpoint is then the chat endpoint the job runs as)."""
    if endpoint == RESPONSES:
        if not isinstance(body, dict):
            raise bodies.bad_request("The request body must be a JSON object.", None, "invalid_body")
        parsed = openai_responses.parse(body, new_id, openai_responses.BATCH_FIELDS)
        return openai_responses.check(parsed, None, lambda chat: bodies.check(chat, CHAT, **limits))
    if endpoint == MESSAGES:
        chat, origin = anthropic_messages.to_chat(body, anthropic_messages.BATCH_FIELDS)
        return anthropic_messages.check(chat, origin, lambda c: bodies.check(c, CHAT, **limits))
    return bodies.check(body, endpoint, **limits)


def load_jobs(s: Session, storage: Storage, batch: Batch, quota: Quota, **options) -> tuple[list[dict], list[tuple]]:
    with tempfile.TemporaryFile("w+", encoding="utf-8") as spool:   # checked lines wait on disk, not in memory
        return _load_jobs(s, storage, batch, quota, spool, **options)


def _load_jobs(s: Session, storage: Storage, batch: Batch, quota: Quota, spool, *, served_model: str | None,
               max_lines: int, chunk_size: int, cache_group: str | None = None, models=None,
               route=None, key_id: int | None = None) -> tuple[list[dict], list[tuple]]:
    """Validate every line of the batch's input file, then (all valid) insert the batch and its job rows in chunks.
    Returns (errors, [(job_id, queue, prefix key)]) (Dispatcher.publish's entries; cache_group: the tenant's
    prefix_cache_group, for the keys); with any error nothing is written. Validation only reads, so on SQLite the
    write lock is taken after the last line is checked (the batch must not be flushed before). models (a
    registry.Registry) resolves each line's model against the tenant's quota, route(sla_class, model) names the
    line's queue; without them every line runs on served_model, in the class's queue."""
    errors: list[dict] = []
    more = 0    # errors past MAX_ERRORS, counted only

    def fail(error: dict) -> None:
        nonlocal more
        if len(errors) < MAX_ERRORS:
            errors.append(error)
        else:
            more += 1

    seen: set[str] = set()
    created: list[tuple] = []
    tokens = inputs = 0
    now = utcnow()
    sla = batch.sla_class.value
    weight = s.scalar(select(Tenant.weight).where(Tenant.id == batch.tenant_id))
    with storage.open(batch.input_file_id) as fh:
        count = 0
        for lineno, raw in enumerate(fh, 1):
            count += bool(raw.strip())
            if count > max_lines:
                return [_line_error(lineno, "too_many_lines",
                                    f"A batch file may hold at most {max_lines} requests.")], []
        fh.seek(0)
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                item = bodies.integral(bodies.loads(raw))
            except (ValueError, UnicodeDecodeError):
                fail(_line_error(lineno, "invalid_json", "This line is not valid JSON."))
                continue
            if not isinstance(item, dict):
                fail(_line_error(lineno, "invalid_request", "Each line must be a JSON object."))
                continue
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
                fail(_line_error(lineno, "missing_required_parameter",
                                 "'custom_id' must be a non-empty string of at most 512 characters.",
                                 "custom_id"))
                continue
            if bodies.bad_text(custom_id):
                fail(_line_error(lineno, "invalid_value", f"'custom_id' {bodies.bad_text(custom_id)}.",
                                 "custom_id"))
                continue
            if custom_id in seen:
                fail(_line_error(lineno, "duplicate_custom_id",
                                 f"The custom_id '{custom_id}' appears more than once.", "custom_id"))
                continue
            seen.add(custom_id)
            if item.get("method", "POST") != "POST":
                fail(_line_error(lineno, "invalid_method", "'method' must be POST.", "method"))
                continue
            if item.get("url") != batch.endpoint:
                fail(_line_error(lineno, "invalid_url", f"'url' must be '{batch.endpoint}' to match "
                                 f"the batch endpoint, got {item.get('url')!r}.", "url"))
                continue
            try:
                body = item.get("body")
                entry = None if models is None else adapters.resolve(   # a batch line may name an adapter too
                    s, models, quota, batch.tenant_id, body.get("model") if isinstance(body, dict) else None)
                model = None if entry is None else entry.name
                if entry is not None:
                    models.check_endpoint(entry, batch.endpoint)
                checked = check_line(batch.endpoint, body, served_model=served_model if models is None else None,
                                     max_tokens_cap=quota.max_tokens_per_request,
                                     context_len=None if entry is None else models.context_len(entry),
                                     embed_model=None if entry is None else models.embed_model(entry),
                                     count_tokens=None if entry is None else models.token_counter(entry),
                                     vocab_size=None if entry is None else models.vocab_size(entry))
                if batch.endpoint == EMBEDDINGS:
                    inputs += embeddings.count(checked.body)
                    if inputs > embeddings.MAX_BATCH_INPUTS:
                        return [_line_error(lineno, "too_many_inputs", f"A batch may hold at most "
                                            f"{embeddings.MAX_BATCH_INPUTS} embedding inputs in all.",
                                            "body.input")], []
            except Exception as exc:  # APIError carries message and param
                fail(_line_error(lineno, getattr(exc, "code", None) or "invalid_body",
                                 getattr(exc, "message", str(exc)), f"body.{getattr(exc, 'param', '')}"))
                continue
            if errors:
                continue  # keep validating, stop writing: the batch will fail as a whole
            job_id = new_id("job_")
            tokens += checked.estimated_tokens
            spool.write(json.dumps([job_id, custom_id, model, checked.endpoint, checked.body,
                                    checked.estimated_tokens]) + "\n")
            created.append((job_id, sla if route is None else route(sla, model),
                            affinity.job_prefix_key(batch.tenant_id, cache_group, checked.endpoint, checked.body),
                            fair.meta(batch.tenant_id, weight, batch.expires_at, checked.estimated_tokens)))
    if more:
        errors.append(_line_error(None, "too_many_errors", f"{more} more lines have errors; only the first "
                                  f"{MAX_ERRORS} are listed."))
    if not errors and not created:
        errors.append(_line_error(0, "empty_file", "The input file holds no requests."))
    if not errors:
        s.add(batch)
        s.flush()
        spool.seek(0)
        rows = []
        for line in spool:
            job_id, custom_id, model, endpoint, body, estimated = json.loads(line)
            rows.append(dict(id=job_id, tenant_id=batch.tenant_id, batch_id=batch.id, custom_id=custom_id,
                             sla_class=sla, model=model, status=JobStatus.queued.value, endpoint=endpoint,
                             request=body, estimated_tokens=estimated, attempts=0, created_at=now, queued_at=now))
            if len(rows) >= chunk_size:
                _insert_jobs(s, rows)
                rows = []
        if rows:
            _insert_jobs(s, rows)
        quotas.reserve_queued(s, quota, len(created), key_id, tokens=tokens)
    return errors, created


_COPIED = ("id", "tenant_id", "batch_id", "custom_id", "sla_class", "model", "status", "endpoint", "request",
           "estimated_tokens", "attempts", "created_at", "queued_at")   # the rest: NULL or the server's default


def _insert_jobs(s: Session, rows: list[dict]) -> None:
    """A page of a batch's job rows: on Postgres one COPY (one statement, and the fastest way in: one INSERT per
    row, psycopg's executemany, or one multi-row INSERT, SQLAlchemy's, cost more), elsewhere executemany."""
    if s.get_bind().dialect.name != "postgresql":
        s.execute(insert(Job), rows)
        return
    from psycopg.types.json import Json
    with s.connection().connection.dbapi_connection.cursor() as cursor:
        with cursor.copy(f"COPY jobs ({', '.join(_COPIED)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([Json(row[c]) if c == "request" else row[c] for c in _COPIED])


def status_counts(s: Session, batch_id: str) -> dict[JobStatus, int]:
    """The batch's jobs per status (statuses without jobs left out)."""
    return dict(s.execute(select(Job.status, func.count()).where(Job.batch_id == batch_id)
                          .group_by(Job.status)).all())


def request_counts(s: Session, batch: Batch) -> dict:
    if batch.status not in ACTIVE:
        return {"total": batch.total, "completed": batch.completed, "failed": batch.failed}
    counts = status_counts(s, batch.id)
    failed = counts.get(JobStatus.failed, 0) + counts.get(JobStatus.expired, 0)
    return {"total": batch.total, "completed": counts.get(JobStatus.completed, 0), "failed": failed}


def usage_and_model(s: Session, batch: Batch, default_model: str | None) -> tuple[dict, str | None]:
    """OpenAI's per-batch `usage` (the tokens of its completed requests so far) and `model` (the model its lines
    ran on; the default model for lines that named none)."""
    p, c = s.execute(select(func.coalesce(func.sum(Job.prompt_tokens), 0),
                            func.coalesce(func.sum(Job.completion_tokens), 0))
                     .where(Job.batch_id == batch.id, Job.status == JobStatus.completed)).one()
    names = s.scalars(select(Job.model).where(Job.batch_id == batch.id).distinct().limit(2)).all()
    model = (names[0] or default_model) if len(names) == 1 else None
    return {"input_tokens": int(p), "output_tokens": int(c), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": int(p) + int(c)}, model


def _move(s: Session, batch: Batch, states: tuple, **values) -> bool:
    """A guarded transition of the batch row (`... WHERE status IN states`), the row locked until commit; the object
    then carries the new values, or, when the batch had left `states` meanwhile (a concurrent cancel or finaliser
    committed first), nothing is written, the object is reloaded and the answer is False."""
    moved = s.execute(update(Batch).where(Batch.id == batch.id, Batch.status.in_(states)).values(**values)).rowcount
    if moved != 1:
        s.refresh(batch)
        return False
    for key, value in values.items():
        set_committed_value(batch, key, value)
    return True


def cancel(s: Session, batch: Batch) -> bool:
    """validating|in_progress → cancelling: queued and running jobs are cancelled now; a worker running one finds
    its lease gone, aborts the sequence and bills what it computed (jobs.settle_cancelled: running jobs keep
    their lease token for it). False, and nothing changed, when the batch was no longer cancellable (the finaliser
    closed it meanwhile)."""
    now = utcnow()
    # The batch row first, then its jobs, then the tenant row: the order every batch transition takes them in, and
    # a worker's claim and completion take job before tenant (tenant between the two job updates deadlocked with a
    # claim in flight).
    if not _move(s, batch, (BatchStatus.validating, BatchStatus.in_progress), status=BatchStatus.cancelling,
                 cancelling_at=now):
        return False
    counts, reserved = {}, 0
    for status, counter in ((JobStatus.queued, Tenant.queued_count), (JobStatus.running, Tenant.running_count)):
        tokens = s.execute(update(Job).where(Job.batch_id == batch.id, Job.status == status)
                           .values(status=JobStatus.cancelled, finished_at=now, lease_expires_at=None)
                           .returning(Job.estimated_tokens)).scalars().all()
        if tokens:
            counts[counter] = counter - len(tokens)
            reserved += sum(tokens)
    if counts:
        s.execute(update(Tenant).where(Tenant.id == batch.tenant_id).values(
            {**counts, Tenant.budget_reserved: Tenant.budget_reserved - reserved}))
    return True


def result_body(job: Job, model: str | None, endpoint: str) -> dict:
    """A completed batch job's response body in the shape of the batch's endpoint."""
    model = job.model or model     # the line's own model; rows older than the registry ran on the default
    created = int(job.finished_at.timestamp()) if job.finished_at else None
    if endpoint == RESPONSES:
        return openai_responses.render(openai_responses.response_id(job.id), job, {}, model=model, created_at=created,
                                service_tier="flex", store=False)
    if endpoint == MESSAGES:
        return anthropic_messages.message(anthropic_messages.message_id(job.id), model, job)
    if job.endpoint == EMBEDDINGS:
        return embeddings.response_body(job.output, job.request, model, job.prompt_tokens)
    usage = openai_completions.usage(job.prompt_tokens, job.completion_tokens)
    picked = openai_completions.choice_objects(job.endpoint, openai_completions.choices_of(job), job.request, job.id,
                                               logprobs.requested(job.endpoint, job.request))
    return {**openai_completions.head(job.endpoint, job.id, created, model), "choices": picked, "usage": usage}


def _result_line(job: Job, model: str | None, endpoint: str) -> str:
    body = result_body(job, model, endpoint)
    return json.dumps({"id": f"batch_req_{job.id}", "custom_id": job.custom_id,
                       "response": {"status_code": 200, "request_id": job.id, "body": body}, "error": None})


def _error_line(job: Job) -> str:
    error = job.error or ({"code": "batch_expired", "message": "This request could not be executed before the "
                                                                  "completion window expired."}
                          if job.status == JobStatus.expired else
                          {"code": f"job_{job.status.value}", "message": f"The request was {job.status.value}."})
    return json.dumps({"id": f"batch_req_{job.id}", "custom_id": job.custom_id, "response": None,
                       "error": {"code": error.get("code"), "message": error.get("message")}})


def finalize(s: Session, storage: Storage, batch: Batch, model: str | None = None) -> bool:
    """Once no job of the batch is queued or running, write the output and error files and close it."""
    if batch.status not in (BatchStatus.in_progress, BatchStatus.cancelling):
        return False
    pending = s.scalar(select(func.count()).where(Job.batch_id == batch.id,
                                                  Job.status.in_((JobStatus.queued, JobStatus.running))))
    if pending:
        return False
    now = utcnow()
    # Guarded: of an API cancel and the finaliser that meet here, one writes the files and closes the batch.
    if not _move(s, batch, (BatchStatus.in_progress, BatchStatus.cancelling), status=BatchStatus.finalizing,
                 finalizing_at=now):
        return False
    counts = {"completed": 0, "failed": 0}

    def lines(want_ok: bool):
        for job in s.scalars(select(Job).where(Job.batch_id == batch.id).order_by(Job.id)
                             .options(undefer(Job.logprobs), undefer(Job.choices)).execution_options(yield_per=1000)):
            ok = job.status == JobStatus.completed
            if ok == want_ok:
                if ok:
                    counts["completed"] += 1
                elif job.status in (JobStatus.failed, JobStatus.expired):
                    counts["failed"] += 1
                yield _result_line(job, model, batch.endpoint) if ok else _error_line(job)

    for want_ok, attr in ((True, "output_file_id"), (False, "error_file_id")):
        file_id = new_id("file-")
        size = storage.write_lines(file_id, lines(want_ok))
        if size:
            s.add(File(id=file_id, tenant_id=batch.tenant_id, purpose="batch_output",
                       filename=f"{batch.id}_{'output' if want_ok else 'error'}.jsonl", bytes=size, created_at=now))
            setattr(batch, attr, file_id)
        else:
            storage.delete(file_id)
    batch.completed, batch.failed = counts["completed"], counts["failed"]
    if batch.cancelling_at is not None:
        batch.status, batch.cancelled_at = BatchStatus.cancelled, now
    elif batch.expired_at is not None:
        batch.status = BatchStatus.expired
    else:
        batch.status, batch.completed_at = BatchStatus.completed, now
    return True


def expire(s: Session, batch: Batch) -> bool:
    """Past expires_at: queued jobs expire; finalize() then closes the batch as expired output. False, and nothing
    changed, when the batch was no longer in progress (cancelled meanwhile) or already expired."""
    now = utcnow()
    if batch.expired_at is not None or not _move(s, batch, (BatchStatus.in_progress,), expired_at=now):
        return False
    tokens = s.execute(update(Job).where(Job.batch_id == batch.id, Job.status == JobStatus.queued)
                       .values(status=JobStatus.expired, finished_at=now).returning(Job.estimated_tokens)).scalars().all()
    if tokens:
        s.execute(update(Tenant).where(Tenant.id == batch.tenant_id).values(
            queued_count=Tenant.queued_count - len(tokens), budget_reserved=Tenant.budget_reserved - sum(tokens)))
    return True


def expire_overdue(s: Session) -> int:
    """Expire every in-progress batch past its expires_at (once); returns how many."""
    overdue = s.scalars(select(Batch).where(Batch.status == BatchStatus.in_progress, Batch.expired_at.is_(None),
                                            Batch.expires_at <= utcnow())).all()
    return sum(expire(s, batch) for batch in overdue)


def results_page(s: Session, batch_id: str, after: str, limit: int) -> list[Job]:
    """Up to `limit` of the batch's jobs with an id past `after`, by id, each with its choices loaded."""
    return s.scalars(select(Job).where(Job.batch_id == batch_id, Job.id > after).order_by(Job.id)
                     .limit(limit).options(undefer(Job.choices))).all()


def files_of(s: Session, batch: Batch) -> dict[str, File]:
    """The batch's input, output and error files that exist, by id."""
    ids = [f for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f]
    return {f.id: f for f in s.scalars(select(File).where(File.id.in_(ids)))}


def remove(s: Session, batch: Batch) -> list[str]:
    """Delete the batch (one that has ended) with its jobs and the rows of its files; returns the ids of those files,
    whose bytes the caller deletes from storage once this is committed."""
    ids = [f for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f]
    s.execute(delete(Job).where(Job.batch_id == batch.id))
    s.execute(delete(File).where(File.id.in_(ids), File.tenant_id == batch.tenant_id))
    s.delete(batch)
    return ids


def open_ids(s: Session) -> list[str]:
    """Batches whose jobs may still be running (in progress or cancelling): the finaliser's candidates."""
    return s.scalars(select(Batch.id).where(Batch.status.in_((BatchStatus.in_progress,
                                                               BatchStatus.cancelling)))).all()


def locked(s: Session, batch_id: str) -> Batch | None:
    """The batch, its row locked until the transaction ends (one finaliser at a time)."""
    return s.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())


def fail_stale_validating(s: Session, older_than: timedelta) -> int:
    """Batches still validating long after creation (left by a server that stopped mid-validation before
    validation and creation were one transaction) fail with an error saying so; they hold no jobs."""
    now = utcnow()
    error = [_line_error(None, "validation_interrupted", "Validation of this batch was interrupted (the server "
                                "stopped); create the batch again.")]
    return s.execute(update(Batch).where(Batch.status == BatchStatus.validating, Batch.created_at < now - older_than)
                     .values(status=BatchStatus.failed, failed_at=now, errors=error)).rowcount


def default_expiry(created):
    return created + timedelta(hours=24)
