"""Admission control: per-minute rate limits and concurrent online requests (Redis or memory), monthly budget, max
queued.

Counting a job against max_queued is one conditional UPDATE of the tenant row that also requires, in the
database, that the tenant is not disabled, that the caller's API key is not revoked and that the live
quotas.max_queued allows it; so a cached authentication (auth.py) can never queue work for a revoked key, a
disabled tenant or past a lowered max_queued. The row lock it takes serializes one tenant's admissions
until commit, which is what makes max_queued hold under concurrency.

Importing it does not import Flask (the sweeper and the batch finaliser import it through service/ledger/batches.py):
what reads the current request (its API key, the app's admission group, the authentication cache) imports Flask
when called, for the API's callers."""
import copy
import json
import logging
import secrets
import threading
import time
from datetime import datetime, timezone

from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from sqlalchemy import case, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..protocol.errors import APIError
from .jobs import period
from .counters import quota_rejected
from .models import ApiKey, Job, Quota, Tenant

WINDOW = 60
log = logging.getLogger(__name__)

_LUA = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if rpm >= 0 and r + 1 > rpm then return 1 end
if tpm >= 0 and t + n > tpm then return 2 end
redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('INCRBY', KEYS[2], n); redis.call('EXPIRE', KEYS[2], ARGV[4])
return 0
"""
_REASONS = {1: ("requests_per_minute", "requests per minute"), 2: ("tokens_per_minute", "tokens per minute")}


class RedisLimiter:
    """Fixed one-minute windows; the check and both increments are one Lua call, so it is atomic.

    While Redis is unreachable the limits fail open within a bound: each web process counts the same windows
    in memory, so a tenant gets at most (web processes) x its limit during an outage, and nobody gets a 5xx."""

    def __init__(self, client):
        self.client = client
        self.script = client.register_script(_LUA)
        self.fallback = MemoryLimiter()

    def hit(self, tenant_id: str, rpm: int | None, tpm: int | None, tokens: int, now: float) -> int:
        window = int(now // WINDOW)
        keys = [f"tp:rl:{{{tenant_id}}}:req:{window}", f"tp:rl:{{{tenant_id}}}:tok:{window}"]
        try:
            return int(self.script(keys=keys, args=[-1 if rpm is None else rpm, -1 if tpm is None else tpm,
                                                    tokens, WINDOW * 2]))
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("rate limits counted in this process: Redis is unreachable (%s)", exc)
            return self.fallback.hit(tenant_id, rpm, tpm, tokens, now)


class MemoryLimiter:
    """The same fixed windows for the embedded mode (one process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, int], list[int]] = {}

    def hit(self, tenant_id: str, rpm: int | None, tpm: int | None, tokens: int, now: float) -> int:
        window = int(now // WINDOW)
        with self.lock:
            if len(self.counts) > 10_000:
                self.counts = {k: v for k, v in self.counts.items() if k[1] >= window - 1}
            c = self.counts.setdefault((tenant_id, window), [0, 0])
            if rpm is not None and c[0] + 1 > rpm:
                return 1
            if tpm is not None and c[1] + tokens > tpm:
                return 2
            c[0] += 1
            c[1] += tokens
            return 0


# ---- concurrent online requests -------------------------------------------------------------------------
# Each online request in progress (waiting for its job, or streaming it) holds one of its tenant's
# quotas.max_concurrent_requests slots. A slot is a lease of LEASE_SECONDS, renewed while its request runs, so the
# slots of a web process that dies are free again within LEASE_SECONDS.
LEASE_SECONDS = 60.0

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""
_RENEW = """
if redis.call('ZADD', KEYS[1], 'XX', 'CH', ARGV[1], ARGV[2]) == 1 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""


class MemorySlots:
    """Leased slots per tenant in this process (the embedded mode; and each web process while Redis is down)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: dict[str, dict[str, float]] = {}    # tenant -> {slot id: lease end}

    def acquire(self, tenant_id: str, limit: int, now: float) -> str | None:
        with self.lock:
            leases = self.held.setdefault(tenant_id, {})
            for slot in [s for s, end in leases.items() if end <= now]:
                del leases[slot]
            if len(leases) >= limit:
                return None
            slot = secrets.token_hex(8)
            leases[slot] = now + LEASE_SECONDS
            return slot

    def renew(self, tenant_id: str, slot: str, now: float) -> None:
        with self.lock:
            if slot in self.held.get(tenant_id, {}):
                self.held[tenant_id][slot] = now + LEASE_SECONDS

    def release(self, tenant_id: str, slot: str) -> None:
        with self.lock:
            leases = self.held.get(tenant_id, {})
            leases.pop(slot, None)
            if not leases:
                self.held.pop(tenant_id, None)

    def active(self, tenant_id: str, now: float) -> int:
        with self.lock:
            return sum(end > now for end in self.held.get(tenant_id, {}).values())


class RedisSlots:
    """The same leases shared by every web process: a sorted set per tenant (slot id scored by its lease end),
    checked and added to in one Lua call. While Redis is unreachable each process counts in memory, so a tenant
    holds at most (web processes) x its limit meanwhile, and nobody gets a 5xx."""

    def __init__(self, client):
        self.client = client
        self.acquire_script = client.register_script(_ACQUIRE)
        self.renew_script = client.register_script(_RENEW)
        self.fallback = MemorySlots()

    @staticmethod
    def _key(tenant_id: str) -> str:
        return f"tp:slots:{{{tenant_id}}}"

    def acquire(self, tenant_id: str, limit: int, now: float) -> str | None:
        slot = secrets.token_hex(8)
        try:
            ok = self.acquire_script(keys=[self._key(tenant_id)],
                                     args=[now, limit, now + LEASE_SECONDS, slot, int(LEASE_SECONDS) * 2])
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("concurrent requests counted in this process: Redis is unreachable (%s)", exc)
            local = self.fallback.acquire(tenant_id, limit, now)
            return None if local is None else "mem:" + local
        return slot if int(ok) else None

    def renew(self, tenant_id: str, slot: str, now: float) -> None:
        if slot.startswith("mem:"):
            return self.fallback.renew(tenant_id, slot[4:], now)
        try:
            self.renew_script(keys=[self._key(tenant_id)], args=[now + LEASE_SECONDS, slot, int(LEASE_SECONDS) * 2])
        except (RedisConnectionError, RedisTimeoutError):
            pass     # the lease may lapse: the slot is then counted free a little early

    def release(self, tenant_id: str, slot: str) -> None:
        if slot.startswith("mem:"):
            return self.fallback.release(tenant_id, slot[4:])
        try:
            self.client.zrem(self._key(tenant_id), slot)
        except (RedisConnectionError, RedisTimeoutError):
            pass     # its lease lapses within LEASE_SECONDS

    def active(self, tenant_id: str, now: float) -> int:
        return int(self.client.zcount(self._key(tenant_id), f"({now}", "+inf")) + self.fallback.active(tenant_id, now)


class Slot:
    """One online request's hold on a concurrency slot: renewed (at most every third of its lease) while the request
    runs, released once, on whichever exit path comes first."""

    def __init__(self, slots, tenant_id: str, slot_id: str, now: float):
        self.slots, self.tenant_id, self.id = slots, tenant_id, slot_id
        self.renewed, self.released = now, False
        self.lock = threading.Lock()

    def renew(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not self.released and now - self.renewed > LEASE_SECONDS / 3:
            self.renewed = now
            self.slots.renew(self.tenant_id, self.id, now)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
        self.slots.release(self.tenant_id, self.id)


def hold_slot(slots, quota: Quota, now: float | None = None) -> Slot | None:
    """A slot for one more online request of the quota's tenant; None when it has no limit; 429 (with Retry-After)
    when it already has max_concurrent_requests in progress."""
    limit = quota.max_concurrent_requests
    if limit is None:
        return None
    now = time.time() if now is None else now
    slot_id = slots.acquire(quota.tenant_id, limit, now)
    if slot_id is None:
        quota_rejected(quota.tenant_id, "max_concurrent_requests")
        raise APIError(429, f"Too many concurrent requests: this tenant may have at most {limit} online requests in "
                            "progress at once; retry when one has finished.", "max_concurrent_requests",
                       retry_after=1)
    return Slot(slots, quota.tenant_id, slot_id, now)


def check_rate(limiter, quota: Quota, tokens: int, now: float | None = None) -> None:
    if quota.requests_per_minute is None and quota.tokens_per_minute is None:
        return
    if quota.tokens_per_minute is not None and tokens > quota.tokens_per_minute:
        quota_rejected(quota.tenant_id, "request_too_large")
        raise APIError(400, f"This request needs {tokens} tokens (prompt + max_tokens), more than the "
                            f"{quota.tokens_per_minute} tokens per minute this tenant is allowed.",
                       "request_too_large", "max_tokens")
    now = time.time() if now is None else now
    verdict = limiter.hit(quota.tenant_id, quota.requests_per_minute, quota.tokens_per_minute, tokens, now)
    if verdict:
        code, what = _REASONS[verdict]
        quota_rejected(quota.tenant_id, code)
        raise APIError(429, f"Rate limit reached for {what}; retry after the window resets.", code,
                       retry_after=WINDOW - int(now) % WINDOW)


def _seconds_to_next_month(now: datetime) -> int:
    nxt = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=timezone.utc)
    return int((nxt - now).total_seconds()) + 1


def _used():
    """Tokens the tenant row says were used this month (its budget counters, moved with each completion)."""
    return case((Tenant.budget_period == period(), Tenant.budget_used), else_=0)


def _budget_refusal(tenant_id: str, budget: int, used: int, reserved: int, tokens: int) -> APIError:
    now = datetime.now(timezone.utc)
    quota_rejected(tenant_id, "insufficient_quota")
    return APIError(429, f"Monthly token budget exhausted: {used} of {budget} tokens used and {reserved} reserved "
                         f"by unfinished jobs; this request needs up to {tokens}.", "insufficient_quota",
                    retry_after=_seconds_to_next_month(now))


# The admission rule, the one statement every admission runs (POST /v1/jobs and the online routes, batches; Postgres
# and SQLite): the tenant row takes n more queued jobs and their reserved tokens only if the tenant is enabled, the
# key (when one is named) is live, max_queued holds with n more, and the monthly budget holds with this month's usage
# plus every unfinished job's reservation plus these tokens. No row updated: refused() says why.
ADMIT = """
UPDATE tenants SET queued_count = tenants.queued_count + :n, budget_reserved = tenants.budget_reserved + :tokens
FROM quotas
WHERE tenants.id = :tenant_id AND quotas.tenant_id = tenants.id
  AND tenants.disabled IS NOT TRUE
  AND (quotas.max_queued IS NULL OR tenants.queued_count + :n <= quotas.max_queued)
  AND (quotas.monthly_token_budget IS NULL OR tenants.budget_reserved + :tokens
       + CASE WHEN tenants.budget_period = :period THEN tenants.budget_used ELSE 0 END
       <= quotas.monthly_token_budget)
  AND (CAST(:key_id AS INTEGER) IS NULL OR EXISTS (
      SELECT 1 FROM api_keys WHERE api_keys.id = CAST(:key_id AS INTEGER)
         AND api_keys.tenant_id = tenants.id AND api_keys.revoked_at IS NULL))"""


def _admission(tenant_id: str, n: int, key_id: int | None, tokens: int) -> dict:
    return {"tenant_id": tenant_id, "n": n, "key_id": key_id, "tokens": tokens, "period": period()}


def reserve_queued(s: Session, quota: Quota, n: int, key_id: int | None = None, tokens: int = 0) -> None:
    """Count n more queued jobs against max_queued, and reserve their tokens (prompt estimate + max_tokens)
    against the monthly budget, in one conditional UPDATE (row-locked until commit). The reservation is settled
    to the actual usage when a job completes and released when it fails, is cancelled or expires (jobs.py).
    key_id, when given, must still be unrevoked."""
    if s.execute(text(ADMIT), _admission(quota.tenant_id, n, key_id, tokens)).rowcount != 1:
        refused(s, quota.tenant_id, n, key_id, tokens)


def refused(s: Session | Connection, tenant_id: str, n: int, key_id: int | None, tokens: int = 0) -> None:
    """Why the admission UPDATE matched no row, as the error the client gets: a revoked key (401) or a
    disabled tenant (403), found by the database rather than the cached authentication (service/error_responses.py
    drops it); otherwise max_queued (429)."""
    row = s.execute(select(Tenant.disabled, Quota.max_queued, Quota.monthly_token_budget, Tenant.budget_reserved,
                           _used())
                    .join(Quota, Quota.tenant_id == Tenant.id).where(Tenant.id == tenant_id)).first()
    live_key = key_id is None or s.scalar(select(ApiKey.id).where(
        ApiKey.id == key_id, ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))) is not None
    if row is None or not live_key or row[0]:      # the API drops its cached authentication on these codes
        if row is None or not live_key:
            raise APIError(401, "Incorrect API key provided.", "invalid_api_key")
        raise APIError(403, "This tenant is disabled.", "tenant_disabled")
    budget, reserved, used = row[2], row[3], row[4]
    if budget is not None and used + reserved + tokens > budget:
        raise _budget_refusal(tenant_id, budget, used, reserved, tokens)
    quota_rejected(tenant_id, "max_queued")
    raise APIError(429, f"Too many queued jobs: this tenant may have at most {row[1]} "
                        f"queued and this request adds {n}.", "max_queued", retry_after=1)


