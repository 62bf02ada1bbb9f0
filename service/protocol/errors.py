"""The API's error type: an APIError carries the HTTP status and OpenAI's error fields (service/error_responses.py
renders it)."""

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
