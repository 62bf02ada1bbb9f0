"""The OpenAPI document agrees with the server: every status a route answers is documented for it, every JSON
response validates against its documented schema, request bodies the schema accepts are accepted and ones it
rejects get a 400; a 405 names the allowed methods."""
import io
import json
import time

import jsonschema
import jsonschema_rs
import pytest

from tidepool.service.openapi import spec

from .conftest import ADMIN, Admin

SPEC = spec()


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": SPEC["components"]})


def _op(method: str, path: str) -> dict:
    return SPEC["paths"][path][method]


def check(resp, method: str, path: str):
    """resp is documented for (method, path): its status, and its JSON body against that status's schema."""
    op = _op(method, path)
    status = str(resp.status_code)
    assert status in op["responses"], (method, path, status, resp.get_data(as_text=True)[:300])
    content = op["responses"][status].get("content")
    if content and resp.is_json:
        errors = sorted(_validator(content["application/json"]["schema"]).iter_errors(resp.get_json()), key=str)
        assert not errors, (method, path, status, [e.message for e in errors[:3]])
    return resp


def _body_ok(path: str, body: dict, method: str = "post", spec: dict = SPEC) -> bool:
    """Whether the document accepts body, formats (date-time) included."""
    schema = spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.validator_for({**schema, "components": spec["components"]},
                                       validate_formats=True).is_valid(body)


