"""Admin JSON API (admin token): tenants, quotas, keys, models and their grants, cross-tenant listings, queue
depths."""
from flask import Blueprint, request

from ..ledger import adapters, affinity, pages, registry, tenants
from ..auth import admin_required
from ..db import session
from ..protocol.errors import bad_request, not_found
from ..ledger.models import SLA_CLASSES, AuditLog, Batch, Job, JobStatus, Quota, Tenant
from . import cfg, json_body, limit_arg, page, ts
from ..app import services
from .batches import batch_json
from .jobs import job_json, list_args

bp = Blueprint("admin", __name__, url_prefix="/v1/admin")


def _tenant(tenant_id: str) -> Tenant:
    t = session().get(Tenant, tenant_id)
    if t is None:
        raise not_found("tenant", tenant_id)
    return t


@bp.post("/tenants")
@admin_required
def create_tenant():
    body = json_body()
    unknown = sorted(set(body) - {"name", "weight", "quota", "default_sla_class"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    s = session()
    tenant, key = tenants.create_tenant(s, body.get("name"), body.get("weight", 1.0), body.get("quota"),
                                        default_sla_class=body.get("default_sla_class"))
    s.commit()
    out = tenants.tenant_json(tenant, s.get(Quota, tenant.id))
    out["api_key"] = key
    return out, 201


@bp.get("/tenants")
@admin_required
def list_tenants():
    rows = tenants.with_quotas(session())
    return {"object": "list", "data": [tenants.tenant_json(t, q) for t, q in rows]}


@bp.get("/tenants/<tenant_id>")
@admin_required
def get_tenant(tenant_id):
    t = _tenant(tenant_id)
    return tenants.tenant_json(t, session().get(Quota, t.id))


@bp.patch("/tenants/<tenant_id>")
@admin_required
def update_tenant(tenant_id):
    body = json_body()
    unknown = sorted(set(body) - {"weight", "default_sla_class", "prefix_cache_group"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    s = session()
    tenant = tenants.update_tenant(s, _tenant(tenant_id), body)
    s.commit()
    return tenants.tenant_json(tenant, s.get(Quota, tenant.id))


@bp.post("/tenants/<tenant_id>/disable")
@admin_required
def disable_tenant(tenant_id):
    return _set_disabled(tenant_id, True)


@bp.post("/tenants/<tenant_id>/enable")
@admin_required
def enable_tenant(tenant_id):
    return _set_disabled(tenant_id, False)


def _set_disabled(tenant_id, disabled):
    s = session()
    _tenant(tenant_id)
    tenants.set_disabled(s, tenant_id, disabled)
    s.commit()
    t = _tenant(tenant_id)
    s.refresh(t)
    return tenants.tenant_json(t, s.get(Quota, t.id))


@bp.patch("/tenants/<tenant_id>/quota")
@admin_required
def set_quota(tenant_id):
    s = session()
    _tenant(tenant_id)
    quota = tenants.set_quota(s, tenant_id, json_body())
    s.commit()
    return tenants.quota_json(quota)


@bp.post("/tenants/<tenant_id>/keys")
@admin_required
def create_key(tenant_id):
    s = session()
    _tenant(tenant_id)
    row, key = tenants.issue_key(s, tenant_id)
    s.commit()
    out = tenants.key_json(row)
    out["api_key"] = key
    return out, 201


@bp.get("/tenants/<tenant_id>/keys")
@admin_required
def list_keys(tenant_id):
    _tenant(tenant_id)
    return {"object": "list", "data": [tenants.key_json(k) for k in tenants.keys_of(session(), tenant_id)]}


@bp.post("/keys/<prefix>/revoke")
@admin_required
def revoke_key(prefix):
    s = session()
    if not tenants.revoke_key(s, prefix):
        raise not_found("active key", prefix)
    s.commit()
    return {"prefix": prefix, "revoked": True}


@bp.get("/jobs")
@admin_required
def list_jobs():
    filters = {name: request.args[name] for name in ("tenant_id", "batch_id") if request.args.get(name)}
    if request.args.get("status"):
        if request.args["status"] not in JobStatus.__members__:
            raise bad_request("unknown status", "status")
        filters["status"] = JobStatus(request.args["status"])
    if request.args.get("sla_class"):
        if request.args["sla_class"] not in SLA_CLASSES:
            raise bad_request("unknown sla_class", "sla_class")
        filters["sla_class"] = request.args["sla_class"]
    limit, with_request = list_args()
    out = page(pages.page(session(), Job, limit, after=request.args.get("cursor"), **filters), limit,
               lambda j: {**job_json(j, with_request=with_request), "tenant_id": j.tenant_id})
    out["next_cursor"] = out["last_id"] if out["has_more"] else None
    return out


@bp.get("/batches")
@admin_required
def list_batches():
    filters = {"tenant_id": request.args["tenant_id"]} if request.args.get("tenant_id") else {}
    limit = limit_arg(20, 100)
    return page(pages.page(session(), Batch, limit, after=request.args.get("after"), **filters), limit,
                lambda b: {**batch_json(b), "tenant_id": b.tenant_id})


@bp.get("/queues")
@admin_required
def queue_depths():
    """Depth per class queue of the default model (`queues`), and per (model, SLA class) with whether a live
    worker consumes that queue (`models`): jobs of a model nobody serves wait there, never failed. Both count
    the jobs routed to a worker's private queue (prefix affinity), which `private` lists one by one."""
    dispatcher = services().dispatcher
    private = [{"queue": name, "shared": shared, "worker": worker, "depth": depth}
               for name, depth in sorted(dispatcher.private_depths().items())
               for shared, worker in [affinity.split_private(name)]]
    return {"object": "queue_depths", "queues": dispatcher.queue_depths(), "models": model_queues(),
            "private": private}


def model_queues() -> list[dict]:
    """Per (registered model, SLA class): its queue, depth, and whether a live worker consumes it (its heartbeat
    names it) or a live model host would load the model for it (registry.hosted_queues)."""
    import time

    from ..ledger.snapshots import SNAPSHOT_TTL, Heartbeats
    names, client = list(services().registry.entries()), services().redis
    now = time.time()
    served = {q for hb in Heartbeats(client).read() if now - hb.get("at", 0) <= SNAPSHOT_TTL
              for q in hb.get("queues", [])} | registry.hosted_queues(client, SNAPSHOT_TTL, now)
    return [{**row, "served": row["queue"] in served} for row in services().dispatcher.model_depths(names)]


# ---- models ------------------------------------------------------------------------------------------------

def _entry(name: str) -> registry.Entry:
    entry = services().registry.get(name)
    if entry is None:
        raise not_found("model", name)
    return entry


def _fresh(name: str) -> dict:
    cfg = services().config
    return registry.entry_json(_entry(name), cfg.tensor_parallel_size, cfg.kv_cache_dtype)


@bp.get("/models")
@admin_required
def list_models():
    cfg = services().config
    return {"object": "list", "data": [registry.entry_json(e, cfg.tensor_parallel_size, cfg.kv_cache_dtype)
                                       for e in services().registry.entries().values()]}


@bp.post("/models")
@admin_required
def register_model():
    body = json_body()
    unknown = sorted(set(body) - {"name", "source", "tier", "enabled", "tensor_parallel_size", "kv_cache_dtype"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    s = session()
    row = registry.register(s, body.get("name"), body.get("source"), body.get("tier", "warm"),
                            body.get("enabled", True), tensor_parallel_size=body.get("tensor_parallel_size"),
                            kv_cache_dtype=body.get("kv_cache_dtype"))
    s.commit()
    return _fresh(row.name), 201


@bp.get("/models/<name>")
@admin_required
def get_model(name):
    return _fresh(name)


@bp.patch("/models/<name>")
@admin_required
def update_model(name):
    """Retier ({"tier": "hot"|"warm"|"cold"}), enable or disable ({"enabled": bool}), re-point ({"source"}) or
    resize ({"tensor_parallel_size": n, or null for the deployment's}) or set its KV cache dtype ({"kv_cache_dtype":
    "fp8_e4m3"|"fp8_e5m2"|"int8"|"auto", or null for the deployment's})."""
    s = session()
    registry.update(s, name, json_body(), default=services().registry.get(name))
    s.commit()
    return _fresh(name)


@bp.post("/tenants/<tenant_id>/models")
@admin_required
def grant_model(tenant_id):
    """Let a tenant use a model ({"model": name}), registered or to be registered, as a quota's allowed_models
    names them; a tenant without an allow-list may use every model already."""
    body = json_body()
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    _tenant(tenant_id)
    s = session()
    quota = registry.grant(s, tenant_id, body.get("model"))
    s.commit()
    return tenants.quota_json(quota)


@bp.delete("/tenants/<tenant_id>/models/<name>")
@admin_required
def revoke_model(tenant_id, name):
    _tenant(tenant_id)
    s = session()
    quota = registry.revoke(s, tenant_id, name, list(services().registry.entries()))
    s.commit()
    return tenants.quota_json(quota)


# ---- LoRA adapters -----------------------------------------------------------------------------------------

def _adapter(name: str) -> dict:
    row = session().get(adapters.Adapter, name)
    if row is None:
        raise not_found("adapter", name)
    return adapters.adapter_json(row)


@bp.get("/adapters")
@admin_required
def list_adapters():
    return {"object": "list", "data": [adapters.adapter_json(a) for a in adapters.listing(session())]}


@bp.post("/adapters")
@admin_required
def register_adapter():
    """Register a PEFT folder over a registered model ({"name", "base_model", "source", "tenant_id"?, "pinned"?,
    "enabled"?}); a folder that does not fit the base model is refused with the reason."""
    body = json_body()
    unknown = sorted(set(body) - {"name", "base_model", "source", "tenant_id", "pinned", "enabled"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    base = body.get("base_model")
    s = session()
    row = adapters.register(s, body.get("name"), base, body.get("source"),
                            services().registry.get(base) if isinstance(base, str) else None,
                            cfg().max_lora_rank or adapters.DEFAULT_MAX_LORA_RANK, body.get("tenant_id"),
                            body.get("pinned", False), body.get("enabled", True))
    s.commit()
    return _adapter(row.name), 201


@bp.get("/adapters/<name>")
@admin_required
def get_adapter(name):
    return _adapter(name)


@bp.patch("/adapters/<name>")
@admin_required
def update_adapter(name):
    """Pin or unpin ({"pinned": bool}), enable or disable ({"enabled": bool})."""
    s = session()
    adapters.update(s, name, json_body())
    s.commit()
    return _adapter(name)


@bp.get("/audit")
@admin_required
def audit_log():
    limit = limit_arg(100, 1000)
    rows = pages.page(session(), AuditLog, limit)[:limit]
    return {"object": "list", "data": [{"id": a.id, "at": ts(a.at), "actor": a.actor, "action": a.action,
                                        "target": a.target, "details": a.details} for a in rows]}
