"""OpenAI's Responses API as a shape over chat completions: a request becomes a chat body (checked by
service/protocol/request_bodies.py, so the grammar and tool-call paths are the chat ones), a job's result becomes a
response object with `message` and `function_call` output items. Flask- and torch-free: the online API
(service/api/responses.py), batch result files and `tidepool run-batch` share it."""
import re
from dataclasses import dataclass, field

from . import request_bodies as bodies, structured_output as structured
from .errors import APIError, bad_request

# The request's own fields; `stream`, `background`, `store`, `previous_response_id`, `service_tier` and
# `sla_class` are the API's (service/api/responses.py), the rest shape the chat body.
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
          "tool_choice", "parallel_tool_calls", "metadata", "user", "safety_identifier", "truncation", "store",
          "previous_response_id", "background", "stream", "service_tier", "sla_class"}
BATCH_FIELDS = FIELDS - {"previous_response_id", "background", "stream", "store"}
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice",
          "parallel_tool_calls", "metadata", "user", "truncation")
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")


@dataclass
class Parsed:
    """A checked Responses request: its input as items with ids, the chat messages they make (and, per message,
    the request field it came from, for error messages), the parameters the response echoes."""
    body: dict
    items: list[dict]
    messages: list[dict]
    origin: list[str]
    params: dict = field(default_factory=dict)


def suffix(any_id: str) -> str:
    return any_id.split("_", 1)[1]


def response_id(job_id: str) -> str:
    """A response's id names its job: resp_<x> runs as job_<x>."""
    return f"resp_{suffix(job_id)}"


def _str(body: dict, name: str, limit: int | None = None) -> None:
    v = body.get(name)
    if v is not None and (not isinstance(v, str) or (limit is not None and len(v) > limit)):
        raise bad_request(f"'{name}' must be a string" + (f" of at most {limit} characters." if limit else "."), name)


def _bool(body: dict, name: str) -> None:
    if not isinstance(body.get(name), (bool, type(None))):
        raise bad_request(f"'{name}' must be a boolean.", name)


def _text(content, where: str, role: str | None) -> list[dict]:
    """A message's content (a string, or a list of input_text / output_text parts) as parts."""
    if isinstance(content, str):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    if not isinstance(content, list) or len(content) > bodies.MAX_CONTENT_PARTS:
        raise bad_request(f"'{where}' must be a string or a list of at most {bodies.MAX_CONTENT_PARTS} "
                          "input_text parts.", where)
    parts = []
    for j, p in enumerate(content):
        w = f"{where}[{j}]"
        if not isinstance(p, dict):
            raise bad_request(f"'{w}' must be an object.", w)
        if p.get("type") not in TEXT_PARTS:
            raise bad_request(f"'{w}.type' {p.get('type')!r} is not supported; content parts must be "
                              f"{list(TEXT_PARTS)} (no images or files).", f"{w}.type", "unsupported_value")
        if not isinstance(p.get("text"), str):
            raise bad_request(f"'{w}.text' must be a string.", f"{w}.text")
        parts.append({"type": p["type"], "text": p["text"]})
    return parts


