"""The model registry: registration, tiers, enable/disable and grants through the admin API, with
audit; /v1/models lists exactly what a tenant may use; unknown models are 404 and forbidden ones 403, in the
OpenAI error shape, on every submission route and for each batch line; a model's jobs wait in its own queues,
visible per (model, SLA class), and the sweeper republishes them there."""
import io
import json

import pytest
import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tidepool.service import create_app
from tidepool.service.ledger.models import AuditLog, Job

from .conftest import ADMIN, Admin

PROMPT = {"prompt": "hi", "max_tokens": 2}


def _folder(path, context=2048):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return str(path)


@pytest.fixture
def two(pg_url, redis_url, tmp_path):
    """A Postgres + Redis app whose default model is `alpha` (TIDEPOOL_MODEL), with `beta` registered."""
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN, "model": _folder(tmp_path / "alpha")})
    client = app.test_client()
    admin = Admin(client)
    r = client.post("/v1/admin/models", json={"name": "beta", "source": _folder(tmp_path / "beta", 64),
                                              "tier": "warm"}, headers=admin.headers)
    assert r.status_code == 201, r.get_json()
    yield app, client, admin
    app.services.database.dispose()


def _ids(client, key):
    r = client.get("/v1/models", headers=key)
    assert r.status_code == 200
    return sorted(m["id"] for m in r.get_json()["data"])


def _error(r, status, code):
    body = r.get_json()
    assert r.status_code == status, body
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["code"] == code
    return body["error"]


def test_admin_registers_retiers_disables_and_grants_with_audit(two):
    app, client, admin = two
    h = admin.headers
    listing = {m["id"]: m for m in client.get("/v1/admin/models", headers=h).get_json()["data"]}
    assert listing["alpha"]["registered"] is False and listing["alpha"]["tier"] == "hot"   # the default, implicit
    assert listing["beta"] == {**listing["beta"], "tier": "warm", "enabled": True, "registered": True}
    assert client.post("/v1/admin/models", json={"name": "beta", "source": "/x"}, headers=h).status_code == 409
    _error(client.post("/v1/admin/models", json={"name": "a@b", "source": "/x"}, headers=h), 400, "invalid_value")
    _error(client.post("/v1/admin/models", json={"name": "c", "source": "rel/x"}, headers=h), 400, "invalid_value")
    _error(client.post("/v1/admin/models", json={"name": "c", "source": "/x", "tier": "lukewarm"}, headers=h),
           400, "invalid_value")
    assert client.post("/v1/admin/models", json={"name": "c", "source": "/x"}).status_code == 401

    r = client.patch("/v1/admin/models/beta", json={"tier": "cold"}, headers=h)
    assert r.status_code == 200 and r.get_json()["tier"] == "cold"
    assert listing["beta"]["tensor_parallel_size"] == listing["alpha"]["tensor_parallel_size"] == 1
    r = client.patch("/v1/admin/models/beta", json={"tensor_parallel_size": 2}, headers=h)
    assert r.status_code == 200 and r.get_json()["tensor_parallel_size"] == 2
    for bad in (0, 65, True, 1.5, "2"):
        _error(client.patch("/v1/admin/models/beta", json={"tensor_parallel_size": bad}, headers=h), 400,
               "invalid_value")
    r = client.patch("/v1/admin/models/beta", json={"tensor_parallel_size": None}, headers=h)
    assert r.status_code == 200 and r.get_json()["tensor_parallel_size"] == 1      # the deployment's again
    assert client.patch("/v1/admin/models/beta", json={"enabled": False}, headers=h).get_json()["enabled"] is False
    assert client.patch("/v1/admin/models/nope", json={"enabled": False}, headers=h).status_code == 404
    # the implicit default model gets its row when an admin changes it
    r = client.patch("/v1/admin/models/alpha", json={"tier": "warm"}, headers=h)
    assert r.status_code == 200 and r.get_json() == {**r.get_json(), "tier": "warm", "registered": True}

    tenant_id, _ = admin.tenant()
    r = client.delete(f"/v1/admin/tenants/{tenant_id}/models/alpha", headers=h)
    assert r.status_code == 200 and r.get_json()["allowed_models"] == ["beta"]
    _error(client.delete(f"/v1/admin/tenants/{tenant_id}/models/beta", headers=h), 409, "last_model")
    r = client.post(f"/v1/admin/tenants/{tenant_id}/models", json={"model": "alpha"}, headers=h)
    assert r.status_code == 200 and r.get_json()["allowed_models"] == ["alpha", "beta"]
    # a model to be registered may be granted, as a quota's allowed_models may name it; a bad name is a 400
    r = client.post(f"/v1/admin/tenants/{tenant_id}/models", json={"model": "later"}, headers=h)
    assert r.status_code == 200 and r.get_json()["allowed_models"] == ["alpha", "beta", "later"]
    _error(client.post(f"/v1/admin/tenants/{tenant_id}/models", json={"model": "a b"}, headers=h), 400, "invalid_value")

    with Session(app.services.database) as s:
        actions = [(a.action, a.target) for a in s.scalars(select(AuditLog).order_by(AuditLog.id))]
    assert [a for a in actions if a[0].startswith("model.")] == [
        ("model.register", "beta"), ("model.retier", "beta"), ("model.update", "beta"), ("model.update", "beta"),
        ("model.disable", "beta"),
        ("model.register", "alpha"), ("model.retier", "alpha"),
        ("model.revoke", tenant_id), ("model.grant", tenant_id), ("model.grant", tenant_id)]


