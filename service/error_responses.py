"""The API's error responses: every APIError and HTTP error as {"error": {"message", "type", "param", "code"}}."""
from flask import jsonify
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

from .auth import forget
from .protocol.errors import APIError, OUTAGE_RETRY_AFTER, TYPES

# codes by which the ledger says the request's cached authentication no longer holds
STALE_AUTH = ("invalid_api_key", "tenant_disabled")


# Anthropic's error types, for its routes (/v1/messages...): {"type": "error", "error": {"type", "message"}}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                   503: "overloaded_error", 504: "timeout_error"}


def anthropic_route() -> bool:
    from flask import has_request_context, request
    return has_request_context() and (request.path == "/v1/messages" or request.path.startswith("/v1/messages/"))


def error_body(status: int, message: str, code=None, param=None) -> dict:
    """The error object in the shape of the API the current request speaks."""
    if anthropic_route():
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": code}}


def error_response(status: int, message: str, code=None, param=None, retry_after=None):
    resp = jsonify(error_body(status, message, code, param))
    resp.status_code = status
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, int(retry_after)))
    return resp


def init_app(app) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        if exc.code in STALE_AUTH:
            forget()
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.retry_after)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        from flask import request
        code = {413: "file_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.code)
        message = exc.description or exc.name
        if exc.code == 404 and request.url_rule is None:      # no route: say which URL, as OpenAI does
            message = f"Invalid URL ({request.method} {request.path}): no such route."
        elif exc.code == 405:
            message = f"Method {request.method} is not allowed for {request.path}."
        resp = error_response(exc.code or 500, message, code)
        for name, value in exc.get_headers():   # e.g. Allow on a 405
            if name.lower() != "content-type":
                resp.headers[name] = value
        return resp

    @app.errorhandler(OperationalError)
    @app.errorhandler(InterfaceError)
    def _database_down(exc):
        app.logger.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return error_response(503, "The database is unavailable; retry shortly.", "database_unavailable",
                              retry_after=OUTAGE_RETRY_AFTER)

    @app.errorhandler(RedisConnectionError)
    @app.errorhandler(RedisTimeoutError)
    def _broker_down(exc):
        app.logger.warning("broker unavailable: %s", exc)
        return error_response(503, "The message broker is unavailable; retry shortly.", "broker_unavailable",
                              retry_after=OUTAGE_RETRY_AFTER)

    @app.errorhandler(Exception)
    def _internal(exc: Exception):
        app.logger.exception("unhandled error")
        return error_response(500, "Internal server error.", "internal_error")
