"""Credentials: tenants' API keys (a visible prefix for lookup plus a 256-bit secret stored only as a SHA-256 hash),
read with their tenant and quota to authenticate a request, and the admin panel's sign-ins (a row per signed-in
cookie, named by the hash of the id the cookie carries)."""
import hashlib
import secrets
import string
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from .models import AdminSession, ApiKey, Quota, Tenant, utcnow

KEY_SCHEME = "tp"
_ALPHABET = string.ascii_lowercase + string.digits


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate() -> tuple[str, str, str]:
    """Return (full key, prefix, hash); the full key is shown once and never stored."""
    prefix = f"{KEY_SCHEME}_" + "".join(secrets.choice(_ALPHABET) for _ in range(10))
    secret = secrets.token_urlsafe(32)
    return f"{prefix}_{secret}", prefix, hash_secret(secret)


def split(key: str) -> tuple[str, str] | None:
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != 10 or not parts[2]:
        return None
    return f"{parts[0]}_{parts[1]}", parts[2]


def new_key_row(tenant_id: str) -> tuple[ApiKey, str]:
    key, prefix, digest = generate()
    return ApiKey(tenant_id=tenant_id, prefix=prefix, secret_hash=digest, created_at=utcnow()), key


# ---- authentication ------------------------------------------------------------------------------------------------

class Holder(NamedTuple):
    """A key as last read, with its tenant and quota as detached snapshots (read-only: nothing writes them back)."""
    key_id: int
    secret_hash: str
    revoked: bool
    last_used_at: datetime | None
    tenant: Tenant
    quota: Quota


_TENANT_ATTRS = [(p.key, p.columns[0]) for p in Tenant.__mapper__.column_attrs]
_QUOTA_ATTRS = [(p.key, p.columns[0]) for p in Quota.__mapper__.column_attrs]
_KEY_COLS = (ApiKey.id, ApiKey.secret_hash, ApiKey.revoked_at, ApiKey.last_used_at)
_LOOKUP = (select(*_KEY_COLS, *(c for _, c in _TENANT_ATTRS), *(c for _, c in _QUOTA_ATTRS))
           .join(Tenant, Tenant.id == ApiKey.tenant_id).join(Quota, Quota.tenant_id == Tenant.id))
_N_KEY, _N_TENANT = len(_KEY_COLS), len(_TENANT_ATTRS)


def holder(conn, prefix: str) -> Holder | None:
    """The key with this prefix, its tenant and its quota, in one read (a Connection or a Session)."""
    row = conn.execute(_LOOKUP.where(ApiKey.prefix == prefix)).first()
    if row is None:
        return None
    tenant_values = row[_N_KEY:_N_KEY + _N_TENANT]
    quota_values = row[_N_KEY + _N_TENANT:]
    tenant = Tenant(**{k: v for (k, _), v in zip(_TENANT_ATTRS, tenant_values)})
    quota = Quota(**{k: v for (k, _), v in zip(_QUOTA_ATTRS, quota_values)})
    return Holder(row[0], row[1], row[2] is not None, row[3], tenant, quota)


def mark_used(conn, key_id: int, at: datetime) -> None:
    """When the key was last used (the caller writes it at most once a minute per key)."""
    conn.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=at))


def by_prefix(s: Session, prefix: str) -> ApiKey | None:
    return s.scalar(select(ApiKey).where(ApiKey.prefix == prefix))


# ---- the panel's sign-ins ------------------------------------------------------------------------------------------

def sign_in(s: Session, sign_in_id: str, lifetime: timedelta) -> None:
    """Record a sign-in (by the hash of the cookie's id) for `lifetime`; the expired ones are deleted."""
    now = utcnow()
    s.execute(delete(AdminSession).where(AdminSession.expires_at <= now))
    s.add(AdminSession(id=sign_in_id, created_at=now, expires_at=now + lifetime))


def signed_in(s: Session, sign_in_id: str) -> bool:
    """The sign-in is recorded and has not expired."""
    return s.scalar(select(AdminSession.id).where(AdminSession.id == sign_in_id,
                                                  AdminSession.expires_at > utcnow())) is not None


def sign_out(s: Session, sign_in_id: str) -> None:
    s.execute(delete(AdminSession).where(AdminSession.id == sign_in_id))
