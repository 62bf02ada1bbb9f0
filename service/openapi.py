"""OpenAPI 3.1 document for every route: the API's contract. tests/service/test_isolation_meta.py keeps it equal to
the URL map; tests/service/test_contract_schemathesis.py runs Schemathesis against the service with it.

Every request body is described exactly as the server checks it: a body the schema accepts is accepted (or refused
only for a reason no schema can state, with a documented 401, 403, 404, 409, 413 or 429: a key, a quota, an id that
must exist, a resource in the wrong state), and a body it rejects is a 400 in the API's error format. The few
checks JSON Schema cannot state across fields (a tool_choice names one of the request's tools, tool names and
message-batch custom_ids are unique) are in `CROSS_FIELD` and the fields' descriptions. The served models' names,
contexts and vocabularies are filled in per app (`_served_models`)."""
from .protocol import (anthropic_messages, embeddings, openai_responses, request_bodies as bodies,
                       structured_output as structured)
from .protocol import sla_classes
from .protocol import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from .protocol.request_bodies import ALLOWED
from .ledger.models import OFFLINE_CLASSES, ONLINE_CLASSES, SLA_CLASSES, BatchStatus, JobStatus
from .ledger.registry import KV_CACHE_DTYPES, MAX_TENSOR_PARALLEL_SIZE

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
    ("patch", "/v1/admin/tenants/{tenant_id}/quota", "Set quota fields", "adminToken", "QuotaUpdate", 200, "Quota"),
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
    ("patch", "/v1/admin/models/{name}", "Retier, enable/disable, re-point or resize a model", "adminToken",
     "ModelUpdate",
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
_ONLINE_CODES = {"500": "The job failed", "504": "Timed out waiting for a worker, or expired"}
_EXTRA_CODES = {"/v1/files": {"415": "Not multipart/form-data"},
                "/readyz": {},
                "/v1/completions": _ONLINE_CODES, "/v1/chat/completions": _ONLINE_CODES,
                "/v1/responses": _ONLINE_CODES, "/v1/messages": _ONLINE_CODES, "/v1/embeddings": _ONLINE_CODES}
# Routes answering `stream: true` with server-sent events (200, text/event-stream): the schema of one event as
# {event, data, id?, retry?} (Open API before 3.2 has a sequential media type's `schema` describe one item)
_JSON_DATA = {"type": "string", "contentMediaType": "application/json",
              "contentSchema": {"type": "object", "required": ["type"]}}
STREAMING = {
    "/v1/completions": {"event": {"const": "message"}, "data": {
        "type": "string", "description": "a JSON chunk (or {\"error\": ...} if the job fails), then [DONE]"}},
    "/v1/responses": {"event": {"type": "string", "pattern": "^response\\."}, "data": _JSON_DATA},
    "/v1/messages": {"event": {"enum": ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop", "ping", "error"]},
                     "data": _JSON_DATA}}
STREAMING["/v1/chat/completions"] = STREAMING["/v1/completions"]
# Routes answering file bytes: their media type
FILE_CONTENT = {"/v1/files/{file_id}/content": "application/jsonl",
                "/v1/messages/batches/{batch_id}/results": "application/x-jsonl"}
# A route's other success answers: status -> (description, response schema)
_OTHER_SUCCESS = {("post", "/v1/jobs"): {"200": ("The job an earlier request with this Idempotency-Key and body "
                                                "created", "Job")}}

# What JSON Schema cannot say across fields, which the server checks (a 400 naming the field); each is in its
# field's description too.
CROSS_FIELD = {
    "tool_choice": "a tool_choice that names a function names one of the request's tools",
    "tools": "the tools' names are unique",
    "custom_id": "a message batch's custom_ids are unique",
}

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULL = {"type": "null"}
_NULL_STR = {"type": ["string", "null"]}
_DEFAULT_CLASS = {"enum": [*ONLINE_CLASSES, None], "description": "class of online requests that name none"}
_TS = {"type": ["integer", "null"], "description": "Unix seconds"}
_JSON = {"$ref": "#/components/schemas/JsonValue"}
_STRUCTURED = {"$ref": "#/components/schemas/StructuredSchema"}


def _int(lo, hi) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo, hi, lo_open=False) -> dict:
    return {"type": "number", ("exclusiveMinimum" if lo_open else "minimum"): lo, "maximum": hi}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, _NULL]}


def _obj(props: dict, required=(), **extra) -> dict:
    """A closed object: exactly these properties (others are a 400)."""
    out = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = list(required)
    return {**out, **extra}


def _given(name: str, schema: dict) -> dict:
    """The condition 'the body has `name`, not null, matching schema'."""
    return {"required": [name], "properties": {name: {"allOf": [{"not": _NULL}, schema]}}}


def _absent_or_null(name: str) -> dict:
    return {"anyOf": [{"not": {"required": [name]}}, {"properties": {name: _NULL}}]}


def _when(condition: dict, then: dict) -> dict:
    return {"if": condition, "then": then}


_TOKEN_ID = {**_int(0, bodies.MAX_TOKEN_ID), "description": "below the model's vocab_size"}
_NAME = {"type": "string", "maxLength": bodies.MAX_NAME_CHARS}
_MODEL = {**_NAME, "description": "a served model (the default model when absent or null), or a LoRA adapter "
                                  "this tenant may use; 404 for any other name, or a model that does not serve "
                                  "this endpoint"}
