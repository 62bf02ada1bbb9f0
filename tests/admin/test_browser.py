"""The admin panel in real headless Chromium: each test drives one operator task end to end against a live
server (Postgres + Redis) and saves a screenshot under test-artifacts/admin/. Tests share one signed-in page
and run in file order."""
import re
import time

import redis
from playwright.sync_api import expect
from sqlalchemy import select

from tidepool.service.ledger import jobs as transitions
from tidepool.service.ledger.models import ApiKey, Job, Quota
from tidepool.workers.metrics import EngineMetrics, SnapshotStore

from .conftest import ADMIN, shot


def _db(app):
    return app.services.sessions()


def _run_job(app, job_id, prompt_tokens=5, completion_tokens=7):
    with _db(app) as s:
        token = transitions.start(s, job_id, worker="gpu0").lease_token
        assert token
        s.commit()
        time.sleep(0.02)
        assert transitions.first_token(s, job_id, token)
        s.commit()
        time.sleep(0.02)
        assert transitions.complete(s, job_id, token, output="hello there", output_token_ids=[1, 2],
                                    prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    finish_reason="length")
        s.commit()


def test_sign_in(page, live):
    page.goto("/admin/")
    assert "/admin/login" in page.url
    page.fill("#token", "not-the-token")
    page.click("button[type=submit]")
    assert page.locator(".flash.error").inner_text() == "That admin token is not right."
    page.js_errors.clear()  # the console reports the 401 of the refused sign-in
    page.fill("#token", ADMIN)
    shot(page, "01-login")
    page.click("button[type=submit]")
    page.wait_for_url("**/admin/")
    assert page.locator(".flash.ok").inner_text() == "Signed in."
    cookie = next(c for c in page.context.cookies() if c["name"] == "tidepool_admin")
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert not page.js_errors


def test_create_tenant(page, live):
    page.goto("/admin/tenants")
    page.fill("#name", "")
    page.click("text=Create tenant")
    assert page.locator("#name-error").inner_text() == "Give the tenant a name."
    page.fill("#name", "acme-browser")
    page.fill("#weight", "2.5")
    page.select_option("#default_sla_class", "realtime")
    page.click("text=Create tenant")
    page.wait_for_selector("#new-key")
    key = page.input_value("#new-key-value")
    assert key.startswith("tp_")
    assert page.locator("h1").inner_text().startswith("acme-browser")
    assert page.locator(".flash.ok").inner_text() == "Tenant 'acme-browser' created."
    assert page.input_value("#default_sla_class") == "realtime"
    shot(page, "02-tenant-created")
    page.fill("#weight", "0")                    # edit: a bad weight is marked, the class choice is kept
    page.select_option("#default_sla_class", "interactive")
    page.click("text=Save scheduling")
    page.wait_for_selector("#weight-error")      # the answer page, not the form still showing
    assert page.locator("#default_sla_class-error").count() == 0
    assert page.input_value("#default_sla_class") == "interactive"
    page.fill("#weight", "2.5")
    page.click("text=Save scheduling")
    assert page.locator(".flash.ok").inner_text().startswith("Scheduling saved: weight 2.5")
    assert page.input_value("#default_sla_class") == "interactive"
    page.goto("/admin/tenants")
    row = page.locator("#tenants tr", has_text="acme-browser")
    assert "2.5" in row.inner_text() and "active" in row.inner_text() and "interactive" in row.inner_text()
    page.fill("#name", "acme-browser")
    page.click("text=Create tenant")
    assert "already exists" in page.locator("#name-error").inner_text()
    shot(page, "03-tenants")


def test_quota_validation_and_save(page, live):
    app, _, _ = live
    page.goto("/admin/tenants")
    page.click("text=acme-browser")
    page.fill("#q-max_running", "lots")
    page.fill("#q-requests_per_minute", "-5")
    page.fill("#q-max_queued", "100")
    page.click("text=Save quota")
    assert page.locator(".flash.error").inner_text().startswith("The quota was not saved")
    err = page.locator("#q-max_running-error")
    assert err.inner_text() == "Enter a whole number of 0 or more, or leave empty for no limit."
    assert page.locator("#q-requests_per_minute-error").is_visible()
    assert page.input_value("#q-max_running") == "lots"  # what the operator typed is kept
    assert page.locator("#q-max_queued-error").count() == 0
    shot(page, "04-quota-validation")
    page.fill("#q-max_running", "4")
    page.fill("#q-requests_per_minute", "600")
    page.uncheck("input[value=realtime]")
    page.click("text=Save quota")
    assert page.locator(".flash.ok").inner_text() == "Quota saved."
    with _db(app) as s:
        tenant_id = page.url.split("/tenants/")[1].split("#")[0]
        q = s.get(Quota, tenant_id)
        assert (q.max_running, q.requests_per_minute, q.max_queued) == (4, 600, 100)
        assert "realtime" not in q.allowed_sla_classes
    assert page.input_value("#q-max_running") == "4"


