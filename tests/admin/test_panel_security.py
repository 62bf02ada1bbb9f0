"""Sign-in, session cookie flags, CSRF on every form, and the JSON admin API refusing the panel's cookie."""
from sqlalchemy import func, select

from tidepool.service.ledger.models import Tenant

from .conftest import ADMIN, csrf_from, make_app, sign_in

HTTPS = "https://localhost"


def test_pages_need_sign_in(client):
    for path in ("/admin/", "/admin/tenants", "/admin/jobs", "/admin/batches", "/admin/jobs/job_x"):
        r = client.get(path, base_url=HTTPS)
        assert r.status_code == 302 and r.headers["Location"].startswith("/admin/login?next="), path
    r = client.get("/admin/api/dashboard", base_url=HTTPS)
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "signed_out"


def test_session_cookie_flags_and_wrong_token(client):
    page = client.get("/admin/login", base_url=HTTPS)
    csrf = csrf_from(page.text)
    r = client.post("/admin/login", data={"token": "nope", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 401 and "That admin token is not right." in r.text
    r = client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf, "next": "//evil.example/x"},
                    base_url=HTTPS)
    assert r.status_code == 302 and r.headers["Location"] == "/admin/"  # no open redirect
    cookie = r.headers["Set-Cookie"]
    for flag in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/admin"):
        assert flag in cookie, flag
    assert ADMIN not in cookie
    assert client.get("/admin/", base_url=HTTPS).status_code == 200