def test_every_route_answers_as_documented(app):
    client = app.test_client()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    tenant_id, key = Admin(client).tenant()
    job = check(client.post("/v1/jobs", json={"prompt": "x", "metadata": {"a": "b"}}, headers=key),
                "post", "/v1/jobs").get_json()
    check(client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                      headers=key), "post", "/v1/jobs")
    check(client.post("/v1/jobs", json={"prompt": ""}, headers=key), "post", "/v1/jobs")
    for method, path, url, kwargs in [
        ("get", "/healthz", "/healthz", {}), ("get", "/readyz", "/readyz", {}),
        ("get", "/v1/jobs", "/v1/jobs?limit=1", {"headers": key}),
        ("get", "/v1/jobs", "/v1/jobs?limit=0", {"headers": key}),
        ("get", "/v1/jobs", "/v1/jobs", {}),
        ("get", "/v1/jobs/{job_id}", f"/v1/jobs/{job['id']}", {"headers": key}),
        ("get", "/v1/jobs/{job_id}", "/v1/jobs/job_nope", {"headers": key}),
        ("post", "/v1/jobs/{job_id}/cancel", f"/v1/jobs/{job['id']}/cancel", {"headers": key}),
        ("post", "/v1/jobs/{job_id}/cancel", f"/v1/jobs/{job['id']}/cancel", {"headers": key}),
        ("get", "/v1/files", "/v1/files", {"headers": key}),
        ("post", "/v1/files", "/v1/files", {"headers": key, "data": b"x", "content_type": "text/plain"}),
        ("get", "/v1/batches", "/v1/batches", {"headers": key}),
        ("get", "/v1/models", "/v1/models", {"headers": key}),
        ("get", "/v1/models/{model_id}", "/v1/models/nope", {"headers": key}),
        ("get", "/v1/admin/tenants", "/v1/admin/tenants", {"headers": admin}),
        ("get", "/v1/admin/tenants/{tenant_id}", f"/v1/admin/tenants/{tenant_id}", {"headers": admin}),
        ("patch", "/v1/admin/tenants/{tenant_id}", f"/v1/admin/tenants/{tenant_id}",
         {"headers": admin, "json": {"weight": 2, "prefix_cache_group": "g"}}),
        ("patch", "/v1/admin/tenants/{tenant_id}/quota", f"/v1/admin/tenants/{tenant_id}/quota",
         {"headers": admin, "json": {"max_queued": 100, "allowed_sla_classes": ["batch"]}}),
        ("post", "/v1/admin/tenants/{tenant_id}/disable", f"/v1/admin/tenants/{tenant_id}/disable", {"headers": admin}),
        ("post", "/v1/admin/tenants/{tenant_id}/enable", f"/v1/admin/tenants/{tenant_id}/enable", {"headers": admin}),
        ("post", "/v1/admin/tenants/{tenant_id}/keys", f"/v1/admin/tenants/{tenant_id}/keys", {"headers": admin}),
        ("get", "/v1/admin/tenants/{tenant_id}/keys", f"/v1/admin/tenants/{tenant_id}/keys", {"headers": admin}),
        ("get", "/v1/admin/jobs", "/v1/admin/jobs", {"headers": admin}),
        ("get", "/v1/admin/batches", "/v1/admin/batches", {"headers": admin}),
        ("get", "/v1/admin/queues", "/v1/admin/queues", {"headers": admin}),
        ("get", "/v1/admin/audit", "/v1/admin/audit", {"headers": admin}),
        ("post", "/v1/admin/models", "/v1/admin/models", {"headers": admin, "json": {"name": "m2", "source": "/m2"}}),
        ("post", "/v1/admin/models", "/v1/admin/models", {"headers": admin, "json": {"name": "m2", "source": "/m2"}}),
        ("get", "/v1/admin/models", "/v1/admin/models", {"headers": admin}),
        ("get", "/v1/admin/models/{name}", "/v1/admin/models/m2", {"headers": admin}),
        ("get", "/v1/admin/models/{name}", "/v1/admin/models/nope", {"headers": admin}),
        ("patch", "/v1/admin/models/{name}", "/v1/admin/models/m2", {"headers": admin, "json": {"tier": "cold"}}),
        ("post", "/v1/admin/tenants/{tenant_id}/models", f"/v1/admin/tenants/{tenant_id}/models",
         {"headers": admin, "json": {"model": "m2"}}),
        ("delete", "/v1/admin/tenants/{tenant_id}/models/{name}", f"/v1/admin/tenants/{tenant_id}/models/m2",
         {"headers": admin}),
        ("get", "/v1/models/{model_id}", "/v1/models/m2", {"headers": key}),
        ("post", "/v1/admin/keys/{prefix}/revoke", "/v1/admin/keys/tp_nope/revoke", {"headers": admin}),
    ]:
        check(getattr(client, method)(url, **kwargs), method, path)
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    f = check(client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")},
                          headers=key), "post", "/v1/files").get_json()
    check(client.get(f"/v1/files/{f['id']}", headers=key), "get", "/v1/files/{file_id}")
    b = check(client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                               "completion_window": "24h"}, headers=key),
              "post", "/v1/batches").get_json()
    check(client.get(f"/v1/batches/{b['id']}", headers=key), "get", "/v1/batches/{batch_id}")
    check(client.post(f"/v1/batches/{b['id']}/cancel", headers=key), "post", "/v1/batches/{batch_id}/cancel")
    check(client.delete(f"/v1/files/{f['id']}", headers=key), "delete", "/v1/files/{file_id}")
    created = check(client.post("/v1/admin/tenants", json={"name": "t-new", "quota": {"max_queued": 1}},
                                headers=admin), "post", "/v1/admin/tenants").get_json()
    prefix = "_".join(created["api_key"].split("_")[:2])
    check(client.post(f"/v1/admin/keys/{prefix}/revoke", headers=admin), "post", "/v1/admin/keys/{prefix}/revoke")


