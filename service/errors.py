"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError

OUTAGE_RETRY_AFTER = 5   # seconds a client is asked to wait when the database or the broker is unreachable

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def not_found(kind: str, obj_id: str) -> APIError:
    return APIError(404, f"No {kind} found with id '{obj_id}'.", "not_found")


def error_response(status: int, message: str, code=None, param=None, retry_after=None):
    from flask import jsonify
    resp = jsonify({"error": {"message": message, "type": TYPES.get(status, "api_error"),
                              "param": param, "code": code}})
    resp.status_code = status
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, int(retry_after)))
    return resp


def init_app(app) -> None:
    from werkzeug.exceptions import HTTPException

    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
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
