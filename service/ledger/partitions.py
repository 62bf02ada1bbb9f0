"""The jobs table by month. On Postgres `jobs` is range-partitioned on its id: a job id starts with its creation time
(models.new_id: `job_` and 14 hex digits of microseconds since the epoch), so the ids of one calendar month (UTC)
form one range, and every statement that names a job by id (the claim, the lease, the completion) reaches one
partition without naming anything else; the primary key stays `id`, and the foreign keys to it keep working. Monthly
partitions are created ahead (the migration, then beat) and a DEFAULT partition takes anything outside them, so an
insert never fails. An Idempotency-Key is unique per tenant through job_idempotency_keys, whatever the month.
`tidepool db prune --before MONTH` drops finished months (on SQLite, where jobs stays one table, it deletes their
rows). Usage lives in the usage table, written when a job finishes, so pruning jobs never loses billed tokens."""
import logging
import re
from dataclasses import dataclass
from datetime import date, datetime, timezone

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

AHEAD = 3   # months created after the current one
DEFAULT = "jobs_default"
_NAME = re.compile(r"^jobs_(\d{4})_(\d{2})$")
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_FINAL_BATCHES = ("completed", "failed", "expired", "cancelled")


def parse_month(value: str) -> date:
    """"YYYY-MM" as the first day of that month; ValueError otherwise."""
    m = _MONTH.match(value or "")
    if not m or not 1 <= int(m[2]) <= 12:
        raise ValueError(f"a month is written YYYY-MM, got {value!r}")
    return date(int(m[1]), int(m[2]), 1)


def next_month(month: date, n: int = 1) -> date:
    i = month.year * 12 + month.month - 1 + n
    return date(i // 12, i % 12 + 1, 1)


def current_month(now: datetime | None = None) -> date:
    now = now or datetime.now(timezone.utc)
    return date(now.year, now.month, 1)


def bound(month: date) -> str:
    """The smallest job id created in `month` (UTC), as models.new_id writes ids."""
    start = datetime(month.year, month.month, 1, tzinfo=timezone.utc)
    micros = int(start.timestamp()) * 1_000_000
    return f"job_{micros:014x}"


def name(month: date) -> str:
    return f"jobs_{month.year:04d}_{month.month:02d}"


def is_partition(table: str) -> bool:
    return table == DEFAULT or _NAME.match(table) is not None


def _range(month: date) -> str:
    return f"FOR VALUES FROM ('{bound(month)}') TO ('{bound(next_month(month))}')"


def create_sql(month: date) -> str:
    return f"CREATE TABLE {name(month)} PARTITION OF jobs {_range(month)}"


def attach_sql(month: date) -> list[str]:
    """A month's partition for a live table: created apart, then attached, which (unlike CREATE TABLE ...
    PARTITION OF) does not lock the jobs table against inserts and updates while it waits for its lock."""
    return [f"CREATE TABLE {name(month)} (LIKE jobs INCLUDING DEFAULTS)",
            f"ALTER TABLE jobs ATTACH PARTITION {name(month)} {_range(month)}"]


def partitioned(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql" and conn.execute(text(
        "SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass('jobs')")).first() is not None


