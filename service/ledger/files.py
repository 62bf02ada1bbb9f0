"""The files a tenant keeps (their bytes in storage.py's folder): the quota that admits a new one, counted in the same
transaction as its row, and the expiry (an upload's `expires_after`) that beat applies. Flask-free."""
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ..protocol.errors import APIError, bad_request
from .models import File, Quota, Tenant, utcnow
from .storage import Storage

EXPIRES_AFTER = (3600, 30 * 24 * 3600)     # seconds an upload may ask to be kept, as OpenAI's files API
SWEEP_BATCH = 1000                          # expired files deleted per upkeep pass


def expiry(anchor: str | None, seconds: str | None, created_at: datetime) -> datetime | None:
    """expires_at from the upload's form fields `expires_after[anchor]` (only `created_at`) and
    `expires_after[seconds]`; None when neither is given; a 400 naming the field otherwise."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request("'expires_after[anchor]' must be 'created_at'.", "expires_after[anchor]")
    lo, hi = EXPIRES_AFTER
    if seconds is None or not seconds.strip().isdigit() or not lo <= int(seconds) <= hi:
        raise bad_request(f"'expires_after[seconds]' must be an integer in [{lo}, {hi}].", "expires_after[seconds]")
    return created_at + timedelta(seconds=int(seconds))


def usage(s: Session, tenant_id: str) -> tuple[int, int]:
    """(files, bytes) the tenant keeps."""
    count, used = s.execute(select(func.count(), func.coalesce(func.sum(File.bytes), 0))
                            .where(File.tenant_id == tenant_id)).one()
    return int(count), int(used)


def room(s: Session, quota: Quota) -> int | None:
    """Bytes the tenant may still store (None: no limit), to cut an upload off early; add() decides."""
    if quota.max_storage_bytes is None:
        return None
    return max(0, quota.max_storage_bytes - usage(s, quota.tenant_id)[1])


def add(s: Session, f: File, quota: Quota) -> None:
    """Add the file's row if the tenant stays within max_files and max_storage_bytes with it: 429 `max_files` or 413
    `max_storage_bytes` otherwise. The tenant's row is locked first, so concurrent uploads are counted one after the
    other until the caller commits."""
    s.execute(select(Tenant.id).where(Tenant.id == f.tenant_id).with_for_update())
    count, used = usage(s, f.tenant_id)
    if quota.max_files is not None and count + 1 > quota.max_files:
        raise APIError(429, f"This tenant keeps {count} files, its limit ({quota.max_files}); delete some before "
                            "uploading more.", "max_files", "file")
    if quota.max_storage_bytes is not None and used + f.bytes > quota.max_storage_bytes:
        raise APIError(413, f"This file ({f.bytes} bytes) does not fit in this tenant's storage: {used} of "
                            f"{quota.max_storage_bytes} bytes are used.", "max_storage_bytes", "file")
    s.add(f)


def delete_expired(s: Session, storage: Storage, now: datetime | None = None) -> int:
    """Delete up to SWEEP_BATCH files past their expires_at: the rows (committed here), then their bytes."""
    ids = s.scalars(select(File.id).where(File.expires_at <= (now or utcnow())).limit(SWEEP_BATCH)).all()
    if not ids:
        return 0
    s.execute(delete(File).where(File.id.in_(ids)))
    s.commit()
    for file_id in ids:
        storage.delete(file_id)
    return len(ids)
