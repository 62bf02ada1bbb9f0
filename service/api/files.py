"""OpenAI Files API: bytes stream to the storage folder, the ledger keeps the metadata. An upload counts against the
tenant's requests per minute, and its files and bytes against max_files and max_storage_bytes (service/ledger/files.py);
one with `expires_after` is deleted by beat when it expires."""
import re
import unicodedata

from flask import Blueprint, g, request, send_file

from ..auth import tenant_required
from ..ledger import files as kept, pages, quotas
from ..protocol.request_bodies import bad_text
from ..db import reads, session
from ..protocol.errors import APIError, bad_request, not_found
from ..ledger.models import File, new_id, utcnow
from . import cfg, limit_arg, owned, page, ts
from ..app import services

bp = Blueprint("files", __name__)
PURPOSES = ("batch",)
MULTIPART_SLACK = 64 * 1024


def safe_filename(name: str | None) -> str:
    """A client's file name as stored and echoed in Content-Disposition: the last path component, control
    characters and quoting/separator characters replaced, at most 255 characters."""
    name = re.split(r"[\\/]", name or "")[-1]
    name = "".join("_" if unicodedata.category(c)[0] == "C" or c in '"\';' else c for c in name).strip(" .")
    return name[:255] or "upload"


def file_json(f: File) -> dict:
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": ts(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": ts(f.expires_at)}


def own_file(file_id: str) -> File:
    return owned(File, file_id, not_found("file", file_id))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"File exceeds the maximum size of {limit} bytes.", "file_too_large", "file")


def _storage_full(room: int) -> APIError:
    return APIError(413, f"This file does not fit in this tenant's storage: {room} bytes are left.",
                    "max_storage_bytes", "file")


@bp.post("/v1/files")
@tenant_required
def upload_file():
    limit = min(filter(None, (g.quota.max_file_bytes, cfg().max_file_bytes)))
    if request.content_length is not None and request.content_length > limit + MULTIPART_SLACK:
        raise _too_large(limit)
    if not (request.mimetype or "").startswith("multipart/form-data"):
        raise APIError(415, "Upload the file as multipart/form-data with fields 'file' and 'purpose'.",
                       "unsupported_media_type")
    quotas.check_rate(services().limiter, g.quota, 0)     # an upload is a request like any other
    purpose = request.form.get("purpose")
    if purpose not in PURPOSES:
        raise bad_request(f"'purpose' must be one of {list(PURPOSES)}.", "purpose")
    now = utcnow()
    expires_at = kept.expiry(request.form.get("expires_after[anchor]"), request.form.get("expires_after[seconds]"),
                             now)
    upload = request.files.get("file")
    if upload is None:
        raise bad_request("'file' is required.", "file", "missing_required_parameter")
    why = bad_text(upload.filename or "")
    if why:
        raise bad_request(f"The file name {why}.", "file")
    s = session()
    room = kept.room(s, g.quota)
    s.rollback()      # (a read: nothing held while the bytes arrive)
    file_id = new_id("file-")
    storage = services().storage
    if room is not None and room < limit:
        size = storage.save(file_id, upload.stream, room, _storage_full(room))
    else:
        size = storage.save(file_id, upload.stream, limit)
    f = File(id=file_id, tenant_id=g.tenant.id, purpose=purpose, filename=safe_filename(upload.filename),
             bytes=size, created_at=now, expires_at=expires_at)
    try:
        kept.add(s, f, g.quota)
        s.commit()
    except BaseException:   # no bytes on disk without their row
        s.rollback()
        storage.delete(file_id)
        raise
    return file_json(f)


@bp.get("/v1/files")
@tenant_required
def list_files():
    purpose = request.args.get("purpose")
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'.", "order")
    limit = limit_arg(10_000, 10_000)
    rows = pages.page(reads(), File, limit, after=request.args.get("after"), ascending=order == "asc",
                      tenant_id=g.tenant.id, **({"purpose": purpose} if purpose else {}))
    return page(rows, limit, file_json)


@bp.get("/v1/files/<file_id>")
@tenant_required
def get_file(file_id):
    return file_json(own_file(file_id))


@bp.get("/v1/files/<file_id>/content")
@tenant_required
def file_content(file_id):
    f = own_file(file_id)
    return send_file(services().storage.path(f.id), mimetype="application/jsonl", as_attachment=True,
                     download_name=safe_filename(f.filename))


@bp.delete("/v1/files/<file_id>")
@tenant_required
def delete_file(file_id):
    f = own_file(file_id)
    s = session()
    s.delete(f)
    s.commit()
    services().storage.delete(f.id)
    return {"id": f.id, "object": "file", "deleted": True}
