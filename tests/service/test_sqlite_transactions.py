"""Transactions on the embedded ledger (SQLite) are scoped to what they write: a read takes no lock, the first write
of a transaction takes the one write lock, and nothing holds it while a request reads, validates or waits for a
second connection."""
import io
import json
import sqlite3

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from tidepool.service.ledger import batches as ledger
from tidepool.service.ledger.models import Job, Tenant

from .conftest import Admin


def _path(app) -> str:
    return app.services.database.url.database


def write_lock_is_free(path: str) -> bool:
    """Whether another connection could start writing at once (no busy wait)."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def test_reads_take_no_lock_and_the_first_write_takes_it(embedded_app):
    engine, path = embedded_app.services.database, _path(embedded_app)
    Admin(embedded_app.test_client()).tenant("reader")
    with Session(engine) as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == "reader"))
        assert tenant is not None and write_lock_is_free(path)
        s.execute(update(Tenant).where(Tenant.id == tenant.id).values(weight=3))
        assert not write_lock_is_free(path)
        s.commit()
    assert write_lock_is_free(path)


def test_a_read_then_write_transaction_survives_a_concurrent_commit(embedded_app):
    """What BEGIN IMMEDIATE at the start was for: a transaction that read before another connection committed
    must not fail with SQLITE_BUSY_SNAPSHOT when it then writes."""
    engine = embedded_app.services.database
    Admin(embedded_app.test_client()).tenant("racer")
    with Session(engine) as s, Session(engine) as other:
        tenant = s.scalar(select(Tenant).where(Tenant.name == "racer"))
        other.execute(update(Tenant).where(Tenant.id == tenant.id).values(weight=5))
        other.commit()
        s.execute(update(Tenant).where(Tenant.id == tenant.id).values(weight=Tenant.weight + 1))
        s.commit()
        assert s.scalar(select(Tenant.weight).where(Tenant.id == tenant.id)) == 6


def test_locking_reads_take_the_write_lock(embedded_app):
    engine, path = embedded_app.services.database, _path(embedded_app)
    with Session(engine) as s:
        s.execute(select(Tenant).with_for_update()).all()
        assert not write_lock_is_free(path)
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        assert write_lock_is_free(path)


@pytest.fixture
def lock_seen_during_validation(embedded_app, monkeypatch):
    seen = []
    check = ledger.check_line

    def checking(*args, **kwargs):
        seen.append(write_lock_is_free(_path(embedded_app)))
        return check(*args, **kwargs)
    monkeypatch.setattr(ledger, "check_line", checking)
    return seen


def test_batch_lines_are_validated_without_the_write_lock(embedded_app, lock_seen_during_validation):
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    lines = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})
                      for i in range(3))
    up = client.post("/v1/files", headers=key, data={"purpose": "batch", "file": (io.BytesIO(lines.encode()), "b.jsonl")})
    assert up.status_code == 200, up.get_json()
    r = client.post("/v1/batches", headers=key, json={"input_file_id": up.get_json()["id"],
                                                      "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert r.status_code == 200 and r.get_json()["status"] == "in_progress", r.get_json()
    assert lock_seen_during_validation == [True, True, True]
    with Session(embedded_app.services.database) as s:
        assert len(s.scalars(select(Job).where(Job.batch_id == r.get_json()["id"])).all()) == 3


def test_message_batch_requests_are_validated_without_the_write_lock(embedded_app, lock_seen_during_validation):
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    reqs = [{"custom_id": f"m{i}", "params": {"model": "tidepool", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]}} for i in range(2)]
    r = client.post("/v1/messages/batches", headers={**key, "anthropic-version": "2023-06-01"},
                    json={"requests": reqs})
    assert r.status_code == 200, r.get_json()
    assert lock_seen_during_validation == [True, True]
