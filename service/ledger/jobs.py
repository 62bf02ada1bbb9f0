"""Job state transitions. Each is a guarded UPDATE (`... WHERE status IN (...)`) plus its side effects
(tenant counters, usage), executed in the caller's transaction; the caller commits. And the reads of one job."""
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import case, delete, func, literal, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, undefer

from . import adapters
from .database import autocommit
from .models import Job, JobIdempotencyKey, JobStatus, Quota, Tenant, Usage, utcnow

Q, R = JobStatus.queued, JobStatus.running


def period(now: datetime | None = None) -> str:
    """The month a budget and a usage row count in (Tenant.budget_period, Usage.period): "YYYY-MM", UTC."""
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m")


@dataclass
class Started:
    lease_token: str | None
    reason: str | None = None  # "not_queued" | "throttled" | "expired" when lease_token is None


def _counter_values(queued: int = 0, running: int = 0, released=0, used: int | None = None) -> dict:
    values = dict(queued_count=Tenant.queued_count + queued, running_count=Tenant.running_count + running,
                  budget_reserved=Tenant.budget_reserved - released)
    if used is not None:
        now = period()
        values.update(budget_period=now, budget_used=case((Tenant.budget_period == now, Tenant.budget_used + used),
                                                          else_=used))
    return values


def _counters(s: Session, tenant_id: str, queued: int = 0, running: int = 0, released: int = 0,
              used: int | None = None) -> None:
    """Move the admission counters; released: budget tokens a finished job no longer holds in reserve; used:
    the tokens a completed job used, counted against this month's budget."""
    s.execute(update(Tenant).where(Tenant.id == tenant_id).values(_counter_values(queued, running, released, used)))


@dataclass
class Runnable:
    """What a worker reads of a job to put it into its engine: the request and the tenant's scheduling."""
    status: JobStatus
    endpoint: str
    request: dict
    sla_class: str
    tenant_id: str
    weight: float
    cache_group: str | None
    queue_time: float | None    # seconds between queued and started, once started
    adapter: tuple[str, str, bool] | None = None   # the LoRA adapter the request names: (name, source, pinned)
    refused: adapters.NotUsable | None = None      # why it must not run (an adapter its tenant may not use)


def read(s: Session, job_id: str, whole: bool = False) -> Job | None:
    """The job's row; whole: with its deferred columns (logprobs, choices) loaded too."""
    return s.get(Job, job_id, options=[undefer(Job.logprobs), undefer(Job.choices)] if whole else None)


def by_idempotency_key(s: Session, tenant_id: str, key: str) -> Job | None:
    """The tenant's job submitted with this Idempotency-Key (on Postgres found through job_idempotency_keys)."""
    if s.get_bind().dialect.name == "postgresql":
        return s.scalar(select(Job).join(JobIdempotencyKey, JobIdempotencyKey.job_id == Job.id).where(
            JobIdempotencyKey.tenant_id == tenant_id, JobIdempotencyKey.idempotency_key == key))
    return s.scalar(select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key))


def hide(s: Session, job_id: str) -> None:
    """The job is no longer listed nor readable by its tenant (its stored response was deleted)."""
    s.execute(update(Job).where(Job.id == job_id).values(hidden=True))


def runnable(conn, job_id: str) -> Runnable | None:
    """The job's request and its tenant's weight and prefix-cache group, in one read (a Session or a Connection)."""
    row = conn.execute(select(Job.status, Job.endpoint, Job.request, Job.sla_class, Job.tenant_id, Job.queued_at,
                              Job.started_at, Job.model, Tenant.weight, Tenant.prefix_cache_group, Quota.allowed_models)
                       .join(Tenant, Tenant.id == Job.tenant_id).outerjoin(Quota, Quota.tenant_id == Job.tenant_id)
                       .where(Job.id == job_id)).first()
    if row is None:
        return None
    queue_time = ((row.started_at - row.queued_at).total_seconds()
                  if row.started_at is not None and row.queued_at is not None else None)
    job = Runnable(row.status, row.endpoint, row.request, row.sla_class.value, row.tenant_id, row.weight or 1.0,
                   row.prefix_cache_group, queue_time)
    try:
        job.adapter = adapters.for_job(conn, row.tenant_id, row.allowed_models, row.model, row.request)
    except adapters.NotUsable as exc:
        job.refused = exc
    return job