# The columns an admitted job is inserted with (the rest take their defaults), listed once for both statements.
JOB_COLUMNS = ("id", "tenant_id", "sla_class", "model", "status", "endpoint", "request", "metadata", "hidden",
               "idempotency_key", "request_hash", "estimated_tokens", "deadline", "attempts", "created_at", "queued_at")


def _job_values(job) -> dict:
    """A transient Job's values for JOB_COLUMNS (attempts 0: it has not run; hidden unless set)."""
    return {c: 0 if c == "attempts" else bool(job.hidden) if c == "hidden" else
            getattr(job, "metadata_" if c == "metadata" else c) for c in JOB_COLUMNS}


def _recordset_types() -> str:
    """json_to_recordset's column list for JOB_COLUMNS, in the jobs table's own Postgres types."""
    from sqlalchemy.dialects import postgresql
    dialect = postgresql.dialect()
    return ", ".join(f"{c} {Job.__table__.c[c].type.compile(dialect=dialect)}" for c in JOB_COLUMNS)


# POST /v1/jobs on Postgres: one statement counts n jobs of one tenant, submitted with one key, against the
# admission rule (all or none) and inserts them, run in autocommit mode: it returns only once the rows are durably
# committed. It returns each row's id and xmin (the inserting transaction's id: a partitioned table cannot return
# xmin itself); the dispatcher marks a job dispatched only if its row still has that xmin (nobody touched it since)
# or has left the queued state. Jobs with an Idempotency-Key also get their job_idempotency_keys row in the same
# statement (its primary key refuses a second job under the key, whatever month partition holds the first).
_ADMIT_PG: dict[bool, str] = {}


