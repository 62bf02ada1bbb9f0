"""Schemathesis against the embedded service (SQLite ledger, in-memory broker, no worker), with every check, on the
tenant API and then the admin API, with a fixed seed and budget: 0 failures. The OpenAPI document is the contract:
a request it accepts is accepted (or refused with a documented 401/403/404/409/429), one it rejects is a 4xx, and
every answer is documented with its status, content type and schema.

Without a worker an accepted online request waits for one: the app's online_timeout makes that a quick 504
(documented), and /readyz says 503 (documented) until a worker's engine is up; those two answers are expected here.
The service serves one model, a config.json folder (no weights are read without a worker), so the document carries
its name, context and vocabulary."""
import dataclasses
import json
import threading
import time

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema
from schemathesis.transport.serialization import Binary
from werkzeug.serving import make_server

from tidepool.service import create_app
from tidepool.service.ledger.settings import Config
from tidepool.service.openapi import CROSS_FIELD

from .conftest import ADMIN, Admin

SEED = 20260501
MAX_EXAMPLES = 6
ONLINE_TIMEOUT = 0.05        # seconds an accepted online request waits for a worker before its 504
WAITS_FOR_A_WORKER = ["/readyz", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                      "/v1/messages"]
MODEL = {"model_type": "llama", "vocab_size": 1000, "max_position_embeddings": 512}


def _unique(names: list[str], limit: int) -> list[str]:
    seen, out = set(), []
    for i, name in enumerate(names):
        while name in seen:
            name = f"{name[:limit - len(str(i)) - 1]}-{i}"
        seen.add(name)
        out.append(name)
    return out


def _tool_names(body: dict, chat: bool) -> None:
    """Unique tool names; a tool_choice naming a function names the first tool."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return
    where = [t["function"] if chat else t for t in tools]
    for fn, name in zip(where, _unique([fn["name"] for fn in where], 64)):
        fn["name"] = name
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and ("function" in choice if chat else "name" in choice):
        (choice["function"] if chat else choice)["name"] = where[0]["name"]


SATISFIED = {"tool_choice", "tools", "custom_id"}     # the CROSS_FIELD rules satisfy_cross_field meets


def satisfy_cross_field(body, path: str):
    """A generated body made to satisfy service.openapi.CROSS_FIELD, the checks JSON Schema cannot state."""
    if not isinstance(body, dict):
        return body
    if path in ("/v1/chat/completions", "/v1/jobs"):
        _tool_names(body, chat=True)
    elif path in ("/v1/responses", "/v1/messages"):
        _tool_names(body, chat=False)
    elif path == "/v1/messages/batches" and isinstance(body.get("requests"), list):
        for r, cid in zip(body["requests"], _unique([r["custom_id"] for r in body["requests"]], 64)):
            r["custom_id"] = cid
            _tool_names(r["params"], chat=False)
    return body


def sendable(case) -> bool:
    """Whether a case means on the wire what it means as JSON: a multipart file part is bytes, so a file generated
    as another JSON type (a negative case) reaches the server as a valid file."""
    body = case.body
    if case.operation.path == "/v1/files" and isinstance(body, dict) and "file" in body:
        return isinstance(body["file"], (str, bytes, Binary))
    return True


def _filter_case(context, case):
    return sendable(case)


def _map_case(context, case):
    if case.meta is not None and case.meta.generation.mode.is_positive and case.body is not None:
        case.body = satisfy_cross_field(case.body, case.operation.path)
    return case


ADMIN_API = "^/v1/admin/"


def config(api_key: str, api: str, max_examples: int = MAX_EXAMPLES) -> SchemathesisConfig:
    """The run of one API ("tenant" or "admin"): the other's operations are off."""
    other = ADMIN_API if api == "tenant" else "^/(?!v1/admin/)"
    return SchemathesisConfig.from_dict({
        "seed": SEED, "cache": {"enabled": False}, "workers": 1, "checks": {"enabled": True},
        # nested bodies (a message batch's requests) are slow to draw: the budget bounds them instead
        "suppress-health-check": ["filter_too_much", "too_slow"],
        "generation": {"max-examples": max_examples, "deterministic": True, "database": "none"},
        "auth": {"openapi": {"apiKey": {"bearer": api_key}, "adminToken": {"bearer": ADMIN}}},
        "operations": [{"include-path-regex": other, "enabled": False},
                       {"include-path": WAITS_FOR_A_WORKER, "checks": {
                           "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503", "504"]}}}],
    })


def failures(schema) -> list[str]:
    """Every failed check and error of a run, with its response and a curl line to repeat it."""
    schema.hook("filter_case")(_filter_case)
    schema.hook("map_case")(_map_case)
    out = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status != Status.FAILURE:
                        continue
                    info, seen = check.failure_info, event.recorder.interactions.get(case_id)
                    body = seen.response.content[:400].decode(errors="replace") if seen and seen.response else ""
                    out.append(f"{event.recorder.label}: {check.name}: {info.failure.title}: "
                               f"{info.failure.message[:300]}\n  response: {body}\n  {info.code_sample[:1500]}")
        elif isinstance(event, events.NonFatalError):
            out.append(f"error in {event.label}: {event.info.title}: {event.info.message[:500]}")
        elif isinstance(event, events.FatalError):
            raise event.exception
    return sorted(set(out))


# Schemathesis sends hundreds of missing and wrong tokens from one address on purpose (its auth checks expect each
# to be a 401): a throttle of wrong admin tokens per address, where the service has one, must not answer them 429.
UNTHROTTLED = {"admin_failures_per_minute": 1 << 30}


def contract_app(database_url: str, tmp_path, **extra):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    settings = {f.name for f in dataclasses.fields(Config)}
    return create_app({"database_url": database_url, "redis_url": None, "storage_dir": str(tmp_path / "storage"),
                       "admin_token": ADMIN, "model": str(model), "online_timeout": ONLINE_TIMEOUT,
                       **{k: v for k, v in UNTHROTTLED.items() if k in settings}, **extra})


@pytest.fixture
def live(sqlite_url, tmp_path):
    """The embedded service on a real socket, with one tenant: (its URL, the tenant's API key)."""
    from kombu.transport.memory import Channel
    Channel.queues.clear()
    app = contract_app(sqlite_url, tmp_path)
    _, key = Admin(app.test_client()).tenant()
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", key["Authorization"].removeprefix("Bearer ")
    server.shutdown()
    thread.join(5)
    app.services.database.dispose()
    Channel.queues.clear()


def test_the_service_keeps_its_openapi_contract(live):
    assert set(CROSS_FIELD) == SATISFIED, "a rule no schema states: generated bodies must meet it here too"
    url, key = live
    start = time.monotonic()
    found = []
    # the tenant API first: the admin API's run may disable the tenant, revoke its key or change its quota
    for api in ("tenant", "admin"):
        found += failures(schemathesis.openapi.from_url(f"{url}/openapi.json", config=config(key, api)))
    print(f"schemathesis: {time.monotonic() - start:.1f} s")
    assert not found, "\n".join(found)
