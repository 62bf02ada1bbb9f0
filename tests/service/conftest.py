"""Real backends, clean per test: Postgres databases cloned from a migrated template, a dedicated
Redis db that is flushed, SQLite files copied from a migrated template."""
import itertools
import shutil
import threading

import pytest
import redis
from werkzeug.serving import make_server

from tidepool.service import create_app, migrate

ADMIN = "test-admin-token"
_counter = itertools.count()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template, tmp_path):
    path = tmp_path / "ledger.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def redis_url(redis_server):
    url = f"{redis_server}/1"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


@pytest.fixture
def redis_client(redis_url):
    return redis.Redis.from_url(redis_url)


def _dispose(app):
    app.services.database.dispose()


def pytest_generate_tests(metafunc):
    """Every test of the API runs on both ledgers: the embedded default (SQLite, in-process transport) that users
    start with, and the production shape (Postgres, Redis). A test of what only the production shape has
    (Redis queues, Postgres locks) is marked `production_shape` and runs there alone."""
    if "app" in metafunc.fixturenames:
        only_production = metafunc.definition.get_closest_marker("production_shape") is not None
        metafunc.parametrize("app", ["postgres"] if only_production else ["postgres", "sqlite"], indirect=True)


@pytest.fixture
def app(request, tmp_path):
    """The production shape (Postgres ledger, Redis broker and rate limits) or the embedded one."""
    if request.param == "sqlite":
        yield request.getfixturevalue("embedded_app")
        return
    app = create_app({"database_url": request.getfixturevalue("pg_url"),
                      "redis_url": request.getfixturevalue("redis_url"), "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN})
    yield app
    _dispose(app)


@pytest.fixture
def embedded_app(sqlite_url, tmp_path):
    """Embedded shape: SQLite ledger, in-memory broker (emptied around each test: tests/conftest.py) and rate
    limits."""
    app = create_app({"database_url": sqlite_url, "redis_url": None, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN})
    yield app
    _dispose(app)


@pytest.fixture
def any_app(app):
    """Both ledgers (the `app` fixture runs every test on both)."""
    return app


@pytest.fixture
def client(app):
    return app.test_client()


class Admin:
    def __init__(self, client):
        self.client = client
        self.headers = {"Authorization": f"Bearer {ADMIN}"}

    def tenant(self, name=None, **quota):
        name = name or f"tenant-{next(_counter)}"
        r = self.client.post("/v1/admin/tenants", json={"name": name, "quota": quota}, headers=self.headers)
        assert r.status_code == 201, r.get_json()
        body = r.get_json()
        return body["id"], {"Authorization": f"Bearer {body['api_key']}"}


@pytest.fixture
def admin(client):
    return Admin(client)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def live_server(app):
    """The app on a real socket, for the official openai client."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(5)
