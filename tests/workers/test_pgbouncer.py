"""The ledger through PgBouncer in transaction pooling mode (docs/operations/scaling.md's remedy for connection
counts): job submission on the web, claims, lease renewals and completions on two workers, every statement through a
pool of few server connections that change hands between transactions. Skipped where `pgbouncer` is not installed
(Debian: `apt-get install pgbouncer`)."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidepool.service import migrate
from tidepool.service.ledger.database import ensure_database
from tidepool.service.ledger.models import Job, JobStatus, Usage

from .conftest import Stack, free_port

pytestmark = pytest.mark.skipif(shutil.which("pgbouncer") is None, reason="needs pgbouncer")


@pytest.fixture
def bouncer(pg_url):
    """A private pgbouncer in front of the test database: pool_mode transaction, 4 server connections."""
    head, db = pg_url.rsplit("/", 1)
    host, port = head.split("@", 1)[1].split(":")
    listen = free_port()
    folder = Path(tempfile.mkdtemp(prefix="tidepool-pgbouncer-"))     # outside pytest's owner-only tmp
    ini = folder / "pgbouncer.ini"
    ini.write_text(f"""[databases]
{db} = host={host} port={port} dbname={db} user=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = 4
max_client_conn = 200
logfile = {folder}/pgbouncer.log
pidfile = {folder}/pgbouncer.pid
""")
    cmd = ["pgbouncer", str(ini)]
    if os.geteuid() == 0:               # pgbouncer refuses to run as root
        os.chmod(folder, 0o755)
        shutil.chown(folder, "postgres")
        cmd = ["pgbouncer", "-u", "postgres", str(ini)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{listen}/{db}"
    import psycopg
    Stack.wait(lambda: _connects(psycopg, url) or proc.poll() is not None, 10, "pgbouncer up")
    assert proc.poll() is None, (folder / "pgbouncer.log").read_text()
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def _connects(psycopg, url: str) -> bool:
    try:
        psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), connect_timeout=1).close()
        return True
    except psycopg.OperationalError:
        return False


def test_ledger_through_pgbouncer_transaction_pooling(bouncer, tiny_model, tmp_path, redis_url):
    url = bouncer + "?prepare_threshold=none"
    assert ensure_database(url) is False
    migrate.upgrade(url)                      # already at head: alembic reads its version through the pooler
    st = Stack(url, tiny_model, tmp_path, redis_url)
    try:
        st.redis.flushdb()
        _, key = st.tenant()
        st.worker("bouncer-a")
        st.worker("bouncer-b")
        # many of the same statements: past psycopg's prepare threshold, on whichever server connection
        ids = st.submit(key, 60, max_tokens=4, ignore_eos=True)
        ids += st.submit(key, 20, sla_class="batch", max_tokens=4, ignore_eos=True)
        st.wait(lambda: st.count(Job.id.in_(ids), Job.status == JobStatus.completed) == len(ids), 120,
                "all jobs completed through pgbouncer", every=0.25)
        with Session(st.engine) as s:
            assert s.scalar(select(func.sum(Usage.requests))) == len(ids)
        assert {j.attempts for j in st.jobs(Job.id.in_(ids))} == {1}
        assert {j.worker for j in st.jobs(Job.id.in_(ids))} <= {"bouncer-a", "bouncer-b"}
    finally:
        st.close()
        st.redis.flushdb()
