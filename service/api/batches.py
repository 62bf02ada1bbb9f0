"""OpenAI Batch API over job rows: a batch is validated in full, then becomes jobs in bulk."""
from flask import Blueprint, g, request

from ..ledger import batches as ledger, eta, pages, quotas, tenants
from ..protocol import request_bodies as bodies
from ..auth import tenant_required
from ..db import reads, session
from ..protocol.errors import APIError, bad_request, not_found
from ..ledger.models import OFFLINE_CLASSES, Batch, BatchStatus, File, SlaClass, new_id, utcnow
from . import cfg, json_body, limit_arg, owned, page, ts
from ..app import services

bp = Blueprint("batches", __name__)
FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "sla_class"}


def batch_json(b: Batch, s=None) -> dict:
    """s: the session b was read in (a listing's reads()), else the request's session."""
    s = s or session()
    errors = {"object": "list", "data": b.errors} if b.errors else None
    usage, model = ledger.usage_and_model(s, b, cfg().served_model_name)
    return {"id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors, "model": model, "usage": usage,
            "input_file_id": b.input_file_id, "completion_window": b.completion_window,
            "status": b.status.value, "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
            "created_at": ts(b.created_at), "in_progress_at": ts(b.in_progress_at),
            "expires_at": ts(b.expires_at), "finalizing_at": ts(b.finalizing_at),
            "completed_at": ts(b.completed_at), "failed_at": ts(b.failed_at), "expired_at": ts(b.expired_at),
            "cancelling_at": ts(b.cancelling_at), "cancelled_at": ts(b.cancelled_at),
            "request_counts": ledger.request_counts(s, b), "metadata": b.metadata_,
            "sla_class": b.sla_class.value, "x_tidepool": _x_tidepool(s, b)}


def _x_tidepool(s, b: Batch) -> dict:
    """Tidepool's extra fields (the OpenAI SDK keeps them as extras): an in-progress batch's estimated completion
    time (unix seconds, null until its class has a measured drain rate), its position behind its tenant's earlier
    work, what is left of it, and whether the estimate misses its window (service/ledger/eta.py)."""
    est = eta.estimate(s, b)
    if est is None:
        return {"eta": None, "position": 0, "remaining": 0, "drain_rate": None, "share": None, "at_risk": False}
    return est.json()


@bp.post("/v1/batches")
@tenant_required
def create_batch():
    body, quota, conf = json_body(), g.quota, cfg()
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    if body.get("endpoint") not in ledger.ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {list(ledger.ENDPOINTS)}.", "endpoint")
    if body.get("completion_window") != "24h":
        raise bad_request("'completion_window' must be '24h'.", "completion_window")
    sla = body.get("sla_class", "batch")
    if sla not in OFFLINE_CLASSES:
        raise bad_request(f"'sla_class' must be one of {list(OFFLINE_CLASSES)}.", "sla_class")
    quotas.check_class(quota, sla)
    metadata = bodies.check_metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    s = session()
    f = tenants.owned(s, File, file_id, g.tenant.id) if isinstance(file_id, str) else None
    if f is None:
        raise APIError(404, f"No file found with id '{file_id}'.", "not_found", "input_file_id")
    if f.purpose != "batch":
        raise bad_request(f"File '{file_id}' has purpose '{f.purpose}', not 'batch'.", "input_file_id")

    now = utcnow()
    batch = Batch(id=new_id("batch_"), tenant_id=g.tenant.id, endpoint=body["endpoint"], input_file_id=f.id,
                  completion_window="24h", sla_class=SlaClass(sla), status=BatchStatus.validating, metadata_=metadata,
                  total=0, completed=0, failed=0, created_at=now, expires_at=ledger.default_expiry(now))
    try:   # the batch is committed with its jobs, or failed, never left validating: a crash leaves no row
        errors, created = ledger.load_jobs(s, services().storage, batch, quota, served_model=conf.served_model_name,
                                           max_lines=conf.max_batch_lines, chunk_size=conf.batch_chunk_size,
                                           cache_group=g.tenant.prefix_cache_group, models=services().registry,
                                           route=services().dispatcher.queue, key_id=g.get("api_key_id"))
    except APIError as exc:  # budget or max_queued: the batch fails as a whole
        errors, created = [{"code": exc.code, "message": exc.message, "param": None, "line": None}], []
    if errors:
        s.rollback()
        batch.status, batch.failed_at, batch.errors = BatchStatus.failed, utcnow(), errors
        s.add(batch)
        s.commit()
        return batch_json(batch)
    batch.status, batch.in_progress_at, batch.total = BatchStatus.in_progress, utcnow(), len(created)
    s.commit()
    services().dispatcher.publish(created)
    return batch_json(batch)


@bp.get("/v1/batches/<batch_id>")
@tenant_required
def get_batch(batch_id):
    return batch_json(owned(Batch, batch_id, not_found("batch", batch_id)))


@bp.get("/v1/batches")
@tenant_required
def list_batches():
    limit = limit_arg(20, 100)
    s = reads()
    rows = pages.page(s, Batch, limit, after=request.args.get("after"), tenant_id=g.tenant.id)
    return page(rows, limit, lambda b: batch_json(b, s))


@bp.post("/v1/batches/<batch_id>/cancel")
@tenant_required
def cancel_batch(batch_id):
    s = session()
    batch = owned(Batch, batch_id, not_found("batch", batch_id))
    if batch.status not in (BatchStatus.validating, BatchStatus.in_progress) or not ledger.cancel(s, batch):
        raise APIError(409, f"Batch '{batch_id}' is {batch.status.value} and cannot be cancelled.",
                       "batch_not_cancellable")
    ledger.finalize(s, services().storage, batch, cfg().served_model_name)
    s.commit()
    return batch_json(batch)
