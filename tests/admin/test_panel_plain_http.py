"""Signing in over plain HTTP to a non-local address cannot work (the browser drops the Secure cookie): the panel
says so, and what to do, instead of a CSRF error that a reload never fixes."""
from .conftest import ADMIN, csrf_from, make_app

PLAIN = "http://10.1.2.3:8000"


def test_plain_http_sign_in_says_what_to_do(client):
    page = client.get("/admin/login", base_url=PLAIN)
    assert page.status_code == 200 and 'id="plain-http"' in page.text
    assert "TIDEPOOL_INSECURE_COOKIES=1" in page.text and "HTTPS" in page.text and "10.1.2.3:8000" in page.text
    # What the browser then sends: the form's token, but no cookie (it dropped the Secure one).
    fresh = client.application.test_client()
    r = fresh.post("/admin/login", data={"token": ADMIN, "csrf_token": csrf_from(page.text)}, base_url=PLAIN)
    assert r.status_code == 400 and "TIDEPOOL_INSECURE_COOKIES=1" in r.text and "Reload the page" not in r.text


def test_no_warning_where_the_cookie_survives(client, pg_url, tmp_path, admin_redis):
    for base, headers in (("https://panel.example", {}), ("http://localhost:8000", {}), ("http://127.0.0.1", {}),
                          ("http://10.1.2.3", {"X-Forwarded-Proto": "https"})):
        page = client.get("/admin/login", base_url=base, headers=headers)
        assert 'id="plain-http"' not in page.text, base
    r = client.application.test_client().post("/admin/login", data={"token": ADMIN}, base_url="https://localhost")
    assert r.status_code == 400 and "Reload the page" in r.text
    insecure = make_app(pg_url, tmp_path, admin_redis, insecure_cookies=True)
    try:
        assert 'id="plain-http"' not in insecure.test_client().get("/admin/login", base_url=PLAIN).text
    finally:
        insecure.services.database.dispose()
