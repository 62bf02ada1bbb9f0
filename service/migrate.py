"""Alembic, configured from code (no alembic.ini) so `tidepool db upgrade` finds the migrations in a checkout and in
an installed wheel alike (service/resources.py). The database itself is created by
service/ledger/database.py (ensure_database)."""
from alembic import command
from alembic.config import Config as AlembicConfig

from tidepool.service.resources import MIGRATIONS


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    from tidepool.service.ledger.database import split_url
    url = split_url(url)[0].render_as_string(hide_password=False)     # migrations run unprepared anyway
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
