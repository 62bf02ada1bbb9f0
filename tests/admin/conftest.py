"""Admin panel and metrics tests: the same real backends as tests/service (Postgres cloned from a migrated
template, a flushed Redis db), plus a live server on a socket and headless Chromium for the browser tests."""
import json
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis
from werkzeug.serving import make_server

from tidepool.service import create_app

ADMIN = "test-admin-token-0123456789"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "admin"
DOCS_SHOTS = Path(__file__).resolve().parents[2] / "docs" / "assets" / "panel"
CHROMIUM = os.environ.get("TIDEPOOL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def admin_redis(redis_server):
    """The Redis db of the admin suites, on the session's private server."""
    return f"{redis_server}/2"


def make_app(pg_url: str, tmp_path, redis_url: str, **extra):
    return create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                       "admin_token": ADMIN, **extra})


@pytest.fixture
def app(pg_url, tmp_path, admin_redis):
    redis.Redis.from_url(admin_redis).flushdb()
    app = make_app(pg_url, tmp_path, admin_redis)
    yield app
    app.services.database.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


def csrf_from(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def sign_in(client) -> str:
    """Sign the test client in over HTTPS (the cookie is Secure); returns the session's CSRF token."""
    page = client.get("/admin/login", base_url="https://localhost")
    r = client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf_from(page.text)},
                    base_url="https://localhost")
    assert r.status_code == 302, r.text
    return csrf_from(client.get("/admin/tenants", base_url="https://localhost").text)


class Api:
    """The JSON API over a real socket (urllib), bearer-authenticated."""

    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body=None, token: str = ADMIN, raw: bytes | None = None,
             content_type: str = "application/json", headers: dict | None = None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": content_type, **(headers or {}),
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def tenant(self, name: str, **quota) -> tuple[str, str]:
        status, body = self.call("POST", "/v1/admin/tenants", {"name": name, "quota": quota})
        assert status == 201, body
        return body["id"], body["api_key"]

    def upload(self, key: str, lines: list[dict]) -> str:
        boundary = "tidepoolboundary"
        payload = "\n".join(json.dumps(x) for x in lines).encode()
        raw = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
               f"Content-Type: application/jsonl\r\n\r\n").encode() + payload + f"\r\n--{boundary}--\r\n".encode()
        status, body = self.call("POST", "/v1/files", token=key, raw=raw,
                                 content_type=f"multipart/form-data; boundary={boundary}")
        assert status == 200, body
        return body["id"]


@pytest.fixture(scope="module")
def live(pg_databases, tmp_path_factory, admin_redis):
    """One app on a real socket for a whole browser module (Postgres + Redis, production shape)."""
    redis.Redis.from_url(admin_redis).flushdb()
    url = pg_databases.create()
    app = make_app(url, tmp_path_factory.mktemp("live"), admin_redis)
    app.config["PANEL_REFRESH_MS"] = 400
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    yield app, base, Api(base)
    server.shutdown()
    thread.join(5)
    app.services.database.dispose()
    pg_databases.drop(url)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright import sync_api as playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[dev]'")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, live):
    """A signed-in laptop-sized page; every JS error on it fails the test that caused it."""
    _, base, _ = live
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=base)
    pg = context.new_page()
    pg.js_errors = []
    pg.on("pageerror", lambda exc: pg.js_errors.append(str(exc)))
    # Console errors count too, except the browser's note on every 4xx page (validation errors are 400s).
    pg.on("console", lambda msg: msg.type == "error" and not msg.text.startswith("Failed to load resource")
          and pg.js_errors.append(msg.text))
    pg.on("dialog", lambda d: d.accept())
    pg.set_default_timeout(10_000)
    yield pg
    context.close()


def shot(page, name: str, full_page: bool = True) -> None:
    """A screenshot in test-artifacts/admin/; with TIDEPOOL_DOCS_SCREENSHOTS=1 (`make screenshots`) also in
    docs/assets/panel/, where the documentation's admin panel page shows it."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)
    if os.environ.get("TIDEPOOL_DOCS_SCREENSHOTS") == "1":
        DOCS_SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACTS / f"{name}.png", DOCS_SHOTS / f"{name}.png")
