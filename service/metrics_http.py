"""/metrics for the web app: the service's counters (service/ledger/metrics.py) and, read from the ledger and the broker at
scrape time, jobs by state and queue depth by class; plus the per-request counting of HTTP requests and latency."""
import hmac
import time

from flask import Blueprint, Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .ledger import affinity, eta, fair
from .ledger.metrics import HTTP_LATENCY, HTTP_REQUESTS, registry_for_scrape
from .ledger.models import Job, utcnow

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
        yield from self.batches()
        yield from self.fairness()

    def batches(self):
        at_risk = GaugeMetricFamily("tidepool:batches_at_risk", "In-progress batches whose estimated completion "
                                    "falls after their window (service/ledger/eta.py), by tenant and SLA class.",
                                    labels=["tenant", "sla_class"])
        eta_s = GaugeMetricFamily("tidepool:batch_eta_seconds", "Seconds until an in-progress batch's estimated "
                                  "completion (absent until its class has a measured drain rate).",
                                  labels=["batch", "tenant", "sla_class"])
        counts: dict = {}
        with Session(self.app.extensions["tidepool.db"]) as s:
            now = utcnow()
            for batch, est in eta.in_progress(s, now):
                key = (batch.tenant_id, batch.sla_class.value)
                counts[key] = counts.get(key, 0) + int(est.at_risk)
                if est.eta is not None:
                    eta_s.add_metric([batch.id, *key], max(0.0, (est.eta - now).total_seconds()))
        for key, n in counts.items():
            at_risk.add_metric(list(key), n)
        yield at_risk
        yield eta_s

    def fairness(self):
        """The fair take's view (service/ledger/fair.py), per tenant and class: weighted service (decayed tokens
        served / weight), jobs waiting, and per class the gap between the backlogged tenants' weighted service."""
        service = GaugeMetricFamily("tidepool:fair_weighted_service", "Decayed tokens served / weight, by tenant "
                                    "and class (queue).", labels=["tenant", "sla_class"])
        backlog = GaugeMetricFamily("tidepool:fair_backlog", "Jobs waiting in the fair take's per-tenant queues, "
                                    "by tenant and class (queue).", labels=["tenant", "sla_class"])
        gap = GaugeMetricFamily("tidepool:fair_service_gap", "Largest difference in weighted service between two "
                                "backlogged tenants of a class (queue): VTC's fairness bound.", labels=["sla_class"])
        try:
            dispatcher = self.app.extensions["tidepool.dispatcher"]
            client = dispatcher._direct_client()
            waiting: dict = {}
            for lane, tenants in dispatcher.fair_backlogs().items():
                parts = affinity.split_private(lane)
                queue = lane if parts is None else parts[0]
                for tenant, n in tenants.items():
                    waiting.setdefault(queue, {}).setdefault(tenant, 0)
                    waiting[queue][tenant] += n
            window = self.app.config["TIDEPOOL"].fair_window
            for queue in sorted(set(waiting) | set(fair.known_queues(client) if client is not None else ())):
                served = fair.services(client, queue, window) if client is not None else {}
                for tenant, (tokens, weight) in sorted(served.items()):
                    service.add_metric([tenant, queue], tokens / weight)
                for tenant, n in sorted(waiting.get(queue, {}).items()):
                    backlog.add_metric([tenant, queue], n)
                norms = [served[t][0] / served[t][1] if t in served else 0.0 for t in waiting.get(queue, {})]
                gap.add_metric([queue], max(norms) - min(norms) if len(norms) > 1 else 0.0)
        except Exception:  # broker down: report nothing rather than fail the scrape
            current_app.logger.warning("fair intake figures unavailable for /metrics")
        yield service
        yield backlog
        yield gap


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
