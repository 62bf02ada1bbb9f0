"""The ledger's database engine (Postgres or SQLite), with a liveness check on checkout, and the sessions and
connections over it: every unit of work on the ledger is opened here, and the ledger's functions run in it (the
caller commits). The web app keeps one session per request (service.db)."""
import re
import select as _select
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, exc, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker


def split_url(url: str) -> tuple[URL, dict]:
    """The URL without Tidepool's own query options, and the driver arguments they stand for:
    `?prepare_threshold=none` turns off psycopg's server-side prepared statements, which a pooler in
    transaction mode (PgBouncer before 1.21) cannot follow from one server connection to the next."""
    u = make_url(url)
    value = u.query.get("prepare_threshold")
    if value is None:
        return u, {}
    threshold = None if str(value).lower() in ("none", "off", "") else int(value)
    return u.difference_update_query(["prepare_threshold"]), {"prepare_threshold": threshold}


_READS = ("SELECT", "PRAGMA", "EXPLAIN", "VALUES")
_WRITE_WORD = re.compile(r"\b(INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)


def _is_read(statement: str) -> bool:
    words = statement.lstrip().split(None, 1)
    head = words[0].upper() if words else ""
    if head == "WITH":
        return not _WRITE_WORD.search(statement)
    return head in _READS


def _begin_writing(conn) -> None:
    """SQLite transactions as Postgres' READ COMMITTED sees them: reads run outside a transaction (each sees what
    was committed, and in WAL mode never waits for a writer), and the first write of a transaction (or a locking
    read) opens it with BEGIN IMMEDIATE, which takes the one write lock at once. So a transaction never upgrades a
    read snapshot to a write lock (SQLITE_BUSY_SNAPSHOT), and only a transaction that writes holds the lock."""
    if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        return
    dbapi_conn = conn.connection.dbapi_connection
    if not dbapi_conn.in_transaction:
        dbapi_conn.execute("BEGIN IMMEDIATE")


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

        @event.listens_for(engine, "before_execute")
        def _locking_read(conn, clauseelement, multiparams, params, execution_options):
            if getattr(clauseelement, "_for_update_arg", None) is not None:   # SELECT ... FOR UPDATE
                _begin_writing(conn)

        @event.listens_for(engine, "before_cursor_execute")
        def _first_write(conn, cursor, statement, parameters, context, executemany):
            if not _is_read(statement):
                _begin_writing(conn)

        return engine
    url, connect_args = split_url(url)
    engine = create_engine(url, pool_size=10, max_overflow=20, insertmanyvalues_page_size=5000,
                           connect_args=connect_args)
    _check_on_checkout(engine)
    return engine


def make_replica_engine(url: str) -> Engine:
    """The read replica's engine (TIDEPOOL_DATABASE_REPLICA_URL): its transactions are READ ONLY on Postgres, so a
    write sent there by mistake fails at once, as it would on a hot standby."""
    engine = make_engine(url)
    return engine.execution_options(postgresql_readonly=True) if engine.dialect.name == "postgresql" else engine


# A pooled connection idle for longer than this is pinged (one round trip) before it is handed out.
PING_IDLE_AFTER = 10.0


def _check_on_checkout(engine: Engine) -> None:
    """What pool_pre_ping protects against, without its round trip on every checkout: a connection the
    server closed (restart, idle timeout, pg_terminate_backend) has the server's goodbye or EOF waiting on
    its socket, which a zero-timeout poll() sees; one idle for PING_IDLE_AFTER seconds (where a silent
    network drop could hide) is pinged as pool_pre_ping would. Either way a dead connection is replaced
    before it is used (DisconnectionError makes the pool retry with a fresh one)."""

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_conn, record):
        record.info["tp_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn, record, proxy):
        since = record.info.pop("tp_idle_since", None)
        if since is None:
            return  # just connected
        try:
            if getattr(dbapi_conn, "closed", False) or getattr(dbapi_conn, "broken", False):
                raise exc.DisconnectionError("connection closed")
            poller = _select.poll()
            poller.register(dbapi_conn.fileno(), _select.POLLIN)
            if poller.poll(0):
                raise exc.DisconnectionError("unexpected data or EOF on an idle connection")
            if time.monotonic() - since > PING_IDLE_AFTER:
                engine.dialect.do_ping(dbapi_conn)
        except exc.DisconnectionError:
            raise
        except Exception as e:
            raise exc.DisconnectionError(f"connection check failed: {e}") from e


def session(engine: Engine, expire_on_commit: bool = True) -> Session:
    """A unit of work: the ledger's functions run in it, the caller commits; closed uncommitted, it rolls back.
    On SQLite its reads run outside a transaction and its first write opens one (BEGIN IMMEDIATE, above)."""
    return Session(engine, expire_on_commit=expire_on_commit)


def sessions(engine: Engine) -> sessionmaker:
    """The web app's factory of units of work (one per request, and the short reads of a stream): rows stay
    readable after their commit."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """A connection for hot paths where one statement is the whole transaction. On Postgres it runs in
    autocommit mode: each statement commits (durably: synchronous_commit) before its result comes back,
    in one round trip, with no BEGIN or COMMIT. On SQLite it is an ordinary transaction, committed on exit."""
    conn = engine.connect()
    try:
        if engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn
        conn.commit()
    finally:
        conn.close()


@contextmanager
def one_statement(engine: Engine) -> Iterator[Session]:
    """A Session over autocommit(): for a unit of work that is one statement (the ledger's one-statement
    transitions), which on Postgres commits itself with no BEGIN or COMMIT around it."""
    with autocommit(engine) as conn, Session(bind=conn) as s:
        yield s


@contextmanager
def outside_transaction(engine: Engine) -> Iterator[Connection]:
    """A connection whose statements run in no transaction (AUTOCOMMIT): a read sees what was committed, in one
    round trip, and on SQLite never waits for the write lock."""
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def read_only(engine: Engine) -> Iterator[Session]:
    """A Session for reads alone, each statement outside any transaction (outside_transaction): one round trip per
    read, no BEGIN or ROLLBACK around it. Nothing may be written through it."""
    with outside_transaction(engine) as conn, Session(bind=conn, expire_on_commit=False) as s:
        yield s


def ping(engine: Engine) -> None:
    """One round trip to the database (readiness); raises what the driver raises when it cannot."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def ensure_database(url: str) -> bool:
    """Create the database `url` names when its server has none by that name (Postgres; SQLite creates its file,
    here with its folder). True when it was created. Raises RuntimeError with a one-line reason otherwise."""
    u = split_url(url)[0]
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        return False
    probe = create_engine(u)
    try:
        with probe.connect():
            return False
    except exc.OperationalError as e:
        if f'database "{u.database}" does not exist' not in str(e.orig):
            raise RuntimeError(f"cannot connect to {u.render_as_string(hide_password=True)}: "
                               f"{_one_line(e.orig)}") from None
    finally:
        probe.dispose()
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{u.database.replace(chr(34), chr(34) * 2)}"'))
    except exc.SQLAlchemyError as e:
        raise RuntimeError(f"database {u.database!r} does not exist and could not be created "
                           f"({_one_line(getattr(e, 'orig', e))}); create it with "
                           f"`createdb {u.database}` and run `tidepool db upgrade` again") from None
    finally:
        admin.dispose()
    return True


def _one_line(error) -> str:
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())
