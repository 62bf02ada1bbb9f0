"""What an online request and a batch line cost the ledger on Postgres, counted statement by statement (BEGIN,
COMMIT and ROLLBACK included) over the web app's and the worker's engines: a request through POST /v1/completions,
and the lines of a batch from its upload on, taken, claimed, run and written by a real worker. The budgets are the
ones the capacity model projects from (benchmarks/capacity.py): a change that adds a statement or a transaction to
these paths fails here. Streamed tokens cost the ledger nothing."""
import io
import json
import threading
from contextlib import contextmanager

from sqlalchemy import event

from .test_intake import _close, _run_engine, _worker

ONLINE_STATEMENTS, ONLINE_TRANSACTIONS = 8, 3
BATCH_LINE_STATEMENTS = 4


class Counter:
    """Statements and transactions sent over some engines."""

    def __init__(self, *engines):
        self.statements, self.transactions, self.texts = 0, 0, []
        self.lock = threading.Lock()
        self.hooks = [(e, name, fn) for e in engines for name, fn in (
            ("before_cursor_execute", self._statement), ("begin", self._begin), ("commit", self._end),
            ("rollback", self._end))]

    @staticmethod
    def _autocommit(conn) -> bool:
        """psycopg sends no BEGIN or COMMIT on this connection: each statement is its own transaction."""
        return conn.connection.dbapi_connection.autocommit

    def _statement(self, conn, cursor, statement, *args):
        with self.lock:
            self.statements += 1
            if self._autocommit(conn):
                self.transactions += 1
            self.texts.append(" ".join(statement.split())[:90])

    def _begin(self, conn):
        if self._autocommit(conn):
            return
        with self.lock:
            self.statements += 1                   # BEGIN
            self.transactions += 1
            self.texts.append("BEGIN")

    def _end(self, conn):
        if self._autocommit(conn):
            return
        with self.lock:
            self.statements += 1                   # COMMIT or ROLLBACK
            self.texts.append("END")

    @contextmanager
    def counting(self):
        for e, name, fn in self.hooks:
            event.listen(e, name, fn)
        try:
            yield self
        finally:
            for e, name, fn in self.hooks:
                event.remove(e, name, fn)


def _online_request(st, w, key: str, max_tokens: int) -> dict:
    """One completion, answered while the test thread plays the worker's loop."""
    client, out = st.app.test_client(), {}
    t = threading.Thread(target=lambda: out.update(r=client.post(
        "/v1/completions", json={"prompt": "count me", "max_tokens": max_tokens, "ignore_eos": True},
        headers={"Authorization": f"Bearer {key}"})))
    t.start()
    st.wait(lambda: st.redis.llen("interactive"), 30, "the request's message")
    assert w.pull()
    _run_engine(w)
    assert w.finish_done()
    t.join(30)
    assert out["r"].status_code == 200, out["r"].get_data()
    return out["r"].get_json()


def test_an_online_request_costs_the_ledger_a_fixed_few_statements(stack):
    st = stack
    _, key = st.tenant()
    w = _worker(st, "w")
    marks = st.app.services.dispatcher.marks
    marks.background = False              # a mark left pending would be flushed by hand below
    try:
        _online_request(st, w, key, 2)    # warm: the API key's cache, the model registry
        costs = {}
        for tokens in (4, 16):
            counter = Counter(st.engine, w.db)
            with counter.counting():
                body = _online_request(st, w, key, tokens)
                marks.flush()             # (nothing: the waiting request heard its job start)
            assert body["usage"]["completion_tokens"] == tokens
            costs[tokens] = (counter.statements, counter.transactions)
            assert counter.statements <= ONLINE_STATEMENTS, counter.texts
            assert counter.transactions <= ONLINE_TRANSACTIONS, counter.texts
        assert costs[16] == costs[4], costs      # no statement per streamed token
    finally:
        _close(w)


def test_a_batch_line_costs_the_ledger_a_few_statements(stack):
    """Upload, batch creation (the lines' jobs in one INSERT), and each line taken, claimed and written alone (one
    statement each, no BEGIN or COMMIT): the batch's fixed statements spread over its lines."""
    st = stack
    _, key = st.tenant()
    w = _worker(st, "w")
    lines = 20
    body = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": f"line {i}", "max_tokens": 4, "ignore_eos": True}}).encode() + b"\n" for i in range(lines))
    client, headers = st.app.test_client(), {"Authorization": f"Bearer {key}"}
    try:
        counter = Counter(st.engine, w.db)
        with counter.counting():
            f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(body), "in.jsonl")},
                            headers=headers).get_json()
            b = client.post("/v1/batches", headers=headers, json={
                "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).get_json()
            assert b["status"] == "in_progress", b
            done = 0
            while done < lines:
                assert w.pull(), f"{done} of {lines} lines ran"    # one offline message a pass
                _run_engine(w)
                assert w.finish_done()
                done += 1
        per_line = counter.statements / lines
        assert per_line <= BATCH_LINE_STATEMENTS, (per_line, counter.texts)
        assert client.get(f"/v1/batches/{b['id']}", headers=headers).get_json()["request_counts"]["completed"] \
            == lines
    finally:
        _close(w)
