"""/metrics for the web app: the service's counters (service/ledger/counters.py) and, read from the ledger and the
broker, jobs by state and queue depth by class (computed at most once per CACHE_SECONDS, however often it is
scraped); plus the per-request counting of HTTP requests and latency. It needs a bearer token: TIDEPOOL_METRICS_TOKEN or the admin
token. Tenant and batch ids label series only with TIDEPOOL_METRICS_TENANT_LABELS=1."""
import hmac
import threading
import time

from flask import Response, current_app, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .error_responses import error_response
from .ledger import affinity, cluster_queues, counters, eta, fair, fleet
from .ledger import database as ledger_db
from .ledger.counters import HTTP_LATENCY, HTTP_REQUESTS, registry_for_scrape
from .ledger.models import utcnow
from .ledger.services import Services

CACHE_SECONDS = 10.0    # the ledger and broker gauges are recomputed at most this often


class LedgerCollector:
    """Gauges read from the ledger and the broker, so every web process reports the same truth; computed at most
    once per CACHE_SECONDS (the queries scan the jobs and batches), the last result served in between."""

    def __init__(self, services: Services):
        self.services = services
        self.by_tenant = services.config.metrics_tenant_labels
        self.lock = threading.Lock()
        self.families: list | None = None
        self.computed = 0.0

    def collect(self):
        with self.lock:
            if self.families is None or time.monotonic() - self.computed > CACHE_SECONDS:
                self.families = list(self.compute())
                self.computed = time.monotonic()
            return list(self.families)

    def compute(self):
        jobs = GaugeMetricFamily("tidepool:jobs", "Jobs in the ledger by state and SLA class.",
                                 labels=["state", "sla_class"])
        with ledger_db.session(self.services.database) as s:
            for status, sla, n in counters.jobs_by_state(s):
                jobs.add_metric([status.value, sla.value], n)
        yield jobs
        depth = GaugeMetricFamily("tidepool:queue_depth", "Messages waiting in the broker per model and SLA class "
                                  "(model \"\" when no model is configured).", labels=["model", "sla_class"])
        try:
            dispatcher, models = self.services.dispatcher, self.services.registry
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
        yield from self.fleet()

    def fleet(self):
        """The fleet planner's last plan (beat, service/ledger/fleet.py), while it is younger than PLAN_TTL."""
        desired = GaugeMetricFamily("tidepool:desired_workers", "Workers the fleet planner wants in each pool "
                                    "(model/device kind) now, which KEDA's prometheus scaler follows; absent while no "
                                    "plan younger than 5 minutes is stored.", labels=["pool"])
        forecast = GaugeMetricFamily("tidepool:forecast_online_tokens_per_s", "The planner's forecast peak of online "
                                     "tokens per second over the next 15 minutes, per model.", labels=["model"])
        try:
            plan = fleet.PlanStore(self.services.redis).get()
        except Exception:  # Redis down: report no plan rather than fail the scrape
            current_app.logger.warning("fleet plan unavailable for /metrics")
            plan = None
        for name, pool in sorted((plan or {}).get("pools", {}).items()):
            desired.add_metric([name], pool["desired"])
        for model, series in sorted((plan or {}).get("forecast", {}).items()):
            forecast.add_metric([model], series[0] if series else 0.0)
        yield desired
        yield forecast

    def batches(self):
        tenant = ["tenant"] if self.by_tenant else []
        at_risk = GaugeMetricFamily("tidepool:batches_at_risk", "In-progress batches whose estimated completion "
                                    "falls after their window (service/ledger/eta.py), by SLA class (and tenant with "
                                    "TIDEPOOL_METRICS_TENANT_LABELS=1).", labels=[*tenant, "sla_class"])
        eta_s = GaugeMetricFamily("tidepool:batch_eta_seconds", "Seconds until the estimated completion of the "
                                  "in-progress batch of a class that finishes last (of each batch, labelled by batch "
                                  "and tenant id, with TIDEPOOL_METRICS_TENANT_LABELS=1); absent until the class has "
                                  "a measured drain rate.", labels=["batch", "tenant", "sla_class"] if self.by_tenant
                                  else ["sla_class"])
        counts: dict = {}
        latest: dict = {}
        with ledger_db.session(self.services.database) as s:
            now = utcnow()
            for batch, est in eta.in_progress(s, now):
                key = (batch.tenant_id, batch.sla_class.value) if self.by_tenant else (batch.sla_class.value,)
                counts[key] = counts.get(key, 0) + int(est.at_risk)
                if est.eta is not None:
                    left = max(0.0, (est.eta - now).total_seconds())
                    if self.by_tenant:
                        eta_s.add_metric([batch.id, *key], left)
                    else:
                        latest[key] = max(latest.get(key, 0.0), left)
        for key, n in counts.items():
            at_risk.add_metric(list(key), n)
        for key, left in latest.items():
            eta_s.add_metric(list(key), left)
        yield at_risk
        yield eta_s

    def fairness(self):
        """The fair take's view (service/ledger/fair.py) per class: the gap between the backlogged tenants' weighted
        service (decayed tokens served / weight) and the jobs waiting; per tenant too (weighted service, backlog)
        with TIDEPOOL_METRICS_TENANT_LABELS=1."""
        tenant = ["tenant"] if self.by_tenant else []
        service = GaugeMetricFamily("tidepool:fair_weighted_service", "Decayed tokens served / weight, by tenant "
                                    "and class (queue); only with TIDEPOOL_METRICS_TENANT_LABELS=1.",
                                    labels=["tenant", "sla_class"])
        backlog = GaugeMetricFamily("tidepool:fair_backlog", "Jobs waiting in the fair take's per-tenant queues, "
                                    "by class (queue), and tenant with TIDEPOOL_METRICS_TENANT_LABELS=1.",
                                    labels=[*tenant, "sla_class"])
        gap = GaugeMetricFamily("tidepool:fair_service_gap", "Largest difference in weighted service between two "
                                "backlogged tenants of a class (queue): VTC's fairness bound.", labels=["sla_class"])
        try:
            dispatcher = self.services.dispatcher
            client = dispatcher._direct_client()
            waiting: dict = {}
            for lane, tenants in dispatcher.fair_backlogs().items():
                parts = affinity.split_private(lane)
                queue = lane if parts is None else parts[0]
                for tenant_id, n in tenants.items():
                    waiting.setdefault(queue, {}).setdefault(tenant_id, 0)
                    waiting[queue][tenant_id] += n
            window = self.services.config.fair_window
            known = {cluster_queues.lane_of(key): key for key in (fair.known_queues(client) if client else ())}
            for queue in sorted(set(waiting) | set(known)):     # (a key on a Redis Cluster: "{queue}")
                served = fair.services(client, known.get(queue, queue), window) if client is not None else {}
                queued = waiting.get(queue, {})
                if self.by_tenant:
                    for tenant_id, (tokens, weight) in sorted(served.items()):
                        service.add_metric([tenant_id, queue], tokens / weight)
                    for tenant_id, n in sorted(queued.items()):
                        backlog.add_metric([tenant_id, queue], n)
                elif queued:
                    backlog.add_metric([queue], sum(queued.values()))
                norms = [served[t][0] / served[t][1] if t in served else 0.0 for t in queued]
                gap.add_metric([queue], max(norms) - min(norms) if len(norms) > 1 else 0.0)
        except Exception:  # broker down: report nothing rather than fail the scrape
            current_app.logger.warning("fair intake figures unavailable for /metrics")
        yield service
        yield backlog
        yield gap


