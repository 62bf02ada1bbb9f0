"""Small things a newcomer meets: `tidepool tenants list`, a real `created` time in /v1/models."""
import json
import os

from tidepool.workers import cli


def test_cli_tenants_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDEPOOL_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    assert cli.main(["db", "upgrade"]) == 0
    assert cli.main(["tenants", "list"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == []
    for name in ("zeta", "acme"):
        assert cli.main(["tenants", "create", name]) == 0
    acme = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert cli.main(["keys", "create", acme["id"]]) == 0
    second = json.loads(capsys.readouterr().out)
    assert cli.main(["keys", "revoke", second["prefix"]]) == 0
    capsys.readouterr()
    assert cli.main(["tenants", "list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listed] == ["acme", "zeta"]
    assert listed[0]["id"] == acme["id"] and listed[0]["key_prefixes"] == ["_".join(acme["api_key"].split("_")[:2])]
    assert listed[0]["weight"] == 1.0 and listed[0]["disabled"] is False


def test_models_list_has_a_created_time(pg_url, redis_url, tmp_path):
    from tidepool.service import create_app
    from tidepool.service.ledger import tenants
    model = tmp_path / "models" / "m1"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    os.utime(model / "config.json", (1_700_000_000, 1_700_000_000))
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "s"),
                      "model": str(model)})
    try:
        with app.services.sessions() as s:
            _, key = tenants.create_tenant(s, "models")
            s.commit()
        data = app.test_client().get("/v1/models", headers={"Authorization": f"Bearer {key}"}).get_json()["data"]
        assert data == [{"id": "m1", "object": "model", "created": 1_700_000_000, "owned_by": "tidepool"}]
    finally:
        app.services.database.dispose()


def test_max_tokens_past_the_context_is_a_400(pg_url, redis_url, tmp_path):
    from tidepool.service import create_app
    from tidepool.service.ledger import tenants
    model = tmp_path / "models" / "small"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "s"),
                      "model": str(model)})
    try:
        with app.services.sessions() as s:
            _, key = tenants.create_tenant(s, "ctx")
            s.commit()
        client, auth = app.test_client(), {"Authorization": f"Bearer {key}"}
        r = client.post("/v1/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000})
        err = r.get_json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        assert "context is 256 tokens" in err["message"] and "fewer than 256" in err["message"]
        # one limit, the model's context, in every message: not the request format's 2^20 bound
        for value, code in ((2_000_000, "context_length_exceeded"), (0, "invalid_value"), (2.5, "invalid_value")):
            r = client.post("/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": value})
            err = r.get_json()["error"]
            assert r.status_code == 400 and (err["code"] or "invalid_value") == code, err
            assert "256 tokens" in err["message"] and "1048576" not in err["message"], err
        r = client.post("/v1/jobs", headers=auth, json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": 256})
        assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
        r = client.post("/v1/jobs", headers=auth, json={"prompt": "hi", "max_tokens": 200})
        assert r.status_code == 202
        r = client.post("/v1/jobs", headers=auth, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 202 and r.get_json()["request"]["max_tokens"] == 255    # default fits the context
    finally:
        app.services.database.dispose()
