"""OpenAPI 3 document for every route; tests/service/test_openapi.py keeps it equal to the URL map."""
from .bodies import ALLOWED, CHAT, COMPLETIONS
from .config import SLA_CLASSES
from .models import BatchStatus, JobStatus

# (method, path, summary, security, request schema, success status, response schema)
ROUTES = [
    ("get", "/healthz", "Process is up", None, None, 200, "Status"),
    ("get", "/readyz", "Database and broker reachable", None, None, 200, "Status"),
    ("get", "/openapi.json", "This document", None, None, 200, None),
    ("post", "/v1/jobs", "Submit a job (Idempotency-Key header supported)", "apiKey", "JobCreate", 202, "Job"),
    ("get", "/v1/jobs", "List the tenant's jobs (status, sla_class, cursor, limit)", "apiKey", None, 200, "JobList"),
    ("get", "/v1/jobs/{job_id}", "Get a job", "apiKey", None, 200, "Job"),
    ("post", "/v1/jobs/{job_id}/cancel", "Cancel a queued or running job", "apiKey", None, 200, "Job"),
    ("post", "/v1/files", "Upload a file (multipart: file, purpose=batch)", "apiKey", "FileUpload", 200, "File"),
    ("get", "/v1/files", "List files (purpose, after, limit, order)", "apiKey", None, 200, "List"),
    ("get", "/v1/files/{file_id}", "Get file metadata", "apiKey", None, 200, "File"),
    ("delete", "/v1/files/{file_id}", "Delete a file", "apiKey", None, 200, "Deleted"),
    ("get", "/v1/files/{file_id}/content", "Download file bytes", "apiKey", None, 200, None),
    ("post", "/v1/batches", "Create a batch from an uploaded JSONL file", "apiKey", "BatchCreate", 200, "Batch"),
    ("get", "/v1/batches", "List batches (after, limit)", "apiKey", None, 200, "List"),
    ("get", "/v1/batches/{batch_id}", "Get a batch", "apiKey", None, 200, "Batch"),
    ("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", "apiKey", None, 200, "Batch"),
    ("post", "/v1/admin/tenants", "Create a tenant and its first API key", "adminToken", "TenantCreate", 201,
     "Tenant"),
    ("get", "/v1/admin/tenants", "List tenants", "adminToken", None, 200, "List"),
    ("get", "/v1/admin/tenants/{tenant_id}", "Get a tenant", "adminToken", None, 200, "Tenant"),
    ("patch", "/v1/admin/tenants/{tenant_id}", "Change weight or default online SLA class", "adminToken",
     "TenantUpdate", 200, "Tenant"),
    ("post", "/v1/admin/tenants/{tenant_id}/disable", "Disable a tenant", "adminToken", None, 200, "Tenant"),
    ("post", "/v1/admin/tenants/{tenant_id}/enable", "Enable a tenant", "adminToken", None, 200, "Tenant"),
    ("patch", "/v1/admin/tenants/{tenant_id}/quota", "Set quota fields", "adminToken", "Quota", 200, "Quota"),
    ("post", "/v1/admin/tenants/{tenant_id}/keys", "Issue an API key (shown once)", "adminToken", None, 201,
     "ApiKey"),
    ("get", "/v1/admin/tenants/{tenant_id}/keys", "List a tenant's keys", "adminToken", None, 200, "List"),
    ("post", "/v1/admin/keys/{prefix}/revoke", "Revoke an API key by prefix", "adminToken", None, 200, None),
    ("get", "/v1/admin/jobs", "List jobs across tenants", "adminToken", None, 200, "JobList"),
    ("get", "/v1/admin/batches", "List batches across tenants", "adminToken", None, 200, "List"),
    ("get", "/v1/admin/queues", "Broker queue depths per SLA class", "adminToken", None, 200, None),
    ("get", "/v1/admin/audit", "Admin audit log", "adminToken", None, 200, "List"),
    ("post", "/v1/completions", "OpenAI completion (stream: true for server-sent events)", "apiKey",
     "OnlineCreate", 200, "Completion"),
    ("post", "/v1/chat/completions", "OpenAI chat completion (stream: true for server-sent events)", "apiKey",
     "OnlineCreate", 200, "Completion"),
    ("get", "/v1/models", "The served model", "apiKey", None, 200, "List"),
    ("get", "/v1/models/{model_id}", "Get the served model", "apiKey", None, 200, "Model"),
]

