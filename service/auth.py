"""Bearer authentication: tenant API keys for the public API, the admin token for /v1/admin."""
import functools
import hmac
from datetime import timedelta

from flask import current_app, g, request
from sqlalchemy import select, update

from . import keys
from .db import session
from .errors import APIError
from .models import ApiKey, Quota, Tenant, utcnow

LAST_USED_RESOLUTION = timedelta(seconds=60)


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _unauthorized(message="Incorrect API key provided.") -> APIError:
    return APIError(401, message, "invalid_api_key")


def authenticate() -> None:
    token = _bearer()
    if token is None:
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    parts = keys.split(token)
    if parts is None:
        raise _unauthorized()
    prefix, secret = parts
    s = session()
    row = s.execute(select(ApiKey, Tenant, Quota).join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .join(Quota, Quota.tenant_id == Tenant.id).where(ApiKey.prefix == prefix)).first()
    if row is None or not keys.matches(row[0], secret):
        raise _unauthorized()
    key, tenant, quota = row
    if tenant.disabled:
        raise APIError(403, "This tenant is disabled.", "tenant_disabled")
    now = utcnow()
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        s.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
        s.commit()
    g.tenant, g.quota = tenant, quota


def tenant_required(view):
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        authenticate()
        return view(*args, **kwargs)
    return wrapper


def admin_required(view):
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        expected = current_app.config["TIDEPOOL"].admin_token
        token = _bearer()
        if not expected or token is None or not hmac.compare_digest(token.encode(), expected.encode()):
            raise _unauthorized("Admin token required.")
        return view(*args, **kwargs)
    return wrapper
