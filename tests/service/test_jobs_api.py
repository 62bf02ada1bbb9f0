"""Native jobs API: success paths, validation, mass assignment, idempotency, auth."""
import json

import pytest

from .conftest import Admin

PROMPT = {"prompt": "Hello", "max_tokens": 8, "sla_class": "interactive"}


def test_submit_get_list_cancel(any_app):
    client = any_app.test_client()
    _, key = Admin(client).tenant()
    r = client.post("/v1/jobs", json={**PROMPT, "temperature": 0.5, "metadata": {"k": "v"}}, headers=key)
    assert r.status_code == 202, r.get_json()
    job = r.get_json()
    assert job["status"] == "queued" and job["sla_class"] == "interactive"
    assert job["request"]["prompt"] == "Hello" and job["request"]["max_tokens"] == 8
    assert job["metadata"] == {"k": "v"} and job["dispatched_at"] is not None
    chat = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}], "sla_class": "batch"},
                       headers=key).get_json()
    assert chat["endpoint"] == "/v1/chat/completions" and chat["request"]["max_tokens"] == 512
    tokens = client.post("/v1/jobs", json={"prompt": [1, 2, 3]}, headers=key).get_json()
    assert tokens["request"]["prompt"] == [1, 2, 3] and tokens["request"]["max_tokens"] == 16

    assert client.get(f"/v1/jobs/{job['id']}", headers=key).get_json()["id"] == job["id"]
    listed = client.get("/v1/jobs?limit=2", headers=key).get_json()
    assert [j["id"] for j in listed["data"]] == [tokens["id"], chat["id"]] and listed["has_more"]
    rest = client.get(f"/v1/jobs?limit=2&cursor={listed['next_cursor']}", headers=key).get_json()
    assert [j["id"] for j in rest["data"]] == [job["id"]] and not rest["has_more"]
    assert [j["id"] for j in client.get("/v1/jobs?sla_class=batch", headers=key).get_json()["data"]] == [chat["id"]]

    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=key)
    assert r.status_code == 200 and r.get_json()["status"] == "cancelled"
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=key).status_code == 409
    assert [j["id"] for j in client.get("/v1/jobs?status=cancelled", headers=key).get_json()["data"]] == [job["id"]]
    tenant = client.get("/v1/admin/tenants", headers=Admin(client).headers).get_json()["data"][0]
    assert tenant["queued_jobs"] == 2


@pytest.mark.parametrize("field,value", [("tenant_id", "ten_other"), ("status", "completed"), ("priority", 99),
                                         ("attempts", 5), ("lease_token", "x")])
def test_mass_assignment_is_rejected(client, admin, field, value):
    _, key = admin.tenant()
    r = client.post("/v1/jobs", json={**PROMPT, field: value}, headers=key)
    assert r.status_code == 400
    assert r.get_json()["error"]["param"] == field
    assert client.get("/v1/jobs", headers=key).get_json()["data"] == []


BAD_BODIES = [
    b"", b"not json", b"[1, 2]", b"null", b'"x"', b"{", json.dumps({"prompt": ""}).encode(),
    json.dumps({}).encode(), json.dumps({"prompt": 5}).encode(), json.dumps({"prompt": ["a", "b"]}).encode(),
    json.dumps({"prompt": [1, -2]}).encode(), json.dumps({"prompt": "x", "messages": []}).encode(),
    json.dumps({"messages": []}).encode(), json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), json.dumps({"messages": "hi"}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 0}).encode(), json.dumps({"prompt": "x", "max_tokens": "9"}).encode(),
    json.dumps({"prompt": "x", "max_tokens": True}).encode(), json.dumps({"prompt": "x", "temperature": -1}).encode(),
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
    json.dumps({"prompt": "x", "top_p": 0}).encode(), json.dumps({"prompt": "x", "stop": [1]}).encode(),
    json.dumps({"prompt": "x", "stop": ["a"] * 17}).encode(), json.dumps({"prompt": "x", "n": 17}).encode(),
    json.dumps({"prompt": "x", "stream": True}).encode(), json.dumps({"prompt": "x", "sla_class": "gold"}).encode(),
    json.dumps({"prompt": "x", "deadline": "tomorrow"}).encode(),
    json.dumps({"prompt": "x", "deadline": "2030-01-01"}).encode(),              # RFC 3339 date-times only
    json.dumps({"prompt": "x", "deadline": "2030-01-01T00:00:00"}).encode(),     # with their offset
    json.dumps({"prompt": "x", "deadline": "2030-01-01T24:00:00Z"}).encode(),
    json.dumps({"prompt": "x", "deadline": 1e300}).encode(), json.dumps({"prompt": "x", "metadata": [1]}).encode(),
    json.dumps({"prompt": "x", "metadata": {"k": 1}}).encode(), json.dumps({"prompt": "x", "seed": 1.5}).encode(),
    json.dumps({"prompt": "x", "logprobs": 99}).encode(), json.dumps({"prompt": "x", "ignore_eos": "yes"}).encode(),
    json.dumps({"prompt": "x", "model": 7}).encode(), json.dumps({"prompt": "x", "stop_token_ids": "1"}).encode(),
    json.dumps({"prompt": "x", "max_tokens": 10 ** 30}).encode(), json.dumps({"prompt": "x", "top_k": -5}).encode(),
]