_ERROR_CODES = {"400": "Bad input", "401": "Bad or revoked key", "403": "Not allowed", "404": "Not found",
                "409": "Conflict", "413": "Too large", "429": "Over quota (Retry-After)"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM = {"type": "number"}
_DEFAULT_CLASS = {"enum": ["realtime", "interactive", None], "description": "class of online requests that name none"}
_TS = {"type": ["integer", "null"], "description": "Unix seconds"}

_SAMPLING = {name: _NUM for name in sorted(ALLOWED[COMPLETIONS] | ALLOWED[CHAT])}
_SAMPLING.update(model=_STR, user=_STR, stop={"oneOf": [_STR, {"type": "array", "items": _STR}]},
                 prompt={"oneOf": [_STR, {"type": "array", "items": _INT}]},
                 messages={"type": "array", "items": {"type": "object", "properties": {
                     "role": _STR, "content": {"oneOf": [_STR, {"type": "array"}]}}}},
                 ignore_eos={"type": "boolean"}, stream={"type": "boolean"}, echo={"type": "boolean"},
                 logprobs={"oneOf": [_INT, {"type": "boolean"}]})

SCHEMAS = {
    "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}},
    "Status": {"type": "object", "properties": {"status": _STR, "checks": {"type": "object"}}},
    "List": {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array"},
                                              "first_id": _STR, "last_id": _STR, "has_more": {"type": "boolean"}}},
    "Deleted": {"type": "object", "properties": {"id": _STR, "object": _STR, "deleted": {"type": "boolean"}}},
    "JobCreate": {"type": "object", "additionalProperties": False, "properties": {
        **_SAMPLING, "sla_class": {"enum": list(SLA_CLASSES), "default": "interactive"},
        "deadline": {"oneOf": [_STR, _NUM]}, "metadata": {"type": "object"}}},
    "Job": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "job"}, "status": {"enum": [s.value for s in JobStatus]},
        "sla_class": {"enum": list(SLA_CLASSES)}, "endpoint": _STR, "request": {"type": "object"},
        "metadata": {"type": ["object", "null"]}, "batch_id": _STR, "custom_id": _STR, "deadline": _TS,
        "created_at": _TS, "queued_at": _TS, "dispatched_at": _TS, "started_at": _TS, "first_token_at": _TS,
        "finished_at": _TS, "attempts": _INT, "worker": _STR, "usage": {"type": ["object", "null"]},
        "output": {"type": ["object", "null"]}, "finish_reason": _STR, "error": {"type": ["object", "null"]}}},
    "JobList": {"allOf": [{"$ref": "#/components/schemas/List"},
                          {"type": "object", "properties": {"next_cursor": {"type": ["string", "null"]}}}]},
    "FileUpload": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"enum": ["batch"]}}},
    "File": {"type": "object", "properties": {"id": _STR, "object": {"const": "file"}, "bytes": _INT,
                                              "created_at": _INT, "filename": _STR, "purpose": _STR,
                                              "status": _STR}},
    "BatchCreate": {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
                    "properties": {"input_file_id": _STR, "endpoint": {"enum": [COMPLETIONS, CHAT]},
                                   "completion_window": {"enum": ["24h"]}, "metadata": {"type": "object"},
                                   "sla_class": {"enum": ["batch", "deferrable"], "default": "batch"}}},
    "Batch": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "batch"}, "endpoint": _STR, "input_file_id": _STR,
        "status": {"enum": [s.value for s in BatchStatus]}, "errors": {"type": ["object", "null"]},
        "output_file_id": _STR, "error_file_id": _STR, "request_counts": {"type": "object", "properties": {
            "total": _INT, "completed": _INT, "failed": _INT}}, "created_at": _INT, "expires_at": _INT}},
    "TenantCreate": {"type": "object", "required": ["name"], "properties": {
        "name": _STR, "weight": _NUM, "quota": {"$ref": "#/components/schemas/Quota"},
        "default_sla_class": _DEFAULT_CLASS}},
    "TenantUpdate": {"type": "object", "properties": {"weight": _NUM, "default_sla_class": _DEFAULT_CLASS}},
    "Tenant": {"type": "object", "properties": {"id": _STR, "name": _STR, "weight": _NUM,
                                                "default_sla_class": _DEFAULT_CLASS,
                                                "disabled": {"type": "boolean"}, "api_key": _STR,
                                                "quota": {"$ref": "#/components/schemas/Quota"}}},
    "Quota": {"type": "object", "properties": {
        "requests_per_minute": _INT, "tokens_per_minute": _INT, "max_running": _INT, "max_queued": _INT,
        "monthly_token_budget": _INT, "max_tokens_per_request": _INT, "max_file_bytes": _INT,
        "allowed_sla_classes": {"type": "array", "items": {"enum": list(SLA_CLASSES)}}}},
    "OnlineCreate": {"type": "object", "properties": {
        **_SAMPLING, "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "sla_class": {"enum": ["realtime", "interactive"], "default": "interactive"}}},
    "Completion": {"type": "object", "description": "text_completion or chat.completion; with stream: true, "
                   "text/event-stream chunks ending in 'data: [DONE]'", "properties": {
                       "id": _STR, "object": _STR, "created": _INT, "model": _STR, "choices": {"type": "array"},
                       "usage": {"type": "object", "properties": {
                           "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}}},
    "Model": {"type": "object", "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT,
                                               "owned_by": _STR}},
    "ApiKey": {"type": "object", "properties": {"prefix": _STR, "api_key": _STR, "tenant_id": _STR}},
}


def _operation(method, path, summary, security, req, status, resp) -> dict:
    params = [{"name": seg[1:-1], "in": "path", "required": True, "schema": _STR}
              for seg in path.split("/") if seg.startswith("{")]
    if path == "/v1/jobs" and method == "post":
        params.append({"name": "Idempotency-Key", "in": "header", "required": False, "schema": _STR})
    op = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '')}"
          .replace("}", "").replace(".", "_"), "parameters": params, "responses": {
              str(status): {"description": "OK", **({"content": {"application/json": {
                  "schema": {"$ref": f"#/components/schemas/{resp}"}}}} if resp else {})},
              **{code: {"description": text, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/Error"}}}} for code, text in _ERROR_CODES.items()}}}
    if security:
        op["security"] = [{security: []}]
    if req:
        ctype = "multipart/form-data" if req == "FileUpload" else "application/json"
        op["requestBody"] = {"required": True, "content": {ctype: {"schema": {"$ref": f"#/components/schemas/{req}"}}}}
    return op


def spec() -> dict:
    paths: dict = {}
    for route in ROUTES:
        paths.setdefault(route[1], {})[route[0]] = _operation(*route)
    return {"openapi": "3.1.0", "info": {"title": "Tidepool", "version": "0.1.0"}, "paths": paths,
            "components": {"schemas": SCHEMAS, "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "Tenant API key"},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "TIDEPOOL_ADMIN_TOKEN"}}}}
