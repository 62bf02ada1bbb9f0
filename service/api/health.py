"""Liveness, readiness and the OpenAPI document."""
from flask import Blueprint
from sqlalchemy import text

from ..db import get_engine
from ..errors import error_response
from ..openapi import spec
from . import ext

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    checks = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        client = ext("redis")
        if client is not None:
            client.ping()
        else:
            ext("dispatcher").ping()
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    if all(v == "ok" for v in checks.values()):
        return {"status": "ok", "checks": checks}
    resp = error_response(503, "Not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), "not_ready")
    return resp


@bp.get("/openapi.json")
def openapi():
    return spec()
