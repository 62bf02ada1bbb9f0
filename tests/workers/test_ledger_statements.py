"""What an online request costs the ledger on Postgres, counted statement by statement (BEGIN, COMMIT and ROLLBACK
included) over the web app's and the worker's engines: a request through POST /v1/completions, taken, claimed, run
and answered by a real worker. The budget is the one the capacity model projects from (benchmarks/capacity.py): a
change that adds a statement or a transaction to this path fails here. Streamed tokens cost the ledger nothing."""
import threading
from contextlib import contextmanager

from sqlalchemy import event

from .test_intake import _close, _run_engine, _worker

ONLINE_STATEMENTS, ONLINE_TRANSACTIONS = 8, 3


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
