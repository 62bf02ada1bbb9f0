"""jobs by month: the migration moves rows into month partitions and back, an Idempotency-Key holds across months,
beat creates coming months, and `tidepool db prune` drops finished months, keeping usage, refusing live ones."""
import hashlib
import json
import secrets
from datetime import datetime, timezone

import pytest
from sqlalchemy import create_engine, insert, inspect, select, text, update
from sqlalchemy.exc import IntegrityError

from tidepool.service import migrate
from tidepool.service.ledger import partitions, quotas
from tidepool.service.ledger.database import make_engine
from tidepool.service.ledger.models import (Batch, BatchStatus, File, Job, JobIdempotencyKey, JobStatus, SlaClass,
                                            StoredResponse, Tenant, Usage, utcnow)
from tidepool.workers import cli

from .conftest import Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8, "sla_class": "interactive"}
NOW = partitions.current_month()
M1, M2 = partitions.next_month(NOW, -3), partitions.next_month(NOW, -2)


def job_id(month) -> str:
    """An id models.new_id gives a job created in `month` (on its first day)."""
    start = int(datetime(month.year, month.month, 1, tzinfo=timezone.utc).timestamp()) * 1_000_000
    return f"job_{start + secrets.randbelow(86_400_000_000):014x}{secrets.token_hex(6)}"


def _row(tenant_id, month, status=JobStatus.completed, key=None, batch_id=None) -> dict:
    return dict(id=job_id(month), tenant_id=tenant_id, sla_class=SlaClass.interactive, status=status,
                endpoint="/v1/completions", request={"prompt": "x"}, hidden=False, estimated_tokens=1, attempts=0,
                idempotency_key=key, batch_id=batch_id, created_at=utcnow())


def _tenant(conn, name="t") -> str:
    tid = f"ten_{secrets.token_hex(4)}"
    conn.execute(insert(Tenant).values(id=tid, name=name, weight=1.0, disabled=False, created_at=utcnow(),
                                       queued_count=0, running_count=0))
    return tid


def _where(conn, ids) -> dict[str, str]:
    return dict(conn.execute(text("SELECT id, tableoid::regclass::text FROM jobs WHERE id = ANY(:ids)"),
                             {"ids": list(ids)}).all())


def test_migration_moves_months_into_partitions_and_back(fresh_pg):
    migrate.upgrade(fresh_pg, "0011")
    engine = create_engine(fresh_pg)
    try:
        with engine.begin() as conn:
            tid = _tenant(conn)
            rows = [_row(tid, M1, key="k1"), _row(tid, M2), _row(tid, NOW, status=JobStatus.queued)]
            conn.execute(insert(Job), rows)
            conn.execute(insert(StoredResponse).values(id="resp_1", tenant_id=tid, job_id=rows[0]["id"],
                                                       background=False, params={}, input_items=[],
                                                       created_at=utcnow()))
        ids = [r["id"] for r in rows]
        migrate.upgrade(fresh_pg)
        with engine.begin() as conn:
            assert _where(conn, ids) == {ids[0]: partitions.name(M1), ids[1]: partitions.name(M2),
                                         ids[2]: partitions.name(NOW)}
            assert set(partitions.months(conn)) >= {M1, M2, NOW, partitions.next_month(NOW, partitions.AHEAD)}
            assert conn.execute(select(JobIdempotencyKey.job_id).where(
                JobIdempotencyKey.idempotency_key == "k1")).scalar() == ids[0]
            conn.execute(insert(Job).values(**{**_row(tid, NOW), "id": "odd-id"}))    # outside every month
            assert _where(conn, ["odd-id"]) == {"odd-id": partitions.DEFAULT}
            # the foreign key to a partitioned jobs still cascades
            conn.execute(text("DELETE FROM jobs WHERE id = :id"), {"id": ids[0]})
            assert conn.execute(select(StoredResponse.id)).first() is None
            assert conn.execute(select(JobIdempotencyKey.job_id)).first() is None
        migrate.downgrade(fresh_pg, "0011")
        with engine.connect() as conn:
            assert {t for t in inspect(conn).get_table_names() if partitions.is_partition(t)} == set()
            assert set(conn.execute(select(Job.id)).scalars()) == {ids[1], ids[2], "odd-id"}
            assert "uq_jobs_tenant_idempotency" in {u["name"] for u in inspect(conn).get_unique_constraints("jobs")}
        migrate.upgrade(fresh_pg)
    finally:
        engine.dispose()