def test_v1_models_lists_exactly_what_the_tenant_may_use(two):
    app, client, admin = two
    anyone_id, anyone = admin.tenant()
    only_beta_id, only_beta = admin.tenant(allowed_models=["beta"])
    assert _ids(client, anyone) == ["alpha", "beta"]          # no allow-list: every enabled model
    assert _ids(client, only_beta) == ["beta"]
    assert client.get("/v1/models/beta", headers=only_beta).get_json()["id"] == "beta"
    _error(client.get("/v1/models/alpha", headers=only_beta), 403, "model_not_allowed")
    _error(client.get("/v1/models/gpt-4", headers=anyone), 404, "model_not_found")
    client.patch("/v1/admin/models/beta", json={"enabled": False}, headers=admin.headers)
    assert _ids(client, anyone) == ["alpha"] and _ids(client, only_beta) == []
    r = client.patch(f"/v1/admin/tenants/{only_beta_id}/quota", json={"allowed_models": []}, headers=admin.headers)
    assert r.status_code == 200 and _ids(client, only_beta) == ["alpha"]    # [] is every model, as null
    assert client.patch(f"/v1/admin/tenants/{anyone_id}/quota", json={"allowed_models": ["a@b"]},
                        headers=admin.headers).status_code == 400


def test_unknown_is_404_and_forbidden_is_403_on_every_route(two):
    app, client, admin = two
    _, key = admin.tenant(allowed_models=["alpha"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/jobs", PROMPT), ("/v1/completions", PROMPT), ("/v1/chat/completions", chat)):
        _error(client.post(path, json={**body, "model": "gpt-4"}, headers=key), 404, "model_not_found")
        _error(client.post(path, json={**body, "model": "beta"}, headers=key), 403, "model_not_allowed")
    client.patch("/v1/admin/models/alpha", json={"enabled": False}, headers=admin.headers)
    _error(client.post("/v1/jobs", json=PROMPT, headers=key), 403, "model_disabled")    # no model: the default

    # each batch line: the batch fails, each bad line named
    client.patch("/v1/admin/models/alpha", json={"enabled": True}, headers=admin.headers)
    lines = [{"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {**PROMPT, **extra}}
             for c, extra in (("ok", {}), ("unknown", {"model": "gpt-4"}), ("forbidden", {"model": "beta"}),
                              ("named", {"model": "alpha"}), ("long", {"model": "alpha", "max_tokens": 2048}))]
    data = "\n".join(json.dumps(x) for x in lines).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
                    headers=key).get_json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key).get_json()
    assert b["status"] == "failed"
    assert [(e["line"], e["code"]) for e in b["errors"]["data"]] == [(2, "model_not_found"), (3, "model_not_allowed"),
                                                                 (5, "context_length_exceeded")]


def test_jobs_wait_in_their_models_queue_visible_and_republished_there(two):
    app, client, admin = two
    _, key = admin.tenant()
    broker = redis.Redis.from_url(app.config["TIDEPOOL"].redis_url)
    a = client.post("/v1/jobs", json=PROMPT, headers=key).get_json()
    b = client.post("/v1/jobs", json={**PROMPT, "model": "beta", "sla_class": "batch"}, headers=key).get_json()
    assert (a["model"], b["model"]) == ("alpha", "beta")
    assert broker.llen("interactive") == 1 and broker.llen("batch@beta") == 1 and broker.llen("batch") == 0
    _error(client.post("/v1/jobs", json={**PROMPT, "model": "beta", "max_tokens": 64}, headers=key), 400,
           "context_length_exceeded")   # beta's own context (64), not alpha's

    # nobody serves beta: its job stays queued and is shown so, per (model, class)
    rows = client.get("/v1/admin/queues", headers=admin.headers).get_json()["models"]
    beta_batch = [r for r in rows if r["model"] == "beta" and r["sla_class"] == "batch"]
    assert beta_batch == [{"model": "beta", "sla_class": "batch", "queue": "batch@beta", "depth": 1,
                           "served": False}]
    from prometheus_client.parser import text_string_to_metric_families
    page = {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(client.get("/metrics", headers=admin.headers).text)
            for s in fam.samples}
    assert page[("tidepool:queue_depth", frozenset({("model", "beta"), ("sla_class", "batch")}))] == 1
    assert page[("tidepool:queue_depth", frozenset({("model", "alpha"), ("sla_class", "interactive")}))] == 1

    # a lost publish is republished to the job's own model queue
    broker.delete("batch@beta", "interactive")
    with Session(app.services.database) as s:
        s.execute(update(Job).values(dispatched_at=None))
        s.commit()
    assert app.services.dispatcher.republish_undispatched(older_than=0) == 2
    assert broker.llen("interactive") == 1 and broker.llen("batch@beta") == 1
    with Session(app.services.database) as s:
        assert s.get(Job, b["id"]).status.value == "queued"


def test_cli_registers_lists_and_retiers(two, pg_url, tmp_path, monkeypatch, capsys):
    from tidepool.workers.cli import main
    app, client, admin = two
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", pg_url)
    monkeypatch.delenv("TIDEPOOL_MODEL", raising=False)
    assert main(["models", "register", "delta", str(tmp_path / "nowhere")]) == 1      # no config.json there
    assert main(["models", "register", "delta", _folder(tmp_path / "delta"), "--tier", "cold"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"name": "delta", "source": str((tmp_path / "delta").resolve()), "tier": "cold", "enabled": True,
                   "tensor_parallel_size": 1, "kv_cache_dtype": "auto"}
    assert main(["models", "register", "delta", _folder(tmp_path / "delta")]) == 1      # taken
    assert main(["models", "set", "delta", "--tier", "hot", "--disable"]) == 0
    capsys.readouterr()
    assert main(["models", "registry"]) == 0
    listed = {m["id"]: m for m in json.loads(capsys.readouterr().out.strip().splitlines()[-1])}
    assert (listed["delta"]["tier"], listed["delta"]["enabled"]) == ("hot", False) and "beta" in listed
    with Session(app.services.database) as s:
        assert [a.actor for a in s.scalars(select(AuditLog).where(AuditLog.target == "delta"))] == ["cli"] * 3


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_models_tensor_parallel_size_round_trips_and_the_deployments_fills_in(backend, tmp_path, monkeypatch,
                                                                                capsys, request):
    from tidepool.workers.cli import main
    url = f"sqlite:///{tmp_path / 'r.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", url)
    monkeypatch.delenv("TIDEPOOL_MODEL", raising=False)
    monkeypatch.setenv("TIDEPOOL_TENSOR_PARALLEL_SIZE", "4")
    assert main(["db", "upgrade"]) == 0
    assert main(["models", "register", "big", _folder(tmp_path / "big"), "--tensor-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tensor_parallel_size"] == 2
    assert main(["models", "register", "small", _folder(tmp_path / "small")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tensor_parallel_size"] == 4     # the deployment's
    assert main(["models", "register", "bad", _folder(tmp_path / "bad"), "--tensor-parallel-size", "0"]) == 1
    assert "tensor_parallel_size" in json.loads(capsys.readouterr().err)["error"]["message"]

    def listed():
        assert main(["models", "registry"]) == 0
        return {m["id"]: m["tensor_parallel_size"] for m in json.loads(capsys.readouterr().out.splitlines()[-1])}
    assert listed() == {"big": 2, "small": 4}
    assert main(["models", "set", "small", "--tensor-parallel-size", "3"]) == 0
    assert main(["models", "set", "big", "--tensor-parallel-size", "default"]) == 0
    capsys.readouterr()
    assert listed() == {"big": 4, "small": 3}
    monkeypatch.delenv("TIDEPOOL_TENSOR_PARALLEL_SIZE")
    assert listed() == {"big": 1, "small": 3}
    from tidepool.service.ledger.database import make_engine
    from tidepool.service.ledger.registry import Registry
    db = make_engine(url)
    try:
        entries = Registry(db, ttl=0).entries()
        assert (entries["big"].tensor_parallel_size, entries["small"].tensor_parallel_size) == (None, 3)
    finally:
        db.dispose()
