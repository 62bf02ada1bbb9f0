"""The service's Prometheus counters: HTTP requests and their latency, quota rejections. Flask-free (quotas.py counts
its refusals here); the web app serves them on /metrics (service/metrics_http.py). Under gunicorn set
PROMETHEUS_MULTIPROC_DIR (an empty folder) and use `child_exit` below as the gunicorn hook; the counters are then
summed over all workers."""
import os

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry()
HTTP_REQUESTS = Counter("tidepool:http_requests", "HTTP requests by route and status.",
                        ["route", "method", "status"], registry=REGISTRY)
HTTP_LATENCY = Histogram("tidepool:http_request_duration_seconds", "HTTP request latency by route.",
                         ["route", "method"], registry=REGISTRY,
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
QUOTA_REJECTIONS = Counter("tidepool:quota_rejections", "Requests refused by a quota, by reason (and tenant id "
                           "with TIDEPOOL_METRICS_TENANT_LABELS=1; else the tenant label is empty).",
                           ["tenant", "reason"], registry=REGISTRY)
# Label values are bounded: an HTTP method outside this set is counted as "other", a route is its template (or
# "unmatched"), and tenant ids label series only where an operator opted in (Config.metrics_tenant_labels).
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
TENANT_LABELS = False     # set by the web app from its settings (service/metrics_http.py)


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


def quota_rejected(tenant_id: str, reason: str) -> None:
    QUOTA_REJECTIONS.labels(tenant_id if TENANT_LABELS else "", reason).inc()


def registry_for_scrape() -> CollectorRegistry:
    """The counters to serve: this process's, or under gunicorn every worker's (multiprocess mode)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return reg
    return REGISTRY


def child_exit(server, worker) -> None:
    """gunicorn hook (`child_exit = service.ledger.metrics.child_exit` in the gunicorn config)."""
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(worker.pid)