_MAX_TOKENS = {**_int(1, bodies.MAX_OUTPUT_TOKENS), "description": "below the model's context; a prompt that leaves "
                                                                   "no room in it, counted in the model's tokens (no "
                                                                   "schema can count them), is a 400 "
                                                                   "context_length_exceeded"}
_TOOL_NAME = {"type": "string", "pattern": structured.TOOL_NAME.pattern}
_METADATA = _nullable({"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                       "additionalProperties": {"type": "string", "maxLength": 512}})
_CALL_ARGUMENTS = {"type": "string", "description": "the call's arguments as the model wrote them (JSON text, "
                                                    "or not: a model does not always write valid JSON)"}

# ---- JSON values and the JSON Schemas of structured output --------------------------------------------------

_JSON_VALUE = {"anyOf": [{"type": ["null", "boolean", "number", "string"]}, {"type": "array", "items": _JSON},
                         {"type": "object", "additionalProperties": _JSON}]}
_SUBSCHEMA = {"anyOf": [_BOOL, _STRUCTURED]}
_STRUCTURED_SCHEMA = {
    "type": "object",
    "description": f"a JSON Schema of the keywords the grammar enforces ({', '.join(sorted(structured.ENFORCED))}) "
                   f"and annotations; at most {structured.MAX_SCHEMA_DEPTH} levels deep and "
                   f"{structured.MAX_SCHEMA_CHARS} characters of JSON",
    "propertyNames": {"enum": sorted(structured.ENFORCED | structured.ANNOTATIONS)},
    "properties": {
        **{k: {"type": "object", "additionalProperties": _SUBSCHEMA} for k in sorted(structured.NAMED_SCHEMAS)},
        "items": _SUBSCHEMA, "additionalProperties": _SUBSCHEMA,
        "anyOf": {"type": "array", "minItems": 1, "items": _SUBSCHEMA},
        "prefixItems": {"type": "array", "minItems": 1, "items": _SUBSCHEMA},
        "required": {"type": "array", "items": _STR}, "enum": {"type": "array", "minItems": 1, "items": _JSON},
        "pattern": _STR, "$ref": _STR, "format": {"enum": sorted(structured.FORMATS)}},
    "additionalProperties": _JSON}

# ---- OpenAI completions and chat bodies -----------------------------------------------------------------------

_TEXT_PART = _obj({"type": {"const": "text"}, "text": _STR}, ["type", "text"])
_PARTS = {"type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": _TEXT_PART}
_CONTENT = {"anyOf": [_STR, _PARTS]}
_TOOL_CALL = _obj({"id": _STR, "type": {"const": "function"},
                   "function": _obj({"name": _STR, "arguments": _CALL_ARGUMENTS}, ["name", "arguments"])},
                  ["id", "function"])


def _chat_message(role: str) -> dict:
    if role == "assistant":
        return {**_obj({"role": {"const": role}, "content": {"anyOf": [_STR, _PARTS, _NULL]}, "name": _NAME,
                        "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL}}, ["role"]),
                "anyOf": [{"required": ["tool_calls"]}, _given("content", {})],
                "description": "content, or tool_calls (then content may be absent or null)"}
    if role == "tool":
        return _obj({"role": {"const": role}, "content": _CONTENT, "name": _NAME, "tool_call_id": _STR},
                    ["role", "content", "tool_call_id"])
    return _obj({"role": {"const": role}, "content": _CONTENT, "name": _NAME}, ["role", "content"])


_MESSAGES = {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES,
             "items": {"oneOf": [_chat_message(r) for r in bodies.ROLES]}}
_RESPONSE_FORMAT = {"oneOf": [
    _obj({"type": {"enum": ["text", "json_object"]}}, ["type"]),
    _obj({"type": {"const": "json_schema"}, "json_schema": _obj({
        "name": _TOOL_NAME, "schema": _STRUCTURED, "strict": _nullable(_BOOL), "description": _STR},
        ["name", "schema"])}, ["type", "json_schema"])]}
_FUNCTION = _obj({"name": _TOOL_NAME, "description": _STR, "parameters": _STRUCTURED, "strict": _nullable(_BOOL)},
                 ["name"])
_TOOLS = {"type": "array", "minItems": 1, "maxItems": structured.MAX_TOOLS, "description": CROSS_FIELD["tools"],
          "items": _obj({"type": {"const": "function"}, "function": _FUNCTION}, ["type", "function"])}
_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]}, _obj({
    "type": {"const": "function"}, "function": _obj({"name": _STR}, ["name"])}, ["type", "function"])],
    "description": f"not 'none': needs tools; {CROSS_FIELD['tool_choice']}"}