def start(s: Session, job_id: str, worker: str, lease_seconds: float = 300, token: str | None = None,
          at: datetime | None = None) -> Started:
    """queued → running, unless the tenant already runs max_running jobs (then nothing changes)
    or the job is past its deadline (then it expires). token: the lease token to use (default: a new one);
    at: when the attempt entered the engine, if it did before this claim (default: now)."""
    # The job row is locked before the tenant's counters, the order every other transition (and a batch's
    # cancel) takes them in; tenant-then-job deadlocked with a batch cancel on Postgres.
    row = s.execute(select(Job.tenant_id, Job.deadline, Quota.max_running)
                    .join(Quota, Quota.tenant_id == Job.tenant_id).where(Job.id == job_id, Job.status == Q)
                    .with_for_update(of=Job)).first()
    if row is None:
        return Started(None, "not_queued")
    tenant_id, deadline, max_running = row
    if deadline is not None and deadline <= utcnow():
        return Started(None, "expired" if expire_overdue(s, job_id=job_id) else "not_queued")
    bump = update(Tenant).where(Tenant.id == tenant_id).values(
        queued_count=Tenant.queued_count - 1, running_count=Tenant.running_count + 1)
    if max_running is not None:
        bump = bump.where(Tenant.running_count < max_running)
    if s.execute(bump).rowcount != 1:
        return Started(None, "throttled")
    token, now = token or secrets.token_hex(16), utcnow()
    res = s.execute(update(Job).where(Job.id == job_id, Job.status == Q).values(
        status=R, attempts=Job.attempts + 1, lease_token=token, worker=worker, started_at=at or now,
        first_token_at=None, lease_expires_at=now + timedelta(seconds=lease_seconds)))
    if res.rowcount != 1:
        _counters(s, tenant_id, queued=1, running=-1)
        return Started(None, "not_queued")
    return Started(token)


# The claim on Postgres, one statement: the job row locked (as start() does first), the tenant's counters moved
# unless it runs max_running jobs already or the job is past its deadline, the job started, and what runnable()
# reads, returned with it. Data-modifying CTEs run to completion whatever the final SELECT reads.
_CLAIM_PG = text("""
WITH j AS (
  SELECT jobs.id, jobs.tenant_id, jobs.deadline, jobs.endpoint, jobs.request, jobs.sla_class, jobs.queued_at,
         jobs.model, tenants.weight, tenants.prefix_cache_group, quotas.allowed_models, quotas.max_running
  FROM jobs JOIN tenants ON tenants.id = jobs.tenant_id JOIN quotas ON quotas.tenant_id = jobs.tenant_id
  WHERE jobs.id = :id AND jobs.status = 'queued'
  FOR UPDATE OF jobs),
bump AS (
  UPDATE tenants SET queued_count = tenants.queued_count - 1, running_count = tenants.running_count + 1
  FROM j WHERE tenants.id = j.tenant_id AND (j.deadline IS NULL OR j.deadline > :now)
    AND (j.max_running IS NULL OR tenants.running_count < j.max_running)
  RETURNING tenants.id),
claimed AS (
  UPDATE jobs SET status = 'running', attempts = jobs.attempts + 1, lease_token = :token, worker = :worker,
    started_at = :now, first_token_at = NULL, lease_expires_at = :expires
  FROM bump WHERE jobs.id = :id AND jobs.status = 'queued'
  RETURNING jobs.id)
SELECT j.*, EXISTS (SELECT 1 FROM claimed) AS started FROM j
""")