def test_bad_bodies_get_openai_shaped_400_never_500(client, admin):
    _, key = admin.tenant()
    for raw in BAD_BODIES:
        r = client.post("/v1/jobs", data=raw, headers={**key, "Content-Type": "application/json"})
        assert r.status_code == 400, (raw, r.status_code, r.get_json())
        err = r.get_json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", raw
    assert client.get("/v1/jobs", headers=key).get_json()["data"] == []


def test_fuzzed_bodies_never_500(embedded_app):
    from hypothesis import HealthCheck, given, settings, strategies as st
    client = embedded_app.test_client()
    _, key = Admin(client).tenant(max_queued=10 ** 9)
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                        max_size=3), max_leaves=6)
    keys = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "stop", "sla_class", "deadline",
                            "metadata", "seed", "top_k", "logprobs", "n"])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(keys, values, max_size=4))
    def run(body):
        r = client.post("/v1/jobs", json=body, headers=key)
        assert r.status_code in (202, 400, 403), (body, r.status_code, r.get_json())
    run()


def test_idempotency_key_returns_original_and_conflicts_on_other_body(client, admin):
    _, key = admin.tenant()
    h = {**key, "Idempotency-Key": "req-1"}
    first = client.post("/v1/jobs", json=PROMPT, headers=h)
    again = client.post("/v1/jobs", json=PROMPT, headers=h)
    assert first.status_code == 202 and again.status_code == 200
    assert again.get_json()["id"] == first.get_json()["id"]
    other = client.post("/v1/jobs", json={**PROMPT, "prompt": "different"}, headers=h)
    assert other.status_code == 409 and other.get_json()["error"]["code"] == "idempotency_conflict"
    assert len(client.get("/v1/jobs", headers=key).get_json()["data"]) == 1
    # the key is per tenant: another tenant may use the same one
    _, key2 = admin.tenant()
    assert client.post("/v1/jobs", json=PROMPT, headers={**key2, "Idempotency-Key": "req-1"}).status_code == 202


def test_bad_missing_and_revoked_keys_are_401(client, admin):
    tenant_id, key = admin.tenant()
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    token = key["Authorization"].split()[1]
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    assert client.get("/v1/jobs", headers=key).status_code == 200
    prefix = "_".join(token.split("_")[:2])
    r = client.post(f"/v1/admin/keys/{prefix}/revoke", headers=admin.headers)
    assert r.status_code == 200
    r = client.get("/v1/jobs", headers=key)
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key"
    new = client.post(f"/v1/admin/tenants/{tenant_id}/keys", headers=admin.headers).get_json()
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {new['api_key']}"}).status_code == 200
    keys = client.get(f"/v1/admin/tenants/{tenant_id}/keys", headers=admin.headers).get_json()["data"]
    assert [k["revoked_at"] is not None for k in keys] == [True, False]
    assert keys[0]["last_used_at"] is not None


def test_disabled_tenant_is_403(client, admin):
    tenant_id, key = admin.tenant()
    client.post(f"/v1/admin/tenants/{tenant_id}/disable", headers=admin.headers)
    assert client.get("/v1/jobs", headers=key).status_code == 403
    client.post(f"/v1/admin/tenants/{tenant_id}/enable", headers=admin.headers)
    assert client.get("/v1/jobs", headers=key).status_code == 200


