"""`alembic upgrade head` yields exactly the models' schema, and `downgrade base` removes it."""
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from tidepool.service import migrate
from tidepool.service.ledger.models import Base
from tidepool.service.ledger.partitions import is_partition, schema_filter


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("fresh_pg")


def test_upgrade_matches_models_and_downgrade_cleans_up(empty_url):
    migrate.upgrade(empty_url)
    engine = create_engine(empty_url)
    try:
        with engine.connect() as conn:
            dialect = engine.dialect.name
            opts = {"compare_type": True, "include_object": schema_filter(dialect)}
            diff = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
            assert diff == []
            tables = {t for t in inspect(conn).get_table_names() if not is_partition(t)}
            assert tables == {name for name, t in Base.metadata.tables.items()
                              if t.info.get("dialect", dialect) == dialect} | {"alembic_version"}
        migrate.downgrade(empty_url, "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
            if engine.dialect.name == "postgresql":
                assert conn.execute(text("SELECT count(*) FROM pg_type WHERE typtype = 'e'")).scalar() == 0
        migrate.upgrade(empty_url)  # and back up again
    finally:
        engine.dispose()
