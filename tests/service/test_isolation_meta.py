"""No route leaks another tenant's object; OpenAPI covers every route; health; CLI."""
import io
import json

from service.openapi import ROUTES
from workers import cli



def test_no_route_leaks_another_tenants_object(client, admin):
    _, mine = admin.tenant()
    _, theirs = admin.tenant()
    job = client.post("/v1/jobs", json={"prompt": "x"}, headers=theirs).get_json()["id"]
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")},
                    headers=theirs).get_json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}, headers=theirs).get_json()["id"]
    probes = [("get", "/v1/jobs/{}", job, "job_missing"), ("post", "/v1/jobs/{}/cancel", job, "job_missing"),
              ("get", "/v1/files/{}", f, "file-missing"), ("get", "/v1/files/{}/content", f, "file-missing"),
              ("delete", "/v1/files/{}", f, "file-missing"), ("get", "/v1/batches/{}", batch, "batch_missing"),
              ("post", "/v1/batches/{}/cancel", batch, "batch_missing")]
    for method, path, other_id, missing_id in probes:
        leaked = getattr(client, method)(path.format(other_id), headers=mine)
        missing = getattr(client, method)(path.format(missing_id), headers=mine)
        assert leaked.status_code == missing.status_code == 404, path
        assert leaked.get_json()["error"]["code"] == missing.get_json()["error"]["code"] == "not_found"
    r = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=mine)
    assert r.status_code == 404
    for path in ("/v1/jobs", "/v1/files", "/v1/batches"):
        assert client.get(path, headers=mine).get_json()["data"] == [], path
    # and the owner still sees everything untouched
    assert client.get(f"/v1/jobs/{job}", headers=theirs).get_json()["status"] == "queued"
    assert client.get(f"/v1/batches/{batch}", headers=theirs).get_json()["status"] == "in_progress"


def test_openapi_documents_exactly_the_url_map(embedded_app):
    spec = embedded_app.test_client().get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.")
    documented = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    served = set()
    for rule in embedded_app.url_map.iter_rules():
        # The HTML admin panel (/admin, session cookie) and the Prometheus text endpoint are not part of
        # the JSON API this document describes.
        if rule.endpoint.startswith("panel.") or rule.rule == "/metrics":
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((method.lower(), path))
    assert served == documented
    assert len(ROUTES) == len(documented)


def test_health_and_readiness(client, tmp_path, pg_url, redis_url):
    from service import create_app
    from workers.metrics import EngineMetrics, SnapshotStore
    assert client.get("/healthz").get_json() == {"status": "ok"}
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path),
                      "model": str(tmp_path / "models" / "m1")})
    store = SnapshotStore(app.extensions["tidepool.redis"])
    store.clear()
    r = app.test_client().get("/readyz")       # no worker has its engine up yet
    assert r.status_code == 503 and "engine no worker with its engine up yet for m1" in r.get_json()["error"]["message"]
    store.put(EngineMetrics(worker="w-ready", model="/elsewhere/other-model").snapshot({}))
    assert app.test_client().get("/readyz").status_code == 503     # a worker for another model does not count
    store.put(EngineMetrics(worker="w-ready", model="models/m1").snapshot({}))
    r = app.test_client().get("/readyz")
    assert r.status_code == 200 and r.get_json()["checks"] == {"database": "ok", "broker": "ok", "engine": "ok"}
    store.clear()
    app.extensions["tidepool.engine"].dispose()
    from service import create_app
    down = create_app({"database_url": pg_url, "redis_url": "redis://127.0.0.1:1/0", "storage_dir": str(tmp_path)})
    r = down.test_client().get("/readyz")
    assert r.status_code == 503 and "broker" in r.get_json()["error"]["message"]
    down.extensions["tidepool.engine"].dispose()


def test_unknown_route_and_method_are_openai_shaped(client):
    assert client.get("/v1/nope").get_json()["error"]["code"] == "not_found"
    r = client.put("/v1/jobs")
    assert r.status_code == 405 and r.get_json()["error"]["type"] == "invalid_request_error"


def test_cli_db_tenants_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    assert cli.main(["db", "upgrade"]) == 0
    capsys.readouterr()
    assert cli.main(["tenants", "create", "acme", "--weight", "2"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["id"].startswith("ten_") and created["api_key"].startswith("tp_") and created["weight"] == 2.0
    assert cli.main(["tenants", "create", "acme"]) == 1
    capsys.readouterr()
    assert cli.main(["keys", "create", created["id"]]) == 0
    key = json.loads(capsys.readouterr().out)
    assert key["api_key"].startswith(key["prefix"] + "_")
    assert cli.main(["keys", "revoke", key["prefix"]]) == 0
    assert cli.main(["keys", "revoke", key["prefix"]]) == 1
    assert cli.main(["keys", "create", "ten_missing"]) == 1

    from service import create_app
    app = create_app({"storage_dir": str(tmp_path / "s")})
    c = app.test_client()
    assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {created['api_key']}"}).status_code == 200
    assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {key['api_key']}"}).status_code == 401
    app.extensions["tidepool.engine"].dispose()


def test_service_never_imports_torch(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from service import create_app, commands, migrate, batches, jobs, dispatch; "
            f"create_app({{'database_url': 'sqlite:///{tmp_path}/t.db', 'storage_dir': '{tmp_path}'}}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
