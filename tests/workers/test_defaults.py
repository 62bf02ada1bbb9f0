"""Defaults are a product surface: `tidepool serve` exactly as a newcomer starts it, with no TIDEPOOL_* variable
at all (SQLite, storage, secrets and the default model all relative to the working directory), driven through
the `openai` client and the admin panel. Every other suite sets absolute paths, so this one must not."""
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "smollm2-135m"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                reason="run `tidepool models pull smollm2-135m` (make test does) to include this")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    """`tidepool serve` started in an empty folder; the default model is found at ./models/smollm2-135m."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m").symlink_to(MODEL)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log, errors = tmp_path / "serve.out", tmp_path / "serve.err"
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.workers.cli", "serve", "--port", str(port)], cwd=tmp_path,
                            env=env, stdout=open(log, "w"), stderr=open(errors, "w"))
    try:
        end = time.monotonic() + 90
        while not (key := re.search(r"API key:\s+(\S+)", log.read_text())) and time.monotonic() < end:
            assert proc.poll() is None, log.read_text() + errors.read_text()
            time.sleep(0.2)
        assert key, log.read_text() + errors.read_text()
        yield f"http://127.0.0.1:{port}", key.group(1), tmp_path, errors
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _panel_get(base: str, cookie: str, path: str) -> requests.Response:
    # A browser keeps the Secure cookie for http://127.0.0.1 (a trustworthy origin); requests does not, so send it.
    return requests.get(base + path, headers={"Cookie": cookie}, allow_redirects=False, timeout=30)


def _panel_sign_in(base: str, token: str) -> str:
    page = requests.get(f"{base}/admin/login", timeout=30)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    cookie = f"tidepool_admin={page.cookies['tidepool_admin']}"
    r = requests.post(f"{base}/admin/login", data={"token": token, "csrf_token": csrf}, headers={"Cookie": cookie},
                      allow_redirects=False, timeout=30)
    assert r.status_code == 302, r.text
    return f"tidepool_admin={r.cookies['tidepool_admin']}"


def test_batch_files_download_on_pure_defaults(served):
    base, key, cwd, log = served
    assert (cwd / "var" / "tidepool.db").is_file() and (cwd / "var" / "storage").is_dir()
    banner = (cwd / "serve.out").read_text()
    assert f"{sys.executable} -c 'from openai import OpenAI" in banner     # the venv's python, not `python`
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    lines = [{"custom_id": f"ok-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 3}} for i in range(2)]
    # Longer than the model's context: runs, fails in the worker, and lands in the error file.
    lines.append({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 3}})
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert client.files.content(upload.id).content == data
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    end = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < end, batch
        time.sleep(0.5)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 1
    assert batch.model == "smollm2-135m"          # usage per batch, as OpenAI reports it

    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == ["ok-0", "ok-1"]
    assert all(x["response"]["status_code"] == 200 for x in output)
    assert batch.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in output)
    assert batch.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in output)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [x["custom_id"] for x in errors] == ["too-long"]
    message = errors[0]["error"]["message"]      # the one limit: the model's context
    assert "context is 8192 tokens" in message and "fewer than 8192" in message and "8191" not in message, message

    # the sign-in page points at the token `serve` made (banner, var/admin_token), not at a variable nobody set
    hint = requests.get(f"{base}/admin/login", timeout=30).text
    assert "var/admin_token" in hint and "TIDEPOOL_ADMIN_TOKEN" not in hint

    # The same three files through the admin panel's links.
    cookie = _panel_sign_in(base, (cwd / "var" / "admin_token").read_text().strip())
    page = _panel_get(base, cookie, f"/admin/batches/{batch.id}")
    assert page.status_code == 200, page.text
    links = dict(re.findall(r'href="(/admin/files/[^"]+)" id="file-(\w+)"', page.text))
    assert sorted(links.values()) == ["errors", "input", "output"], page.text
    by_label = {label: path for path, label in links.items()}
    assert _panel_get(base, cookie, by_label["input"]).content == data
    got = _panel_get(base, cookie, by_label["output"])
    assert got.status_code == 200 and got.content == client.files.content(batch.output_file_id).content
    got = _panel_get(base, cookie, by_label["errors"])
    assert got.status_code == 200 and b"too-long" in got.content
    # The banner goes to stdout; stderr is log lines only, JSON by default, with the engine's start-up lines
    # and one line per HTTP request (no werkzeug development-server lines, no colours).
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    said = [x["msg"] for x in lines]
    assert any(m.startswith("KV pool:") for m in said) and any(m.startswith("native CPU decode kernel") for m in said)
    assert any(x["logger"] == "tidepool.http" and x.get("route") == "/v1/files/<file_id>/content" for x in lines)
    assert not [x for x in lines if x["logger"].startswith(("werkzeug", "kombu")) or "\x1b[" in x["msg"]]
