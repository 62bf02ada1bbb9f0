"""OpenAPI 3 document for every route; tests/service/test_isolation_meta.py keeps it equal to the URL map."""
import json

from .ledger import anthropic_shapes, bodies, embeddings, responses, structured, tiers
from .ledger.bodies import ALLOWED, CHAT, COMPLETIONS, EMBEDDINGS
from .ledger.models import OFFLINE_CLASSES, ONLINE_CLASSES, SLA_CLASSES, BatchStatus, JobStatus

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
    ("patch", "/v1/admin/tenants/{tenant_id}", "Change weight, default online SLA class or prefix-cache group",
     "adminToken",
     "TenantUpdate", 200, "Tenant"),
    ("post", "/v1/admin/tenants/{tenant_id}/disable", "Disable a tenant", "adminToken", None, 200, "Tenant"),
    ("post", "/v1/admin/tenants/{tenant_id}/enable", "Enable a tenant", "adminToken", None, 200, "Tenant"),
    ("patch", "/v1/admin/tenants/{tenant_id}/quota", "Set quota fields", "adminToken", "Quota", 200, "Quota"),
    ("post", "/v1/admin/tenants/{tenant_id}/keys", "Issue an API key (shown once)", "adminToken", None, 201,
     "ApiKey"),
    ("get", "/v1/admin/tenants/{tenant_id}/keys", "List a tenant's keys", "adminToken", None, 200, "List"),
    ("post", "/v1/admin/keys/{prefix}/revoke", "Revoke an API key by prefix", "adminToken", None, 200, "Revoked"),
    ("get", "/v1/admin/jobs", "List jobs across tenants", "adminToken", None, 200, "JobList"),
    ("get", "/v1/admin/batches", "List batches across tenants", "adminToken", None, 200, "List"),
    ("get", "/v1/admin/queues", "Broker queue depths per SLA class, and per (model, SLA class) with whether a live "
     "worker serves it", "adminToken", None, 200, "Queues"),
    ("get", "/v1/admin/models", "List the model registry (with the implicit default model)", "adminToken", None,
     200, "List"),
    ("post", "/v1/admin/models", "Register a model", "adminToken", "ModelCreate", 201, "RegisteredModel"),
    ("get", "/v1/admin/models/{name}", "Get a registered model", "adminToken", None, 200, "RegisteredModel"),
    ("patch", "/v1/admin/models/{name}", "Retier, enable/disable or re-point a model", "adminToken", "ModelUpdate",
     200, "RegisteredModel"),
    ("post", "/v1/admin/tenants/{tenant_id}/models", "Grant a model to a tenant's allow-list", "adminToken",
     "ModelGrant", 200, "Quota"),
    ("delete", "/v1/admin/tenants/{tenant_id}/models/{name}", "Revoke a model from a tenant's allow-list",
     "adminToken", None, 200, "Quota"),
    ("get", "/v1/admin/adapters", "List the LoRA adapters", "adminToken", None, 200, "List"),
    ("post", "/v1/admin/adapters", "Register a LoRA adapter (PEFT folder) over a registered model", "adminToken",
     "AdapterCreate", 201, "Adapter"),
    ("get", "/v1/admin/adapters/{name}", "Get a LoRA adapter", "adminToken", None, 200, "Adapter"),
    ("patch", "/v1/admin/adapters/{name}", "Pin or unpin, enable or disable a LoRA adapter", "adminToken",
     "AdapterUpdate", 200, "Adapter"),
    ("get", "/v1/admin/audit", "Admin audit log", "adminToken", None, 200, "List"),
    ("post", "/v1/completions", "OpenAI completion (stream: true for server-sent events)", "apiKey",
     "CompletionCreate", 200, "Completion"),
    ("post", "/v1/chat/completions", "OpenAI chat completion (stream: true for server-sent events)", "apiKey",
     "ChatCreate", 200, "Completion"),
    ("post", "/v1/embeddings", "OpenAI embeddings (one vector per input)", "apiKey", "EmbeddingCreate", 200,
     "EmbeddingList"),
    ("get", "/v1/models", "The models this tenant may use", "apiKey", None, 200, "List"),
    ("post", "/v1/responses", "OpenAI Responses API (stream: true for its events; background: true answers at once "
     "with the queued response)", "apiKey", "ResponseCreate", 200, "Response"),
    ("get", "/v1/responses/{response_id}", "Get a stored response", "apiKey", None, 200, "Response"),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response", "apiKey", None, 200, "Deleted"),
    ("post", "/v1/responses/{response_id}/cancel", "Cancel a background response", "apiKey", None, 200, "Response"),
    ("get", "/v1/responses/{response_id}/input_items", "A stored response's input items (after, limit, order)",
     "apiKey", None, 200, "List"),
    ("post", "/v1/messages", "Anthropic Messages (x-api-key or Bearer; stream: true for its events)", "apiKey",
     "MessageCreate", 200, "Message"),
    ("post", "/v1/messages/batches", "Create an Anthropic Message Batch (a Tidepool batch of class batch)", "apiKey",
     "MessageBatchCreate", 200, "MessageBatch"),
    ("get", "/v1/messages/batches", "List message batches (after_id, before_id, limit)", "apiKey", None, 200,
     "MessageBatchList"),
    ("get", "/v1/messages/batches/{batch_id}", "Get a message batch", "apiKey", None, 200, "MessageBatch"),
    ("post", "/v1/messages/batches/{batch_id}/cancel", "Cancel a message batch", "apiKey", None, 200,
     "MessageBatch"),
    ("get", "/v1/messages/batches/{batch_id}/results", "An ended message batch's results (JSONL)", "apiKey", None,
     200, None),
    ("delete", "/v1/messages/batches/{batch_id}", "Delete an ended message batch", "apiKey", None, 200,
     "MessageBatchDeleted"),
    ("get", "/v1/models/{model_id}", "Get a model this tenant may use (404 unknown, 403 not allowed)", "apiKey",
     None, 200, "Model"),
]