_FIELDS = {   # every body field bodies.check accepts, with its bounds; null means "not given"
    "model": _MODEL, "user": _NAME, "max_tokens": _MAX_TOKENS, "max_completion_tokens": _MAX_TOKENS,
    "temperature": _num(0, 2), "top_p": _num(0, 1, lo_open=True), "min_p": _num(0, 1),
    "top_k": _int(-1, 1 << 20), "seed": _int(-(1 << 63), (1 << 64) - 1),
    "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, 10, lo_open=True),
    "stop": {"oneOf": [{"type": "string", "maxLength": bodies.MAX_STOP_CHARS},
                       {"type": "array", "maxItems": bodies.MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": bodies.MAX_STOP_CHARS}}]},
    "stop_token_ids": {"type": "array", "maxItems": bodies.MAX_STOP_TOKEN_IDS, "items": _int(0, bodies.MAX_TOKEN_ID)},
    "ignore_eos": _BOOL, "speculate": _BOOL, "n": _int(1, bodies.MAX_CHOICES), "stream": _BOOL, "echo": _BOOL,
    "best_of": {**_int(1, bodies.MAX_CHOICES), "description": "at least n"},
    "top_logprobs": _int(0, 20), "response_format": _RESPONSE_FORMAT, "tools": _TOOLS, "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": _BOOL,
}
_PROMPT = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": bodies.MAX_PROMPT_CHARS},
                     {"type": "array", "minItems": 1, "maxItems": bodies.MAX_PROMPT_TOKEN_IDS, "items": _TOKEN_ID,
                      "description": "token ids, fewer than the model's context"}]}


def _tools_rules() -> list[dict]:
    """A chat body's tool rules: a tool_choice other than none needs tools; a forced call (required, or a named
    function) leaves response_format text."""
    return [_when(_given("tool_choice", {"not": {"const": "none"}}), {"required": ["tools"],
                                                                      "properties": {"tools": {"type": "array"}}}),
            _when(_given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
                  {"properties": {"response_format": {"anyOf": [_NULL, {"properties": {"type": {"const": "text"}}}]}}})]


def _best_of_rules(stream: bool) -> list[dict]:
    """best_of is at least n; a streamed request cannot ask for more than n (the best are known only at the end)."""
    rules = [_when(_given("n", {"minimum": k}), {"properties": {"best_of": {"anyOf": [_NULL, {"minimum": k}]}}})
             for k in range(2, bodies.MAX_CHOICES + 1)]
    if stream:
        rules += [_when({"allOf": [_given("stream", {"const": True}),
                                   {"properties": {"n": {"anyOf": [_NULL, {"maximum": k}]}}}]},
                        {"properties": {"best_of": {"anyOf": [_NULL, {"maximum": k}]}}})
                  for k in range(1, bodies.MAX_CHOICES)]
    return rules


def _class_rules() -> list[dict]:
    """service_tier and sla_class agree when both are given."""
    return [_when({"allOf": [_given("service_tier", {"const": tier}), _given("sla_class", {})]},
                  {"properties": {"sla_class": {"const": cls}}}) for tier, cls in sla_classes.TIER_CLASS.items()]


_ONLINE_SLA = {"sla_class": _nullable({"enum": [*ONLINE_CLASSES, "batch"],
                                       "description": "batch only with service_tier flex"}),
               "service_tier": _nullable({"enum": list(sla_classes.TIERS)})}
_ONLINE_RULES = [*_class_rules(),   # online, sla_class batch comes with service_tier flex
                 _when(_given("sla_class", {"const": "batch"}), _given("service_tier", {"const": "flex"}))]
_JOB_EXTRA = {"sla_class": _nullable({"enum": list(SLA_CLASSES)}),
              "service_tier": _nullable({"enum": list(sla_classes.TIERS)}),
              "deadline": _nullable({"oneOf": [
                  {"type": "string", "format": "date-time", "description": "RFC 3339"},
                  {"type": "number", "description": "Unix seconds", "minimum": bodies.MIN_DEADLINE,
                   "maximum": bodies.MAX_DEADLINE}], "description": "one already past expires the job unrun"}),
              "metadata": _METADATA}


def _request(endpoint: str, extra: dict, stream: dict | None = None, online: bool = False) -> dict:
    """The body schema of one endpoint: exactly the fields bodies.check allows (each may be null: not given),
    plus extra."""
    props = {name: _nullable(_FIELDS[name]) for name in sorted(ALLOWED[endpoint]) if name in _FIELDS}
    rules = []
    if endpoint == COMPLETIONS:
        props.update(prompt=_PROMPT, logprobs=_nullable(_int(0, 20)))
        rules += _best_of_rules(stream=online)
    else:
        props.update(messages=_MESSAGES, logprobs=_nullable(_BOOL))
        rules += _tools_rules()
    if stream is not None:
        props["stream"] = stream
    if online:
        props["stream_options"] = _nullable(_obj({"include_usage": _nullable(_BOOL)}))
    return {**_obj({**props, **extra}, ["prompt" if endpoint == COMPLETIONS else "messages"]), "allOf": rules}


def _embedding_request(extra: dict) -> dict:
    """The body embeddings.check accepts."""
    ids = {"type": "array", "minItems": 1, "maxItems": embeddings.MAX_INPUT_TOKEN_IDS, "items": _TOKEN_ID}
    text = {"type": "string", "minLength": 1, "maxLength": embeddings.MAX_INPUT_CHARS}
    many = {"minItems": 1, "maxItems": embeddings.MAX_INPUTS}
    return _obj({
        "model": _nullable(_MODEL), "user": _nullable(_NAME),
        "input": {"oneOf": [text, ids, {"type": "array", **many, "items": text},
                            {"type": "array", **many, "items": ids}]},
        "encoding_format": _nullable({"enum": list(embeddings.FORMATS)}),
        "dimensions": _nullable({**_int(1, embeddings.MAX_DIMENSIONS),
                                 "description": "only models with Matryoshka dimensions, one of theirs"}),
        "truncate": _nullable({**_BOOL, "description": "cut inputs past the model's max_seq_length (else a 400)"}),
        **extra}, ["input"])


def _job_create() -> dict:
    completion = _request(COMPLETIONS, _JOB_EXTRA, stream=_nullable({"const": False}))
    chat = _request(CHAT, _JOB_EXTRA, stream=_nullable({"const": False}))
    return {"oneOf": [completion, chat, _embedding_request(_JOB_EXTRA)], "allOf": _class_rules(),
            "description": "a completion (prompt), chat (messages) or embeddings (input) body, run as a queued job"}


def _online(body: dict) -> dict:
    return {**body, "allOf": [*body.get("allOf", []), *_ONLINE_RULES]}


# ---- OpenAI Responses ---------------------------------------------------------------------------------------

_ITEM_ID = _nullable({"type": "string", "maxLength": 64})
_RESPONSE_PARTS = {"type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": {
    "type": "object", "required": ["type", "text"], "additionalProperties": _JSON,
    "properties": {"type": {"enum": list(openai_responses.TEXT_PARTS)}, "text": _STR}}}
_NON_EMPTY = {"type": "string", "minLength": 1}
_INPUT_ITEM = {"oneOf": [
    _obj({"type": {"const": "message"}, "role": {"enum": list(openai_responses.ROLES)},
          "content": {"anyOf": [_STR, _RESPONSE_PARTS]}, "id": _ITEM_ID, "status": _JSON}, ["role", "content"]),
    _obj({"type": {"const": "function_call"}, "call_id": _NON_EMPTY, "name": _NON_EMPTY,
          "arguments": {**_CALL_ARGUMENTS, "minLength": 1}, "id": _ITEM_ID, "status": _JSON},
         ["type", "call_id", "name", "arguments"]),
    _obj({"type": {"const": "function_call_output"}, "call_id": _NON_EMPTY,
          "output": {"anyOf": [_STR, _RESPONSE_PARTS]}, "id": _ITEM_ID, "status": _JSON},
         ["type", "call_id", "output"])]}
_TEXT_FORMAT = {"oneOf": [
    _obj({"type": {"enum": ["text", "json_object"]}}, ["type"]),
    _obj({"type": {"const": "json_schema"}, "name": _TOOL_NAME, "schema": _STRUCTURED, "strict": _nullable(_BOOL),
          "description": _STR}, ["type", "name", "schema"])]}
_RESPONSE_CREATE = {**_obj({
    "model": _nullable(_MODEL), "user": _nullable(_NAME), "safety_identifier": _nullable(_NAME),
    "input": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": bodies.MAX_PROMPT_CHARS},
                        {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES, "items": _INPUT_ITEM}]},
    "instructions": _nullable({"type": "string", "maxLength": bodies.MAX_PROMPT_CHARS}),
    "max_output_tokens": _nullable(_MAX_TOKENS),
    "temperature": _nullable(_num(0, 2)), "top_p": _nullable(_num(0, 1, lo_open=True)),
    "text": _nullable(_obj({"format": _nullable(_TEXT_FORMAT), "verbosity": _JSON})),
    "tools": _nullable({"type": "array", "maxItems": structured.MAX_TOOLS, "description": CROSS_FIELD["tools"],
                        "items": _obj({"type": {"const": "function"}, "name": _TOOL_NAME, "description": _STR,
                                       "parameters": _STRUCTURED, "strict": _nullable(_BOOL)}, ["type", "name"])}),
    "tool_choice": _nullable({"oneOf": [{"enum": ["none", "auto", "required"]}, _obj({
        "type": {"const": "function"}, "name": _STR}, ["type", "name"])],
        "description": f"not 'none': needs tools; {CROSS_FIELD['tool_choice']}"}),
    "parallel_tool_calls": _nullable(_BOOL), "metadata": _METADATA,
    "store": _nullable({**_BOOL, "description": "default true"}),
    "previous_response_id": _nullable({"type": "string", "maxLength": 64,
                                       "description": "a completed stored response of this tenant (404, 409)"}),
    "background": _nullable({**_BOOL, "description": "needs store, not stream"}), "stream": _nullable(_BOOL),
    "truncation": _nullable({"const": "disabled"}), **_ONLINE_SLA}, ["input"]),
    "allOf": [
        _when(_given("tool_choice", {"not": {"const": "none"}}),
              {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
        _when(_given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
              {"properties": {"text": {"anyOf": [_NULL, {"properties": {"format": {"anyOf": [
                  _NULL, {"properties": {"type": {"const": "text"}}}]}}}]}}}),
        _when(_given("background", {"const": True}),
              {"properties": {"store": {"not": {"const": False}}, "stream": {"not": {"const": True}}}}),
        *_ONLINE_RULES]}

# ---- Anthropic Messages ---------------------------------------------------------------------------------------


def _block(kind: str, props: dict, required=()) -> dict:
    """A content block of one type: its fields; any other field may only be null."""
    return {"type": "object", "required": ["type", *required], "additionalProperties": _NULL,
            "properties": {"type": {"const": kind}, "cache_control": _JSON, **props}}


_TEXT_BLOCK = _block("text", {"text": _STR, "citations": _JSON}, ["text"])
_TEXT_BLOCKS = {"type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": _TEXT_BLOCK}
_TOOL_USE = _block("tool_use", {"id": _NON_EMPTY, "name": _STR, "input": {"type": "object",
                                                                         "additionalProperties": _JSON}},
                   ["id", "name", "input"])
_TOOL_RESULT = _block("tool_result", {"tool_use_id": _NON_EMPTY, "is_error": _JSON,
                                      "content": {"anyOf": [_STR, _TEXT_BLOCKS, _NULL]}}, ["tool_use_id"])


def _anthropic_message(role: str, block: dict) -> dict:
    return _obj({"role": {"const": role}, "content": {"anyOf": [_STR, {
        "type": "array", "maxItems": bodies.MAX_CONTENT_PARTS, "items": {"oneOf": [_TEXT_BLOCK, block]}}]}},
        ["role", "content"])


def _message_create(stream: bool) -> dict:
    props = {
        "model": _nullable(_MODEL), "max_tokens": _MAX_TOKENS,
        "messages": {"type": "array", "minItems": 1, "maxItems": bodies.MAX_MESSAGES, "items": {"oneOf": [
            _anthropic_message("user", _TOOL_RESULT), _anthropic_message("assistant", _TOOL_USE)]}},
        "system": _nullable({"anyOf": [_STR, _TEXT_BLOCKS]}),
        "stop_sequences": _nullable({"type": "array", "maxItems": bodies.MAX_STOP, "items": {
            "type": "string", "minLength": 1, "maxLength": bodies.MAX_STOP_CHARS}}),
        "temperature": _nullable(_num(0, 1)), "top_p": _nullable(_num(0, 1, lo_open=True)),
        "top_k": _nullable(_int(-1, 1 << 20)),
        "tools": _nullable({"type": "array", "maxItems": structured.MAX_TOOLS, "description": CROSS_FIELD["tools"],
                            "items": _obj({"type": {"const": "custom"}, "name": _TOOL_NAME, "description": _STR,
                                           "input_schema": _STRUCTURED, "cache_control": _JSON},
                                          ["name", "input_schema"])}),
        "tool_choice": _nullable({**_obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": _NULL_STR,
                                          "disable_parallel_tool_use": _nullable(_BOOL)}, ["type"]),
                                  "description": f"not none: needs tools; type tool: name, "
                                                 f"{CROSS_FIELD['tool_choice']}"}),
        "metadata": _nullable(_obj({"user_id": _nullable(_NAME)})),
        "service_tier": _nullable({"enum": list(anthropic_messages.ANTHROPIC_TIERS)}),
        "sla_class": _nullable({"enum": list(ONLINE_CLASSES)})}
    if stream:
        props["stream"] = _nullable(_BOOL)
    return {**_obj(props, ["model", "max_tokens", "messages"]), "allOf": [
        _when(_given("tool_choice", {"properties": {"type": {"not": {"const": "none"}}}}),
              {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
        _when(_given("tool_choice", {"properties": {"type": {"const": "tool"}}}),
              {"properties": {"tool_choice": {"required": ["name"], "properties": {"name": _STR}}}})]}


_MESSAGE_CREATE = _message_create(stream=True)

# ---- admin --------------------------------------------------------------------------------------------------

_QUOTA = {name: _nullable(_int(0, (1 << 63) - 1 if name in ("monthly_token_budget", "max_file_bytes",
                                                             "max_storage_bytes") else (1 << 31) - 1))
          for name in ("requests_per_minute", "tokens_per_minute", "max_running", "max_queued",
                       "monthly_token_budget", "max_tokens_per_request", "max_file_bytes", "max_concurrent_requests",
                       "max_files", "max_storage_bytes")}
_WEIGHT = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6}
_MODEL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}
_SOURCE = {"type": "string", "pattern": "^/", "maxLength": 1024, "description": "an absolute path"}
_TIER = {"enum": ["hot", "warm", "cold"]}
_TENSOR_PARALLEL = {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_TENSOR_PARALLEL_SIZE,
                    "description": "the ranks its engines shard it over; null: the deployment's "
                                   "(TIDEPOOL_TENSOR_PARALLEL_SIZE)"}
