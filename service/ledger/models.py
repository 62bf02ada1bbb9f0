"""Ledger schema: SQLAlchemy models shared by the API, the workers and the migrations; `audit` writes the audit log."""
import enum
import secrets
import time
from datetime import datetime, timezone

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer,
                        MetaData, String, Text, TypeDecorator, UniqueConstraint, false)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

# the ledger's import point of the SLA classes
from ..protocol.sla_classes import OFFLINE_CLASSES, ONLINE_CLASSES, SLA_CLASSES, SlaClass  # noqa: F401

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class JobStatus(str, enum.Enum):
    queued = "queued"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


TERMINAL = (JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.expired)


class BatchStatus(str, enum.Enum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    """Time-ordered id: sorting by id sorts by creation, which makes id a pagination cursor."""
    return f"{prefix}{time.time_ns() // 1000:014x}{secrets.token_hex(6)}"


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def _enum(cls, name):
    return Enum(cls, name=name, values_callable=lambda e: [m.value for m in e], validate_strings=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten_"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # Class of this tenant's online requests (/v1/completions, /v1/chat/completions) that name none.
    default_sla_class: Mapped[str | None] = mapped_column(String(16))
    # Prefix-cache namespace: a tenant's cached prompt blocks serve only its own requests, unless an admin
    # puts tenants in one group (e.g. one organisation's system prompt). See cache_namespace().
    prefix_cache_group: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Admission counters, changed only in the same transaction as the job transitions that move them.
    queued_count: Mapped[int] = mapped_column(Integer, default=0)
    running_count: Mapped[int] = mapped_column(Integer, default=0)
    # The monthly budget's admission counters: tokens (prompt estimate + max_tokens) reserved by jobs not yet
    # finished, and tokens used in budget_period (as in the usage roll-up), kept on this row so that admission
    # checks the budget on the row it locks.
    budget_reserved: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    budget_used: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    budget_period: Mapped[str | None] = mapped_column(String(7))


def cache_namespace(tenant_id: str, prefix_cache_group: str | None) -> str:
    """The engine's prefix-cache namespace for a tenant's jobs: decided here, never by the client."""
    return f"group:{prefix_cache_group}" if prefix_cache_group else f"tenant:{tenant_id}"


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


# Limits every new tenant starts with (an admin may raise them, or set NULL: unlimited). Online requests a tenant may
# have in progress at once: half of a web process's request threads (gunicorn --threads and `tidepool serve
# --threads` default to 32), so one tenant cannot hold them all; files and bytes a tenant may keep in storage.
DEFAULT_MAX_CONCURRENT_REQUESTS = 16
DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_STORAGE_BYTES = 10 << 30


class Quota(Base):
    """Per-tenant limits; NULL means unlimited."""
    __tablename__ = "quotas"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_running: Mapped[int | None] = mapped_column(Integer)
    max_queued: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    allowed_sla_classes: Mapped[list] = mapped_column(JSON, default=lambda: [c.value for c in SlaClass])
    max_tokens_per_request: Mapped[int | None] = mapped_column(Integer)
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(
        Integer, default=DEFAULT_MAX_CONCURRENT_REQUESTS, server_default=str(DEFAULT_MAX_CONCURRENT_REQUESTS))
    max_files: Mapped[int | None] = mapped_column(Integer, default=DEFAULT_MAX_FILES,
                                                  server_default=str(DEFAULT_MAX_FILES))
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger, default=DEFAULT_MAX_STORAGE_BYTES,
                                                          server_default=str(DEFAULT_MAX_STORAGE_BYTES))
    # Registered models this tenant may use; NULL or [] means every enabled model (service/ledger/registry.py).
    allowed_models: Mapped[list | None] = mapped_column(JSON)


class ModelTier(str, enum.Enum):
    """How a worker keeps a model: hot stays loaded, warm loads on demand, cold only when an admin warms it."""
    hot = "hot"
    warm = "warm"
    cold = "cold"


class Model(Base):
    """The model registry: what the service serves, under which name, from which folder (service/ledger/registry.py)."""
    __tablename__ = "models"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    source: Mapped[str] = mapped_column(String(1024))
    tier: Mapped[str] = mapped_column(String(8), default=ModelTier.warm.value)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # The ranks its engines shard it over; NULL: the deployment's (TIDEPOOL_TENSOR_PARALLEL_SIZE or the flag).
    tensor_parallel_size: Mapped[int | None] = mapped_column(Integer)
    # Its KV cache element type (auto, fp8_e4m3, fp8_e5m2, int8); NULL: the deployment's (TIDEPOOL_KV_CACHE_DTYPE).
    kv_cache_dtype: Mapped[str | None] = mapped_column(String(16))
    # `tidepool models calibrate-kv`'s record: per-(layer, KV head) scales and each dtype's measured accuracy.
    kv_cache_calibration: Mapped[dict | None] = mapped_column(JSON, deferred=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Adapter(Base):
    """A LoRA adapter over a registered model: a PEFT folder, owned by one tenant or shared (tenant_id NULL; a
    tenant's allow-list then lists it), checked against its base at registration (service/ledger/adapters.py)."""
    __tablename__ = "adapters"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(128))
    source: Mapped[str] = mapped_column(String(1024))
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list] = mapped_column(JSON)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file-"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # An upload's `expires_after`: beat deletes the file (row and bytes) once it is past (service/ledger/files.py).
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)


