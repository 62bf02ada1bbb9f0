"""Alembic, configured from code (no alembic.ini) so `tidepool db upgrade` finds the migrations in a checkout and in
an installed wheel alike (service/ledger/resources.py)."""
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig

from tidepool.service.ledger.resources import MIGRATIONS


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    from tidepool.service.ledger.db import split_url
    url = split_url(url)[0].render_as_string(hide_password=False)     # migrations run unprepared anyway
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def ensure_database(url: str) -> bool:
    """Create the database `url` names when its server has none by that name (Postgres; SQLite creates its file,
    here with its folder). True when it was created. Raises RuntimeError with a one-line reason otherwise."""
    from sqlalchemy import create_engine, exc, text

    from tidepool.service.ledger.db import split_url

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