_KV_CACHE_DTYPE = {"enum": [*KV_CACHE_DTYPES, None], "description": "its KV cache element type; null: the "
                                                                    "deployment's (TIDEPOOL_KV_CACHE_DTYPE)"}
_CACHE_GROUP = {"type": ["string", "null"], "minLength": 1, "maxLength": 64, "pattern": "^[ -~]*$",
                "description": "tenants of one group share cached prompt prefixes"}
# Python's str.isspace() characters: a tenant name holds at least one other
_PY_SPACE = "\\t\\n\\u000b\\f\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
_RFC3339 = {"type": ["string", "null"], "format": "date-time"}
_MESSAGE_BATCH = {"type": "object", "properties": {
    "id": _STR, "type": {"const": "message_batch"}, "processing_status": {"enum": ["in_progress", "canceling", "ended"]},
    "request_counts": {"type": "object", "properties": {k: _INT for k in ("processing", "succeeded", "errored",
                                                                           "canceled", "expired")}},
    "ended_at": _RFC3339, "created_at": _RFC3339, "expires_at": _RFC3339, "archived_at": _RFC3339,
    "cancel_initiated_at": _RFC3339, "results_url": _NULL_STR}}
_LIST_FIELDS = {"object": {"const": "list"}, "data": {"type": "array"}, "first_id": _NULL_STR,
                "last_id": _NULL_STR, "has_more": _BOOL}

