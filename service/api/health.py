"""Liveness, readiness and the OpenAPI document."""
from pathlib import Path

from flask import Blueprint

from ..db import get_engine
from ..ledger.database import ping
from ..error_responses import error_response
from ..openapi import spec
from ..ledger.snapshots import SnapshotStore
from . import cfg
from ..app import services

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    checks = {}
    try:
        ping(get_engine())
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        client = services().redis
        if client is not None:
            client.ping()
        else:
            services().dispatcher.ping()
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    checks["engine"] = _engine_check()
    if all(v == "ok" for v in checks.values()):
        return {"status": "ok", "checks": checks}
    resp = error_response(503, "Not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), "not_ready")
    return resp


def _engine_check() -> str:
    """ok once a worker serving this model has its engine up (workers publish snapshots only after loading)."""
    try:
        snaps = SnapshotStore(services().redis).read()
    except Exception as exc:
        return f"error: {type(exc).__name__}"
    model = cfg().model
    if any(not model or not s.get("model") or Path(s["model"]).name == Path(model).name for s in snaps):
        return "ok"
    return "no worker with its engine up yet" + (f" for {Path(model).name}" if model else "")


@bp.get("/openapi.json")
def openapi():
    return spec()