def test_class_not_allowed_is_403_and_max_tokens_cap_is_400(client, admin):
    _, key = admin.tenant(allowed_sla_classes=["batch"], max_tokens_per_request=100)
    r = client.post("/v1/jobs", json={**PROMPT, "sla_class": "realtime"}, headers=key)
    assert r.status_code == 403 and r.get_json()["error"]["code"] == "sla_class_not_allowed"
    r = client.post("/v1/jobs", json={**PROMPT, "sla_class": "batch", "max_tokens": 101}, headers=key)
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "max_tokens"
    assert client.post("/v1/jobs", json={**PROMPT, "sla_class": "batch", "max_tokens": 100},
                       headers=key).status_code == 202


def test_served_model_name_is_checked(pg_url, redis_url, tmp_path):
    from tidepool.service import create_app
    app = create_app({"database_url": pg_url, "redis_url": redis_url, "storage_dir": str(tmp_path),
                      "admin_token": "test-admin-token", "model": "/models/SmolLM2-135M/"})
    client = app.test_client()
    _, key = Admin(client).tenant()
    assert client.post("/v1/jobs", json={**PROMPT, "model": "SmolLM2-135M"}, headers=key).status_code == 202
    r = client.post("/v1/jobs", json={**PROMPT, "model": "gpt-4"}, headers=key)
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"   # unknown: 404
    app.services.database.dispose()


def test_admin_api_needs_the_admin_token(client, admin):
    tenant_id, key = admin.tenant()
    assert client.get("/v1/admin/tenants").status_code == 401
    assert client.get("/v1/admin/tenants", headers=key).status_code == 401
    r = client.patch(f"/v1/admin/tenants/{tenant_id}/quota", json={"max_queued": 5}, headers=admin.headers)
    assert r.status_code == 200 and r.get_json()["max_queued"] == 5
    assert client.patch(f"/v1/admin/tenants/{tenant_id}/quota", json={"max_queued": -1},
                        headers=admin.headers).status_code == 400
    assert client.patch(f"/v1/admin/tenants/{tenant_id}/quota", json={"bogus": 1},
                        headers=admin.headers).status_code == 400
    client.post("/v1/jobs", json=PROMPT, headers=key)
    jobs = client.get(f"/v1/admin/jobs?tenant_id={tenant_id}", headers=admin.headers).get_json()["data"]
    assert len(jobs) == 1 and jobs[0]["tenant_id"] == tenant_id
    assert client.get("/v1/admin/queues", headers=admin.headers).get_json()["queues"]["interactive"] == 1
    actions = [a["action"] for a in client.get("/v1/admin/audit", headers=admin.headers).get_json()["data"]]
    assert actions[:2] == ["quota.set", "tenant.create"]
    assert client.get("/v1/admin/tenants/nope", headers=admin.headers).status_code == 404
    assert client.post("/v1/admin/tenants", json={"name": ""}, headers=admin.headers).status_code == 400


def test_tenant_default_online_class_is_set_changed_and_validated(client, admin):
    h = admin.headers
    r = client.post("/v1/admin/tenants", json={"name": "chatty", "default_sla_class": "realtime"}, headers=h)
    assert r.status_code == 201 and r.get_json()["default_sla_class"] == "realtime"
    tenant_id = r.get_json()["id"]
    r = client.patch(f"/v1/admin/tenants/{tenant_id}", json={"default_sla_class": "interactive", "weight": 3},
                     headers=h)
    assert r.status_code == 200
    assert (r.get_json()["default_sla_class"], r.get_json()["weight"]) == ("interactive", 3.0)
    for bad in ({"default_sla_class": "batch"}, {"weight": 0}, {"name": "renamed"}):
        r = client.patch(f"/v1/admin/tenants/{tenant_id}", json=bad, headers=h)
        assert r.status_code == 400 and r.get_json()["error"]["param"] in bad
    assert client.get(f"/v1/admin/tenants/{tenant_id}", headers=h).get_json()["default_sla_class"] == "interactive"
    assert client.patch("/v1/admin/tenants/ten_missing", json={"weight": 2}, headers=h).status_code == 404
    bad_create = client.post("/v1/admin/tenants", json={"name": "x", "default_sla_class": "deferrable"}, headers=h)
    assert bad_create.status_code == 400
