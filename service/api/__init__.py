"""API blueprints and the small helpers they share."""
from datetime import datetime

from flask import current_app, g, request

from ..db import session
from ..ledger import tenants
from ..ledger.settings import Config
from ..protocol.request_bodies import bad_text, check_text, integral, loads
from ..protocol.errors import APIError, bad_request


def cfg() -> Config:
    return current_app.config["TIDEPOOL"]


def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


MAX_JSON_BYTES = 16 << 20   # a request that carries a prompt (docs/guides/online-api.md, "Request limits"); files go through /v1/files
SMALL_JSON_BYTES = 1 << 20  # any other JSON body (admin, batch creation): what parsing it may cost stays small


def json_body(max_bytes: int = SMALL_JSON_BYTES) -> dict:
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, f"The request body is larger than {max_bytes} bytes.", "request_too_large")
    request.max_content_length = max_bytes   # a body sent without a length is cut off there
    try:
        body = loads(request.get_data(cache=False))
    except ValueError as exc:
        detail = f" ({exc})" if "deeper" in str(exc) else ""
        raise bad_request(f"The request body must be valid JSON{detail}.", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_body")
    check_text(body, "")
    return integral(body)


def limit_arg(default: int = 20, maximum: int = 10_000) -> int:
    raw = request.args.get("limit", default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise bad_request("'limit' must be an integer.", "limit") from None
    if not 1 <= value <= maximum:
        raise bad_request(f"'limit' must be between 1 and {maximum}.", "limit")
    return value


def owned(model, row_id: str, missing: APIError, **match):
    """The calling tenant's row of `model` with this id (and the column values `match` names), or `missing` raised:
    another tenant's row is as absent as one that does not exist (service/ledger/tenants.py)."""
    row = tenants.owned(session(), model, row_id, g.tenant.id, **match)
    if row is None:
        raise missing
    return row


def page(rows: list, limit: int, render) -> dict:
    """OpenAI cursor page: rows were fetched with limit + 1 to learn has_more."""
    data = [render(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def check_arguments() -> None:
    """Path ids and query parameters must be text the ledger can compare (no NUL, no lone surrogates), and a
    query parameter is given at most once."""
    for name in request.args:
        if len(request.args.getlist(name)) > 1:
            raise bad_request(f"'{name}' is given more than once.", name if not bad_text(name) else None)
    for name, value in [*(request.view_args or {}).items(), *request.args.items(multi=True)]:
        why = bad_text(name) or (bad_text(value) if isinstance(value, str) else None)
        if why:
            raise bad_request(f"'{name}' {why}.", name if not bad_text(name) else None)


def init_app(app) -> None:
    app.before_request(check_arguments)
