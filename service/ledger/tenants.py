"""Tenants: what belongs to a tenant (owned), their administration shared by the admin API, the panel and the CLI
(every change is written to the audit log), and the usage the panel shows."""
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from . import keys
from ..protocol.request_bodies import bad_text
from ..protocol.errors import APIError, bad_request
from .jobs import period
from .registry import check_allowed
from .models import ONLINE_CLASSES, SLA_CLASSES, ApiKey, Job, JobStatus, Quota, Tenant, Usage, audit, utcnow

QUOTA_FIELDS = {
    "requests_per_minute": int, "tokens_per_minute": int, "max_running": int, "max_queued": int,
    "monthly_token_budget": int, "max_tokens_per_request": int, "max_file_bytes": int,
    "max_concurrent_requests": int, "max_files": int, "max_storage_bytes": int,
    "allowed_sla_classes": list, "allowed_models": list,
}


_QUOTA_MAX = {"monthly_token_budget": (1 << 63) - 1, "max_file_bytes": (1 << 63) - 1,   # BIGINT columns
              "max_storage_bytes": (1 << 63) - 1}
MAX_WEIGHT = 1e6


def check_quota_fields(values: dict) -> dict:
    if not isinstance(values, dict):
        raise bad_request("quota must be an object", "quota")
    out = {}
    for name, value in values.items():
        if name not in QUOTA_FIELDS:
            raise bad_request(f"Unknown quota field '{name}'.", name, "unknown_parameter")
        if name == "allowed_sla_classes":
            if not isinstance(value, list) or len(value) > len(SLA_CLASSES) or any(v not in SLA_CLASSES for v in value):
                raise bad_request(f"allowed_sla_classes must be a list drawn from {list(SLA_CLASSES)}.", name)
        elif name == "allowed_models":   # null or []: every enabled model (service/ledger/registry.py)
            value = check_allowed(value)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                    or not 0 <= value <= _QUOTA_MAX.get(name, (1 << 31) - 1)):
            raise bad_request(f"{name} must be an integer in [0, {_QUOTA_MAX.get(name, (1 << 31) - 1)}] or null.",
                              name)
        out[name] = value
    return out


def _check_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
        raise bad_request(f"weight must be a number in (0, {MAX_WEIGHT:g}].", "weight")
    return float(weight)


def _check_default_class(value) -> str | None:
    if value is not None and value not in ONLINE_CLASSES:
        raise bad_request(f"default_sla_class must be one of {list(ONLINE_CLASSES)} or null.", "default_sla_class")
    return value


def _check_cache_group(value) -> str | None:
    if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 64
                              or not value.isprintable() or not value.isascii()):
        raise bad_request("prefix_cache_group must be 1 to 64 printable ASCII characters, or null.",
                          "prefix_cache_group")
    return value


def owned(s: Session, model, row_id: str, tenant_id: str, **match):
    """The row of `model` (a table with `id` and `tenant_id`) with this id, if it belongs to the tenant and has the
    column values `match` names; else None. Another tenant's row is as absent as one that does not exist."""
    return s.scalar(select(model).filter_by(id=row_id, tenant_id=tenant_id, **match))


def id_by_name(s: Session, name: str) -> str | None:
    return s.scalar(select(Tenant.id).where(Tenant.name == name))


def with_quotas(s: Session, order_by: str = "id") -> list[tuple[Tenant, Quota]]:
    """Every tenant with its quota, by id or by name (the admin API's list and the panel's)."""
    order = Tenant.name if order_by == "name" else Tenant.id
    return s.execute(select(Tenant, Quota).join(Quota).order_by(order)).all()


def by_name(s: Session) -> list[Tenant]:
    return s.scalars(select(Tenant).order_by(Tenant.name)).all()


def create_tenant(s: Session, name: str, weight: float = 1.0, quota: dict | None = None,
                  actor: str = "admin", default_sla_class: str | None = None) -> tuple[Tenant, str]:
    if not isinstance(name, str) or not name.strip() or len(name) > 200 or bad_text(name):
        raise bad_request("name must be a non-empty string of at most 200 characters, with no NUL or lone "
                          "surrogates.", "name")
    weight = _check_weight(weight)
    default_sla_class = _check_default_class(default_sla_class)
    if s.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise APIError(409, f"A tenant named '{name}' already exists.", "tenant_exists", "name")
    tenant = Tenant(name=name, weight=weight, disabled=False, queued_count=0, running_count=0,
                    default_sla_class=default_sla_class, created_at=utcnow())
    s.add(tenant)
    s.flush()
    s.add(Quota(tenant_id=tenant.id, **{"allowed_sla_classes": list(SLA_CLASSES), **check_quota_fields({} if quota is None else quota)}))
    row, key = keys.new_key_row(tenant.id)
    s.add(row)
    audit(s, actor, "tenant.create", tenant.id, {"name": name, "weight": weight})
    return tenant, key


