"""Every list and string of a request is bounded (docs/guides/online-api.md, "Request limits"): beyond the bound, a
400 naming the field, so one tenant cannot make the workers crawl (a million stop_token_ids) or the ledger choke."""
import json

import pytest

from tidepool.service.protocol import request_bodies as bodies
from tidepool.service.api import MAX_JSON_BYTES

from .conftest import ADMIN, Admin

MSG = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/jobs", {"prompt": "x", "stop_token_ids": list(range(1_000_000))}, "stop_token_ids"),
    ("/v1/jobs", {"prompt": "x", "stop_token_ids": [1] * (bodies.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("/v1/jobs", {"prompt": "x", "stop_token_ids": [1 << 40]}, "stop_token_ids"),
    ("/v1/jobs", {"prompt": [1 << 40]}, "prompt"),
    ("/v1/jobs", {"prompt": [1] * (bodies.MAX_PROMPT_TOKEN_IDS + 1)}, "prompt"),
    ("/v1/jobs", {"prompt": "x" * (bodies.MAX_PROMPT_CHARS + 1)}, "prompt"),
    ("/v1/jobs", {"prompt": "x", "stop": ["s"] * (bodies.MAX_STOP + 1)}, "stop"),
    ("/v1/jobs", {"prompt": "x", "stop": "s" * (bodies.MAX_STOP_CHARS + 1)}, "stop"),
    ("/v1/jobs", {"prompt": "x", "user": "u" * (bodies.MAX_NAME_CHARS + 1)}, "user"),
    ("/v1/jobs", {"prompt": "x", "model": "m" * (bodies.MAX_NAME_CHARS + 1)}, "model"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * (bodies.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MSG * (bodies.MAX_MESSAGES + 1)}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (bodies.MAX_PROMPT_CHARS // 2 + 1)}] * 2},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "n" * 257}]}, "messages[0].name"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
def test_fields_beyond_their_bound_are_400(client, admin, path, body, param):
    _, key = admin.tenant()
    r = client.post(path, data=json.dumps(body), content_type="application/json", headers=key)
    assert r.status_code == 400, (r.status_code, r.get_json())
    assert r.get_json()["error"]["param"] == param


def test_fields_at_their_bound_are_accepted(client, admin):
    _, key = admin.tenant()
    body = {"prompt": "x", "stop_token_ids": [7] * bodies.MAX_STOP_TOKEN_IDS, "stop": ["s"] * bodies.MAX_STOP,
            "user": "u" * bodies.MAX_NAME_CHARS}
    assert client.post("/v1/jobs", json=body, headers=key).status_code == 202


def test_a_json_body_over_the_limit_is_413(client, admin):
    _, key = admin.tenant()
    r = client.post("/v1/jobs", data=b'{"prompt": "' + b"x" * MAX_JSON_BYTES + b'"}',
                    content_type="application/json", headers=key)
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "request_too_large"


def test_admin_numbers_are_bounded(client):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    tenant_id, _ = Admin(client).tenant()
    for path, method, body, param in [
        (f"/v1/admin/tenants/{tenant_id}/quota", "patch", {"requests_per_minute": 10 ** 12}, "requests_per_minute"),
        (f"/v1/admin/tenants/{tenant_id}/quota", "patch", {"allowed_sla_classes": ["batch"] * 5},
         "allowed_sla_classes"),
        (f"/v1/admin/tenants/{tenant_id}", "patch", {"weight": 1e12}, "weight"),
        (f"/v1/admin/tenants/{tenant_id}", "patch", {"prefix_cache_group": "g" * 65}, "prefix_cache_group"),
    ]:
        r = getattr(client, method)(path, json=body, headers=headers)
        assert r.status_code == 400 and r.get_json()["error"]["param"] == param, (body, r.get_json())
