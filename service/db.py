"""Per-request sessions and connections over the ledger's database engine (the app's services hold it)."""
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


def _close_session(_exc=None) -> None:
    s = g.pop("db_session", None)
    if s is not None:
        s.close()
