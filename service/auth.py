"""Bearer authentication: tenant API keys for the public API, the admin token for /v1/admin.

A key's row, its tenant and its quota are read once and then kept for TIDEPOOL_AUTH_CACHE_TTL seconds per
process (Config.auth_cache_ttl; 0 turns the cache off), keyed by the key's
prefix; the secret is checked against the stored hash on every request. What a stale entry can and cannot do:

* Queue work: no. The statement that counts new jobs against max_queued (quotas.reserve_queued, and the
  admission statement of POST /v1/jobs) requires, in the database, that the key is not revoked, the tenant
  not disabled and the live quotas.max_queued not exceeded. When it refuses, quotas.refused() reads why from
  the database (401, 403 or 429) and drops the entry.
* Everything else sees a revocation, a disable or a quota change (rate limits, budget, classes, max_tokens)
  made by another process within TIDEPOOL_AUTH_CACHE_TTL seconds, and one made through this process (admin API,
  panel, CLI code in-process) at once: every committed ORM change to api_keys (other than last_used_at),
  tenants (other than the job counters) or quotas drops all entries.
"""
import functools
import hmac
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

from flask import Flask, current_app, g, request
from sqlalchemy import event
from sqlalchemy.orm import Session

from .app import services
from .ledger import keys
from .db import autocommit
from .protocol.errors import APIError
from .ledger.models import ApiKey, Quota, Tenant, utcnow

