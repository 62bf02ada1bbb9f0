"""API keys: a visible prefix for lookup plus a 256-bit secret stored only as a SHA-256 hash."""
import hashlib
import secrets
import string

from .models import ApiKey, utcnow

KEY_SCHEME = "tp"
_ALPHABET = string.ascii_lowercase + string.digits


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate() -> tuple[str, str, str]:
    """Return (full key, prefix, hash); the full key is shown once and never stored."""
    prefix = f"{KEY_SCHEME}_" + "".join(secrets.choice(_ALPHABET) for _ in range(10))
    secret = secrets.token_urlsafe(32)
    return f"{prefix}_{secret}", prefix, _hash(secret)


def split(key: str) -> tuple[str, str] | None:
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != 10 or not parts[2]:
        return None
    return f"{parts[0]}_{parts[1]}", parts[2]


def new_key_row(tenant_id: str) -> tuple[ApiKey, str]:
    key, prefix, digest = generate()
    return ApiKey(tenant_id=tenant_id, prefix=prefix, secret_hash=digest, created_at=utcnow()), key