def test_issue_and_revoke_key(page, live):
    app, _, api = live
    page.goto("/admin/tenants")
    page.click("text=acme-browser")
    page.click("text=Issue a new key")
    key = page.input_value("#new-key-value")
    prefix = "_".join(key.split("_")[:2])
    assert "Copy it now" in page.locator(".flash.ok").inner_text()
    assert api.call("GET", "/v1/jobs", token=key)[0] == 200
    page.goto(page.url.replace("/keys", ""))  # reload: the secret is never shown again
    assert page.locator("#new-key").count() == 0 and key not in page.content()
    row = page.locator(f"tr[data-prefix='{prefix}']")
    assert "active" in row.inner_text() and "never" not in row.inner_text()  # last use is recorded
    shot(page, "05-keys")
    row.locator("text=Revoke").click()
    assert page.locator(".flash.ok").inner_text() == f"Key {prefix} revoked."
    assert "revoked" in page.locator(f"tr[data-prefix='{prefix}']").inner_text()
    assert api.call("GET", "/v1/jobs", token=key)[0] == 401
    with _db(app) as s:
        assert s.scalar(select(ApiKey.revoked_at).where(ApiKey.prefix == prefix)) is not None
    shot(page, "06-key-revoked")


def test_job_timeline(page, live):
    app, _, api = live
    tenant_id, key = api.tenant("jobs-tenant")
    status, job = api.call("POST", "/v1/jobs", {"prompt": "hi", "max_tokens": 8, "sla_class": "interactive"},
                           token=key)
    assert status == 202
    status, other = api.call("POST", "/v1/jobs", {"prompt": "yo", "max_tokens": 8, "sla_class": "batch"},
                             token=key)
    page.goto(f"/admin/jobs?tenant={tenant_id}")
    assert page.locator(f"tr[data-job='{job['id']}']").is_visible()
    page.select_option("#f-class", "batch")
    page.click("text=Filter")
    page.wait_for_url("**sla_class=batch**")
    page.wait_for_selector(f"tr[data-job='{other['id']}']")  # is_visible() does not wait: the old page may still show
    assert page.locator(f"tr[data-job='{job['id']}']").count() == 0
    shot(page, "07-jobs-filtered")
    page.goto(f"/admin/jobs/{job['id']}")
    assert page.locator("#job-status").inner_text() == "queued"
    assert page.locator("#timeline li.done").count() == 2  # queued, dispatched
    _run_job(app, job["id"])
    page.reload()
    assert page.locator("#job-status").inner_text() == "completed"
    labels = page.locator("#timeline li .label").all_inner_texts()
    assert labels == ["queued", "dispatched", "started", "first token", "completed"]
    assert page.locator("#timeline li.done").count() == 5
    assert page.locator("#timeline .delta").count() == 4
    assert "hello there" in page.content()
    shot(page, "08-job-timeline")
    page.goto(f"/admin/jobs/{other['id']}")
    page.click("text=Cancel job")
    assert page.locator(".flash.ok").inner_text() == "Job cancelled."
    assert page.locator("#job-status").inner_text() == "cancelled"
    assert not page.js_errors


def test_cancel_batch(page, live):
    app, _, api = live
    _, key = api.tenant("batch-tenant")
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"line {i}", "max_tokens": 4}} for i in range(5)]
    file_id = api.upload(key, lines)
    status, batch = api.call("POST", "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/completions",
                                                     "completion_window": "24h"}, token=key)
    assert status == 200 and batch["status"] == "in_progress"
    with _db(app) as s:
        first = s.scalars(select(Job.id).where(Job.batch_id == batch["id"]).order_by(Job.id)).first()
    _run_job(app, first)
    page.goto("/admin/batches")
    page.click(f"text={batch['id']}")
    assert page.locator("#batch-status").inner_text() == "in_progress"
    assert page.locator("#batch-progress").get_attribute("value") == "1"
    shot(page, "09-batch-in-progress")
    page.click("text=Cancel batch")
    assert "Batch cancelled" in page.locator(".flash.ok").inner_text()
    assert page.locator("#batch-status").inner_text() == "cancelled"
    assert page.locator("#file-output").is_visible() and page.locator("#file-errors").is_visible()
    with page.expect_download() as dl:
        page.click("#file-errors")
    assert dl.value.suggested_filename.endswith("_error.jsonl")
    shot(page, "10-batch-cancelled")
    with _db(app) as s:
        states = s.scalars(select(Job.status).where(Job.batch_id == batch["id"])).all()
    assert sorted(x.value for x in states) == ["cancelled"] * 4 + ["completed"]


