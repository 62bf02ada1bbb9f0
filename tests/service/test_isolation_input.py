"""Hostile input gets a 400 naming the field, never a 500: NUL bytes and lone surrogates in any string of a
request (jobs, completions, chat, batch lines), in query parameters and path ids, and in upload file names
(whose bytes are then never written); Content-Disposition never echoes a raw file name."""
import io
import json
import os

import pytest

from .conftest import ADMIN, Admin

BAD = ["a\x00b", "a\ud800b"]


def _post(client, path, body, key):
    return client.post(path, data=json.dumps(body), content_type="application/json", headers=key)


@pytest.mark.parametrize("bad", BAD, ids=["nul", "surrogate"])
def test_bad_strings_in_bodies_are_400_naming_the_field(any_app, bad):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    cases = [
        ("/v1/jobs", {"prompt": bad}, "prompt"),
        ("/v1/jobs", {"prompt": "x", "metadata": {"k": bad}}, "metadata.k"),
        ("/v1/jobs", {"prompt": "x", "metadata": {bad: "v"}}, "metadata"),
        ("/v1/jobs", {"prompt": "x", "user": bad}, "user"),
        ("/v1/jobs", {"prompt": "x", "stop": [bad]}, "stop[0]"),
        ("/v1/jobs", {"messages": [{"role": "user", "content": bad}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": bad}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": bad}, "stop"),
        ("/v1/completions", {"prompt": "x", "user": bad}, "user"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}]},
         "messages[0].content[0].text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": bad}]},
         "messages[0].name"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["ok", bad]}, "stop[1]"),
    ]
    for path, body, param in cases:
        r = _post(client, path, body, key)
        assert r.status_code == 400, (path, body, r.status_code, r.get_json())
        assert r.get_json()["error"]["param"] == param, (path, r.get_json())
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers={**key, "Idempotency-Key": "k\x00"})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "Idempotency-Key"
    assert client.get("/v1/jobs", headers=key).get_json()["data"] == []


def test_nul_in_query_parameters_and_ids_is_400(any_app):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for method, path, headers in [
        ("get", "/v1/jobs?cursor=%00", key), ("get", "/v1/jobs?status=%00", key), ("get", "/v1/jobs/job_%00", key),
        ("post", "/v1/jobs/job_%00/cancel", key), ("get", "/v1/files?after=%00", key),
        ("get", "/v1/files?purpose=%00", key), ("get", "/v1/files/file-%00", key),
        ("get", "/v1/files/file-%00/content", key), ("delete", "/v1/files/file-%00", key),
        ("get", "/v1/batches?after=%00", key), ("get", "/v1/batches/batch_%00", key),
        ("post", "/v1/batches/batch_%00/cancel", key), ("get", "/v1/models/m%00", key),
        ("get", "/v1/admin/tenants/ten_%00", admin), ("post", "/v1/admin/keys/tp_%00/revoke", admin),
        ("get", "/v1/admin/jobs?tenant_id=%00", admin),
    ]:
        r = getattr(client, method)(path, headers=headers)
        assert r.status_code == 400, (path, r.status_code, r.get_data(as_text=True)[:200])
        assert "NUL" in r.get_json()["error"]["message"]


def test_an_upload_named_with_nul_writes_no_bytes(any_app, tmp_path):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    storage = any_app.services.storage.root
    r = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(b"x" * 1000), "a\x00b.jsonl")},
                    headers=key, content_type="multipart/form-data")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "file"
    assert [f for _, _, files in os.walk(storage) for f in files] == []
    assert client.get("/v1/files", headers=key).get_json()["data"] == []


def test_content_disposition_never_echoes_a_raw_file_name(any_app):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    r = client.post("/v1/files", data={"purpose": "batch",
                                       "file": (io.BytesIO(b"{}\n"), '../x;\x07evil.jsonl')},
                    headers=key, content_type="multipart/form-data")
    assert r.status_code == 200, r.get_json()
    f = r.get_json()
    assert f["filename"] == "x__evil.jsonl"
    disposition = client.get(f"/v1/files/{f['id']}/content", headers=key).headers["Content-Disposition"]
    assert disposition == "attachment; filename=x__evil.jsonl"


def test_a_batch_line_with_a_nul_custom_id_fails_the_batch_cleanly(any_app):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    line = json.dumps({"custom_id": "a\x00b", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "hi", "max_tokens": 2}}).encode() + b"\n"
    bad_body = json.dumps({"custom_id": "c2", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "hi\ud800", "max_tokens": 2}}).encode() + b"\n"
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line + bad_body), "in.jsonl")},
                    headers=key, content_type="multipart/form-data").get_json()
    r = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key)
    assert r.status_code == 200, r.get_json()
    b = r.get_json()
    assert b["status"] == "failed"
    assert [(e["line"], e["param"]) for e in b["errors"]["data"]] == [(1, "custom_id"), (2, "body.prompt")]


@pytest.mark.parametrize("bad", BAD, ids=["nul", "surrogate"])
def test_a_tenant_name_with_bad_text_is_400(any_app, bad):
    r = any_app.test_client().post("/v1/admin/tenants", data=json.dumps({"name": bad}),
                                   content_type="application/json", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "name"


def test_deeply_nested_json_is_400_not_500(any_app):
    """Nesting past bodies.MAX_JSON_DEPTH (in a body or a batch line) is a 400: neither the parser's nor the
    checks' recursion reaches Python's limit."""
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for depth in (900, 50_000, 100):
        nested = "[" * depth + "]" * depth
        for path, body, headers in (("/v1/jobs", '{"prompt": %s}' % nested, key),
                                    ("/v1/chat/completions", '{"messages": %s}' % nested, key),
                                    ("/v1/admin/tenants", '{"name": %s}' % nested, admin)):
            r = client.post(path, data=body, content_type="application/json", headers=headers)
            assert r.status_code == 400, (path, depth, r.status_code)
            assert r.get_json()["error"]["code"] == "invalid_json"
    ok = {"prompt": "x", "metadata": {"k": "v"}, "response_format": {"type": "json_object"}}
    assert client.post("/v1/jobs", json=ok, headers=key).status_code == 202
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": %s}}\n' % (
        "[" * 5000 + "]" * 5000)
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line.encode()), "in.jsonl")},
                    headers=key, content_type="multipart/form-data").get_json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"}, headers=key)
    assert b.status_code == 200 and b.get_json()["status"] == "failed"
    assert b.get_json()["errors"]["data"][0]["code"] == "invalid_json"