ACCEPTED = [
    ("/v1/jobs", {"prompt": [1, 2], "max_tokens": 1, "temperature": 0, "top_p": 1, "stop": ["a"],
                  "stop_token_ids": [2], "n": 2, "best_of": 3, "seed": -5, "logprobs": 0, "user": "u", "sla_class": "batch"}),
    ("/v1/jobs", {"messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                               {"role": "user", "content": "x", "name": "n"}], "top_logprobs": 2,
                  "max_completion_tokens": 3, "stream": False, "metadata": None}),
    ("/v1/jobs", {"prompt": "x", "temperature": None, "deadline": "2999-01-01T00:00:00Z"}),
    ("/v1/jobs", {"prompt": "x", "deadline": "2001-01-01T00:00:00+05:00", "user": None}),    # past: it expires
    ("/v1/jobs", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "not JSON"}}]}]}),
    ("/v1/jobs", {"prompt": "x", "n": 2, "best_of": 2, "service_tier": "flex", "sla_class": "batch"}),
    ("/v1/jobs", {"prompt": "x", "max_tokens": 8.0, "top_k": 2.0, "stop_token_ids": [3.0]}),   # JSON: 8.0 is 8
]
REJECTED = [
    ("/v1/jobs", {}), ("/v1/jobs", {"prompt": "x", "messages": []}), ("/v1/jobs", {"prompt": "x", "bogus": 1}),
    ("/v1/jobs", {"prompt": "x", "max_tokens": 0}), ("/v1/jobs", {"prompt": "x", "max_tokens": 1.5}),
    ("/v1/jobs", {"prompt": "x", "top_p": 0}), ("/v1/jobs", {"prompt": "x", "n": 17}),
    ("/v1/jobs", {"prompt": "x", "stream": True}), ("/v1/jobs", {"prompt": "x", "echo": 1}),
    ("/v1/jobs", {"prompt": [-1]}), ("/v1/jobs", {"prompt": "x", "stop": [""]}),
    ("/v1/jobs", {"prompt": "x", "metadata": {"k": 1}}), ("/v1/jobs", {"prompt": "x", "sla_class": "gold"}),
    ("/v1/jobs", {"messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x", "extra": 1}]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}),
    ("/v1/completions", {"prompt": "x", "sla_class": "batch"}), ("/v1/completions", {"messages": []}),
    ("/v1/chat/completions", {"prompt": "x"}), ("/v1/completions", {"prompt": "x", "stream": "yes"}),
    ("/v1/jobs", {"prompt": "x", "ignore_eos": 0}), ("/v1/jobs", {"prompt": "x", "n": True}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "logprobs": 0}),
    ("/v1/jobs", {"prompt": "x", "user": "a\x00b"}), ("/v1/jobs", {"prompt": "x", "max_tokens": 8.5}),
    ("/v1/jobs", {"prompt": "x", "n": 3, "best_of": 2}),
    ("/v1/jobs", {"prompt": "x", "service_tier": "priority", "sla_class": "interactive"}),
    ("/v1/jobs", {"messages": [{"role": "tool", "content": "18"}]}),              # tool_call_id required
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": None}]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}),   # needs tools
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": 0}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "oneOf": []}}}]}),          # a keyword the grammar lacks
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": 0}}}),
    ("/v1/jobs", {"prompt": "x", "deadline": "2030-01-01"}), ("/v1/jobs", {"prompt": "x", "deadline": 1e13}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": 1}}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"extra": True}}),
    ("/v1/completions", {"prompt": "x", "stream": True, "n": 1, "best_of": 2}),
    ("/v1/completions", {"prompt": "x", "sla_class": "batch"}),                  # batch online needs flex
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "function", "name": {}}}),
    ("/v1/responses", {"input": "x", "tool_choice": "auto", "tools": []}),
    ("/v1/responses", {"input": "x", "background": True, "store": False}),
    ("/v1/responses", {"input": "x", "background": True, "stream": True}),
    ("/v1/responses", {"input": "x", "store": 1}),
    ("/v1/messages", {"model": "m", "max_tokens": None, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "system": [{"type": "tool_result", "tool_use_id": "t"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_result", "tool_use_id": "u"}]}]}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "input": {}}]}]}),                          # a tool_use field on text
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": {}}],
                      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}),
    ("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": {
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "sla_class": {}}}]}),
    ("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": {
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stream": False}}]}),
]


# One app per ledger serves every case of a table, each case with a tenant of its own; a failure names every case
# that failed.
def _answered_otherwise(cases, status: int, send) -> list[str]:
    wrong = []
    for case in cases:
        r = send(*case)
        if r.status_code != status:
            wrong.append(f"{case[:-1]} {json.dumps(case[-1])[:300]}: {r.status_code} {r.get_data(as_text=True)[:300]}")
    return wrong


def test_bodies_the_schema_accepts_are_accepted(client, admin):
    assert [case for case in ACCEPTED if not _body_ok(*case)] == []

    def send(path, body):
        return client.post(path, json=body, headers=admin.tenant()[1])
    wrong = _answered_otherwise(ACCEPTED, 202, send)
    assert not wrong, "\n".join(wrong)


def test_bodies_the_schema_rejects_are_400(client, admin):
    assert [case for case in REJECTED if _body_ok(*case)] == []

    def send(path, body):
        return check(client.post(path, json=body, headers=admin.tenant()[1]), "post", path)
    wrong = _answered_otherwise(REJECTED, 400, send)
    assert not wrong, "\n".join(wrong)


ADMIN_REJECTED = [
    ("post", "/v1/admin/models", {"name": "m", "source": "relative/path"}),
    ("post", "/v1/admin/tenants", {"name": " \u0085\u3000"}),                  # only whitespace
    ("post", "/v1/admin/tenants/{tenant_id}/models", {"model": "m", "extra": 1}),
    ("patch", "/v1/admin/tenants/{tenant_id}", {"weight": True}),
]


def test_admin_bodies_the_schema_rejects_are_400(client, admin):
    assert [case for case in ADMIN_REJECTED if _body_ok(case[1], case[2], case[0])] == []

    def send(method, path, body):
        url = path.replace("{tenant_id}", admin.tenant()[0]).replace("{name}", "a1")
        return check(getattr(client, method)(url, json=body, headers=admin.headers), method, path)
    wrong = _answered_otherwise(ADMIN_REJECTED, 400, send)
    assert not wrong, "\n".join(wrong)


@pytest.fixture
def served(pg_url, redis_url, tmp_path):
    """An app serving one model (a config.json folder: context 64, vocabulary 100) whose online requests answer 504
    at once without a worker: (its test client, its document)."""
    from tidepool.service import create_app
    folder = tmp_path / "m1"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 100, "max_position_embeddings": 64}))
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path / "storage"),
                      "admin_token": ADMIN, "model": str(folder), "online_timeout": 0.05})
    yield app.test_client(), app.test_client().get("/openapi.json").get_json()
    app.services.database.dispose()