def _admit_pg_statement(keyed: bool) -> str:
    if keyed not in _ADMIT_PG:
        columns = ", ".join(JOB_COLUMNS)
        picked = ", ".join("admitted.id" if c == "tenant_id" else "coalesce(r.metadata, CAST('null' AS json))"
                           if c == "metadata" else f"r.{c}" for c in JOB_COLUMNS)     # metadata None: JSON null
        insert = (f"INSERT INTO jobs ({columns})\nSELECT {picked}\n"
                  f"FROM admitted, json_to_recordset(CAST(:rows AS json)) AS r({_recordset_types()})\n")
        xmin = "CAST(CAST(pg_current_xact_id() AS xid) AS text)"
        if keyed:
            _ADMIT_PG[keyed] = (
                f"WITH admitted AS ({ADMIT}\n    RETURNING tenants.id),\n"
                f"inserted AS ({insert}RETURNING jobs.id, jobs.tenant_id, jobs.idempotency_key),\n"
                "keyed AS (INSERT INTO job_idempotency_keys (tenant_id, idempotency_key, job_id)\n"
                "SELECT tenant_id, idempotency_key, id FROM inserted WHERE idempotency_key IS NOT NULL)\n"
                f"SELECT id, {xmin} FROM inserted")
        else:
            _ADMIT_PG[keyed] = f"WITH admitted AS ({ADMIT}\n    RETURNING tenants.id)\n{insert}RETURNING jobs.id, {xmin}"
    return _ADMIT_PG[keyed]


