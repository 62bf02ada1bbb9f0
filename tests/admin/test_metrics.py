"""/metrics on the web app and on a worker: the tidepool: names are there and their values move."""
import json
import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidepool.service.ledger import jobs as transitions
from tidepool.service.ledger.logging import JsonFormatter, configure, log_job, scrub
from tidepool.workers.metrics import EngineMetrics, SnapshotStore, start_metrics_server

from .conftest import ADMIN, make_app

BEARER = {"Authorization": f"Bearer {ADMIN}"}
ENGINE_NAMES = ["tidepool:time_to_first_token_seconds", "tidepool:inter_token_latency_seconds",
                "tidepool:e2e_request_latency_seconds", "tidepool:request_queue_time_seconds",
                "tidepool:num_requests_running", "tidepool:num_requests_waiting", "tidepool:kv_cache_usage_perc",
                "tidepool:num_preemptions_total", "tidepool:prefix_cache_queries_total",
                "tidepool:prefix_cache_hits_total", "tidepool:prompt_tokens_total",
                "tidepool:generation_tokens_total", "tidepool:iteration_tokens"]


def samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} for every sample of a Prometheus text page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(page: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in page.items() if n == name and set(labels.items()) <= set(ls))


def scrape(client) -> dict:
    return samples(client.get("/metrics", headers=BEARER).text)


def test_service_metrics_move_when_jobs_run(client, app, monkeypatch):
    from tidepool.service import metrics_http
    monkeypatch.setattr(metrics_http, "CACHE_SECONDS", 0.0)     # every scrape reads the ledger
    r = client.post("/v1/admin/tenants", json={"name": "m", "quota": {"max_queued": 1}}, headers=BEARER)
    key = r.get_json()["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    before = scrape(client)
    assert value(before, "tidepool:jobs", state="queued") == 0
    job = client.post("/v1/jobs", json={"prompt": "hi", "sla_class": "batch"}, headers=auth).get_json()
    assert client.post("/v1/jobs", json={"prompt": "hi"}, headers=auth).status_code == 429  # max_queued
    page = scrape(client)
    assert value(page, "tidepool:jobs", state="queued", sla_class="batch") == 1
    assert value(page, "tidepool:queue_depth", sla_class="batch") == 1
    assert value(page, "tidepool:quota_rejections_total", tenant="", reason="max_queued") == \
        value(before, "tidepool:quota_rejections_total", tenant="", reason="max_queued") + 1
    assert value(page, "tidepool:http_requests_total", route="/v1/jobs", method="POST", status="202") >= \
        value(before, "tidepool:http_requests_total", route="/v1/jobs", method="POST", status="202") + 1
    assert value(page, "tidepool:http_request_duration_seconds_count", route="/v1/jobs") >= 2

    with app.services.sessions() as s:
        token = transitions.start(s, job["id"], "gpu0").lease_token
        s.commit()
        page = scrape(client)
        assert value(page, "tidepool:jobs", state="running", sla_class="batch") == 1
        assert value(page, "tidepool:jobs", state="queued") == 0
        transitions.complete(s, job["id"], token, output="x", output_token_ids=[1], prompt_tokens=1,
                             completion_tokens=1, finish_reason="stop")
        s.commit()
    page = scrape(client)
    assert value(page, "tidepool:jobs", state="completed", sla_class="batch") == 1
    assert value(page, "tidepool:jobs", state="running") == 0


def test_multiprocess_mode_sums_counters_across_processes(client, tmp_path, monkeypatch):
    """Under gunicorn each worker writes its counters to PROMETHEUS_MULTIPROC_DIR; /metrics reads them all."""
    from prometheus_client import Counter, values
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: 4242))
    c = Counter("tidepool:http_requests", "x", ["route", "method", "status"], registry=None)
    c.labels("/v1/jobs", "POST", "202").inc(7)
    page = scrape(client)
    assert value(page, "tidepool:http_requests_total", route="/v1/jobs", status="202") == 7
    assert ("tidepool:queue_depth", frozenset({("model", ""), ("sla_class", "batch")})) in page  # ledger gauges still served


