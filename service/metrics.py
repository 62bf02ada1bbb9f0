"""Service metrics on /metrics: HTTP requests, quota rejections, and, read from the ledger and the broker at
scrape time, jobs by state and queue depth by class. Under gunicorn set PROMETHEUS_MULTIPROC_DIR (an empty
folder) and use `child_exit` below as the gunicorn hook; the counters are then summed over all workers."""
import hmac
import os
import time

from flask import Blueprint, Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from .models import Job

REGISTRY = CollectorRegistry()
HTTP_REQUESTS = Counter("tidepool:http_requests", "HTTP requests by route and status.",
                        ["route", "method", "status"], registry=REGISTRY)
HTTP_LATENCY = Histogram("tidepool:http_request_duration_seconds", "HTTP request latency by route.",
                         ["route", "method"], registry=REGISTRY,
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
QUOTA_REJECTIONS = Counter("tidepool:quota_rejections", "Requests refused by a quota, by tenant id and reason.",
                           ["tenant", "reason"], registry=REGISTRY)

bp = Blueprint("metrics", __name__)


def quota_rejected(tenant_id: str, reason: str) -> None:
    QUOTA_REJECTIONS.labels(tenant_id, reason).inc()


class LedgerCollector:
    """Gauges computed when scraped, so every web process reports the same truth."""

    def __init__(self, app):
        self.app = app

    def collect(self):
        jobs = GaugeMetricFamily("tidepool:jobs", "Jobs in the ledger by state and SLA class.",
                                 labels=["state", "sla_class"])
        with self.app.extensions["tidepool.engine"].connect() as conn:
            for status, sla, n in conn.execute(select(Job.status, Job.sla_class, func.count())
                                               .group_by(Job.status, Job.sla_class)):
                jobs.add_metric([status.value, sla.value], n)
        yield jobs
        depth = GaugeMetricFamily("tidepool:queue_depth", "Messages waiting in the broker per model and SLA class "
                                  "(model \"\" when no model is configured).", labels=["model", "sla_class"])
        try:
            dispatcher, models = self.app.extensions["tidepool.dispatcher"], self.app.extensions["tidepool.registry"]
            names = list(models.entries())
            rows = dispatcher.model_depths(names) if names else \
                [{"model": "", "sla_class": c, "depth": n} for c, n in dispatcher.queue_depths().items()]
            for row in rows:
                depth.add_metric([row["model"], row["sla_class"]], row["depth"])
        except Exception:  # broker down: report no depth rather than fail the scrape
            current_app.logger.warning("queue depth unavailable for /metrics")
        yield depth


def _registry_for_scrape() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return reg
    return REGISTRY


@bp.get("/metrics")
def metrics():
    token = current_app.config["TIDEPOOL"].metrics_token  # optional: scrapers then send it as a bearer token
    if token and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                         f"Bearer {token}".encode()):
        return Response("metrics token required\n", status=401, content_type="text/plain")
    ledger = CollectorRegistry()
    ledger.register(LedgerCollector(current_app._get_current_object()))
    body = generate_latest(_registry_for_scrape()) + generate_latest(ledger)
    return Response(body, content_type=CONTENT_TYPE_LATEST)


def child_exit(server, worker) -> None:
    """gunicorn hook (`child_exit = service.metrics.child_exit` in the gunicorn config)."""
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(worker.pid)


def init_app(app) -> None:
    app.register_blueprint(bp)

    @app.before_request
    def _start_timer():
        g.request_started = time.perf_counter()

    @app.after_request
    def _count(response):
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        HTTP_REQUESTS.labels(route, request.method, str(response.status_code)).inc()
        started = g.get("request_started")
        if started is not None:
            HTTP_LATENCY.labels(route, request.method).observe(time.perf_counter() - started)
        return response