def _iso(value):
    return None if value is None else value.isoformat()


def _params(jobs: list, key_id: int | None) -> dict:
    """The jobs as one JSON array (one parameter, parsed by Postgres, instead of a dozen arrays). The json
    columns keep the text json.dumps gives them, as the ORM writes them; a None metadata is stored as JSON
    null, as the ORM does."""
    rows = []
    for j in jobs:
        row = _job_values(j)
        row.update(sla_class=j.sla_class.value, status=j.status.value, deadline=_iso(j.deadline),
                   created_at=_iso(j.created_at), queued_at=_iso(j.queued_at))
        rows.append(row)
    return {**_admission(jobs[0].tenant_id, len(jobs), key_id, sum(j.estimated_tokens for j in jobs)),
            "rows": json.dumps(rows)}


def admit_pg(conn: Connection, jobs: list, key_id: int | None) -> dict[str, str] | None:
    """Insert queued jobs (transient Job instances, one tenant) and count them against max_queued in one
    autocommit statement: {job id: xmin} for all of them, or None when refused (nothing written)."""
    keyed = any(j.idempotency_key is not None for j in jobs)
    rows = conn.execute(text(_admit_pg_statement(keyed)), _params(jobs, key_id)).all()
    return dict(rows) if rows else None


def admit_one(conn: Connection, job, key_id: int | None = None) -> str | None:
    """Insert one queued Job (a transient instance with every column of the INSERT set) and count it
    against max_queued, in conn (autocommit on Postgres, see db.autocommit): the row's xmin on Postgres,
    None elsewhere. Raises the client's error when refused, IntegrityError on a duplicate Idempotency-Key."""
    if conn.dialect.name == "postgresql":
        admitted = admit_pg(conn, [job], key_id)
        if admitted is None:
            refused(conn, job.tenant_id, 1, key_id, job.estimated_tokens)
        return admitted[job.id]
    if conn.execute(text(ADMIT), _admission(job.tenant_id, 1, key_id, job.estimated_tokens)).rowcount != 1:
        refused(conn, job.tenant_id, 1, key_id, job.estimated_tokens)
    conn.execute(Job.__table__.insert().values(**_job_values(job)))
    return None