_ERROR_CODES = {"400": "Bad input", "401": "Bad or revoked key", "403": "Not allowed", "404": "Not found",
                "409": "Conflict", "413": "Too large", "429": "Over quota (Retry-After)",
                "503": "Database or broker unavailable (Retry-After)"}
_EXTRA_CODES = {"/v1/files": {"415": "Not multipart/form-data"},
                "/readyz": {},
                "/v1/completions": {"500": "The job failed", "504": "Timed out or expired"},
                "/v1/chat/completions": {"500": "The job failed", "504": "Timed out or expired"},
                "/v1/responses": {"500": "The job failed", "504": "Timed out or expired"},
                "/v1/messages": {"500": "The job failed", "504": "Timed out or expired"},
                "/v1/embeddings": {"500": "The job failed", "504": "Timed out or expired"}}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULL_STR = {"type": ["string", "null"]}
_DEFAULT_CLASS = {"enum": [*ONLINE_CLASSES, None], "description": "class of online requests that name none"}
_TS = {"type": ["integer", "null"], "description": "Unix seconds"}


def _int(lo, hi) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo, hi, lo_open=False) -> dict:
    return {"type": "number", ("exclusiveMinimum" if lo_open else "minimum"): lo, "maximum": hi}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_TOKEN_ID = _int(0, bodies.MAX_TOKEN_ID)
