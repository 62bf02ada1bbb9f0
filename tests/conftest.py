"""Backends for every suite: Postgres (one migrated template per session, cloned into a fresh database per use)
and a private redis-server per session (per xdist worker), so parallel test processes never flush each other's
queues. The backends' clients load when a fixture first needs them: the kernel and engine suites also run on a
GPU machine whose image has torch but not the service's packages (benchmarks/gpu_check.sh)."""
import itertools
import os

import pytest
import torch

from tests.servers import free_port, start_redis  # noqa: F401  (tests/workers/conftest.py imports them here)

# Without CUDA the kernel tests run the Triton kernels on CPU tensors, which only works under Triton's interpreter,
# and it must be on before anything imports triton: transformers and peft may, when test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

PG = os.environ.get("TIDEPOOL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
REDIS = os.environ.get("TIDEPOOL_TEST_REDIS")     # a server (redis://host:port) instead of a private one


@pytest.fixture(autouse=True)
def empty_memory_broker():
    """The embedded broker (kombu's memory transport) keeps its queues in the process, shared by every app and
    worker in it: what one test left queued must not reach the next test's worker."""
    from kombu.transport.memory import Channel
    Channel.queues.clear()
    yield
    Channel.queues.clear()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """redis://127.0.0.1:PORT of a redis-server private to this test process; suites use their own db numbers."""
    if REDIS:
        yield REDIS.rstrip("/")
        return
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A local Redis Cluster of three masters (tests/servers.py RedisCluster) on free ports from 7100, for this test
    process; skipped where redis-server is not installed."""
    import shutil
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed")
    from tests.servers import RedisCluster, free_ports
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")      # test processes look in ranges of their own
    start = 7100 + 30 * (int(worker[2:]) % 3 if worker[2:].isdigit() else 0)
    cluster = RedisCluster(free_ports(3, start=start, stop=start + 30), tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.close()


class PgDatabases:
    def __init__(self):
        self._counter = itertools.count()
        self.template: str | None = None

    def execute(self, sql: str) -> None:
        import psycopg
        dsn = PG.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql)

    def _name(self) -> str:
        return f"tidepool_test_{os.getpid()}_{next(self._counter)}"

    def migrated_template(self) -> str:
        if self.template is None:
            self.template = f"tidepool_test_tmpl_{os.getpid()}"
            self.execute(f"DROP DATABASE IF EXISTS {self.template} WITH (FORCE)")
            self.execute(f"CREATE DATABASE {self.template}")
            from tidepool.service import migrate
            migrate.upgrade(f"{PG}/{self.template}")
        return self.template

    def create(self, migrated: bool = True) -> str:
        """A new database URL: migrated (cloned from the template) or empty."""
        name = self._name()
        template = f" TEMPLATE {self.migrated_template()}" if migrated else ""
        self.execute(f"CREATE DATABASE {name}{template}")
        return f"{PG}/{name}"

    def drop(self, url: str) -> None:
        self.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")

    def close(self) -> None:
        if self.template is not None:
            self.execute(f"DROP DATABASE IF EXISTS {self.template} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_databases():
    dbs = PgDatabases()
    yield dbs
    dbs.close()


@pytest.fixture
def fresh_pg(pg_databases):
    """An empty Postgres database URL (no schema), dropped afterwards."""
    url = pg_databases.create(migrated=False)
    yield url
    pg_databases.drop(url)


@pytest.fixture
def pg_url(pg_databases):
    """A migrated Postgres database URL, dropped afterwards."""
    url = pg_databases.create()
    yield url
    pg_databases.drop(url)


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory):
    """all-MiniLM-L6-v2 as `tidepool models pull all-minilm-l6-v2` writes it (from the installed wheel of the dev
    extra: no download)."""
    from tidepool.workers.tools.model_pull import pull_model
    return str(pull_model("all-minilm-l6-v2", tmp_path_factory.mktemp("models"), log=lambda *_: None))


# Under xdist (`make test` runs two processes, --dist loadfile) each file's tests run together in one process;
# files that start worker processes come first so that the long ones don't form the tail of the run.
_FIRST = ("workers", "engine", "kernels", "admin", "service")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        parts = item.path.relative_to(config.rootpath).parts
        return _FIRST.index(parts[1]) if len(parts) > 2 and parts[1] in _FIRST else len(_FIRST)
    items.sort(key=rank)     # stable: the order inside a file is kept
