"""Database engine and per-request sessions."""
from flask import current_app, g
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        # Take the write lock when a transaction begins: a read-then-write transaction could
        # otherwise fail with SQLITE_BUSY_SNAPSHOT instead of waiting for a concurrent writer.
        @event.listens_for(engine, "begin")
        def _begin_immediate(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True,
                         insertmanyvalues_page_size=5000)


def init_app(app, url: str) -> None:
    engine = make_engine(url)
    app.extensions["tidepool.engine"] = engine
    app.extensions["tidepool.sessions"] = sessionmaker(engine, expire_on_commit=False)
    app.teardown_appcontext(_close_session)


def get_engine() -> Engine:
    return current_app.extensions["tidepool.engine"]


def session() -> Session:
    if "db_session" not in g:
        g.db_session = current_app.extensions["tidepool.sessions"]()
    return g.db_session


def _close_session(_exc=None) -> None:
    s = g.pop("db_session", None)
    if s is not None:
        s.close()