SCHEMAS = {
    "JsonValue": {**_JSON_VALUE, "description": "any JSON value"},
    "StructuredSchema": _STRUCTURED_SCHEMA,
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": _NULL_STR, "code": _NULL_STR}}}},
    "Status": {"type": "object", "properties": {"status": _STR, "checks": {"type": "object"}}},
    "List": {"type": "object", "required": ["object", "data"], "properties": _LIST_FIELDS},
    "Deleted": {"type": "object", "properties": {"id": _STR, "object": _STR, "deleted": _BOOL}},
    "JobCreate": _job_create(),
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
    "FileUpload": {"type": "object", "required": ["file", "purpose"], "description": "other fields are ignored; "
                   "expires_after[anchor] and expires_after[seconds] come together or not at all",
                   "anyOf": [{"required": ["expires_after[anchor]", "expires_after[seconds]"]},
                             {"not": {"anyOf": [{"required": ["expires_after[anchor]"]},
                                                {"required": ["expires_after[seconds]"]}]}}],
                   "properties": {"file": {"type": "string", "contentMediaType": "application/octet-stream",
                                           "description": "the file's bytes (JSONL for a batch)"},
                                  "purpose": {"enum": ["batch"]},
                                  "expires_after[anchor]": {"enum": ["created_at"]},
                                  "expires_after[seconds]": {"type": "integer", "minimum": 3600,
                                                             "maximum": 2592000}}},
    "File": {"type": "object", "properties": {"id": _STR, "object": {"const": "file"}, "bytes": _INT,
                                              "created_at": _INT, "filename": _STR, "purpose": _STR,
                                              "status": _STR, "status_details": {"type": "null"},
                                              "expires_at": _TS}},
    "BatchCreate": _obj({"input_file_id": {**_STR, "description": "a file of this tenant (404)"},
                         "endpoint": {"enum": [COMPLETIONS, CHAT, EMBEDDINGS, RESPONSES]},
                         "completion_window": {"const": "24h"}, "metadata": _METADATA,
                         "sla_class": {"enum": list(OFFLINE_CLASSES), "default": "batch"}},
                        ["input_file_id", "endpoint", "completion_window"]),
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
    "TenantCreate": _obj({"name": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": f"[^{_PY_SPACE}]",
                                   "description": "not only whitespace; unique (409)"},
                          "weight": _WEIGHT, "quota": _nullable({"$ref": "#/components/schemas/QuotaUpdate"}),
                          "default_sla_class": _DEFAULT_CLASS}, ["name"]),
    "TenantUpdate": _obj({"weight": _WEIGHT, "default_sla_class": _DEFAULT_CLASS, "prefix_cache_group": _CACHE_GROUP}),
    "Tenant": {"type": "object", "properties": {"id": _STR, "object": {"const": "tenant"}, "name": _STR,
                                                "weight": _NUM, "default_sla_class": _DEFAULT_CLASS,
                                                "prefix_cache_group": _CACHE_GROUP, "disabled": _BOOL,
                                                "created_at": _INT, "queued_jobs": _INT, "running_jobs": _INT,
                                                "api_key": _STR, "quota": {"$ref": "#/components/schemas/Quota"}}},
    "QuotaUpdate": _obj({
        **_QUOTA, "allowed_sla_classes": {"type": "array", "maxItems": len(SLA_CLASSES),
                                          "items": {"enum": list(SLA_CLASSES)}},
        "allowed_models": {"type": ["array", "null"], "maxItems": 1000, "items": _MODEL_NAME,
                           "description": "null or []: every enabled model"}}),
    "Quota": {"type": "object", "properties": {
        **_QUOTA, "allowed_sla_classes": {"type": "array", "items": {"enum": list(SLA_CLASSES)}},
        "allowed_models": {"type": ["array", "null"], "items": _STR}}},
    "ModelCreate": _obj({"name": {**_MODEL_NAME, "description": "unique (409)"}, "source": _SOURCE, "tier": _TIER,
                         "enabled": _BOOL, "tensor_parallel_size": _TENSOR_PARALLEL,
                         "kv_cache_dtype": _KV_CACHE_DTYPE}, ["name", "source"]),
    "ModelUpdate": _obj({"tier": _TIER, "enabled": _BOOL, "source": _SOURCE,
                         "tensor_parallel_size": _TENSOR_PARALLEL, "kv_cache_dtype": _KV_CACHE_DTYPE}),
    "ModelGrant": _obj({"model": {**_MODEL_NAME, "description": "registered or to be registered"}}, ["model"]),
    "RegisteredModel": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "source": _NULL_STR,
        "tier": _TIER, "enabled": _BOOL, "registered": _BOOL,
        "tensor_parallel_size": {"type": "integer", "minimum": 1,
                                 "description": "its own, else the deployment's (TIDEPOOL_TENSOR_PARALLEL_SIZE)"},
        "kind": {"enum": ["generate", "embed"], "description": "embed: a sentence-transformers folder or BERT"},
        "kv_cache_dtype": {"enum": list(KV_CACHE_DTYPES), "description": "its own, else the deployment's "
                                                                          "(TIDEPOOL_KV_CACHE_DTYPE)"},
        "kv_cache_dtype_in_use": {"enum": list(KV_CACHE_DTYPES), "description": "auto where its KV calibration "
                                                                                 "refused kv_cache_dtype"},
        "kv_cache_loss": {"type": ["number", "null"], "description": "the calibration's measured loss for "
                                                                     "kv_cache_dtype (null: not calibrated)"}}},
    "AdapterCreate": _obj({"name": {**_MODEL_NAME, "description": "unique among models and adapters (409)"},
                           "base_model": {**_MODEL_NAME, "description": "a registered model (404)"},
                           "source": {**_SOURCE, "description": "an absolute path to a PEFT LoRA folder (404 when "
                                                                "none is there, 400 when it does not fit the base "
                                                                "model)"},
                           "tenant_id": {**_NULL_STR, "description": "a tenant (404); null: shared"},
                           "pinned": _BOOL, "enabled": _BOOL}, ["name", "base_model", "source"]),
    "AdapterUpdate": _obj({"pinned": _BOOL, "enabled": _BOOL}),
    "Adapter": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "adapter"}, "base_model": _STR, "source": _STR, "tenant_id": _NULL_STR,
        "rank": _INT, "target_modules": {"type": "array", "items": _STR}, "pinned": _BOOL, "enabled": _BOOL,
        "created": _INT}},
    "CompletionCreate": _online(_request(COMPLETIONS, _ONLINE_SLA, stream=_nullable(_BOOL), online=True)),
    "ChatCreate": _online(_request(CHAT, _ONLINE_SLA, stream=_nullable(_BOOL), online=True)),
    "EmbeddingCreate": _online(_embedding_request(_ONLINE_SLA)),
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
        "service_tier": {"enum": list(sla_classes.TIER_CLASS)}, "previous_response_id": _NULL_STR, "store": _BOOL,
        "error": {"type": ["object", "null"]}, "incomplete_details": {"type": ["object", "null"]}}},
    "MessageCreate": _MESSAGE_CREATE,
    "Message": {"type": "object", "description": "with stream: true, text/event-stream of Messages events",
                "properties": {
        "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _NULL_STR,
        "content": {"type": "array"}, "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": _NULL_STR, "usage": {"type": "object", "properties": {"input_tokens": _INT,
                                                                               "output_tokens": _INT}}}},
    "MessageBatchCreate": _obj({"requests": {"type": "array", "minItems": 1, "maxItems": 100_000, "items": _obj({
        "custom_id": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$", "description": CROSS_FIELD["custom_id"]},
        "params": _message_create(stream=False)}, ["custom_id", "params"])}}, ["requests"]),
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
    ("get", "/v1/responses/{response_id}/input_items"): {
        "after": {**_CURSOR, "description": "an input item of this response (404)"}, "limit": _int(1, 100),
        "order": {"enum": ["asc", "desc"]}},
    ("get", "/v1/messages/batches"): {"after_id": _CURSOR, "before_id": _CURSOR, "limit": _int(1, 1000)},
}
_PATH = {"name": _MODEL_NAME}   # path parameters with a form (the others are ids: any text, 404 when unknown)
_PATH_FORM = {("delete", "/v1/admin/tenants/{tenant_id}/models/{name}")}