@pytest.mark.production_shape
def test_an_idempotency_key_holds_across_months(app):
    client = app.test_client()
    tenant_id, key = Admin(client).tenant()
    engine = app.services.database
    old = Job(id=job_id(M1), tenant_id=tenant_id, sla_class=SlaClass.interactive, model=None,
              status=JobStatus.queued, endpoint="/v1/completions", request={"prompt": "Hello"}, metadata_=None,
              hidden=False, idempotency_key="same", estimated_tokens=1, deadline=None,
              request_hash=hashlib.sha256(json.dumps(PROMPT, sort_keys=True).encode()).hexdigest(),
              attempts=0, created_at=utcnow(), queued_at=utcnow())
    partitions.ensure_ahead(engine, now=datetime(M1.year, M1.month, 1, tzinfo=timezone.utc))
    with engine.connect() as conn:
        assert quotas.admit_pg(conn, [old], None) is not None
        conn.commit()
        assert _where(conn, [old.id]) == {old.id: partitions.name(M1)}
        # a job of this month under the same key is refused by the key's table, whatever partition holds the first
        again = Job(**{c: getattr(old, c) for c in ("tenant_id", "sla_class", "model", "status", "endpoint",
                                                    "request", "metadata_", "hidden", "idempotency_key",
                                                    "request_hash", "estimated_tokens", "deadline", "attempts",
                                                    "created_at", "queued_at")}, id=job_id(NOW))
        with pytest.raises(IntegrityError):
            quotas.admit_pg(conn, [again], None)
        conn.rollback()
    # through the API: a retry finds the job of the older month and creates none
    replay = client.post("/v1/jobs", json=PROMPT, headers={**key, "Idempotency-Key": "same"})
    assert replay.status_code == 200 and replay.get_json()["id"] == old.id
    first = client.post("/v1/jobs", json=PROMPT, headers={**key, "Idempotency-Key": "fresh"})
    again = client.post("/v1/jobs", json=PROMPT, headers={**key, "Idempotency-Key": "fresh"})
    assert (first.status_code, again.status_code) == (202, 200) and again.get_json()["id"] == first.get_json()["id"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar() == 2
        assert conn.execute(text("SELECT count(*) FROM job_idempotency_keys")).scalar() == 2


def test_beat_creates_the_coming_months(pg_url):
    engine = make_engine(pg_url)
    try:
        later = datetime(NOW.year + 1, NOW.month, 15, tzinfo=timezone.utc)
        created = partitions.ensure_ahead(engine, now=later)
        assert partitions.name(partitions.next_month(NOW, 12 + partitions.AHEAD)) in created
        assert partitions.ensure_ahead(engine, now=later) == []
        with engine.connect() as conn:
            row = _row(_tenant(conn), partitions.next_month(NOW, 13))
            conn.execute(insert(Job).values(**row))
            assert _where(conn, [row["id"]]) == {row["id"]: partitions.name(partitions.next_month(NOW, 13))}
    finally:
        engine.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def ledger_url(request):
    return request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")


def _prune(monkeypatch, capsys, url, month) -> tuple[int, str, str]:
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", url)
    code = cli.main(["db", "prune", "--before", month])
    out, err = capsys.readouterr()
    return code, out, err


def test_prune_keeps_usage_and_files_and_refuses_months_with_live_jobs(ledger_url, monkeypatch, capsys):
    engine = make_engine(ledger_url)
    label = lambda m: f"{m.year:04d}-{m.month:02d}"     # noqa: E731
    partitions.ensure_ahead(engine, now=datetime(M1.year, M1.month, 1, tzinfo=timezone.utc))
    try:
        with engine.begin() as conn:
            tid = _tenant(conn)
            conn.execute(insert(File).values(id="file-in", tenant_id=tid, purpose="batch", filename="in.jsonl",
                                             bytes=10, created_at=utcnow()))
            conn.execute(insert(Batch).values(id="batch_1", tenant_id=tid, endpoint="/v1/completions",
                                              input_file_id="file-in", completion_window="24h",
                                              sla_class=SlaClass.batch, status=BatchStatus.in_progress,
                                              created_at=utcnow()))
            done = [_row(tid, M1), _row(tid, M1, key="k"), _row(tid, M2, batch_id="batch_1")]
            live = _row(tid, M2, status=JobStatus.running)
            current = _row(tid, NOW)
            conn.execute(insert(Job), done + [live, current])
            conn.execute(insert(Usage).values(tenant_id=tid, period=label(M1), requests=2, prompt_tokens=10,
                                              completion_tokens=20))
        code, out, err = _prune(monkeypatch, capsys, ledger_url, label(partitions.next_month(NOW)))
        assert code == 1 and "current month" in err
        code, out, err = _prune(monkeypatch, capsys, ledger_url, label(NOW))
        assert code == 1 and "nothing pruned" in err
        assert f"{label(M2)} still has 1 queued or running jobs and jobs of 1 batches not yet finalised" in err
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM jobs")).scalar() == 5

        code, out, err = _prune(monkeypatch, capsys, ledger_url, label(M2))     # M1 alone is finished
        assert code == 0, err
        assert json.loads(out) == {"pruned": [label(M1)], "jobs": 2}
        with engine.begin() as conn:
            assert set(conn.execute(select(Job.id)).scalars()) == {done[2]["id"], live["id"], current["id"]}
            conn.execute(update(Job).where(Job.id == live["id"]).values(status=JobStatus.failed))
            conn.execute(update(Batch).values(status=BatchStatus.completed, output_file_id="file-out"))
        code, out, err = _prune(monkeypatch, capsys, ledger_url, label(NOW))
        assert code == 0, err
        assert json.loads(out)["jobs"] == 2 and label(M2) in json.loads(out)["pruned"]
        with engine.connect() as conn:
            assert set(conn.execute(select(Job.id)).scalars()) == {current["id"]}
            assert conn.execute(select(Usage.period, Usage.requests, Usage.prompt_tokens,
                                       Usage.completion_tokens)).all() == [(label(M1), 2, 10, 20)]
            assert conn.execute(select(File.id)).scalars().all() == ["file-in"]
            assert conn.execute(select(Batch.status)).scalar() == BatchStatus.completed
            if engine.dialect.name == "postgresql":
                assert M1 not in partitions.months(conn) and M2 not in partitions.months(conn)
                assert NOW in partitions.months(conn)
    finally:
        engine.dispose()
