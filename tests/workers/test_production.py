"""The production sequence of docs/operations/production.md, top to bottom, as an operator runs it: `tidepool db
upgrade` on a database that does not exist yet, `tidepool tenants create`, `make up` (honcho over the Procfile with
the venv's commands), `/readyz` turning ready once a worker has its engine up, one request through the `openai`
client; every line the processes log is JSON; on this host without a GPU the Procfile runs one engine, serving every
class."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import openai
import psycopg
import pytest
import requests

from tests.conftest import PG
from tests.workers.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _drop(name: str) -> None:
    with psycopg.connect(PG.replace("postgresql+psycopg://", "postgresql://") + "/postgres", autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture
def database():
    name = f"tidepool_prod_{uuid.uuid4().hex[:10]}"
    yield f"{PG}/{name}"
    _drop(name)


def test_documented_production_sequence(database, redis_url, tiny_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(TIDEPOOL_DATABASE_URL=database, TIDEPOOL_REDIS_URL=redis_url, TIDEPOOL_MODEL=tiny_model,
               TIDEPOOL_ADMIN_TOKEN="prod-admin-token-123", TIDEPOOL_STORAGE_DIR=str(tmp_path / "storage"),
               TIDEPOOL_BEAT_SCHEDULE=str(tmp_path / "celerybeat-schedule"), OMP_NUM_THREADS="1")
    up = subprocess.run([str(BIN / "tidepool"), "db", "upgrade"], env=env, capture_output=True, text=True,
                        timeout=120)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout.splitlines()[-1]) == {"upgraded": "head", "created": True}
    made = subprocess.run([str(BIN / "tidepool"), "tenants", "create", "acme"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout.splitlines()[-1])["api_key"]

    log_path = tmp_path / "honcho.log"
    # `-o` keeps make from checking the install against pyproject.toml: the venv running this test is the install.
    stack = subprocess.Popen(["make", "-s", "-C", str(ROOT), "-o", ".venv/.installed", "up", f"PORT={port}"],
                             env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 90
        ready = None
        while time.monotonic() < end:
            assert stack.poll() is None, log_path.read_text()
            try:
                ready = requests.get(f"{base}/readyz", timeout=5)
                if ready.status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):   # not listening yet, or its workers still booting
                pass
            time.sleep(0.3)
        assert ready is not None and ready.status_code == 200, log_path.read_text()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        r = client.chat.completions.create(model=Path(tiny_model).name, max_tokens=4,
                                           messages=[{"role": "user", "content": "Hello"}])
        assert r.usage.completion_tokens == 4
        time.sleep(6)      # one beat tick and a few heartbeats: their lines must be JSON too
    finally:
        os.killpg(stack.pid, signal.SIGTERM)     # as a terminal's Ctrl-C reaches the whole foreground group
        end = time.monotonic() + 30
        while _group_alive(stack.pid) and time.monotonic() < end:
            time.sleep(0.2)
        if _group_alive(stack.pid):
            os.killpg(stack.pid, signal.SIGKILL)
        stack.wait()
    text = log_path.read_text()
    lines = [m.groups() for m in re.finditer(r"^\S+ (\S+?)\.\d+\s*\| (.*)$", text, re.M)]
    by_process = {}
    for process, line in lines:
        if process == "system":
            continue
        try:
            json.loads(line)
        except ValueError:
            pytest.fail(f"{process} logged a line that is not JSON: {line!r}\n{text}")
        by_process.setdefault(process, []).append(line)
    assert set(by_process) == {"web", "worker", "beat"}, text
    # a host without a GPU: one engine, named for its device, serving every class
    starts = [json.loads(x) for x in by_process["worker"] if '"metrics_port"' in x]
    assert len(starts) == 1 and starts[0]["metrics_port"] is not None, starts
    assert (starts[0]["kind"], starts[0]["device"]) == ("gpu", "cpu") and starts[0]["worker"].startswith("cpu-")
    assert starts[0]["queues"] == ["realtime", "interactive", "batch", "deferrable"], starts
    pools = [x for x in by_process["worker"] if json.loads(x).get("msg", "").startswith("KV pool:")]
    assert len(pools) == 1, by_process["worker"]
    assert any('"worker.ready"' in x for x in by_process["worker"]), by_process["worker"]
    assert "No hostname was supplied" not in text and "Traceback" not in text
