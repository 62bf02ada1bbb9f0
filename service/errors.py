"""The API's error responses: every APIError and HTTP error as {"error": {"message", "type", "param", "code"}}."""
from flask import jsonify
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

from .auth import forget
from .ledger.errors import OUTAGE_RETRY_AFTER, TYPES, APIError

# codes by which the ledger says the request's cached authentication no longer holds
STALE_AUTH = ("invalid_api_key", "tenant_disabled")


def error_response(status: int, message: str, code=None, param=None, retry_after=None):
    resp = jsonify({"error": {"message": message, "type": TYPES.get(status, "api_error"),
                              "param": param, "code": code}})
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
        code = {413: "file_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.code)
        resp = error_response(exc.code or 500, exc.description or exc.name, code)
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