def claim(engine, job_id: str, worker: str, lease_seconds: float = 300,
          token: str | None = None) -> tuple[Started, Runnable | None]:
    """start() and runnable() together: (Started, the job to run when it started). On Postgres one autocommit
    statement (a deadline passed or a throttled tenant, both rare, then take start()'s own path); elsewhere
    start() then runnable() in one transaction."""
    token = token or secrets.token_hex(16)
    if engine.dialect.name != "postgresql":
        return _claim_in_session(engine, job_id, worker, lease_seconds, token)
    now = utcnow()
    with autocommit(engine) as conn:
        row = conn.execute(_CLAIM_PG, {"id": job_id, "now": now, "token": token, "worker": worker,
                                       "expires": now + timedelta(seconds=lease_seconds)}).first()
        if row is None:
            return Started(None, "not_queued"), None
        if row.started:
            job = Runnable(JobStatus.running, row.endpoint, row.request, row.sla_class, row.tenant_id,
                           row.weight or 1.0, row.prefix_cache_group,
                           None if row.queued_at is None else (now - row.queued_at).total_seconds())
            try:
                job.adapter = adapters.for_job(conn, row.tenant_id, row.allowed_models, row.model, row.request)
            except adapters.NotUsable as exc:
                job.refused = exc
            return Started(token), job
    return _claim_in_session(engine, job_id, worker, lease_seconds, token)    # past its deadline, or throttled


def _claim_in_session(engine, job_id: str, worker: str, lease_seconds: float, token: str):
    with Session(engine, expire_on_commit=False) as s:
        started = start(s, job_id, worker, lease_seconds, token=token)
        job = runnable(s, job_id) if started.lease_token is not None else None
        if started.reason == "throttled":    # over max_running: back to the sweeper, which republishes it
            undispatch(s, job_id)
        s.commit()
    return started, job


def renew_lease(s: Session, job_id: str, lease_token: str, lease_seconds: float = 300) -> bool:
    return s.execute(update(Job).where(Job.id == job_id, Job.status == R, Job.lease_token == lease_token)
                     .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))).rowcount == 1


def current_leases(s: Session, leases: dict[str, str], renew_seconds: float | None = None) -> set[str]:
    """Of `leases` (job id -> lease token), the jobs still running under that lease (one read); with renew_seconds,
    their leases are renewed to now + renew_seconds (one guarded UPDATE)."""
    if not leases:
        return set()
    rows = dict(s.execute(select(Job.id, Job.lease_token).where(Job.id.in_(list(leases)), Job.status == R)).all())
    live = {job_id for job_id, token in leases.items() if rows.get(job_id) == token}
    if renew_seconds is not None and live:
        s.execute(update(Job).where(Job.id.in_(live), Job.lease_token.in_([leases[j] for j in live]), Job.status == R)
                  .values(lease_expires_at=utcnow() + timedelta(seconds=renew_seconds)))
    return live


def undispatch(s: Session, job_id: str) -> bool:
    """A queued job a worker may not start now (its tenant is at max_running) goes back to the sweeper, which
    republishes it after TIDEPOOL_REPUBLISH_AFTER."""
    return s.execute(update(Job).where(Job.id == job_id, Job.status == Q).values(dispatched_at=None)).rowcount == 1


def undispatch_all(s: Session) -> int:
    """Every queued job marked dispatched goes back to the sweeper, which republishes it: the broker lost its queues
    (a Redis without persistence restarted; workers/beat.py notices). A message that survived is then a duplicate,
    dropped at claim."""
    return s.execute(update(Job).where(Job.status == Q, Job.dispatched_at.is_not(None))
                     .values(dispatched_at=None)).rowcount


def first_token(s: Session, job_id: str, lease_token: str, at: datetime | None = None) -> bool:
    return s.execute(update(Job).where(Job.id == job_id, Job.status == R, Job.lease_token == lease_token,
                                       Job.first_token_at.is_(None))
                     .values(first_token_at=at or utcnow())).rowcount == 1


def _usage_upsert(insert, prompt_tokens: int, completion_tokens: int):
    return insert.on_conflict_do_update(index_elements=["tenant_id", "period"], set_={
        "requests": Usage.requests + 1, "prompt_tokens": Usage.prompt_tokens + prompt_tokens,
        "completion_tokens": Usage.completion_tokens + completion_tokens})


