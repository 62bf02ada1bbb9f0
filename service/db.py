"""Per-request sessions and connections over the ledger's database engine (service.ledger.db builds it)."""
from collections.abc import Iterator
from contextlib import contextmanager

from flask import current_app, g
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from .ledger.db import make_engine


def init_app(app, url: str) -> None:
    engine = make_engine(url)
    app.extensions["tidepool.db"] = engine
    app.extensions["tidepool.sessions"] = sessionmaker(engine, expire_on_commit=False)
    app.teardown_appcontext(_close_session)


def get_engine() -> Engine:
    return current_app.extensions["tidepool.db"]


@contextmanager
def autocommit() -> Iterator[Connection]:
    """A connection for hot paths where one statement is the whole transaction. On Postgres it runs in
    autocommit mode: each statement commits (durably: synchronous_commit) before its result comes back,
    in one round trip, with no BEGIN or COMMIT. On SQLite it is an ordinary transaction, committed on exit."""
    engine = get_engine()
    conn = engine.connect()
    try:
        if engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn
        conn.commit()
    finally:
        conn.close()


def session() -> Session:
    if "db_session" not in g:
        g.db_session = current_app.extensions["tidepool.sessions"]()
    return g.db_session


def _close_session(_exc=None) -> None:
    s = g.pop("db_session", None)
    if s is not None:
        s.close()
