"""One JSON line per HTTP request, through the ledger's log configuration (service.ledger.logging)."""
import logging
import time

from flask import g, request


def init_app(app) -> None:
    """One JSON line per HTTP request (route template, not query string; tenant when authenticated)."""
    http_log = logging.getLogger("tidepool.http")

    @app.before_request
    def _t0():
        g.log_t0 = time.perf_counter()

    @app.after_request
    def _access(response):
        if http_log.isEnabledFor(logging.INFO):
            tenant = getattr(g.get("tenant"), "id", None)
            started = g.get("log_t0")
            http_log.info("request", extra={
                "method": request.method, "path": request.path, "http_status": response.status_code,
                "route": request.url_rule.rule if request.url_rule is not None else None, "tenant": tenant,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1) if started else None})
        return response