def _allowed() -> bool:
    """A bearer token that is TIDEPOOL_METRICS_TOKEN or the admin token (with neither set, nothing is)."""
    conf = current_app.config["TIDEPOOL"]
    sent = request.headers.get("Authorization", "").encode()
    return any(hmac.compare_digest(sent, f"Bearer {token}".encode())
               for token in (conf.metrics_token, conf.admin_token) if token)


def scrape(gauges: LedgerCollector) -> Response:
    """GET /metrics: the service's counters and this app's ledger gauges."""
    if not _allowed():
        return error_response(401, "/metrics needs 'Authorization: Bearer <token>' with TIDEPOOL_METRICS_TOKEN or "
                                   "the admin token.", "invalid_api_key")
    ledger = CollectorRegistry()
    ledger.register(gauges)
    body = generate_latest(registry_for_scrape()) + generate_latest(ledger)
    return Response(body, content_type=CONTENT_TYPE_LATEST)


def init_app(app) -> None:
    gauges = LedgerCollector(app.services)
    app.add_url_rule("/metrics", "metrics", lambda: scrape(gauges))
    counters.TENANT_LABELS = app.config["TIDEPOOL"].metrics_tenant_labels

    @app.before_request
    def _start_timer():
        g.request_started = time.perf_counter()

    @app.after_request
    def _count(response):
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        method = counters.method_label(request.method)
        HTTP_REQUESTS.labels(route, method, str(response.status_code)).inc()
        started = g.get("request_started")
        if started is not None:
            HTTP_LATENCY.labels(route, method).observe(time.perf_counter() - started)
        return response