def _copy(exc: BaseException) -> BaseException:
    try:
        return copy.copy(exc)
    except Exception:
        return exc


class _Ticket:
    __slots__ = ("job", "event", "lead", "xmin", "error")

    def __init__(self, job):
        self.job, self.event, self.lead, self.xmin, self.error = job, threading.Event(), False, None, None


class _Lane:
    __slots__ = ("pending", "busy")

    def __init__(self):
        self.pending: list[_Ticket] = []
        self.busy = False


class GroupAdmission:
    """Group commit of POST /v1/jobs admissions within one process (Postgres).

    Every admission of a tenant takes that tenant's row lock until its commit is flushed, so one tenant's
    jobs are committed one after another, each waiting for its own WAL flush. Here the concurrent submissions
    of one (tenant, key) lane share a statement instead: the first thread in the lane (the leader) admits its
    job; jobs arriving meanwhile queue, and when it is done the oldest waiter leads the next statement with all
    of them. Each caller still returns only after the statement holding its job committed, and gets its own
    outcome: a statement that is refused (max_queued, or a revoked key / disabled tenant) or fails on a
    constraint is retried job by job, so max_queued is applied per job, in arrival order, exactly as alone."""

    def __init__(self, max_batch: int = 64):
        self.max_batch = max_batch
        self.lock = threading.Lock()
        self.lanes: dict[tuple, _Lane] = {}
        self.batches = self.admitted = 0  # leader turns and jobs they carried (for tests and tuning)

    def admit(self, job, key_id: int | None, connect) -> str:
        """Admit job; returns its xmin. connect() gives an autocommit connection (context manager)."""
        lane_key = (job.tenant_id, key_id)
        me = _Ticket(job)
        with self.lock:
            lane = self.lanes.get(lane_key)
            if lane is None:
                lane = self.lanes[lane_key] = _Lane()
            lane.pending.append(me)
            me.lead = not lane.busy
            lane.busy = True
        if not me.lead:
            me.event.wait()
        if me.lead:
            with self.lock:
                batch, lane.pending = lane.pending[:self.max_batch], lane.pending[self.max_batch:]
                self.batches += 1
                self.admitted += len(batch)
            try:
                self._run(batch, key_id, connect)
            finally:
                with self.lock:
                    if lane.pending:
                        lane.pending[0].lead = True
                        lane.pending[0].event.set()
                    else:
                        lane.busy = False
                        if self.lanes.get(lane_key) is lane:
                            del self.lanes[lane_key]
                for t in batch:
                    if t is not me:
                        t.event.set()
        if me.error is not None:
            raise me.error
        return me.xmin

    @staticmethod
    def _run(batch: list[_Ticket], key_id: int | None, connect) -> None:
        try:
            with connect() as conn:
                admitted = None
                if len(batch) > 1:
                    try:
                        admitted = admit_pg(conn, [t.job for t in batch], key_id)
                    except IntegrityError:  # e.g. a duplicate Idempotency-Key: find out whose, one by one
                        admitted = None
                if admitted is not None:
                    for t in batch:
                        t.xmin = admitted[t.job.id]
                    return
                for t in batch:  # alone, or the group was refused: each job on its own, in arrival order
                    try:
                        t.xmin = admit_one(conn, t.job, key_id)
                    except Exception as exc:
                        t.error = exc
        except BaseException as exc:
            for i, t in enumerate(batch):
                if t.xmin is None and t.error is None:
                    t.error = exc if i == 0 else _copy(exc)  # each thread raises its own instance
            if not isinstance(exc, Exception):
                raise


def check_class(quota: Quota, sla_class: str) -> None:
    if sla_class not in (quota.allowed_sla_classes or []):
        quota_rejected(quota.tenant_id, "sla_class_not_allowed")
        raise APIError(403, f"SLA class '{sla_class}' is not allowed for this tenant.",
                       "sla_class_not_allowed", "sla_class")