def _add_usage(s: Session, tenant_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    values = dict(tenant_id=tenant_id, period=period(), requests=1, prompt_tokens=prompt_tokens,
                  completion_tokens=completion_tokens)
    insert = (postgresql if s.get_bind().dialect.name == "postgresql" else sqlite).insert
    s.execute(_usage_upsert(insert(Usage).values(**values), prompt_tokens, completion_tokens))


def complete(s: Session, job_id: str, lease_token: str, *, output: str, output_token_ids: list[int] | None,
             prompt_tokens: int, completion_tokens: int, finish_reason: str, logprobs: list | None = None,
             choices: list | None = None, first_token_at: datetime | None = None,
             finished_at: datetime | None = None) -> bool:
    """running → completed with the result, its tenant's counters and budget settled and its usage added; False (and
    nothing written) if the lease is not current. n > 1: output & co. are the first choice, `choices` the others
    (Job.choices); completion_tokens counts all. first_token_at: when the first token came, unless first_token
    recorded it already. On Postgres all of it is one statement."""
    values = dict(status=JobStatus.completed, finished_at=finished_at or utcnow(), output=output,
                  output_token_ids=output_token_ids, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  finish_reason=finish_reason, logprobs=logprobs, choices=choices, lease_token=None,
                  lease_expires_at=None)
    if first_token_at is not None:
        values["first_token_at"] = func.coalesce(Job.first_token_at, literal(first_token_at, Job.first_token_at.type))
    done = (update(Job).where(Job.id == job_id, Job.status == R, Job.lease_token == lease_token).values(**values)
            .returning(Job.tenant_id, Job.estimated_tokens))
    used = prompt_tokens + completion_tokens
    if s.get_bind().dialect.name == "postgresql":
        done = done.cte("done")
        settled = (update(Tenant).where(Tenant.id == done.c.tenant_id)
                   .values(_counter_values(running=-1, released=done.c.estimated_tokens, used=used))
                   .returning(Tenant.id).cte("settled"))
        billed = _usage_upsert(postgresql.insert(Usage).from_select(
            ["tenant_id", "period", "requests", "prompt_tokens", "completion_tokens"],
            select(done.c.tenant_id, literal(period()), literal(1), literal(prompt_tokens),
                   literal(completion_tokens))), prompt_tokens, completion_tokens).returning(Usage.tenant_id)
        return s.execute(select(func.count()).select_from(done)
                         .add_cte(settled, billed.cte("billed"))).scalar() == 1
    row = s.execute(done).first()
    if row is None:
        return False
    tenant_id, reserved = row
    _counters(s, tenant_id, running=-1, released=reserved, used=used)  # settled
    _add_usage(s, tenant_id, prompt_tokens, completion_tokens)
    return True


def fail(s: Session, job_id: str, lease_token: str, error: dict, *, retry: bool = False) -> bool:
    """running → failed, or back to queued (undispatched, so the sweeper republishes it) when retry."""
    values = dict(lease_token=None, lease_expires_at=None, error=error)
    if retry:
        values.update(status=Q, queued_at=utcnow(), dispatched_at=None, worker=None)
    else:
        values.update(status=JobStatus.failed, finished_at=utcnow())
    row = s.execute(update(Job).where(Job.id == job_id, Job.status == R, Job.lease_token == lease_token)
                    .values(**values).returning(Job.tenant_id, Job.estimated_tokens)).first()
    if row is None:
        return False
    _counters(s, row[0], queued=1 if retry else 0, running=-1, released=0 if retry else row[1])
    return True


def forget_refused(s: Session, job_id: str) -> bool:
    """Delete an online request's job that failed without running (its prompt refused by the engine: the answer is
    a 400, like any other bad input, and leaves no job). fail() has already settled its counters and budget."""
    return s.execute(delete(Job).where(Job.id == job_id, Job.status == JobStatus.failed, Job.batch_id.is_(None),
                                       Job.completion_tokens.is_(None))).rowcount == 1


def release(s: Session, job_id: str, lease_token: str) -> bool:
    """running → queued by a worker shutting down: its message goes back to the broker, so the job stays
    dispatched, and the interrupted attempt is not counted."""
    tenant_id = s.execute(update(Job).where(Job.id == job_id, Job.status == R, Job.lease_token == lease_token)
                          .values(status=Q, lease_token=None, lease_expires_at=None, worker=None,
                                  attempts=Job.attempts - 1, started_at=None, first_token_at=None,
                                  dispatched_at=func.coalesce(Job.dispatched_at, utcnow()))   # (its mark may wait)
                          .returning(Job.tenant_id)).scalar()
    if tenant_id is None:
        return False
    _counters(s, tenant_id, queued=1, running=-1)
    return True


def cancel(s: Session, job_id: str, tenant_id: str | None = None, running: bool = True) -> bool:
    """queued|running (or only queued, running=False) → cancelled; a running job's worker finds its lease gone
    and aborts. A running job keeps its lease token: the worker bills what the attempt computed with it
    (settle_cancelled), once."""
    for status, counter in ((Q, "queued"), (R, "running"))[:2 if running else 1]:
        stmt = update(Job).where(Job.id == job_id, Job.status == status)
        if tenant_id is not None:
            stmt = stmt.where(Job.tenant_id == tenant_id)
        row = s.execute(stmt.values(status=JobStatus.cancelled, finished_at=utcnow(), lease_expires_at=None)
                        .returning(Job.tenant_id, Job.estimated_tokens)).first()
        if row is not None:
            _counters(s, row[0], released=row[1], **{counter: -1})
            return True
    return False


def settle_cancelled(s: Session, job_id: str, lease_token: str, prompt_tokens: int, completion_tokens: int) -> bool:
    """The usage of the attempt that ran a job when it was cancelled: the prompt tokens it processed and the tokens
    it generated are billed (usage and this month's budget) and written on the job. Guarded by the attempt's lease
    token, which it clears: a redelivered result, or a completion that lost the race to the cancel, bills nothing
    more. False when there is nothing to settle."""
    tenant_id = s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.cancelled,
                                            Job.lease_token == lease_token)
                          .values(lease_token=None, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
                          .returning(Job.tenant_id)).scalar()
    if tenant_id is None:
        return False
    if prompt_tokens or completion_tokens:
        _counters(s, tenant_id, used=prompt_tokens + completion_tokens)
        _add_usage(s, tenant_id, prompt_tokens, completion_tokens)
    return True