def _operation(method, path, summary, security, req, status, resp) -> dict:
    params = [{"name": seg[1:-1], "in": "path", "required": True,
               "schema": _PATH[seg[1:-1]] if (method, path) in _PATH_FORM and seg[1:-1] in _PATH else _STR}
              for seg in path.split("/") if seg.startswith("{")]
    params += [{"name": name, "in": "query", "required": False, "schema": schema}
               for name, schema in _QUERY.get((method, path), {}).items()]
    if path == "/v1/jobs" and method == "post":
        params.append({"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "minLength": 1, "maxLength": 255}})
    params = [{**p, "schema": _no_nul(p["schema"])} for p in params]
    codes = {**_ERROR_CODES, **_EXTRA_CODES.get(path, {})}
    content = {}
    if resp:
        content["application/json"] = {"schema": {"$ref": f"#/components/schemas/{resp}"}}
    if path in STREAMING:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["event", "data"], "description": "one server-sent event (stream: true)",
            "properties": {**STREAMING[path], "id": _STR, "retry": _INT}}}
    if path in FILE_CONTENT:
        content[FILE_CONTENT[path]] = {"schema": {"type": "string", "description": "JSON lines"}}
    ok = {str(status): {"description": "OK", **({"content": content} if content else {})}}
    for code, (text, schema) in _OTHER_SUCCESS.get((method, path), {}).items():
        ok[code] = {"description": text, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}}
    op = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '')}"
          .replace("}", "").replace(".", "_"), "parameters": params, "responses": {
              **ok, **{code: {"description": text, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/Error"}}}} for code, text in codes.items()}}}
    if security:
        op["security"] = [{security: []}]
    if req:
        ctype = "multipart/form-data" if req == "FileUpload" else "application/json"
        op["requestBody"] = {"required": True, "content": {ctype: {"schema": {"$ref": f"#/components/schemas/{req}"}}}}
    return op


_NO_NUL = "^[^\\u0000]*$"   # no string of a request may hold NUL (nor a lone surrogate, which JSON Schema cannot say)


def _no_nul(schema):
    """Every string of a request schema (values and object keys) without NUL: the ledger cannot store it."""
    if isinstance(schema, dict):
        out = {k: (v if k in ("const", "enum", "default") else _no_nul(v)) for k, v in schema.items()}
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if "string" in types and "format" not in schema:
            if "pattern" not in schema:
                out["pattern"] = _NO_NUL
            else:    # a pattern of its own (e.g. a tenant name's "not only spaces") and no NUL
                out["allOf"] = [*out.get("allOf", []), {"pattern": _NO_NUL}]
        if "object" in types and schema.get("additionalProperties") is not False:
            out["propertyNames"] = {**schema.get("propertyNames", {}), "pattern": _NO_NUL}
        return out
    if isinstance(schema, list):
        return [_no_nul(v) for v in schema]
    return schema


REQUESTS = ("JsonValue", "StructuredSchema", "JobCreate", "CompletionCreate", "ChatCreate", "EmbeddingCreate",
            "BatchCreate", "TenantCreate", "TenantUpdate", "QuotaUpdate", "ModelCreate", "ModelUpdate", "ModelGrant",
            "AdapterCreate", "AdapterUpdate", "ResponseCreate", "MessageCreate", "MessageBatchCreate")
for _name in REQUESTS:
    SCHEMAS[_name] = _no_nul(SCHEMAS[_name])
# The request bodies that name a model, and their fields the model's context or vocabulary bounds
_MODEL_BODIES = ("JobCreate", "CompletionCreate", "ChatCreate", "EmbeddingCreate", "ResponseCreate", "MessageCreate",
                 "MessageBatchCreate")
_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _replace(schema, key: str, old, new):
    """schema with every `key: old` made `key: new`."""
    if isinstance(schema, dict):
        return {k: new if k == key and v == old else _replace(v, key, old, new) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_replace(v, key, old, new) for v in schema]
    return schema


def _token_bounds(props: dict, ctx: int | None, vocab: int | None) -> dict:
    """The token fields among props, bounded: output tokens below ctx, a token-id prompt's ids below vocab and
    fewer than ctx of them."""
    out = {}
    for name, sub in props.items():
        if name in _OUTPUT_FIELDS and ctx is not None:
            out[name] = _replace(sub, "maximum", bodies.MAX_OUTPUT_TOKENS, ctx - 1)
        elif name == "prompt" and (ctx is not None or vocab is not None):
            if vocab is not None:
                sub = _replace(sub, "maximum", bodies.MAX_TOKEN_ID, vocab - 1)
            if ctx is not None:
                sub = _replace(sub, "maxItems", bodies.MAX_PROMPT_TOKEN_IDS, min(ctx - 1, bodies.MAX_PROMPT_TOKEN_IDS))
            out[name] = sub
    return out


def _per_model(schema, model: dict, limits: dict, default: str | None):
    """Every body (an object with a `model` property) in schema: `model` one of the served names, its token fields
    bounded by the model's limits (directly when every generating model has the same, else by `model`)."""
    if isinstance(schema, list):
        return [_per_model(v, model, limits, default) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k == "properties" else _per_model(v, model, limits, default) for k, v in schema.items()}
    props = schema.get("properties")
    if not (isinstance(props, dict) and isinstance(props.get("model"), dict)):
        if isinstance(props, dict):
            out["properties"] = {p: _per_model(s, model, limits, default) for p, s in props.items()}
        return out
    props = {p: model if p == "model" else _per_model(s, model, limits, default) for p, s in props.items()}
    if len(set(limits.values())) == 1:
        props.update(_token_bounds(props, *next(iter(limits.values()))))
    else:
        for name, (ctx, vocab) in limits.items():
            named = {"required": ["model"], "properties": {"model": {"const": name}}}
            bounds = _token_bounds(props, ctx, vocab)
            if bounds:
                out["allOf"] = [*out.get("allOf", []), _when(
                    {"anyOf": [named, _absent_or_null("model")]} if name == default else named,
                    {"properties": bounds})]
    out["properties"] = props
    return out


def _served_models(schemas: dict) -> dict:
    """In an app serving models: `model`, where a body names one, is one of the enabled registry names (null or
    absent: the default model), and the token fields are bounded by the model's context and vocabulary."""
    from flask import has_app_context

    from .app import services
    if not has_app_context():
        return schemas
    registry = services().registry
    entries = [e for e in registry.entries().values() if e.enabled]
    if not entries:
        return schemas
    model = {"anyOf": [*({"const": e.name} for e in entries), _NULL], "description": _MODEL["description"]}
    limits = {e.name: (registry.context_len(e), registry.vocab_size(e)) for e in entries
              if registry.kind(e) == "generate"}
    return {**schemas, **{name: _per_model(schemas[name], model, limits, registry.default_name)
                          for name in _MODEL_BODIES}}


def spec() -> dict:
    paths: dict = {}
    for route in ROUTES:
        paths.setdefault(route[1], {})[route[0]] = _operation(*route)
    return {"openapi": "3.1.0", "info": {"title": "Tidepool", "version": "0.1.0"}, "paths": paths,
            "components": {"schemas": _served_models(SCHEMAS), "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "Tenant API key (on /v1/messages "
                                                                              "also as the x-api-key header)"},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "TIDEPOOL_ADMIN_TOKEN"}}}}
