"""/metrics for the web app: the service's counters (service/ledger/metrics.py) and, read from the ledger and the broker at
scrape time, jobs by state and queue depth by class; plus the per-request counting of HTTP requests and latency."""
import hmac
import time

from flask import Blueprint, Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from .ledger.metrics import HTTP_LATENCY, HTTP_REQUESTS, registry_for_scrape
from .ledger.models import Job

bp = Blueprint("metrics", __name__)


class LedgerCollector:
    """Gauges computed when scraped, so every web process reports the same truth."""

    def __init__(self, app):
        self.app = app

    def collect(self):
        jobs = GaugeMetricFamily("tidepool:jobs", "Jobs in the ledger by state and SLA class.",
                                 labels=["state", "sla_class"])
        with self.app.extensions["tidepool.db"].connect() as conn:
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


@bp.get("/metrics")
def metrics():
    token = current_app.config["TIDEPOOL"].metrics_token  # optional: scrapers then send it as a bearer token
    if token and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                         f"Bearer {token}".encode()):
        return Response("metrics token required\n", status=401, content_type="text/plain")
    ledger = CollectorRegistry()
    ledger.register(LedgerCollector(current_app._get_current_object()))
    body = generate_latest(registry_for_scrape()) + generate_latest(ledger)
    return Response(body, content_type=CONTENT_TYPE_LATEST)


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
