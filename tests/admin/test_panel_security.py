"""Sign-in, session cookie flags, CSRF on every form, and the JSON admin API refusing the panel's cookie."""
from sqlalchemy import func, select

from service.ledger.models import Tenant

from .conftest import ADMIN, csrf_from, sign_in

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
    with app.extensions["tidepool.sessions"]() as s:
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

    from service.ledger.snapshots import Heartbeats
    sign_in(client)
    r = app.extensions["tidepool.redis"]
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