class Batch(Base):
    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    sla_class: Mapped[SlaClass] = mapped_column(_enum(SlaClass, "sla_class"))
    status: Mapped[BatchStatus] = mapped_column(_enum(BatchStatus, "batch_status"), index=True)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    errors: Mapped[list | None] = mapped_column(JSON)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Job(Base):
    """On Postgres partitioned by month over its id (service/ledger/partitions.py), where an Idempotency-Key is
    unique through JobIdempotencyKey; on SQLite one table with the unique constraint below."""
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency", info={"dialect": "sqlite"}),
        Index("ix_jobs_tenant_status", "tenant_id", "status"),
        Index("ix_jobs_undispatched", "status", "dispatched_at"),
        {"postgresql_partition_by": "RANGE (id)"},
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    custom_id: Mapped[str | None] = mapped_column(String(512))
    sla_class: Mapped[SlaClass] = mapped_column(_enum(SlaClass, "sla_class"))
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus, "job_status"), default=JobStatus.queued)
    # The registry name of the model that runs it (its queue: service/ledger/dispatch.py queue_name); NULL on rows
    # older than the registry, which ran on the deployment's one model.
    model: Mapped[str | None] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(64))
    request: Mapped[dict] = mapped_column(JSON)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON)
    # Not readable through /v1/jobs: the job of a Responses request with `store: false`, or of a deleted response.
    hidden: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    estimated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    worker: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    output: Mapped[str | None] = mapped_column(Text)
    output_token_ids: Mapped[list | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[dict | None] = mapped_column(JSON)
    # Per generated token when the request asked for logprobs (entries as in service/protocol/logprobs.py);
    # deferred, so listings never load it: undefer(Job.logprobs) where a response needs it.
    logprobs: Mapped[list | None] = mapped_column(JSON, deferred=True)
    # n > 1: the choices after the first, in order, each {"text", "token_ids", "finish_reason", "logprobs"}
    # (the first is output, output_token_ids, finish_reason and logprobs above); NULL for one choice.
    # Deferred like logprobs: undefer(Job.choices) where a response needs it (protocol/openai_completions.py).
    choices: Mapped[list | None] = mapped_column(JSON, deferred=True)


class JobIdempotencyKey(Base):
    """Postgres: the job a tenant submitted with an Idempotency-Key, inserted by the statement that inserts the job
    (quotas.admit_pg), so a retry finds it whatever month partition holds the job."""
    __tablename__ = "job_idempotency_keys"
    __table_args__ = {"info": {"dialect": "postgresql"}}
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)


class StoredResponse(Base):
    """A stored OpenAI Responses API response (`store`, the default): the job that produced it, its own input items
    and the parameters it echoes; a later request names it as `previous_response_id`
    (service/protocol/openai_responses.py)."""
    __tablename__ = "responses"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(40))
    background: Mapped[bool] = mapped_column(Boolean, default=False)
    params: Mapped[dict] = mapped_column(JSON)           # the request's parameters other than input
    input_items: Mapped[list] = mapped_column(JSON)      # this request's input, as items with ids
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Usage(Base):
    """Tokens consumed per tenant per calendar month (UTC), added when a job finishes."""
    __tablename__ = "usage"
    __table_args__ = (UniqueConstraint("tenant_id", "period", name="uq_usage_tenant_period"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    period: Mapped[str] = mapped_column(String(7))  # "YYYY-MM"
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class AdminSession(Base):
    """A signed-in admin panel session: the session cookie names it (by a random id, stored hashed) and every panel
    request checks it is here, so signing out (which deletes it) ends it for every copy of the cookie."""
    __tablename__ = "admin_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)    # sha256 of the id in the cookie
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AuditLog(Base):
    """The audit log: who changed what in the ledger's administration (tenants, quotas, keys, models)."""
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(64))
    details: Mapped[dict | None] = mapped_column(JSON)


def audit(s: Session, actor: str, action: str, target: str | None, details: dict | None = None) -> None:
    s.add(AuditLog(actor=actor, action=action, target=target, details=details, at=utcnow()))
