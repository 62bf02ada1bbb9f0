"""Per-request sessions and connections over the ledger's database engine (service.ledger.database builds them)."""
from contextlib import AbstractContextManager

from flask import current_app, g
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .ledger import database as ledger_db


def init_app(app, url: str) -> None:
    engine = ledger_db.make_engine(url)
    app.extensions["tidepool.db"] = engine
    app.extensions["tidepool.sessions"] = ledger_db.sessions(engine)
    app.teardown_appcontext(_close_session)


def get_engine() -> Engine:
    return current_app.extensions["tidepool.db"]


def autocommit() -> AbstractContextManager[Connection]:
    """The app's connection for one-statement transactions (service.ledger.database.autocommit)."""
    return ledger_db.autocommit(get_engine())


def session() -> Session:
    if "db_session" not in g:
        g.db_session = current_app.extensions["tidepool.sessions"]()
    return g.db_session


def _close_session(_exc=None) -> None:
    s = g.pop("db_session", None)
    if s is not None:
        s.close()