LAST_USED_RESOLUTION = timedelta(seconds=60)
_CACHE_SIZE = 10_000


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _api_key() -> str | None:
    """A tenant key: `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
    return _bearer() or request.headers.get("x-api-key", "").strip() or None


def _unauthorized(message="Incorrect API key provided.") -> APIError:
    return APIError(401, message, "invalid_api_key")


# ---- the cache -------------------------------------------------------------------------------------------

_generation = 0          # bumped by every committed change that can affect authentication
_generation_lock = threading.Lock()


def invalidate_all() -> None:
    """Drop every cached entry in this process (all apps)."""
    global _generation
    with _generation_lock:
        _generation += 1


@dataclass
class Entry:
    """One key as last read: its tenant and quota are detached, read-only snapshots shared by requests."""
    key_id: int
    secret_hash: str
    revoked: bool
    last_used_at: object
    tenant: Tenant
    quota: Quota
    expires: float
    generation: int


class AuthCache:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()

    def get(self, prefix: str) -> Entry | None:
        entry = self.entries.get(prefix)
        if entry is None or entry.generation != _generation or entry.expires <= time.monotonic():
            return None
        return entry

    def put(self, prefix: str, entry: Entry) -> None:
        if self.ttl <= 0:
            return
        with self.lock:
            if len(self.entries) >= _CACHE_SIZE:
                now = time.monotonic()
                self.entries = {k: e for k, e in self.entries.items() if e.expires > now}
                if len(self.entries) >= _CACHE_SIZE:
                    self.entries.clear()
            self.entries[prefix] = entry

    def drop(self, prefix: str) -> None:
        self.entries.pop(prefix, None)


_caches: "weakref.WeakKeyDictionary[Flask, AuthCache]" = weakref.WeakKeyDictionary()   # one per app


def _cache() -> AuthCache:
    app = current_app._get_current_object()
    cache = _caches.get(app)
    if cache is None:
        cache = _caches.setdefault(app, AuthCache(float(services().config.auth_cache_ttl)))
    return cache


def _load(prefix: str, ttl: float) -> Entry | None:
    generation = _generation  # read before the row: a change committed meanwhile makes the entry stale
    with autocommit() as conn:
        found = keys.holder(conn, prefix)
    if found is None:
        return None
    return Entry(**found._asdict(), expires=time.monotonic() + ttl, generation=generation)


def forget(prefix: str | None = None) -> None:
    """Drop one key's entry (or the current request's) in this app, e.g. after the database refused it."""
    prefix = prefix or g.get("api_key_prefix")
    if prefix:
        _cache().drop(prefix)


def authenticate() -> None:
    token = _api_key()
    if token is None:
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
    parts = keys.split(token)
    if parts is None:
        raise _unauthorized()
    prefix, secret = parts
    cache = _cache()
    entry = cache.get(prefix)
    if entry is None:
        entry = _load(prefix, cache.ttl)
        if entry is not None:
            cache.put(prefix, entry)
    if entry is None or entry.revoked or not hmac.compare_digest(entry.secret_hash, keys.hash_secret(secret)):
        raise _unauthorized()
    if entry.tenant.disabled:
        raise APIError(403, "This tenant is disabled.", "tenant_disabled")
    now = utcnow()
    last = entry.last_used_at
    if last is None or now - last > LAST_USED_RESOLUTION:
        entry.last_used_at = now  # one writer per entry and resolution period
        with autocommit() as conn:
            keys.mark_used(conn, entry.key_id, now)
    g.tenant, g.quota, g.api_key_id, g.api_key_prefix = entry.tenant, entry.quota, entry.key_id, prefix


# ---- in-process invalidation -----------------------------------------------------------------------------

_COUNTERS = {"queued_count", "running_count", "budget_reserved", "budget_used", "budget_period"}   # moved by every job transition: irrelevant to authentication
_IGNORED = {"tenants": _COUNTERS, "api_keys": {"last_used_at"}, "quotas": set()}


def _columns_set(stmt) -> set[str] | None:
    values = getattr(stmt, "_values", None) or getattr(stmt, "_ordered_values", None)
    if not values:
        return None  # unknown: assume it matters
    items = values.items() if hasattr(values, "items") else values
    return {getattr(k, "key", k) for k, _ in items}


def _matters(table_name: str, columns: set[str] | None) -> bool:
    ignored = _IGNORED.get(table_name)
    if ignored is None:
        return False
    return columns is None or not columns <= ignored


@event.listens_for(Session, "do_orm_execute")
def _watch_statements(state):
    if not (state.is_update or state.is_delete):
        return
    table = getattr(state.statement, "table", None)
    name = getattr(table, "name", None)
    if name and _matters(name, _columns_set(state.statement) if state.is_update else None):
        state.session.info["tp_auth_dirty"] = True


@event.listens_for(Session, "before_flush")
def _watch_flush(session, _ctx, _instances):
    for obj in list(session.dirty) + list(session.deleted):
        if isinstance(obj, (Tenant, ApiKey, Quota)):
            session.info["tp_auth_dirty"] = True
            return


@event.listens_for(Session, "after_commit")
def _after_commit(session):
    if session.info.pop("tp_auth_dirty", False):
        invalidate_all()


@event.listens_for(Session, "after_rollback")
def _after_rollback(session):
    session.info.pop("tp_auth_dirty", None)


def tenant_required(view):
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        authenticate()
        return view(*args, **kwargs)
    return wrapper


# ---- admin token guessing ---------------------------------------------------------------------------------
# Wrong admin tokens, through the panel's sign-in or as a bearer, are counted per client address (the one the trusted
# proxies name, TIDEPOOL_TRUSTED_PROXIES) in the rate limiter's one-minute windows, as its token counter; past
# Config.admin_failures_per_minute that address is refused until the window ends. Right tokens are not counted, and other
# addresses are never affected: nobody can lock the admins out from elsewhere.

def _failures_key() -> str:
    return f"admin-auth-failures:{request.remote_addr}"


def admin_throttled() -> int | None:
    """Seconds until this client address may try an admin token again; None when it may now."""
    from .ledger.quotas import WINDOW
    now = time.time()
    allowed = current_app.config["TIDEPOOL"].admin_failures_per_minute
    if services().limiter.hit(_failures_key(), None, allowed - 1, 0, now):
        return WINDOW - int(now) % WINDOW
    return None


def admin_failed() -> None:
    """Count a wrong admin token from this client address."""
    services().limiter.hit(_failures_key(), None, None, 1, time.time())


def admin_required(view):
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        expected = current_app.config["TIDEPOOL"].admin_token
        wait = admin_throttled()
        if wait is not None:
            raise APIError(429, "Too many wrong admin tokens from this address; retry after the window resets.",
                           "too_many_attempts", retry_after=wait)
        token = _bearer()
        if not expected or token is None or not hmac.compare_digest(token.encode(), expected.encode()):
            admin_failed()
            raise _unauthorized("Admin token required.")
        return view(*args, **kwargs)
    return wrapper