def months(conn: Connection) -> list[date]:
    """The monthly partitions that exist, oldest first."""
    rows = conn.execute(text("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                             "WHERE i.inhparent = to_regclass('jobs')")).scalars()
    found = [_NAME.match(r) for r in rows]
    return sorted(date(int(m[1]), int(m[2]), 1) for m in found if m)


def ensure_ahead(engine: Engine, now: datetime | None = None, ahead: int = AHEAD) -> list[str]:
    """Create the current month's partition and the next `ahead` ones where missing (Postgres with a partitioned
    jobs table; a no-op elsewhere). Returns the partitions created. Beat calls it on every sweep: a check of the
    catalog, and a CREATE once a month."""
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect() as conn:
        if not partitioned(conn):
            return []
        have = set(months(conn))
    wanted = [next_month(current_month(now), i) for i in range(ahead + 1)]
    created = []
    for month in wanted:
        if month in have:
            continue
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            for statement in attach_sql(month):
                conn.execute(text(statement))
        created.append(name(month))
        log.info("created partition %s", name(month))
    return created


class Refused(Exception):
    """`tidepool db prune` cannot drop what was asked: the message says why."""


@dataclass
class Pruned:
    months: list[str]      # "YYYY-MM" of every month dropped (Postgres) or emptied (SQLite)
    jobs: int              # job rows removed


def _blockers(conn: Connection, lo: str, hi: str) -> list[str]:
    """Why the jobs with ids in [lo, hi) cannot go yet: live jobs, or batches whose files are not written."""
    why = []
    live = conn.execute(text("SELECT count(*) FROM jobs WHERE id >= :lo AND id < :hi "
                             "AND status IN ('queued', 'running')"), {"lo": lo, "hi": hi}).scalar()
    if live:
        why.append(f"{live} queued or running jobs")
    open_batches = conn.execute(text(
        "SELECT count(DISTINCT b.id) FROM jobs j JOIN batches b ON b.id = j.batch_id "
        "WHERE j.id >= :lo AND j.id < :hi AND CAST(b.status AS VARCHAR(16)) NOT IN :final"
    ).bindparams(bindparam("final", expanding=True)), {"lo": lo, "hi": hi, "final": _FINAL_BATCHES}).scalar()
    if open_batches:
        why.append(f"jobs of {open_batches} batches not yet finalised (their output files are not written)")
    return why


def _label(month: date) -> str:
    return f"{month.year:04d}-{month.month:02d}"


def prune(engine: Engine, before: date, now: datetime | None = None) -> Pruned:
    """Drop the jobs of every month strictly before `before`, all finished: on Postgres each such partition is
    detached and dropped, on SQLite the rows are deleted. Usage is kept (the usage table), and so are files and
    batches; stored responses and Idempotency-Keys of those jobs go with them. Raises Refused, dropping nothing,
    when `before` is past the current month or a month still has live jobs or unfinalised batches."""
    if before > current_month(now):
        raise Refused(f"--before {_label(before)} would prune the current month; the latest allowed is "
                      f"{_label(current_month(now))}")
    with engine.connect() as conn:
        on_partitions = partitioned(conn)
        if on_partitions:
            candidates = [m for m in months(conn) if m < before]
        else:
            oldest = conn.execute(text("SELECT min(id) FROM jobs WHERE id < :hi"), {"hi": bound(before)}).scalar()
            candidates = [] if oldest is None else _months_between(oldest, before)
        refusals = []
        for month in candidates:
            why = _blockers(conn, bound(month), bound(next_month(month)))
            if why:
                refusals.append(f"{_label(month)} still has {' and '.join(why)}")
    if refusals:
        raise Refused("nothing pruned: " + "; ".join(refusals))
    removed = 0
    for month in candidates:
        span = {"lo": bound(month), "hi": bound(next_month(month))}
        with engine.begin() as conn:
            if on_partitions:
                conn.execute(text("SET LOCAL lock_timeout = '10s'"))
                # detaching checks that nothing references the partition's rows: remove what does first
                conn.execute(text("DELETE FROM responses WHERE job_id >= :lo AND job_id < :hi"), span)
                conn.execute(text("DELETE FROM job_idempotency_keys WHERE job_id >= :lo AND job_id < :hi"), span)
                removed += conn.execute(text(f"SELECT count(*) FROM {name(month)}")).scalar()
                conn.execute(text(f"ALTER TABLE jobs DETACH PARTITION {name(month)}"))
                conn.execute(text(f"DROP TABLE {name(month)}"))
            else:
                removed += conn.execute(text("DELETE FROM jobs WHERE id >= :lo AND id < :hi"), span).rowcount
    return Pruned(months=[_label(m) for m in candidates], jobs=removed)


def _months_between(job_id: str, before: date) -> list[date]:
    """The months from the one `job_id` was created in up to (not including) `before`."""
    try:
        micros = int(job_id[4:18], 16)
        first = current_month(datetime.fromtimestamp(micros / 1e6, timezone.utc))
    except ValueError:
        first = date(1970, 1, 1)
    out = []
    while first < before:
        out.append(first)
        first = next_month(first)
    return out


def schema_filter(dialect: str):
    """Alembic's include_object for comparing the database with the models: the monthly partitions are not models,
    and an object the models mark for one dialect only (info={"dialect": ...}) is left out on the others."""
    def include(obj, table_name, type_, reflected, compare_to):
        if type_ == "table" and is_partition(table_name):
            return False
        if type_ == "foreign_key_constraint" and reflected and is_partition(obj.referred_table.name):
            return False   # Postgres' own copy of a foreign key, for each partition of the table it references
        only = getattr(obj, "info", {}).get("dialect") if obj is not None else None
        return only is None or only == dialect
    return include
