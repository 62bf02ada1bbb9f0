"""jobs partitioned by month (Postgres): range partitions over the job id, which starts with its creation time, one
per month from the oldest job's to a few months ahead, and a DEFAULT partition; Idempotency-Keys unique through
job_idempotency_keys. SQLite keeps one table: nothing changes there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""
from datetime import datetime, timezone

from alembic import op

from tidepool.service.ledger import partitions

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

_INDEXES = ("CREATE INDEX ix_jobs_batch_id ON jobs (batch_id)",
            "CREATE INDEX ix_jobs_tenant_status ON jobs (tenant_id, status)",
            "CREATE INDEX ix_jobs_undispatched ON jobs (status, dispatched_at)")
_FOREIGN_KEYS = (
    "ALTER TABLE jobs ADD CONSTRAINT fk_jobs_tenant_id_tenants FOREIGN KEY (tenant_id) REFERENCES tenants (id) "
    "ON DELETE CASCADE",
    "ALTER TABLE jobs ADD CONSTRAINT fk_jobs_batch_id_batches FOREIGN KEY (batch_id) REFERENCES batches (id) "
    "ON DELETE CASCADE")
_RESPONSES_FK = ("ALTER TABLE responses ADD CONSTRAINT fk_responses_job_id_jobs FOREIGN KEY (job_id) "
                 "REFERENCES jobs (id) ON DELETE CASCADE")


def _set_old_table_aside() -> None:
    op.execute("ALTER TABLE responses DROP CONSTRAINT fk_responses_job_id_jobs")
    op.execute("ALTER TABLE jobs RENAME TO jobs_old")
    op.execute("ALTER TABLE jobs_old RENAME CONSTRAINT pk_jobs TO pk_jobs_old")
    op.execute("DROP INDEX ix_jobs_batch_id, ix_jobs_tenant_status, ix_jobs_undispatched")


def _first_month(oldest: str | None):
    now = partitions.current_month()
    if oldest is None:
        return now
    try:
        first = datetime.fromtimestamp(int(oldest[4:18], 16) / 1e6, timezone.utc)
    except ValueError:
        return now
    return min(now, partitions.current_month(first))


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    oldest = op.get_bind().exec_driver_sql("SELECT min(id) FROM jobs").scalar()
    _set_old_table_aside()
    op.execute("ALTER TABLE jobs_old DROP CONSTRAINT uq_jobs_tenant_idempotency")
    op.execute("CREATE TABLE jobs (LIKE jobs_old INCLUDING DEFAULTS) PARTITION BY RANGE (id)")
    op.execute("ALTER TABLE jobs ADD CONSTRAINT pk_jobs PRIMARY KEY (id)")
    month, last = _first_month(oldest), partitions.next_month(partitions.current_month(), partitions.AHEAD)
    while month <= last:
        op.execute(partitions.create_sql(month))
        month = partitions.next_month(month)
    op.execute(f"CREATE TABLE {partitions.DEFAULT} PARTITION OF jobs DEFAULT")
    op.execute("INSERT INTO jobs SELECT * FROM jobs_old")
    op.execute("DROP TABLE jobs_old")
    for statement in _FOREIGN_KEYS + _INDEXES + (_RESPONSES_FK,):
        op.execute(statement)
    op.execute("CREATE TABLE job_idempotency_keys ("
               "tenant_id VARCHAR(40) NOT NULL, idempotency_key VARCHAR(255) NOT NULL, job_id VARCHAR(40) NOT NULL, "
               "CONSTRAINT pk_job_idempotency_keys PRIMARY KEY (tenant_id, idempotency_key), "
               "CONSTRAINT fk_job_idempotency_keys_tenant_id_tenants FOREIGN KEY (tenant_id) REFERENCES tenants (id) "
               "ON DELETE CASCADE, "
               "CONSTRAINT fk_job_idempotency_keys_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs (id) "
               "ON DELETE CASCADE)")
    op.execute("CREATE INDEX ix_job_idempotency_keys_job_id ON job_idempotency_keys (job_id)")
    op.execute("INSERT INTO job_idempotency_keys (tenant_id, idempotency_key, job_id) "
               "SELECT tenant_id, idempotency_key, id FROM jobs WHERE idempotency_key IS NOT NULL")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TABLE job_idempotency_keys")
    _set_old_table_aside()
    op.execute("CREATE TABLE jobs (LIKE jobs_old INCLUDING DEFAULTS)")
    op.execute("INSERT INTO jobs SELECT * FROM jobs_old")
    op.execute("DROP TABLE jobs_old")     # and its partitions
    op.execute("ALTER TABLE jobs ADD CONSTRAINT pk_jobs PRIMARY KEY (id)")
    op.execute("ALTER TABLE jobs ADD CONSTRAINT uq_jobs_tenant_idempotency UNIQUE (tenant_id, idempotency_key)")
    for statement in _FOREIGN_KEYS + _INDEXES + (_RESPONSES_FK,):
        op.execute(statement)