def test_form_without_csrf_token_is_rejected(client, app):
    csrf = sign_in(client)
    for data in ({"name": "forged"}, {"name": "forged", "csrf_token": "wrong"}):
        r = client.post("/admin/tenants", data=data, base_url=HTTPS)
        assert r.status_code == 400 and "CSRF check failed" in r.text
    r = client.post("/admin/login", data={"token": ADMIN}, base_url=HTTPS)
    assert r.status_code == 400  # sign-in is a form too
    with app.services.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == 0
    r = client.post("/admin/tenants", data={"name": "real", "weight": "1", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 303     # post/redirect/get


def test_every_panel_form_carries_the_csrf_token(client, app):
    csrf = sign_in(client)
    r = client.post("/admin/tenants", data={"name": "forms", "weight": "1", "csrf_token": csrf}, base_url=HTTPS,
                    follow_redirects=True)
    html = r.text
    assert html.count("<form") >= 6
    assert html.count('method="post"') == html.count('name="csrf_token"')


def test_json_admin_api_ignores_the_session_cookie(client):
    sign_in(client)
    cookie = client.get_cookie("tidepool_admin", domain="localhost", path="/admin")
    assert cookie is not None
    headers = {"Cookie": f"tidepool_admin={cookie.value}"}
    for method, path in (("get", "/v1/admin/tenants"), ("post", "/v1/admin/tenants"), ("get", "/v1/admin/jobs")):
        r = getattr(client, method)(path, headers=headers, json={"name": "x"}, base_url=HTTPS)
        assert r.status_code == 401 and r.get_json()["error"]["message"] == "Admin token required.", path
    # the bearer token still works, with or without the cookie
    r = client.get("/v1/admin/tenants", headers={**headers, "Authorization": f"Bearer {ADMIN}"}, base_url=HTTPS)
    assert r.status_code == 200


def test_sign_out_and_token_rotation_end_the_session(client, app):
    csrf = sign_in(client)
    assert client.get("/admin/tenants", base_url=HTTPS).status_code == 200
    app.config["TIDEPOOL"].admin_token = "rotated-token-abcdef"
    assert client.get("/admin/tenants", base_url=HTTPS).status_code == 302
    app.config["TIDEPOOL"].admin_token = ADMIN
    assert client.get("/admin/tenants", base_url=HTTPS).status_code == 200
    r = client.post("/admin/logout", data={"csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 302
    assert client.get("/admin/tenants", base_url=HTTPS).status_code == 302


def test_not_found_and_bad_filters_are_shown(client):
    sign_in(client)
    r = client.get("/admin/tenants/ten_missing", base_url=HTTPS)
    assert r.status_code == 404 and "No tenant with id ten_missing." in r.text
    r = client.get("/admin/jobs?status=bogus&since=yesterday", base_url=HTTPS)
    assert r.status_code == 400 and "Unknown status." in r.text and "Use a date and time" in r.text


def test_dashboard_reads_worker_heartbeats(client, app):
    """Workers that only write their heartbeat (workers/worker.py) still show on the dashboard."""
    import time

    from tidepool.service.ledger.snapshots import Heartbeats
    sign_in(client)
    r = app.services.redis
    beat = {"name": "gpu-7", "device": "cuda", "at": time.time() - 1,
            "engine": {"running": 5, "waiting": 1, "kv_cache_usage": 0.5, "preemptions": 2,
                       "prefix_cache_queries": 10, "prefix_cache_hits": 5, "total_generation_tokens": 100}}
    Heartbeats(r).put(beat, ttl=60)
    first = client.get("/admin/api/dashboard", base_url=HTTPS).get_json()
    beat["at"] += 1
    beat["engine"]["total_generation_tokens"] = 150
    Heartbeats(r).put(beat, ttl=60)
    d = client.get("/admin/api/dashboard", base_url=HTTPS).get_json()
    [w] = d["workers"]
    assert (w["worker"], w["running"], w["waiting"], w["kv_cache_usage"]) == ("gpu-7", 5, 1, 0.5)
    assert w["generation_tokens_per_s"] == 50 and d["tokens_per_s"] == 50
    assert d["prefix_cache_hit_rate"] == 0.5 and d["preemptions"] == 2 and first["errors"] == []


def test_sign_in_attempts_are_throttled(client):
    csrf = csrf_from(client.get("/admin/login", base_url=HTTPS).text)
    codes = [client.post("/admin/login", data={"token": f"guess-{i}", "csrf_token": csrf}, base_url=HTTPS).status_code
             for i in range(11)]
    assert codes == [401] * 10 + [429]
    r = client.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 429 and "Too many sign-in attempts" in r.text


def _proxied_app(pg_url, tmp_path, admin_redis, **extra):
    import redis
    redis.Redis.from_url(admin_redis).flushdb()
    return make_app(pg_url, tmp_path, admin_redis, **extra)


def _login(client, token: str, address: str | None = None):
    headers = {"X-Forwarded-For": address} if address else {}
    csrf = csrf_from(client.get("/admin/login", base_url=HTTPS, headers=headers).text)
    return client.post("/admin/login", data={"token": token, "csrf_token": csrf}, base_url=HTTPS, headers=headers)


def test_a_throttled_address_locks_out_no_one_else(pg_url, tmp_path, admin_redis):
    """Behind a trusted proxy (TIDEPOOL_TRUSTED_PROXIES) wrong tokens are counted per client address: one that
    keeps guessing is refused for the rest of the minute, every other address still signs in."""
    app = _proxied_app(pg_url, tmp_path, admin_redis, trusted_proxies=1)
    try:
        guesser, admin = app.test_client(), app.test_client()
        codes = [_login(guesser, f"guess-{i}", "203.0.113.9").status_code for i in range(11)]
        assert codes == [401] * 10 + [429]
        r = _login(guesser, ADMIN, "203.0.113.9")
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert _login(admin, ADMIN, "198.51.100.7").status_code == 302
        assert admin.get("/admin/tenants", base_url=HTTPS).status_code == 200
    finally:
        app.services.database.dispose()


def test_without_trusted_proxies_a_forwarded_address_is_not_believed(client):
    for i in range(10):
        assert _login(client, f"guess-{i}", f"192.0.2.{i}").status_code == 401
    assert _login(client, ADMIN, "192.0.2.200").status_code == 429       # same socket peer: same address


def test_right_tokens_are_not_counted(app):
    for _ in range(12):     # a new browser each time (a signed-in one is sent on from the sign-in page)
        assert _login(app.test_client(), ADMIN).status_code == 302
    assert _login(app.test_client(), "nope").status_code == 401


def test_wrong_admin_bearer_tokens_are_throttled_per_address(pg_url, tmp_path, admin_redis):
    app = _proxied_app(pg_url, tmp_path, admin_redis, trusted_proxies=1)
    try:
        client = app.test_client()
        guesser = {"X-Forwarded-For": "203.0.113.9"}
        codes = [client.get("/v1/admin/tenants", headers={**guesser, "Authorization": f"Bearer guess-{i}"}).status_code
                 for i in range(10)]
        assert codes == [401] * 10
        for token in ("guess-10", ADMIN):
            r = client.get("/v1/admin/tenants", headers={**guesser, "Authorization": f"Bearer {token}"})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.get_json()["error"]["code"] == "too_many_attempts"
        r = client.get("/v1/admin/tenants", headers={"X-Forwarded-For": "198.51.100.7",
                                                     "Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200
    finally:
        app.services.database.dispose()


def test_a_copied_cookie_signs_in_nothing_after_sign_out(app):
    """Sign-out ends the session on the server: a copy of the cookie taken before (another tab, a stolen copy)
    is signed out too; a new sign-in starts a new session."""
    browser, thief = app.test_client(), app.test_client()
    csrf = sign_in(browser)
    cookie = browser.get_cookie("tidepool_admin", domain="localhost", path="/admin")
    thief.set_cookie("tidepool_admin", cookie.value, domain="localhost", path="/admin", secure=True)
    assert thief.get("/admin/tenants", base_url=HTTPS).status_code == 200
    assert browser.post("/admin/logout", data={"csrf_token": csrf}, base_url=HTTPS).status_code == 302
    assert browser.get("/admin/tenants", base_url=HTTPS).status_code == 302
    r = thief.get("/admin/tenants", base_url=HTTPS)
    assert r.status_code == 302 and r.headers["Location"].startswith("/admin/login")
    assert thief.get("/admin/api/dashboard", base_url=HTTPS).status_code == 401
    sign_in(browser)
    assert browser.get("/admin/tenants", base_url=HTTPS).status_code == 200
    assert thief.get("/admin/tenants", base_url=HTTPS).status_code == 302