def update_tenant(s: Session, tenant: Tenant, values: dict, actor: str = "admin") -> Tenant:
    """Change a tenant's weight, default online SLA class and/or prefix-cache group (keys absent: unchanged)."""
    if "weight" in values:
        tenant.weight = _check_weight(values["weight"])
    if "default_sla_class" in values:
        tenant.default_sla_class = _check_default_class(values["default_sla_class"])
    if "prefix_cache_group" in values:   # tenants of one group share cached prompt prefixes
        tenant.prefix_cache_group = _check_cache_group(values["prefix_cache_group"])
    audit(s, actor, "tenant.update", tenant.id, values)
    return tenant


def set_quota(s: Session, tenant_id: str, values: dict, actor: str = "admin") -> Quota:
    values = check_quota_fields(values)
    quota = s.get(Quota, tenant_id)
    for name, value in values.items():
        setattr(quota, name, list(value) if isinstance(value, list) else value)
    audit(s, actor, "quota.set", tenant_id, values)
    return quota


def set_disabled(s: Session, tenant_id: str, disabled: bool, actor: str = "admin") -> None:
    s.execute(update(Tenant).where(Tenant.id == tenant_id).values(disabled=disabled))
    audit(s, actor, "tenant.disable" if disabled else "tenant.enable", tenant_id)


def issue_key(s: Session, tenant_id: str, actor: str = "admin") -> tuple[ApiKey, str]:
    row, key = keys.new_key_row(tenant_id)
    s.add(row)
    audit(s, actor, "key.create", tenant_id, {"prefix": row.prefix})
    return row, key


def revoke_key(s: Session, prefix: str, actor: str = "admin") -> bool:
    res = s.execute(update(ApiKey).where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
                    .values(revoked_at=utcnow()))
    if res.rowcount:
        audit(s, actor, "key.revoke", prefix)
    return bool(res.rowcount)


def keys_of(s: Session, tenant_id: str, newest_first: bool = False) -> list[ApiKey]:
    """Every key of the tenant, revoked ones too, in the order they were issued (or newest first)."""
    return s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)
                     .order_by(ApiKey.id.desc() if newest_first else ApiKey.id)).all()


def live_key_prefixes(s: Session) -> dict[str, list[str]]:
    """tenant id -> the prefixes of its keys that are not revoked, in the order they were issued."""
    out: dict[str, list[str]] = {}
    for tenant_id, prefix in s.execute(select(ApiKey.tenant_id, ApiKey.prefix)
                                       .where(ApiKey.revoked_at.is_(None)).order_by(ApiKey.id)):
        out.setdefault(tenant_id, []).append(prefix)
    return out


def usage(s: Session, now: datetime) -> dict[str, dict]:
    """tenant id -> its tokens this month (`month`, with `requests_month`) and today (`today`, of the jobs completed
    since midnight UTC), and its queued and running jobs per SLA class (`classes`); tenants with none of these are
    left out."""
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    out: dict[str, dict] = {}

    def row(tid):
        return out.setdefault(tid, {"today": 0, "month": 0, "requests_month": 0,
                                    "classes": {c: {"queued": 0, "running": 0} for c in SLA_CLASSES}})
    for tid, p, c, n in s.execute(select(Usage.tenant_id, Usage.prompt_tokens, Usage.completion_tokens,
                                         Usage.requests).where(Usage.period == period(now))):
        row(tid).update(month=(p or 0) + (c or 0), requests_month=n or 0)
    for tid, tokens in s.execute(select(Job.tenant_id, func.sum(func.coalesce(Job.prompt_tokens, 0)
                                                                + func.coalesce(Job.completion_tokens, 0)))
                                 .where(Job.status == JobStatus.completed, Job.finished_at >= midnight)
                                 .group_by(Job.tenant_id)):
        row(tid)["today"] = int(tokens or 0)
    for tid, sla, status, n in s.execute(select(Job.tenant_id, Job.sla_class, Job.status, func.count())
                                         .where(Job.status.in_((JobStatus.queued, JobStatus.running)))
                                         .group_by(Job.tenant_id, Job.sla_class, Job.status)):
        row(tid)["classes"][sla.value][status.value] = n
    return out


def tenant_json(t: Tenant, quota: Quota | None = None) -> dict:
    out = {"id": t.id, "object": "tenant", "name": t.name, "weight": t.weight, "disabled": t.disabled,
           "default_sla_class": t.default_sla_class,
           "prefix_cache_group": t.prefix_cache_group,
           "created_at": int(t.created_at.timestamp()), "queued_jobs": t.queued_count,
           "running_jobs": t.running_count}
    if quota is not None:
        out["quota"] = quota_json(quota)
    return out


def quota_json(q: Quota) -> dict:
    return {name: getattr(q, name) for name in QUOTA_FIELDS}


def key_json(k: ApiKey) -> dict:
    ts = lambda d: int(d.timestamp()) if d else None  # noqa: E731
    return {"prefix": k.prefix, "tenant_id": k.tenant_id, "created_at": ts(k.created_at),
            "revoked_at": ts(k.revoked_at), "last_used_at": ts(k.last_used_at)}
