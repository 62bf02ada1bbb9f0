"""Per-request sessions and connections over the ledger's database engine and its read replica (the app's services
hold them)."""
from contextlib import AbstractContextManager

from flask import g
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .app import services
from .ledger import database as ledger_db


def init_app(app) -> None:
    app.teardown_appcontext(_close_session)


def get_engine() -> Engine:
    return services().database


def autocommit() -> AbstractContextManager[Connection]:
    """The app's connection for one-statement transactions (service.ledger.database.autocommit)."""
    return ledger_db.autocommit(get_engine())


def session() -> Session:
    if "db_session" not in g:
        g.db_session = services().sessions()
    return g.db_session


def reads() -> Session:
    """The request's session for reads that may lag by the replication delay (listings, the admin panel's pages,
    usage reports): over the read replica when TIDEPOOL_DATABASE_REPLICA_URL is set, else session() itself."""
    svc = services()
    if svc.replica is svc.database:
        return session()
    if "db_reads" not in g:
        g.db_reads = svc.replica_sessions()
    return g.db_reads


def _close_session(_exc=None) -> None:
    for name in ("db_session", "db_reads"):
        s = g.pop(name, None)
        if s is not None:
            s.close()