_NAME = {"type": "string", "maxLength": bodies.MAX_NAME_CHARS}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": _STR}}
_TOOL_NAME = {"type": "string", "pattern": structured.TOOL_NAME.pattern}
_TOOL_CALL = {"type": "object", "required": ["id", "function"], "additionalProperties": False, "properties": {
    "id": _STR, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                 "properties": {"name": _STR, "arguments": {"type": "string", "description": "JSON"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
    "role": {"enum": list(bodies.ROLES)}, "name": _NAME,
    "content": {"oneOf": [_STR, {"type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": _TEXT_PART},
                          {"type": "null", "description": "an assistant message with tool_calls"}]},
    "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL, "description": "assistant messages"},
    "tool_call_id": {"type": "string", "description": "tool messages (required there)"}}}
_SCHEMA = {"type": "object", "description": "JSON Schema; keywords the grammar cannot enforce are a 400 "
                                            "(docs: Structured outputs and tools)"}
_FIELDS = {   # every body field bodies.check accepts, with its bounds; null means "not given"
    "model": _NAME, "user": _NAME,
    "max_tokens": _int(1, 1 << 20), "max_completion_tokens": _int(1, 1 << 20),
    "temperature": _num(0, 2), "top_p": _num(0, 1, lo_open=True), "min_p": _num(0, 1),
    "top_k": _int(-1, 1 << 20), "seed": _int(-(1 << 63), (1 << 64) - 1),
    "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, 10, lo_open=True),
    "stop": {"oneOf": [{"type": "string", "maxLength": bodies.MAX_STOP_CHARS},
                       {"type": "array", "maxItems": bodies.MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": bodies.MAX_STOP_CHARS}}]},
    "stop_token_ids": {"type": "array", "maxItems": bodies.MAX_STOP_TOKEN_IDS, "items": _TOKEN_ID},
    "ignore_eos": _BOOL, "n": _int(1, bodies.MAX_CHOICES), "stream": _BOOL, "echo": _BOOL,
    "best_of": _int(1, bodies.MAX_CHOICES),
    "top_logprobs": _int(0, 20),
    "response_format": {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["name", "schema"], "additionalProperties": False,
                        "properties": {"name": _TOOL_NAME, "schema": _SCHEMA, "strict": _BOOL, "description": _STR}}}},
    "tools": {"type": "array", "minItems": 1, "maxItems": structured.MAX_TOOLS, "items": {
        "type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                "name": _TOOL_NAME, "description": _STR, "parameters": _SCHEMA, "strict": _BOOL}}}}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "additionalProperties": False, "properties": {"name": _STR}}}}]},
    "parallel_tool_calls": _BOOL,
}
_PROMPT = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": bodies.MAX_PROMPT_CHARS},
                     {"type": "array", "minItems": 1, "maxItems": bodies.MAX_PROMPT_TOKEN_IDS, "items": _TOKEN_ID}]}
_MESSAGES = {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES, "items": _MESSAGE}
_METADATA = _nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                       "additionalProperties": {"type": "string", "maxLength": 512}})


def _embedding_request(extra: dict) -> dict:
    """The body embeddings.check accepts."""
    ids = {"type": "array", "minItems": 1, "maxItems": embeddings.MAX_INPUT_TOKEN_IDS, "items": _TOKEN_ID}
    text = {"type": "string", "minLength": 1, "maxLength": embeddings.MAX_INPUT_CHARS}
    many = {"minItems": 1, "maxItems": embeddings.MAX_INPUTS}
    return {"type": "object", "additionalProperties": False, "required": ["input"], "properties": {
        "model": _nullable(_NAME), "user": _nullable(_NAME),
        "input": {"oneOf": [text, ids, {"type": "array", **many, "items": text},
                            {"type": "array", **many, "items": ids}]},
        "encoding_format": _nullable({"enum": list(embeddings.FORMATS)}),
        "dimensions": _nullable({**_int(1, (1 << 31) - 1), "description": "only models with Matryoshka dimensions"}),
        "truncate": _nullable({**_BOOL, "description": "cut inputs past the model's max_seq_length (else a 400)"}),
        **extra}}


def _request(endpoint: str, extra: dict, stream=None) -> dict:
    """The body schema of one endpoint: exactly the fields bodies.check allows, plus extra."""
    props = {name: _nullable(_FIELDS[name]) for name in sorted(ALLOWED[endpoint]) if name in _FIELDS}
    if endpoint == COMPLETIONS:
        props.update(prompt=_PROMPT, logprobs=_nullable(_int(0, 20)))
    else:
        props.update(messages=_MESSAGES, logprobs=_nullable(_BOOL))
    if stream is not None:
        props["stream"] = stream
    return {"type": "object", "additionalProperties": False, "required": ["prompt" if endpoint == COMPLETIONS
                                                                          else "messages"],
            "properties": {**props, **extra}}


_JOB_EXTRA = {"sla_class": {"enum": list(SLA_CLASSES), "default": "interactive"},
              "deadline": _nullable({"oneOf": [{"type": "string", "format": "date-time", "description": "future"},
                                               {"type": "number", "description": "future Unix time",
                                                "maximum": 253402300799}]}),
              "metadata": _METADATA, "service_tier": _nullable({"enum": list(tiers.TIERS)})}
_ONLINE_EXTRA = {"sla_class": _nullable({"enum": list(ONLINE_CLASSES)}),
                 "service_tier": _nullable({"enum": list(tiers.TIERS)}),
                 "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL}})}
_TEXTS = {"type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": {
    "type": "object", "required": ["type", "text"], "properties": {"type": {"enum": list(responses.TEXT_PARTS)},
                                                                   "text": _STR}}}
_INPUT_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": list(responses.ROLES)}, "id": _STR,
        "content": {"oneOf": [_STR, _TEXTS]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR, "id": _STR}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _STR, "output": {"oneOf": [_STR, _TEXTS]},
        "id": _STR}}]}