def items(value, new_id) -> list[dict]:
    """`input` (a string or a list of items) as items with ids (new_id(prefix) makes one)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a non-empty string or a non-empty list of input items.", "input")
    if len(value) > bodies.MAX_MESSAGES:
        raise bad_request(f"'input' has {len(value)} items; at most {bodies.MAX_MESSAGES} are allowed.", "input",
                          "array_above_max_length")
    out = []
    for i, it in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(f"'{where}' must be an object.", where)
        kind = it.get("type", "message" if "role" in it else None)
        given = it.get("id")
        if given is not None and (not isinstance(given, str) or len(given) > 64):
            raise bad_request(f"'{where}.id' must be a string of at most 64 characters.", f"{where}.id")
        if kind == "message":
            extra = sorted(set(it) - {"type", "role", "content", "id", "status"})
            if extra:
                raise bad_request(f"'{where}' has unsupported field '{extra[0]}'.", f"{where}.{extra[0]}")
            if it.get("role") not in ROLES:
                raise bad_request(f"'{where}.role' must be one of {list(ROLES)}.", f"{where}.role")
            out.append({"id": given or new_id("msg_"), "type": "message", "role": it["role"],
                        "content": _text(it.get("content"), f"{where}.content", it["role"]), "status": "completed"})
        elif kind == "function_call":
            extra = sorted(set(it) - {"type", "call_id", "name", "arguments", "id", "status"})
            if extra:
                raise bad_request(f"'{where}' has unsupported field '{extra[0]}'.", f"{where}.{extra[0]}")
            for name in ("call_id", "name", "arguments"):
                if not isinstance(it.get(name), str) or not it[name]:
                    raise bad_request(f"'{where}.{name}' must be a non-empty string.", f"{where}.{name}")
            out.append({"id": given or new_id("fc_"), "type": "function_call", "call_id": it["call_id"],
                        "name": it["name"], "arguments": it["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            extra = sorted(set(it) - {"type", "call_id", "output", "id", "status"})
            if extra:
                raise bad_request(f"'{where}' has unsupported field '{extra[0]}'.", f"{where}.{extra[0]}")
            if not isinstance(it.get("call_id"), str) or not it["call_id"]:
                raise bad_request(f"'{where}.call_id' must be a non-empty string.", f"{where}.call_id")
            output = it.get("output")
            if not isinstance(output, str):
                output = "".join(p["text"] for p in _text(output, f"{where}.output", None))
            out.append({"id": given or new_id("fco_"), "type": "function_call_output", "call_id": it["call_id"],
                        "output": output, "status": "completed"})
        else:
            raise bad_request(f"'{where}.type' {kind!r} is not supported; input items must be 'message', "
                              "'function_call' or 'function_call_output'.", f"{where}.type", "unsupported_value")
    return out


def messages(its: list[dict], where: str = "input") -> tuple[list[dict], list[str]]:
    """Items as chat messages (consecutive function calls make one assistant message with tool_calls), and the
    request field each message came from."""
    msgs, origin = [], []
    for i, it in enumerate(its):
        if it["type"] == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            msgs.append({"role": role, "content": "".join(p["text"] for p in it["content"])})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1].get("tool_calls") and origin[-1].startswith(where):
                msgs[-1]["tool_calls"].append(call)
                continue
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        origin.append(f"{where}[{i}]")
    return msgs, origin


def _format(text) -> dict | None:
    """`text.format` -> the chat body's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("'text' must be an object with 'format'.", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format.type' must be one of 'text', 'json_object', 'json_schema'.",
                          "text.format.type")
    if fmt["type"] != "json_schema":
        if set(fmt) != {"type"}:
            raise bad_request(f"'text.format' has unsupported field '{sorted(set(fmt) - {'type'})[0]}'.",
                              "text.format")
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools.", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"'tools[{i}].type' must be 'function' (built-in tools are not supported).",
                              f"tools[{i}].type", "unsupported_value")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out or None


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
                              "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def parse(body: dict, new_id, fields=FIELDS) -> Parsed:
    """400 naming the field for anything the chat body cannot say; the chat body is checked later (check())."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    if "input" not in body:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    for name in ("store", "background", "stream", "parallel_tool_calls"):
        _bool(body, name)
    _str(body, "instructions", bodies.MAX_PROMPT_CHARS)
    _str(body, "previous_response_id", 64)
    _str(body, "safety_identifier", bodies.MAX_NAME_CHARS)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled' (input is never truncated here).", "truncation",
                          "unsupported_value")
    bodies.check_metadata(body.get("metadata"))
    its = items(body["input"], new_id)
    msgs, origin = messages(its)
    chat = {"model": body.get("model"), "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "response_format": _format(body.get("text")), "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"), "user": body.get("user")}
    chat = {k: v for k, v in chat.items() if v is not None}
    params = {k: body.get(k) for k in ECHOED}
    return Parsed(chat, its, msgs, origin, params)


def chat_body(p: Parsed, history: list[dict] | None = None) -> tuple[dict, list[str]]:
    """(the chat body to check: instructions, the conversation so far, this input; each message's origin)."""
    head, origin = [], []
    if p.params.get("instructions"):
        head, origin = [{"role": "system", "content": p.params["instructions"]}], ["instructions"]
    history = history or []
    return ({**p.body, "messages": head + history + p.messages},
            origin + ["previous_response_id"] * len(history) + p.origin)


_RENAMES = [(re.compile(r"^response_format\.json_schema"), "text.format"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.function"), "tool_choice"),
            (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^messages$"), "input")]


def renamed(exc: APIError, origin: list[str]) -> APIError:
    """A chat-body error as the Responses request's field."""
    param = exc.param
    if not param:
        return exc
    m = re.match(r"^messages\[(\d+)\]", param)
    if m:
        new = origin[int(m.group(1))] if int(m.group(1)) < len(origin) else "input"
        if new.startswith("input["):    # the item's field keeps its name
            exc.message, exc.param = exc.message.replace(f"'{m.group(0)}", f"'{new}"), new + param[m.end():]
        else:                           # instructions, or a message of the stored conversation
            exc.message, exc.param = exc.message.replace(f"'{param}'", f"'{new}'"), new
        return exc
    for pattern, repl in _RENAMES:
        new_param = pattern.sub(repl, param)
        if new_param != param:
            exc.message, exc.param = exc.message.replace(f"'{param}'", f"'{new_param}'"), new_param
            break
    return exc


def check(p: Parsed, history, check_chat) -> bodies.Checked:
    """The chat body checked by check_chat(body) (service.protocol.request_bodies.check with the caller's limits), its
    errors named as the Responses fields."""
    body, origin = chat_body(p, history)
    try:
        return check_chat(body)
    except APIError as exc:
        raise renamed(exc, origin) from None


def history(stored_messages: list[dict], had_instructions: bool, output_message: dict) -> list[dict]:
    """The conversation a response continues: its own chat messages without its instructions, then its output."""
    msgs = stored_messages[1:] if had_instructions else list(stored_messages)
    out = {k: v for k, v in output_message.items() if v is not None or k == "content"}
    return msgs + [out]


# ---- rendering -------------------------------------------------------------------------------------------

def usage(prompt_tokens, completion_tokens) -> dict:
    p, c = prompt_tokens or 0, completion_tokens or 0
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def message_item(resp_id: str, text: str, status: str = "completed") -> dict:
    return {"id": f"msg_{suffix(resp_id)}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def output_items(resp_id: str, chat: dict, text: str, finish_reason: str | None) -> list[dict]:
    """A finished job's text as output items: the message (if any text), then each function call."""
    content, calls = structured.parse(chat, text, resp_id) if structured.uses_tools(chat) else (text, [])
    out = []
    if content is not None and (content or not calls):
        out.append(message_item(resp_id, content, "incomplete" if finish_reason == "length" else "completed"))
    for i, call in enumerate(calls):
        out.append({"id": f"fc_{suffix(resp_id)}_{i}", "type": "function_call", "status": "completed",
                    "call_id": call["id"], "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"]})
    return out


STATUS = {"queued": "queued", "running": "in_progress", "completed": "completed", "failed": "failed",
          "cancelled": "cancelled", "expired": "failed"}


def render(resp_id: str, job, params: dict, *, model: str | None, created_at: int, service_tier: str | None,
           background: bool = False, store: bool = True, previous_response_id: str | None = None,
           status: str | None = None) -> dict:
    """The response object of a job (anything with status, request, output, finish_reason, prompt_tokens,
    completion_tokens, error); `status` overrides the job's (a stream's response.created)."""
    job_status = getattr(job.status, "value", job.status)
    status = status or STATUS[job_status]
    output, error, incomplete, used = [], None, None, None
    if status == "completed":
        output = output_items(resp_id, job.request, job.output or "", job.finish_reason)
        used = usage(job.prompt_tokens, job.completion_tokens)
        if job.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    elif status == "failed":
        err = job.error or {}
        code = "invalid_prompt" if err.get("code") in ("invalid_prompt", "context_length_exceeded") else "server_error"
        error = {"code": code, "message": err.get("message") or
                 ("The request expired before it ran." if job_status == "expired" else "The request failed.")}
    return {"id": resp_id, "object": "response", "created_at": created_at, "status": status,
            "background": background, "error": error, "incomplete_details": incomplete,
            "instructions": params.get("instructions"), "max_output_tokens": params.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": params.get("parallel_tool_calls") is not False,
            "previous_response_id": previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": service_tier, "store": store,
            "temperature": params.get("temperature") if params.get("temperature") is not None else 1.0,
            "text": params.get("text") or {"format": {"type": "text"}},
            "tool_choice": params.get("tool_choice") or "auto", "tools": params.get("tools") or [],
            "top_p": params.get("top_p") if params.get("top_p") is not None else 1.0,
            "truncation": params.get("truncation") or "disabled", "usage": used, "user": params.get("user"),
            "metadata": params.get("metadata") or {}}
