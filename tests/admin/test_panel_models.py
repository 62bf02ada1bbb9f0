"""The Models page in headless Chromium against a live server: register (with per-field errors),
retier, disable, grant and revoke, a model's waiting jobs shown as served by no worker; every change audited
with the panel as actor; a form without the CSRF token is refused."""
import re

from sqlalchemy import select

from tidepool.service.ledger.models import AuditLog, Quota

from .conftest import ADMIN, csrf_from, make_app, shot, sign_in


def _flash(page) -> str:
    return page.locator(".flash").first.inner_text()


def test_models_page_end_to_end(page, live):
    app, _, api = live
    page.goto("/admin/login")
    page.fill("#token", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/")
    page.click("nav >> text=Models")
    page.wait_for_url("**/admin/models")
    assert "No models yet" in page.locator("main").inner_text()

    page.fill("#model-name", "beta")
    page.fill("#model-source", "relative/beta")
    page.click("text=Register model")
    assert "absolute path" in page.locator("#model-source-error").inner_text()
    assert page.input_value("#model-name") == "beta"          # what the operator typed is kept
    page.fill("#model-source", "/srv/models/beta")
    page.select_option("#model-tier", "cold")
    page.click("text=Register model")
    assert _flash(page) == "Model 'beta' registered (cold)."
    row = page.locator("#models tr[data-model=beta]")
    assert "/srv/models/beta" in row.inner_text() and "enabled" in row.inner_text()
    assert row.locator("select[name=tier]").input_value() == "cold"

    row.locator("select[name=tier]").select_option("hot")
    row.locator("text=Retier").click()
    assert _flash(page) == "Model 'beta': tier hot."
    row = page.locator("#models tr[data-model=beta]")
    assert row.locator("select[name=tier]").input_value() == "hot"
    # destructive buttons look it, as on Tenants: Disable and Revoke are red, unlike Retier and Grant
    red = page.evaluate("() => ['#models tr[data-model=beta] button.danger', '#revoke-button', '#grant-button']"
                        ".map(s => getComputedStyle(document.querySelector(s)).color)")
    assert red[0] == red[1] != red[2], red
    assert row.locator("button.danger").inner_text() == "Disable"
    row.locator("text=Disable").click()
    assert _flash(page) == "Model 'beta': disabled."
    assert "disabled" in page.locator("#models tr[data-model=beta]").inner_text()
    page.locator("#models tr[data-model=beta]").locator("text=Enable").click()
    assert _flash(page) == "Model 'beta': enabled."

    # grants: a tenant without a list may use everything; revoking gives it a list of the others
    page.fill("#model-name", "gamma")
    page.fill("#model-source", "/srv/models/gamma")
    page.click("text=Register model")
    tenant_id, key = api.tenant("models-browser")
    page.reload()
    assert "every enabled model" in page.locator(f"#allow-lists tr[data-tenant={tenant_id}]").inner_text()
    page.select_option("#grant-tenant", tenant_id)
    page.select_option("#grant-model", "beta")
    page.click("#revoke-button")
    assert _flash(page) == "'beta' revoked from the tenant."
    assert page.locator(f"#allow-lists tr[data-tenant={tenant_id}]").inner_text().split()[-1] == "gamma"
    status, body = api.call("GET", "/v1/models", token=key)
    assert status == 200 and [m["id"] for m in body["data"]] == ["gamma"]
    page.select_option("#grant-tenant", tenant_id)
    page.select_option("#grant-model", "gamma")
    page.click("#revoke-button")
    assert "last model" in _flash(page)
    page.select_option("#grant-tenant", tenant_id)
    page.select_option("#grant-model", "beta")
    page.click("#grant-button")
    assert _flash(page) == "'beta' granted to the tenant."
    with app.services.sessions() as s:
        assert s.get(Quota, tenant_id).allowed_models == ["beta", "gamma"]

    # a job for a model no worker serves waits, and the page says so
    status, job = api.call("POST", "/v1/jobs", {"prompt": "hi", "max_tokens": 2, "model": "gamma"}, token=key)
    assert status == 202 and job["model"] == "gamma", job
    page.goto("/admin/models")
    assert "interactive 1 · no worker" in page.locator("#models tr[data-model=gamma]").inner_text()
    shot(page, "models")
    assert not page.js_errors

    with app.services.sessions() as s:
        audit = [(a.actor, a.action, a.target) for a in s.scalars(select(AuditLog).order_by(AuditLog.id))
                 if a.action.startswith("model.")]
    assert audit == [("panel", "model.register", "beta"), ("panel", "model.retier", "beta"),
                     ("panel", "model.disable", "beta"), ("panel", "model.enable", "beta"),
                     ("panel", "model.register", "gamma"), ("panel", "model.revoke", tenant_id),
                     ("panel", "model.grant", tenant_id)]


def test_model_forms_need_the_csrf_token(client, app):
    csrf = sign_in(client)
    https = "https://localhost"
    r = client.post("/admin/models", data={"name": "x", "source": "/x"}, base_url=https)
    assert r.status_code in (400, 403)
    page = client.get("/admin/models", base_url=https)
    assert page.status_code == 200 and csrf_from(page.text) == csrf
    r = client.post("/admin/models", data={"name": "x", "source": "/x", "csrf_token": csrf}, base_url=https)
    assert r.status_code == 303
    for path, data in (("/admin/models/update", {"name": "x", "tier": "hot"}),
                       ("/admin/models/grants", {"tenant_id": "t", "model": "x", "action": "grant"})):
        assert client.post(path, data=data, base_url=https).status_code in (400, 403)


def test_the_page_shows_each_models_tensor_parallel_size(pg_url, tmp_path, admin_redis):
    app = make_app(pg_url, tmp_path, admin_redis, tensor_parallel_size=4)
    try:
        client, bearer = app.test_client(), {"Authorization": f"Bearer {ADMIN}"}
        for body in ({"name": "big", "source": "/srv/models/big", "tensor_parallel_size": 2},
                     {"name": "small", "source": "/srv/models/small"}):
            assert client.post("/v1/admin/models", json=body, headers=bearer).status_code == 201
        sign_in(client)
        page = client.get("/admin/models", base_url="https://localhost").text

        def cell(model):
            row = re.search(rf'<tr data-model="{model}">(.*?)</tr>', page, re.S).group(1)
            text = re.search(r'class="tensor-parallel">(.*?)</td>', row, re.S).group(1)
            return " ".join(re.sub(r"<[^>]+>", " ", text).split())
        assert "<th>Tensor parallel</th>" in page
        assert (cell("big"), cell("small")) == ("2", "4 (deployment)")
    finally:
        app.services.database.dispose()


def test_the_page_shows_each_models_kv_cache_dtype_in_use_and_its_loss(pg_url, tmp_path, admin_redis):
    from sqlalchemy.orm import Session

    from tidepool.service.ledger import registry
    app = make_app(pg_url, tmp_path, admin_redis)
    try:
        client, bearer = app.test_client(), {"Authorization": f"Bearer {ADMIN}"}
        for body in ({"name": "q8", "source": "/srv/models/q8", "kv_cache_dtype": "int8"},
                     {"name": "e5", "source": "/srv/models/e5", "kv_cache_dtype": "fp8_e5m2"},
                     {"name": "plain", "source": "/srv/models/plain"}):
            assert client.post("/v1/admin/models", json=body, headers=bearer).status_code == 201
        figures = {"int8": {"loss": 0.004, "refused": False}, "fp8_e5m2": {"loss": 0.094, "refused": True}}
        with Session(app.services.database) as s:
            for name in ("q8", "e5"):
                registry.set_kv_calibration(s, name, {"accuracy": figures}, actor="test")
            s.commit()
        app.services.registry._cached = None
        sign_in(client)
        page = client.get("/admin/models", base_url="https://localhost").text

        def cell(model):
            row = re.search(rf'<tr data-model="{model}">(.*?)</tr>', page, re.S).group(1)
            text = re.search(r'class="kv-cache">(.*?)</td>', row, re.S).group(1)
            return " ".join(re.sub(r"<[^>]+>", " ", text).split())
        assert "<th>KV cache</th>" in page
        assert cell("q8") == "int8 0.40% lost"
        assert cell("e5") == "auto fp8_e5m2 refused 9.40% lost"
        assert cell("plain") == "auto"
        listed = {m["id"]: m for m in client.get("/v1/admin/models", headers=bearer).get_json()["data"]}
        assert listed["e5"]["kv_cache_dtype_in_use"] == "auto" and listed["q8"]["kv_cache_loss"] == 0.004
    finally:
        app.services.database.dispose()
