"""What a newcomer trips on in the panel: a refresh after creating a tenant or issuing a key (post/redirect/get,
the key shown once, with a copy button), a finished batch without an error file, words broken mid-word."""
from pathlib import Path

from tidepool.service.ledger import tenants
from tidepool.service.ledger.models import Batch, BatchStatus, SlaClass

from .conftest import sign_in

HTTPS = "https://localhost"
WEB = Path(__file__).resolve().parents[2] / "web"


def test_new_tenant_and_key_post_redirect_get(client):
    csrf = sign_in(client)
    r = client.post("/admin/tenants", data={"name": "prg", "weight": "1", "csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 303 and "/admin/tenants/ten_" in r.headers["Location"]
    page = client.get(r.headers["Location"], base_url=HTTPS).text
    assert 'id="new-key-value"' in page and 'id="copy-key"' in page and "Tenant &#39;prg&#39; created." in page
    key = page.split('id="new-key-value"')[0].rsplit('value="', 1)[1].split('"')[0]
    assert key.startswith("tp_")
    again = client.get(r.headers["Location"], base_url=HTTPS).text      # a refresh: no second tenant, no key
    assert key not in again and 'id="new-key-value"' not in again
    r = client.post(r.headers["Location"] + "/keys", data={"csrf_token": csrf}, base_url=HTTPS)
    assert r.status_code == 303
    page = client.get(r.headers["Location"], base_url=HTTPS).text
    assert 'id="new-key-value"' in page and "Copy it now" in page


def test_finished_batch_without_errors_says_none(client, app):
    sign_in(client)
    with app.services.sessions() as s:
        tenant, _ = tenants.create_tenant(s, "files")
        done = Batch(tenant_id=tenant.id, endpoint="/v1/completions", input_file_id="file-x", completion_window="24h",
                     sla_class=SlaClass.batch, status=BatchStatus.completed, output_file_id=None)
        running = Batch(tenant_id=tenant.id, endpoint="/v1/completions", input_file_id="file-y",
                        completion_window="24h", sla_class=SlaClass.batch, status=BatchStatus.in_progress)
        s.add_all([done, running])
        s.commit()
        done_id, running_id = done.id, running.id
    page = client.get(f"/admin/batches/{done_id}", base_url=HTTPS).text
    assert "none (no request failed)" in page and "written when the batch finishes" not in page
    page = client.get(f"/admin/batches/{running_id}", base_url=HTTPS).text
    assert "written when the batch finishes" in page


def test_words_do_not_break_mid_word():
    css = (WEB / "static" / "panel.css").read_text()
    assert "break-all" not in css and "overflow-wrap: anywhere" in css


def test_dashboard_charts_are_seeded_from_the_ledger(client, app):
    from datetime import timedelta

    from tidepool.service.ledger.models import Job, JobStatus, utcnow
    sign_in(client)
    now = utcnow()
    with app.services.sessions() as s:
        tenant, _ = tenants.create_tenant(s, "seeded")
        for i, (sla, ago) in enumerate([(SlaClass.realtime, 30), (SlaClass.realtime, 31), (SlaClass.batch, 100)]):
            finished = now - timedelta(seconds=ago)
            s.add(Job(id=f"job_seed{i}", tenant_id=tenant.id, sla_class=sla, status=JobStatus.completed,
                      endpoint="/v1/completions", request={"prompt": "x", "max_tokens": 50}, estimated_tokens=51,
                      attempts=1, created_at=finished - timedelta(seconds=2), queued_at=finished - timedelta(seconds=2),
                      first_token_at=finished - timedelta(seconds=1.5), finished_at=finished, completion_tokens=50))
        s.commit()
    plain = client.get("/admin/api/dashboard", base_url=HTTPS).get_json()
    assert "history" not in plain
    points = client.get("/admin/api/dashboard?history=1", base_url=HTTPS).get_json()["history"]
    assert len(points) == 18 and points == sorted(points, key=lambda p: p["ts"])
    assert sum(p["tokens_per_s"] for p in points) * 10 == 150
    rt = [p for p in points if p["ttft_p99"]["realtime"] is not None]
    assert len(rt) in (1, 2) and all(abs(p["ttft_p99"]["realtime"] - 0.5) < 0.01 for p in rt)
    assert [p["e2e_p99"]["batch"] for p in points if p["e2e_p99"]["batch"] is not None] == [2.0]


def test_dashboard_script_gets_the_classes_from_the_server(client):
    import json
    import re

    from tidepool.service.ledger.models import SLA_CLASSES
    sign_in(client)
    page = client.get("/admin/", base_url=HTTPS).text
    raw = re.search(r'data-classes="([^"]*)"', page).group(1).replace("&#34;", '"')
    assert tuple(json.loads(raw)) == SLA_CLASSES
    script = (WEB / "static" / "dashboard.js").read_text()
    assert not any(f'"{c}"' in script for c in SLA_CLASSES)