SERVED = [   # (path, body, the status without a worker: 202 queued, 504 accepted and waited for a worker)
    ("/v1/jobs", {"prompt": [99] * 63, "max_tokens": 63}, 202),
    ("/v1/jobs", {"prompt": [100]}, 400),                      # past the vocabulary
    ("/v1/jobs", {"prompt": [1] * 64}, 400),                   # fills the context
    ("/v1/jobs", {"prompt": "x", "max_tokens": 64}, 400),
    ("/v1/completions", {"prompt": [99], "stream": True, "stream_options": {"include_usage": True}}, 504),
    ("/v1/completions", {"prompt": [100]}, 400),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "user": None}, 504),
    ("/v1/responses", {"input": "x", "background": True, "store": None}, 200),
    ("/v1/responses", {"input": "x", "max_output_tokens": 64}, 400),
    ("/v1/messages", {"model": "m1", "max_tokens": 63, "messages": [{"role": "user", "content": "x"}]}, 504),
    ("/v1/messages", {"model": None, "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/embeddings", {"input": "x"}, 404),                    # m1 generates: no such model for embeddings
]


@pytest.mark.parametrize("path,body,status", SERVED)
def test_the_served_model_bounds_the_document_and_the_server_alike(served, path, body, status):
    client, doc = served
    assert _body_ok(path, body, spec=doc) == (status != 400)
    _, key = Admin(client).tenant()
    r = client.post(path, json=body, headers=key)
    assert r.status_code == status, r.get_json()
    assert str(status) in doc["paths"][path]["post"]["responses"]


def test_models_with_other_limits_are_bounded_each_by_name(served, tmp_path):
    """Two served models with different vocabularies and contexts: the document bounds each by its name (and the
    default's when model is absent), as the server does."""
    client, _ = served
    folder = tmp_path / "m2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 200, "max_position_embeddings": 32}))
    r = client.post("/v1/admin/models", json={"name": "m2", "source": str(folder)},
                    headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.get_json()
    doc = client.get("/openapi.json").get_json()
    _, key = Admin(client).tenant()
    for body, status in [({"model": "m2", "prompt": [150]}, 202), ({"model": "m1", "prompt": [150]}, 400),
                         ({"prompt": [150]}, 400), ({"prompt": [99] * 40}, 202),
                         ({"model": "m2", "prompt": [99] * 40}, 400),
                         ({"model": "m2", "prompt": "x", "max_tokens": 31}, 202),
                         ({"model": "m2", "prompt": "x", "max_tokens": 32}, 400)]:
        assert _body_ok("/v1/jobs", body, spec=doc) == (status == 202), body
        assert client.post("/v1/jobs", json=body, headers=key).status_code == status, body


def test_an_online_request_without_a_worker_is_answered_at_its_timeout(served):
    """The wait for a worker ends at online_timeout, not at the next second's check of the ledger."""
    client, _ = served
    _, key = Admin(client).tenant()
    start = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "x"}, headers=key)
    assert r.status_code == 504 and time.monotonic() - start < 0.5