def expire_overdue(s: Session, now: datetime | None = None, job_id: str | None = None) -> int:
    """queued jobs past their deadline → expired (all of them, or just job_id)."""
    now = now or utcnow()
    stmt = update(Job).where(Job.status == Q, Job.deadline.is_not(None), Job.deadline <= now)
    if job_id is not None:
        stmt = stmt.where(Job.id == job_id)
    rows = s.execute(stmt.values(status=JobStatus.expired, finished_at=now)
                     .returning(Job.tenant_id, Job.estimated_tokens)).all()
    for tenant_id, (n, tokens) in _per_tenant(rows).items():
        _counters(s, tenant_id, queued=-n, released=tokens)
    return len(rows)


def _per_tenant(rows) -> dict[str, tuple[int, int]]:
    """(tenant_id, estimated_tokens) rows -> {tenant_id: (jobs, tokens)}."""
    out: dict[str, tuple[int, int]] = {}
    for tenant_id, tokens in rows:
        n, total = out.get(tenant_id, (0, 0))
        out[tenant_id] = (n + 1, total + (tokens or 0))
    return out


def reclaim_lapsed(s: Session, max_attempts: int = 3, now: datetime | None = None) -> int:
    """running jobs whose lease lapsed (worker died) → queued again, or failed after max_attempts."""
    now = now or utcnow()
    lapsed = s.execute(select(Job.id, Job.tenant_id, Job.attempts, Job.lease_token)
                       .where(Job.status == R, Job.lease_expires_at < now)).all()
    for job_id, _tenant, attempts, token in lapsed:
        fail(s, job_id, token, {"code": "lease_expired", "message": "The worker stopped renewing its lease."},
             retry=attempts < max_attempts)
    return len(lapsed)