def test_dashboard_renders_with_data(page, live, admin_redis):
    app, _, api = live
    _, key = api.tenant("dash-tenant")
    for cls in ("interactive", "interactive", "batch"):
        status, job = api.call("POST", "/v1/jobs", {"prompt": "x", "max_tokens": 4, "sla_class": cls}, token=key)
        _run_job(app, job["id"], completion_tokens=30)
    api.call("POST", "/v1/jobs", {"prompt": "x", "max_tokens": 4, "sla_class": "deferrable"}, token=key)
    metrics = EngineMetrics(worker="gpu0", store=SnapshotStore(redis.Redis.from_url(admin_redis)), device="cuda:0")
    stats = {"running": 3, "waiting": 2, "by_class": {"interactive": {"running": 2, "waiting": 0},
                                                      "batch": {"running": 1, "waiting": 2}},
             "kv_cache_usage": 0.42, "preemptions": 3, "prefix_cache_queries": 40, "prefix_cache_hits": 10,
             "total_prompt_tokens": 100, "total_generation_tokens": 500, "total_steps": 10,
             "last_step": {"tokens": 7}}
    metrics.update_from_stats(stats, now=time.time() - 1)
    page.goto("/admin/")
    page.wait_for_selector("#dashboard[data-loaded='1']")
    # on load every chart spans the same window (the ledger's history seeds them all, not only the latency ones)
    spans = {c: page.locator(f"#{c} text.axis", has_text=re.compile(r"^-\d+s$")).first.text_content()
             for c in ("c-queue", "c-tps", "c-kv", "c-ttft", "c-seqs", "c-e2e")}
    assert len(set(spans.values())) == 1, spans
    # the two cache tiles say what each measures (in use now vs hits since start)
    assert "now" in page.locator("#tile-kv").inner_text() and "since" in page.locator("#tile-prefix").inner_text()
    stats.update(total_generation_tokens=800, total_steps=20)
    metrics.update_from_stats(stats, now=time.time())
    # (The panel's CSP forbids eval, so wait from Python rather than with wait_for_function.)
    expect(page.locator("#worker-table")).to_contain_text("gpu0 (cuda:0)")
    line = page.locator("#c-queue polyline").first
    deadline = time.time() + 10
    while len((line.get_attribute("points") or "").split()) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert len(line.get_attribute("points").split()) >= 3, "the chart did not refresh on its own"
    assert page.locator("#t-kv").inner_text() == "42.0%"
    assert page.locator("#t-prefix").inner_text() == "25.0%"
    assert page.locator("#t-preempt").inner_text() == "3"
    assert float(page.locator("#t-tps").inner_text()) > 0
    row = page.locator("#class-table tr[data-class='interactive']")
    assert int(row.locator("td[data-k='n']").inner_text()) >= 2  # earlier tests completed one too
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", row.locator("td[data-k='ttft_p99']").inner_text())
    deferrable = page.locator("#class-table tr[data-class='deferrable']")
    assert deferrable.locator("td[data-k='queued']").inner_text() == "1"
    assert deferrable.locator("td[data-k='queue']").inner_text() == "1"  # the message waits in Redis
    assert "gpu0 (cuda:0)" in page.locator("#worker-table").inner_text()
    assert "interactive 2/0 · batch 1/2" in page.locator("#worker-table").inner_text()
    assert page.locator("#dash-error").is_hidden()
    shot(page, "11-dashboard")
    assert not page.js_errors, page.js_errors


def test_phone_layout(browser, live):
    """The same pages on a phone-sized screen: nothing wider than the viewport."""
    _, base, _ = live
    context = browser.new_context(viewport={"width": 390, "height": 844}, base_url=base, is_mobile=True,
                                  has_touch=True, device_scale_factor=2)
    pg = context.new_page()
    pg.goto("/admin/login")
    pg.fill("#token", ADMIN)
    pg.click("button[type=submit]")
    pg.wait_for_selector("#dashboard[data-loaded='1']")
    for path, name in (("/admin/", "12-phone-dashboard"), ("/admin/tenants", "13-phone-tenants"),
                       ("/admin/jobs", "14-phone-jobs")):
        pg.goto(path)
        if path == "/admin/":
            pg.wait_for_selector("#dashboard[data-loaded='1']")
        overflow = pg.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{path} scrolls sideways by {overflow}px"
        shot(pg, name)
    context.close()