def test_routes_that_stream_declare_their_event_stream(served):
    _, doc = served
    streaming = {path for path, ops in doc["paths"].items() for op in ops.values()
                 if "text/event-stream" in op["responses"].get("200", {}).get("content", {})}
    assert streaming == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
    assert "application/jsonl" in doc["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]


def test_405_names_the_allowed_methods(client):
    r = client.delete("/v1/jobs")
    assert r.status_code == 405 and set(r.headers["Allow"].split(", ")) >= {"GET", "POST"}
    assert r.get_json()["error"]["code"] == "method_not_allowed"


def test_integral_floats_are_stored_as_integers(client, admin):
    _, key = admin.tenant()
    job = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 8.0}, headers=key).get_json()
    assert job["request"]["max_tokens"] == 8 and type(job["request"]["max_tokens"]) is int


def test_other_json_bodies_and_queries_are_checked_too(client, admin):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    _, key = admin.tenant()
    r = check(client.post("/v1/batches", json={"input_file_id": "f\x00", "endpoint": "/v1/completions",
                                               "completion_window": "24h"}, headers=key), "post", "/v1/batches")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "input_file_id"
    r = check(client.post("/v1/admin/tenants", json={"name": "q", "quota": False}, headers=headers),
              "post", "/v1/admin/tenants")
    assert r.status_code == 400
    r = check(client.get("/v1/jobs?status=queued&status=running", headers=key), "get", "/v1/jobs")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "status"


def test_the_document_names_the_served_model(tmp_path, sqlite_url):
    from tidepool.service import create_app
    app = create_app({"database_url": sqlite_url, "storage_dir": str(tmp_path), "model": str(tmp_path / "m1")})
    doc = app.test_client().get("/openapi.json").get_json()
    model = doc["components"]["schemas"]["CompletionCreate"]["properties"]["model"]
    assert {"const": "m1"} in model["anyOf"]


def test_refusals_for_state_or_missing_things_are_404_or_409_as_documented(served):
    """What no schema can say (an item that must exist, a resource in the wrong state) is a 404 or a 409."""
    client, doc = served
    _, key = Admin(client).tenant()
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def answer(method, path, url, status, **kw):
        r = getattr(client, method)(url, headers=kw.pop("headers", key), **kw)
        assert r.status_code == status, r.get_json()
        assert str(status) in doc["paths"][path][method]["responses"]
        return r.get_json()

    queued = answer("post", "/v1/responses", "/v1/responses", 200, json={"input": "x", "background": True})
    answer("get", "/v1/responses/{response_id}/input_items", f"/v1/responses/{queued['id']}/input_items?after=nope",
           404)
    answer("post", "/v1/responses", "/v1/responses", 409, json={"input": "y", "previous_response_id": queued["id"]})
    answer("post", "/v1/responses", "/v1/responses", 504, json={"input": "x"})   # stored, not in the background
    foreground = client.get("/v1/jobs?limit=1", headers=key).get_json()["data"][0]["id"].replace("job_", "resp_")
    answer("post", "/v1/responses/{response_id}/cancel", f"/v1/responses/{foreground}/cancel", 409)
    params = {"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    batch = answer("post", "/v1/messages/batches", "/v1/messages/batches", 200,
                   json={"requests": [{"custom_id": "a", "params": params}]})
    answer("get", "/v1/messages/batches/{batch_id}/results", f"/v1/messages/batches/{batch['id']}/results", 409)
    answer("delete", "/v1/messages/batches/{batch_id}", f"/v1/messages/batches/{batch['id']}", 409)
    answer("post", "/v1/admin/adapters", "/v1/admin/adapters", 404, headers=admin,
           json={"name": "a1", "base_model": "m1", "source": "/nowhere/at/all"})