_RESPONSE_CREATE = {"type": "object", "additionalProperties": False, "required": ["input"], "properties": {
    "model": _nullable(_NAME), "user": _nullable(_NAME), "safety_identifier": _nullable(_NAME),
    "input": {"oneOf": [{"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES, "items": _INPUT_ITEM}]},
    "instructions": _nullable(_STR), "max_output_tokens": _nullable(_int(1, 1 << 20)),
    "temperature": _nullable(_num(0, 2)), "top_p": _nullable(_num(0, 1, lo_open=True)),
    "text": _nullable({"type": "object", "properties": {"format": {"type": "object", "required": ["type"],
                                                                    "properties": {"type": {"enum": [
                                                                        "text", "json_object", "json_schema"]},
                                                                        "name": _TOOL_NAME, "schema": _SCHEMA,
                                                                        "strict": _BOOL}}}}),
    "tools": _nullable({"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": _TOOL_NAME, "description": _STR, "parameters": _SCHEMA,
        "strict": _BOOL}}}),
    "tool_choice": _nullable({"oneOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "name": _STR}}]}),
    "parallel_tool_calls": _nullable(_BOOL), "metadata": _METADATA, "store": _nullable(_BOOL),
    "previous_response_id": _nullable(_STR), "background": _nullable(_BOOL), "stream": _nullable(_BOOL),
    "truncation": _nullable({"const": "disabled"}), "service_tier": _nullable({"enum": list(tiers.TIERS)}),
    "sla_class": _nullable({"enum": list(ONLINE_CLASSES)})}}
_BLOCKS = {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result"]}}}}
_MESSAGE_CREATE = {"type": "object", "additionalProperties": False, "required": ["model", "max_tokens", "messages"],
                   "properties": {
    "model": _NAME, "max_tokens": _int(1, 1 << 20),
    "messages": {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES, "items": {
        "type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"enum": ["user", "assistant"]}, "content": {"oneOf": [_STR, _BLOCKS]}}}},
    "system": _nullable({"oneOf": [_STR, _BLOCKS]}), "stop_sequences": _nullable({"type": "array", "items": _STR}),
    "temperature": _nullable(_num(0, 1)), "top_p": _nullable(_num(0, 1, lo_open=True)),
    "top_k": _nullable(_int(-1, 1 << 20)), "stream": _nullable(_BOOL),
    "tools": _nullable({"type": "array", "items": {"type": "object", "required": ["name", "input_schema"],
                                                   "properties": {"name": _TOOL_NAME, "description": _STR,
                                                                  "input_schema": _SCHEMA}}}),
    "tool_choice": _nullable({"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR, "disable_parallel_tool_use": _BOOL}}),
    "metadata": _nullable({"type": "object", "additionalProperties": False, "properties": {"user_id": _NULL_STR}}),
    "service_tier": _nullable({"enum": list(anthropic_shapes.ANTHROPIC_TIERS)}),
    "sla_class": _nullable({"enum": list(ONLINE_CLASSES)})}}
_RFC3339 = {"type": ["string", "null"], "format": "date-time"}
_MESSAGE_BATCH = {"type": "object", "properties": {
    "id": _STR, "type": {"const": "message_batch"}, "processing_status": {"enum": ["in_progress", "canceling", "ended"]},
    "request_counts": {"type": "object", "properties": {k: _INT for k in ("processing", "succeeded", "errored",
                                                                           "canceled", "expired")}},
    "ended_at": _RFC3339, "created_at": _RFC3339, "expires_at": _RFC3339, "archived_at": _RFC3339,
    "cancel_initiated_at": _RFC3339, "results_url": _NULL_STR}}
_QUOTA = {name: _nullable(_int(0, (1 << 63) - 1 if name in ("monthly_token_budget", "max_file_bytes",
                                                             "max_storage_bytes") else (1 << 31) - 1))
          for name in ("requests_per_minute", "tokens_per_minute", "max_running", "max_queued",
                       "monthly_token_budget", "max_tokens_per_request", "max_file_bytes", "max_concurrent_requests",
                       "max_files", "max_storage_bytes")}
_WEIGHT = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6}
_MODEL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}
_TIER = {"enum": ["hot", "warm", "cold"]}
_CACHE_GROUP = {"type": ["string", "null"], "minLength": 1, "maxLength": 64, "pattern": "^[ -~]*$",
                "description": "tenants of one group share cached prompt prefixes"}
_LIST_FIELDS = {"object": {"const": "list"}, "data": {"type": "array"}, "first_id": _NULL_STR,
                "last_id": _NULL_STR, "has_more": _BOOL}

SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR}}}},
    "Status": {"type": "object", "properties": {"status": _STR, "checks": {"type": "object"}}},
    "List": {"type": "object", "required": ["object", "data"], "properties": _LIST_FIELDS},
    "Deleted": {"type": "object", "properties": {"id": _STR, "object": _STR, "deleted": _BOOL}},
    "JobCreate": {"oneOf": [_request(COMPLETIONS, _JOB_EXTRA, stream=_nullable({"const": False})),
                            _request(CHAT, _JOB_EXTRA, stream=_nullable({"const": False})),
                            _embedding_request(_JOB_EXTRA)]},
    "Job": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "job"}, "status": {"enum": [s.value for s in JobStatus]},
        "sla_class": {"enum": list(SLA_CLASSES)}, "model": _NULL_STR, "endpoint": _STR, "request": {"type": "object"},
        "metadata": {"type": ["object", "null"]}, "batch_id": _NULL_STR, "custom_id": _NULL_STR, "deadline": _TS,
        "created_at": _TS, "queued_at": _TS, "dispatched_at": _TS, "started_at": _TS, "first_token_at": _TS,
        "finished_at": _TS, "attempts": _INT, "worker": _NULL_STR, "usage": {"type": ["object", "null"]},
        "output": {"type": ["object", "null"]}, "finish_reason": _NULL_STR, "error": {"type": ["object", "null"]},
        "tenant_id": _STR}},
    "JobList": {"type": "object", "required": ["object", "data"],
                "properties": {**_LIST_FIELDS, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Job"}},
                               "next_cursor": _NULL_STR}},
    "FileUpload": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"enum": ["batch"]},
        "expires_after[anchor]": {"enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000}}},
    "File": {"type": "object", "properties": {"id": _STR, "object": {"const": "file"}, "bytes": _INT,
                                              "created_at": _INT, "filename": _STR, "purpose": _STR,
                                              "status": _STR, "status_details": {"type": "null"},
                                              "expires_at": _TS}},
    "BatchCreate": {"type": "object", "additionalProperties": False,
                    "required": ["input_file_id", "endpoint", "completion_window"],
                    "properties": {"input_file_id": _STR,
                                   "endpoint": {"enum": [COMPLETIONS, CHAT, EMBEDDINGS, responses.RESPONSES]},
                                   "completion_window": {"const": "24h"}, "metadata": _METADATA,
                                   "sla_class": {"enum": list(OFFLINE_CLASSES), "default": "batch"}}},
    "Batch": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "batch"}, "endpoint": _STR, "input_file_id": _STR,
        "completion_window": _STR, "sla_class": {"enum": list(OFFLINE_CLASSES)},
        "status": {"enum": [s.value for s in BatchStatus]}, "errors": {"type": ["object", "null"]},
        "output_file_id": _NULL_STR, "error_file_id": _NULL_STR, "request_counts": {"type": "object", "properties": {
            "total": _INT, "completed": _INT, "failed": _INT}}, "metadata": {"type": ["object", "null"]},
        "model": _NULL_STR, "usage": {"type": "object", "properties": {
            "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT,
            "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _INT}}}},
        **{f: _TS for f in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                            "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
        "x_tidepool": {"type": "object", "description": "Tidepool's estimate for an in-progress batch (service/"
                       "ledger/eta.py): eta (unix seconds; null without a measured drain rate or when not in "
                       "progress), position (its tenant's jobs of the class served before it), remaining, "
                       "drain_rate (jobs/s of its class), share (of that rate), at_risk (eta after expires_at).",
                       "properties": {"eta": {"type": ["integer", "null"]}, "position": _INT, "remaining": _INT,
                                      "drain_rate": {"type": ["number", "null"]},
                                      "share": {"type": ["number", "null"]}, "at_risk": {"type": "boolean"}}}}},
    "TenantCreate": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 200}, "weight": _WEIGHT,
        "quota": {"anyOf": [{"$ref": "#/components/schemas/Quota"}, {"type": "null"}]},
        "default_sla_class": _DEFAULT_CLASS}},
    "TenantUpdate": {"type": "object", "additionalProperties": False, "properties": {
        "weight": _WEIGHT, "default_sla_class": _DEFAULT_CLASS, "prefix_cache_group": _CACHE_GROUP}},
    "Tenant": {"type": "object", "properties": {"id": _STR, "object": {"const": "tenant"}, "name": _STR,
                                                "weight": _NUM, "default_sla_class": _DEFAULT_CLASS,
                                                "prefix_cache_group": _CACHE_GROUP, "disabled": _BOOL,
                                                "created_at": _INT, "queued_jobs": _INT, "running_jobs": _INT,
                                                "api_key": _STR, "quota": {"$ref": "#/components/schemas/Quota"}}},
    "Quota": {"type": "object", "additionalProperties": False, "properties": {
        **_QUOTA, "allowed_sla_classes": {"type": "array", "maxItems": len(SLA_CLASSES),
                                          "items": {"enum": list(SLA_CLASSES)}},
        "allowed_models": {"type": ["array", "null"], "maxItems": 1000, "items": _MODEL_NAME,
                           "description": "null or []: every enabled model"}}},
    "ModelCreate": {"type": "object", "additionalProperties": False, "required": ["name", "source"], "properties": {
        "name": _MODEL_NAME, "source": {"type": "string", "minLength": 1, "maxLength": 1024},
        "tier": _TIER, "enabled": _BOOL}},
    "ModelUpdate": {"type": "object", "additionalProperties": False, "properties": {
        "tier": _TIER, "enabled": _BOOL, "source": {"type": "string", "minLength": 1, "maxLength": 1024}}},
    "ModelGrant": {"type": "object", "additionalProperties": False, "required": ["model"],
                   "properties": {"model": _MODEL_NAME}},
    "RegisteredModel": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "source": _NULL_STR,
        "tier": _TIER, "enabled": _BOOL, "registered": _BOOL,
        "kind": {"enum": ["generate", "embed"], "description": "embed: a sentence-transformers folder or BERT"}}},
    "AdapterCreate": {"type": "object", "additionalProperties": False, "required": ["name", "base_model", "source"],
                      "properties": {"name": _MODEL_NAME, "base_model": _MODEL_NAME,
                                     "source": {"type": "string", "minLength": 1, "maxLength": 1024},
                                     "tenant_id": _NULL_STR, "pinned": _BOOL, "enabled": _BOOL}},
    "AdapterUpdate": {"type": "object", "additionalProperties": False,
                      "properties": {"pinned": _BOOL, "enabled": _BOOL}},
    "Adapter": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "adapter"}, "base_model": _STR, "source": _STR, "tenant_id": _NULL_STR,
        "rank": _INT, "target_modules": {"type": "array", "items": _STR}, "pinned": _BOOL, "enabled": _BOOL,
        "created": _INT}},
    "CompletionCreate": _request(COMPLETIONS, _ONLINE_EXTRA, stream=_nullable(_BOOL)),
    "ChatCreate": _request(CHAT, _ONLINE_EXTRA, stream=_nullable(_BOOL)),
    "EmbeddingCreate": _embedding_request({"sla_class": _nullable({"enum": list(ONLINE_CLASSES)})}),
    "EmbeddingList": {"type": "object", "properties": {
        "object": {"const": "list"}, "model": _NULL_STR, "data": {"type": "array", "items": {
            "type": "object", "properties": {"object": {"const": "embedding"}, "index": _INT, "embedding": {
                "oneOf": [{"type": "array", "items": _NUM}, {"type": "string", "description": "base64 float32"}]}}}},
        "usage": {"type": "object", "properties": {"prompt_tokens": _INT, "total_tokens": _INT}}}},
    "Completion": {"type": "object", "description": "text_completion or chat.completion; with stream: true, "
                   "text/event-stream chunks ending in 'data: [DONE]'", "properties": {
                       "id": _STR, "object": _STR, "created": _INT, "model": _NULL_STR, "choices": {"type": "array"},
                       "usage": {"type": "object", "properties": {
                           "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}}},
    "ResponseCreate": _RESPONSE_CREATE,
    "Response": {"type": "object", "description": "with stream: true, text/event-stream of Responses events",
                 "properties": {
        "id": _STR, "object": {"const": "response"}, "created_at": _INT,
        "status": {"enum": ["queued", "in_progress", "completed", "failed", "incomplete", "cancelled"]},
        "background": _BOOL, "output": {"type": "array"}, "usage": {"type": ["object", "null"]},
        "service_tier": {"enum": list(tiers.TIER_CLASS)}, "previous_response_id": _NULL_STR, "store": _BOOL,
        "error": {"type": ["object", "null"]}, "incomplete_details": {"type": ["object", "null"]}}},
    "MessageCreate": _MESSAGE_CREATE,
    "Message": {"type": "object", "description": "with stream: true, text/event-stream of Messages events",
                "properties": {
        "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _NULL_STR,
        "content": {"type": "array"}, "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": _NULL_STR, "usage": {"type": "object", "properties": {"input_tokens": _INT,
                                                                               "output_tokens": _INT}}}},
    "MessageBatchCreate": {"type": "object", "additionalProperties": False, "required": ["requests"], "properties": {
        "requests": {"type": "array", "minItems": 1, "maxItems": 100_000, "items": {
            "type": "object", "required": ["custom_id", "params"], "additionalProperties": False, "properties": {
                "custom_id": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "params": _MESSAGE_CREATE}}}}},
    "MessageBatch": _MESSAGE_BATCH,
    "MessageBatchList": {"type": "object", "properties": {"data": {"type": "array", "items": _MESSAGE_BATCH},
                                                          "has_more": _BOOL, "first_id": _NULL_STR,
                                                          "last_id": _NULL_STR}},
    "MessageBatchDeleted": {"type": "object", "properties": {"id": _STR,
                                                             "type": {"const": "message_batch_deleted"}}},
    "Model": {"type": "object", "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT,
                                               "owned_by": _STR}},
    "ApiKey": {"type": "object", "properties": {"prefix": _STR, "api_key": _STR, "tenant_id": _STR,
                                                "created_at": _TS, "revoked_at": _TS, "last_used_at": _TS}},
    "Revoked": {"type": "object", "properties": {"prefix": _STR, "revoked": {"const": True}}},
    "Queues": {"type": "object", "properties": {"object": {"const": "queue_depths"},
                                                "queues": {"type": "object", "additionalProperties": _INT},
                                                "models": {"type": "array", "items": {"type": "object", "properties": {
                                                    "model": _STR, "sla_class": {"enum": list(SLA_CLASSES)},
                                                    "queue": _STR, "depth": _INT, "served": _BOOL}}},
                                                "private": {"type": "array", "items": {"type": "object", "properties": {
                                                    "queue": _STR, "shared": _STR, "worker": _STR, "depth": _INT}}}}},
}

_CURSOR = {"type": "string"}
_STATUS = {"enum": ["", *(s.value for s in JobStatus)], "description": "empty: any"}
_CLASS = {"enum": ["", *SLA_CLASSES], "description": "empty: any"}
_INCLUDE = {"enum": ["", "request"], "description": "request: each job's request body (left out by default)"}
_QUERY = {   # query parameters each listing reads (each at most once)
    ("get", "/v1/jobs"): {"status": _STATUS, "sla_class": _CLASS,
                          "cursor": _CURSOR, "limit": _int(1, 100), "include": _INCLUDE},
    ("get", "/v1/files"): {"purpose": _STR, "after": _CURSOR, "order": {"enum": ["asc", "desc"]},
                           "limit": _int(1, 10_000)},
    ("get", "/v1/batches"): {"after": _CURSOR, "limit": _int(1, 100)},
    ("get", "/v1/admin/jobs"): {"tenant_id": _STR, "batch_id": _STR, "status": _STATUS, "sla_class": _CLASS,
                                "cursor": _CURSOR, "limit": _int(1, 100), "include": _INCLUDE},
    ("get", "/v1/admin/batches"): {"tenant_id": _STR, "after": _CURSOR, "limit": _int(1, 100)},
    ("get", "/v1/admin/audit"): {"limit": _int(1, 1000)},
    ("get", "/v1/responses/{response_id}/input_items"): {"after": _CURSOR, "limit": _int(1, 100),
                                                         "order": {"enum": ["asc", "desc"]}},
    ("get", "/v1/messages/batches"): {"after_id": _CURSOR, "before_id": _CURSOR, "limit": _int(1, 1000)},
}


def _operation(method, path, summary, security, req, status, resp) -> dict:
    params = [{"name": seg[1:-1], "in": "path", "required": True, "schema": _STR}
              for seg in path.split("/") if seg.startswith("{")]
    params += [{"name": name, "in": "query", "required": False, "schema": schema}
               for name, schema in _QUERY.get((method, path), {}).items()]
    if path == "/v1/jobs" and method == "post":
        params.append({"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "minLength": 1, "maxLength": 255}})
    params = [{**p, "schema": _no_nul(p["schema"])} for p in params]
    codes = {**_ERROR_CODES, **_EXTRA_CODES.get(path, {})}
    op = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '')}"
          .replace("}", "").replace(".", "_"), "parameters": params, "responses": {
              str(status): {"description": "OK", **({"content": {"application/json": {
                  "schema": {"$ref": f"#/components/schemas/{resp}"}}}} if resp else {})},
              **{code: {"description": text, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/Error"}}}} for code, text in codes.items()}}}
    if security:
        op["security"] = [{security: []}]
    if req:
        ctype = "multipart/form-data" if req == "FileUpload" else "application/json"
        op["requestBody"] = {"required": True, "content": {ctype: {"schema": {"$ref": f"#/components/schemas/{req}"}}}}
    return op


def _served_model(schemas: dict) -> dict:
    """In an app serving models, `model` (where a body names one) must be one of the enabled registry names."""
    from flask import current_app, has_app_context
    names = [e.name for e in current_app.extensions["tidepool.registry"].entries().values() if e.enabled] \
        if has_app_context() else []
    if not names:
        return schemas
    model = {"anyOf": [*({"const": n} for n in names), {"type": "null"}]}

    def fix(schema):
        if isinstance(schema, dict):
            return {k: model if k == "model" and isinstance(v, dict) and "anyOf" in v else fix(v)
                    for k, v in schema.items()}
        if isinstance(schema, list):
            return [fix(v) for v in schema]
        return schema
    return {**schemas, **{n: fix(schemas[n]) for n in ("JobCreate", "CompletionCreate", "ChatCreate",
                                                         "EmbeddingCreate")}}


_NO_NUL = "^[^\\u0000]*$"   # no string of a request may hold NUL (nor a lone surrogate, which JSON Schema cannot say)


def _no_nul(schema):
    if isinstance(schema, dict):
        out = {k: _no_nul(v) for k, v in schema.items()}
        if schema.get("type") == "string" and "pattern" not in schema and "format" not in schema:
            out["pattern"] = _NO_NUL
        if "propertyNames" in schema:
            out["propertyNames"] = {**schema["propertyNames"], "pattern": _NO_NUL}
        return out
    if isinstance(schema, list):
        return [_no_nul(v) for v in schema]
    return schema


for _name in ("JobCreate", "CompletionCreate", "ChatCreate", "EmbeddingCreate", "BatchCreate", "TenantCreate",
              "TenantUpdate", "Quota", "ResponseCreate", "MessageCreate", "MessageBatchCreate"):
    SCHEMAS[_name] = _no_nul(SCHEMAS[_name])


def _future_deadline(schemas: dict) -> dict:
    """A Unix-time deadline must be in the future: the document says from when it is served."""
    import time
    job = json.loads(json.dumps(schemas["JobCreate"]).replace('"maximum": 253402300799',
                                                              f'"minimum": {int(time.time()) + 60}, "maximum": 253402300799'))
    return {**schemas, "JobCreate": job}


def spec() -> dict:
    paths: dict = {}
    for route in ROUTES:
        paths.setdefault(route[1], {})[route[0]] = _operation(*route)
    return {"openapi": "3.1.0", "info": {"title": "Tidepool", "version": "0.1.0"}, "paths": paths,
            "components": {"schemas": _future_deadline(_served_model(SCHEMAS)), "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "Tenant API key (on /v1/messages "
                                                                              "also as the x-api-key header)"},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "TIDEPOOL_ADMIN_TOKEN"}}}}