def test_engine_metrics_from_a_real_tiny_engine(tmp_path):
    from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
    from tidepool.workers.tools.tiny_model import make_tiny_model

    # Targets no step can miss, however slow this machine's calibration was.
    loose = {cls: {"ttft_ms": 1e9, "itl_ms": 1e9} for cls in ("realtime", "interactive")}
    engine = LLMEngine(EngineConfig(model=str(make_tiny_model(tmp_path / "m", seed=1)), device="cpu",
                                    sla_targets=loose))
    registry = CollectorRegistry()
    store = SnapshotStore()
    store.clear()
    metrics = EngineMetrics(registry=registry, worker="cpu0", store=store, device="cpu")
    prefix = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # a full block to share
    classes = {"r0": ("batch", "a"), "r1": ("realtime", "b"), "r2": ("batch", "a"), "r3": ("interactive", "b")}
    for i, (rid, (cls, tenant)) in enumerate(classes.items()):
        n = 2 if rid == "r2" else 1     # every choice's tokens count
        engine.add_request(rid, prefix + [30 + i], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                  n=n), sla_class=cls, tenant=tenant)
    t0 = time.time()  # every update below is stamped t0, so only the first publishes a snapshot
    engine.step()
    metrics.update_from_stats(engine.stats(), now=t0)
    mid = samples(generate_latest(registry).decode())
    # the step policy gives the online prompts a first-token step of their own: the offline two join in the next
    assert value(mid, "tidepool:num_requests_running", worker="cpu0") == 2
    assert value(mid, "tidepool:kv_cache_usage_perc", worker="cpu0") > 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cls, tenant = classes[out.request_id]
                metrics.observe_request(out, cls, tenant, queue_time=0.25)
        metrics.update_from_stats(engine.stats(), now=t0)
    stats = engine.stats()
    text = generate_latest(registry).decode()
    page = samples(text)
    for name in ENGINE_NAMES:
        assert name in text, name
    assert value(page, "tidepool:generation_tokens_total") == 40 == stats["total_generation_tokens"]
    assert value(page, "tidepool:generation_tokens_total", sla_class="batch", tenant="a") == 24
    assert value(page, "tidepool:prompt_tokens_total") == 4 * 18
    assert value(page, "tidepool:time_to_first_token_seconds_count") == 4
    assert value(page, "tidepool:time_to_first_token_seconds_count", sla_class="batch") == 2
    assert value(page, "tidepool:e2e_request_latency_seconds_sum") > value(
        page, "tidepool:time_to_first_token_seconds_sum") > 0
    assert value(page, "tidepool:inter_token_latency_seconds_count") == 4
    assert value(page, "tidepool:request_queue_time_seconds_sum") == 1.0
    assert value(page, "tidepool:request_success_total", finish_reason="length") == 4
    assert value(page, "tidepool:prefix_cache_queries_total", worker="cpu0") == stats["prefix_cache_queries"] > 0
    assert value(page, "tidepool:prefix_cache_hits_total", worker="cpu0") == stats["prefix_cache_hits"]
    assert value(page, "tidepool:iteration_tokens_count", worker="cpu0") == stats["total_steps"]
    assert value(page, "tidepool:iteration_tokens_sum", worker="cpu0") == \
        stats["total_prompt_tokens"] + stats["total_generation_tokens"] - 5  # each sequence's first token: prefill
    assert value(page, "tidepool:num_requests_running", worker="cpu0") == 0
    # the snapshot the dashboard reads
    [snap] = store.read(now=t0)
    assert snap["worker"] == "cpu0" and snap["device"] == "cpu" and snap["running"] == 2
    metrics.update_from_stats(stats, now=snap["ts"] + 2)
    [snap] = store.read(now=snap["ts"] + 2)
    assert snap["running"] == 0 and snap["total_generation_tokens"] == 40 and snap["generation_tokens_per_s"] > 0
    assert store.read(now=snap["ts"] + 60) == []  # a silent worker drops off the dashboard
    # and its own /metrics endpoint
    server, thread = start_metrics_server(0, registry, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as resp:
            served = resp.read().decode()
        assert "tidepool:generation_tokens_total" in served
    finally:
        server.shutdown()
        server.server_close()


def test_engine_counters_survive_an_engine_restart():
    registry = CollectorRegistry()
    m = EngineMetrics(registry=registry, worker="w")
    m.update_from_stats({"preemptions": 5, "total_steps": 1, "last_step": {"tokens": 3}})
    m.update_from_stats({"preemptions": 2, "total_steps": 1, "last_step": {"tokens": 3}})  # restarted engine
    assert value(samples(generate_latest(registry).decode()), "tidepool:num_preemptions_total") == 7


def test_tenant_label_cardinality_is_bounded():
    from types import SimpleNamespace

    from tidepool.workers import metrics as wm
    registry = CollectorRegistry()
    m = EngineMetrics(registry=registry)
    out = SimpleNamespace(prompt_token_ids=[1], token_ids=[2], generated_tokens=1, finish_reason="stop",
                          arrival_time=0.0, first_token_time=None, finished_time=None)
    for i in range(wm.MAX_TENANT_LABELS + 20):
        m.observe_request(out, "batch", f"t{i}")
    page = samples(generate_latest(registry).decode())
    tenants = {dict(ls)["tenant"] for (n, ls) in page if n == "tidepool:prompt_tokens_total"}
    assert len(tenants) == wm.MAX_TENANT_LABELS + 1 and "other" in tenants


def test_job_log_lines_are_json_with_context_and_no_secrets(client, capsys):
    import io
    import logging
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        r = client.post("/v1/admin/tenants", json={"name": "logs"}, headers=BEARER)
        key = r.get_json()["api_key"]
        job = client.post("/v1/jobs", json={"prompt": "hi", "sla_class": "realtime"},
                          headers={"Authorization": f"Bearer {key}"}).get_json()
        logging.getLogger("tidepool.test").warning("client sent Authorization: Bearer %s and key %s", key, key)
        logging.getLogger("tidepool.test").warning("admin token is %s", ADMIN)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    queued = next(x for x in lines if x.get("event") == "job.queued")
    assert queued["job_id"] == job["id"] and queued["tenant"] == r.get_json()["id"]
    assert queued["sla_class"] == "realtime" and queued["status"] == "queued" and queued["level"] == "info"
    text = stream.getvalue()
    assert key not in text and ADMIN not in text and key.rsplit("_", 1)[0][:13] in text  # prefix kept
    assert "Bearer [redacted]" in text


def test_scrub_and_configure():
    import io
    import logging
    assert scrub("password=hunter2 secret: abc") == "password=[redacted] secret: [redacted]"
    assert scrub("tp_abcdefghij_SECRETsecret") == "tp_abcdefghij_[redacted]"
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        handler = configure("INFO", stream)
        assert configure() is handler and root.handlers.count(handler) == 1  # idempotent
        assert not [h for h in root.handlers if type(h) is logging.StreamHandler and h is not handler]
        log_job("job.started", job_id="job_1", tenant="ten_1", sla_class="batch", worker="gpu0")
    finally:
        root.handlers, root.level = saved, level
    line = json.loads(stream.getvalue())
    assert line["msg"] == "job.started" and line["job_id"] == "job_1" and line["worker"] == "gpu0"


def test_grafana_dashboard_plots_only_metrics_that_exist(client):
    import re
    from pathlib import Path
    dash = json.loads((Path(__file__).resolve().parents[2] / "web/grafana/tidepool-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"tidepool:[a-z_]+", e)}
    registry = CollectorRegistry()
    EngineMetrics(registry=registry).update_from_stats({"by_class": {}, "total_steps": 1, "last_step": {}})
    exposed = generate_latest(registry).decode() + client.get("/metrics", headers=BEARER).text
    exposed_names = set(re.findall(r"^# TYPE (tidepool:[a-z_]+)", exposed, re.M))
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exposed_names or base in exposed_names or name.removesuffix("_total") in exposed_names, name
    assert len(dash["panels"]) >= 15 and {p["gridPos"]["w"] for p in dash["panels"]} <= {12, 24}


def test_metrics_token_when_configured(pg_url, tmp_path, admin_redis, monkeypatch):
    monkeypatch.setenv("TIDEPOOL_METRICS_TOKEN", "scrape-secret")     # read once, when the app is built
    app = make_app(pg_url, tmp_path, admin_redis)
    try:
        client = app.test_client()
        assert client.get("/metrics").status_code == 401
        r = client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
        assert r.status_code == 200 and "tidepool:http_requests_total" in r.text
    finally:
        app.services.database.dispose()


def test_http_requests_are_logged_as_json(client):
    import io
    import logging
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tidepool.http")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        client.get("/v1/admin/tenants/ten_x", headers=BEARER)
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["route"] == "/v1/admin/tenants/<tenant_id>" and line["http_status"] == 404
    assert line["method"] == "GET" and line["duration_ms"] >= 0 and ADMIN not in stream.getvalue()


def test_worker_metrics_port_moves_to_the_next_free_one():
    import socket
    import urllib.request

    from tidepool.workers.metrics import bind_metrics_server
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        registry = CollectorRegistry()
        EngineMetrics(registry=registry, worker="second")
        bound = bind_metrics_server(port, registry)
        assert bound > port
        assert "tidepool:kv_cache_usage_perc" in urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics").read().decode()


def test_text_log_format(monkeypatch):
    import io
    import logging
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    stream = io.StringIO()
    monkeypatch.setenv("TIDEPOOL_LOG_FORMAT", "text")
    try:
        configure("INFO", stream)
        log_job("job.started", job_id="job_1", tenant="ten_1", sla_class="batch")
        logging.getLogger("werkzeug").info("127.0.0.1 - - \x1b[32mGET / 200\x1b[0m")     # held at WARNING
        logging.getLogger("kombu.connection").warning("No hostname was supplied. Reverting to default 'localhost'")
        logging.getLogger("x").warning("key tp_abcdefghij_SECRETsecret")
    finally:
        root.handlers, root.level = saved, level
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and not lines[0].startswith("{")
    assert "INFO tidepool.jobs: job.started" in lines[0] and "job_id=job_1" in lines[0]
    assert lines[1].endswith("x: key tp_abcdefghij_[redacted]")


def test_metrics_need_a_token_by_default(pg_url, tmp_path, admin_redis):
    """/metrics is closed by default: the admin token (or TIDEPOOL_METRICS_TOKEN) opens it; with neither set,
    nothing does. The refusal is in the API's error format."""
    for extra, tokens in (({}, [ADMIN]), ({"metrics_token": "scrape-secret"}, [ADMIN, "scrape-secret"]),
                          ({"admin_token": None}, [])):
        app = make_app(pg_url, tmp_path, admin_redis, **extra)
        try:
            client = app.test_client()
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer "}):
                r = client.get("/metrics", headers=headers)
                assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key", (extra, headers)
            for token in tokens:
                r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
                assert r.status_code == 200 and "tidepool:http_requests_total" in r.text
        finally:
            app.services.database.dispose()


def test_http_series_have_bounded_labels(client):
    """A client's method and path never become label values: methods outside the standard set count as
    "other", paths as their route template (or "unmatched")."""
    for method in ("BREW", "PROPFIND", "X" * 200):
        client.open("/v1/jobs", method=method)
    client.get("/v1/jobs/job_anything-at-all")
    client.get("/no/such/route/12345")
    page = scrape(client)
    methods = {dict(ls).get("method") for (n, ls) in page if n == "tidepool:http_requests_total"}
    routes = {dict(ls).get("route") for (n, ls) in page if n == "tidepool:http_requests_total"}
    assert methods <= {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other"} and "other" in methods
    assert "/v1/jobs/<job_id>" in routes and "unmatched" in routes
    assert not [r for r in routes if "12345" in r or "job_anything" in r]


def _tenant_with_ids(client) -> tuple[str, str]:
    """A tenant with a quota rejection and an in-progress batch: (tenant id, batch id)."""
    import io
    r = client.post("/v1/admin/tenants", json={"name": f"ids-{time.monotonic_ns()}", "quota": {"max_queued": 2}},
                    headers=BEARER)
    tenant_id, auth = r.get_json()["id"], {"Authorization": f"Bearer {r.get_json()['api_key']}"}
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")},
                    headers=auth).get_json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": f, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}, headers=auth).get_json()
    assert batch["status"] == "in_progress", batch
    client.post("/v1/jobs", json={"prompt": "hi", "sla_class": "batch"}, headers=auth)
    assert client.post("/v1/jobs", json={"prompt": "hi"}, headers=auth).status_code == 429     # max_queued
    return tenant_id, batch["id"]


def test_no_tenant_or_batch_ids_as_labels_unless_opted_in(client, pg_url, tmp_path, admin_redis, monkeypatch):
    from tidepool.service.ledger import counters
    monkeypatch.setattr(counters, "TENANT_LABELS", False, raising=False)    # restored after the opted-in app
    tenant_id, batch_id = _tenant_with_ids(client)
    text = client.get("/metrics", headers=BEARER).text
    assert tenant_id not in text and batch_id not in text
    assert value(samples(text), "tidepool:quota_rejections_total", reason="max_queued") >= 1
    assert value(samples(text), "tidepool:batches_at_risk", sla_class="batch") == 0
    opted = make_app(pg_url, tmp_path, admin_redis, metrics_tenant_labels=True)
    try:
        other = opted.test_client()
        tenant_id, _ = _tenant_with_ids(other)
        page = samples(other.get("/metrics", headers=BEARER).text)
        assert value(page, "tidepool:quota_rejections_total", tenant=tenant_id, reason="max_queued") == 1
        assert ("tidepool:batches_at_risk", frozenset({("tenant", tenant_id), ("sla_class", "batch")})) in page
    finally:
        opted.services.database.dispose()


def test_scrapes_in_quick_succession_run_the_ledger_queries_once(client, app):
    from sqlalchemy import event
    engine = app.services.database
    statements = []
    assert client.get("/metrics", headers=BEARER).status_code == 200
    listen = lambda *args: statements.append(args[2])     # noqa: E731
    event.listen(engine, "before_cursor_execute", listen)
    try:
        for _ in range(3):
            assert "tidepool:jobs" in client.get("/metrics", headers=BEARER).text
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    assert statements == []
