"""The tenant's default online SLA class in the panel's create and edit forms (the JSON admin API's
PATCH /v1/admin/tenants/<id> field): saved, shown, validated per field, CSRF-guarded, audited."""
import re

from sqlalchemy import select

from tidepool.service.ledger.models import AuditLog, Tenant

from .conftest import csrf_from, sign_in

HTTPS = "https://localhost"


def _tenant(app, name: str) -> Tenant:
    with app.services.sessions() as s:
        return s.scalar(select(Tenant).where(Tenant.name == name))


def _selected(html: str, select_id: str) -> str:
    block = re.search(rf'<select id="{select_id}".*?</select>', html, re.S).group(0)
    return re.search(r'<option value="([^"]*)" selected>', block).group(1)


def test_create_with_a_default_class_and_per_field_errors(client, app):
    csrf = sign_in(client)
    page = client.get("/admin/tenants", base_url=HTTPS).text
    assert _selected(page, "default_sla_class") == ""       # no default unless chosen
    assert '<option value="batch"' not in page               # only online classes are offered

    r = client.post("/admin/tenants", data={"name": "chatty", "weight": "2", "default_sla_class": "realtime",
                                            "csrf_token": csrf}, base_url=HTTPS, follow_redirects=True)
    assert r.status_code == 200
    assert _selected(r.text, "default_sla_class") == "realtime"     # the edit form shows it
    assert _tenant(app, "chatty").default_sla_class == "realtime"
    assert "chatty" in (rows := client.get("/admin/tenants", base_url=HTTPS).text) and "realtime" in rows

    # a forged value: the field is marked, what else was typed is kept, nothing is created
    r = client.post("/admin/tenants", data={"name": "offline", "weight": "x", "default_sla_class": "batch",
                                            "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 400
    assert re.search(r'id="default_sla_class-error">Choose realtime or interactive', r.text)
    assert 'id="weight-error"' in r.text and 'value="offline"' in r.text
    assert 'aria-invalid="true" aria-describedby="default_sla_class-error"' in r.text
    assert _tenant(app, "offline") is None

    r = client.post("/admin/tenants", data={"name": "plain", "weight": "1", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 303 and _tenant(app, "plain").default_sla_class is None


def test_edit_default_class_validates_and_audits(client, app):
    csrf = sign_in(client)
    r = client.post("/admin/tenants", data={"name": "acme", "weight": "1", "csrf_token": csrf}, base_url=HTTPS,
                    follow_redirects=True)
    tenant_id = _tenant(app, "acme").id
    assert _selected(r.text, "default_sla_class") == ""
    url = f"/admin/tenants/{tenant_id}/scheduling"

    r = client.post(url, data={"weight": "3", "default_sla_class": "interactive", "csrf_token": csrf},
                    base_url=HTTPS)
    assert r.status_code == 302 and r.headers["Location"].endswith(f"/admin/tenants/{tenant_id}")
    page = client.get(f"/admin/tenants/{tenant_id}", base_url=HTTPS).text
    assert "Scheduling saved: weight 3, online requests without a class run as interactive." in page
    assert _selected(page, "default_sla_class") == "interactive" and 'value="3"' in page
    t = _tenant(app, "acme")
    assert (t.weight, t.default_sla_class) == (3.0, "interactive")

    # both fields wrong: each gets its own message, the typed values stay, nothing changes
    r = client.post(url, data={"weight": "0", "default_sla_class": "deferrable", "csrf_token": csrf},
                    base_url=HTTPS)
    assert r.status_code == 400 and "Scheduling was not saved" in r.text
    assert 'id="weight-error"' in r.text and 'id="default_sla_class-error"' in r.text
    assert 'value="0"' in r.text
    t = _tenant(app, "acme")
    assert (t.weight, t.default_sla_class) == (3.0, "interactive")

    # only the class wrong: the weight field is not marked
    r = client.post(url, data={"weight": "4", "default_sla_class": "bogus", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 400 and 'id="weight-error"' not in r.text and 'id="default_sla_class-error"' in r.text

    # back to no default
    r = client.post(url, data={"weight": "3", "default_sla_class": "", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 302 and _tenant(app, "acme").default_sla_class is None

    # CSRF as on every other form
    for data in ({"weight": "1", "default_sla_class": "realtime"},
                 {"weight": "1", "default_sla_class": "realtime", "csrf_token": "wrong"}):
        r = client.post(url, data=data, base_url=HTTPS)
        assert r.status_code == 400 and "CSRF check failed" in r.text
    assert _tenant(app, "acme").default_sla_class is None

    with app.services.sessions() as s:
        changes = s.scalars(select(AuditLog.details).where(AuditLog.action == "tenant.update",
                                                           AuditLog.target == tenant_id).order_by(AuditLog.id)).all()
    assert [c["default_sla_class"] for c in changes] == ["interactive", None]


def test_the_scheduling_form_carries_the_csrf_token(client):
    csrf = sign_in(client)
    r = client.post("/admin/tenants", data={"name": "forms2", "weight": "1", "csrf_token": csrf}, base_url=HTTPS,
                    follow_redirects=True)
    form = re.search(r'<form[^>]*id="scheduling".*?</form>', r.text, re.S).group(0)
    assert csrf_from(form) == csrf and 'name="default_sla_class"' in form
