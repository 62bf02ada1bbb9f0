"""Anthropic's Messages API as a shape over chat completions: a request becomes a chat body (checked by
service/protocol/request_bodies.py: the grammar and tool-call paths are the chat ones), a job's result becomes a
message with text and tool_use blocks. Flask- and torch-free: the online API (service/api/anthropic.py) and message
batches share it."""
import json
import re

from . import request_bodies as bodies, structured_output as structured
from .errors import APIError, bad_request
from .sla_classes import ONLINE_CLASSES

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
          "tool_choice", "metadata", "stream", "service_tier", "sla_class"}
BATCH_FIELDS = FIELDS - {"stream"}
# Anthropic's own service_tier values; neither changes the class (service_tier here is OpenAI's, see sla_classes.py).
ANTHROPIC_TIERS = ("auto", "standard_only")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message_id(job_id: str) -> str:
    return f"msg_{job_id.split('_', 1)[1]}"


# The fields of each content block type (besides `type`); any other field may only be null
BLOCK_FIELDS = {"text": {"text", "cache_control", "citations"},
                "tool_use": {"id", "name", "input", "cache_control"},
                "tool_result": {"tool_use_id", "content", "is_error", "cache_control"}}
# The block types each place takes: tool results come from the user, tool calls from the assistant
BLOCK_TYPES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use"), "system": ("text",),
               "tool": ("text",)}


def _blocks(content, where: str, role: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or len(content) > bodies.MAX_CONTENT_PARTS:
        raise bad_request(f"{where}: must be a string or a list of at most {bodies.MAX_CONTENT_PARTS} content "
                          "blocks.", where)
    allowed = BLOCK_TYPES[role]
    out = []
    for j, b in enumerate(content):
        w = f"{where}.{j}"
        if not isinstance(b, dict) or b.get("type") not in allowed:
            kind = b.get("type") if isinstance(b, dict) else None
            place = "system" if role == "system" else "tool_result's content" if role == "tool" else f"{role} message"
            raise bad_request(f"{w}.type: {kind!r} is not supported in a {place}; use {list(allowed)} "
                              "(no images, documents or thinking).", f"{w}.type", "unsupported_value")
        extra = sorted(k for k in set(b) - BLOCK_FIELDS[b["type"]] - {"type"} if b[k] is not None)
        if extra:
            raise bad_request(f"{w}.{extra[0]}: Extra inputs are not permitted", f"{w}.{extra[0]}")
        if b["type"] == "text" and not isinstance(b.get("text"), str):
            raise bad_request(f"{w}.text: Field required (a string)", f"{w}.text")
        if b["type"] == "tool_use" and not (isinstance(b.get("id"), str) and b["id"] and isinstance(b.get("name"), str)
                                            and isinstance(b.get("input"), dict)):
            raise bad_request(f"{w}: a tool_use block needs 'id', 'name' and an object 'input'.", w)
        if b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise bad_request(f"{w}.tool_use_id: Field required", f"{w}.tool_use_id")
            c = b.get("content")
            if c is None:
                c = ""
            elif not isinstance(c, str):
                c = "".join(p["text"] for p in _blocks(c, f"{w}.content", "tool"))
            b = {**b, "content": c}
        out.append(b)
    return out


def _messages(messages, system) -> tuple[list[dict], list[str]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list.", "messages")
    if len(messages) > bodies.MAX_MESSAGES:
        raise bad_request(f"messages: at most {bodies.MAX_MESSAGES} messages are allowed.", "messages",
                          "array_above_max_length")
    out, origin = [], []
    if system is not None:
        text = system if isinstance(system, str) else "".join(
            b["text"] for b in _blocks(system, "system", "system"))
        if text:
            out.append({"role": "system", "content": text})
            origin.append("system")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: must be an object.", where)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad_request(f"{where}.{extra[0]}: Extra inputs are not permitted", f"{where}.{extra[0]}")
        if m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'.", f"{where}.role")
        if "content" not in m:
            raise bad_request(f"{where}.content: Field required", f"{where}.content")
        blocks = _blocks(m["content"], f"{where}.content", m["role"])
        before = len(out)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if m["role"] == "assistant":
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                     for b in blocks if b["type"] == "tool_use"]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
                       if calls else {"role": "assistant", "content": text})
        else:
            out += [{"role": "tool", "tool_call_id": b["tool_use_id"], "content": b["content"]}
                    for b in blocks if b["type"] == "tool_result"]
            if text or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
        origin += [where] * (len(out) - before)
    return out, origin


def _tools(tools):
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list.", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise bad_request(f"tools.{i}.type: only custom tools (name, description, input_schema) are supported.",
                              f"tools.{i}.type", "unsupported_value")
        extra = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control"})
        if extra:
            raise bad_request(f"tools.{i}.{extra[0]}: Extra inputs are not permitted", f"tools.{i}.{extra[0]}")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools.{i}.input_schema: Field required (a JSON Schema object)",
                              f"tools.{i}.input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice, has_tools: bool):
    """-> (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kinds = ("auto", "any", "tool", "none")
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise bad_request(f"tool_choice.type: must be one of {list(kinds)}.", "tool_choice.type")
    extra = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise bad_request(f"tool_choice.{extra[0]}: Extra inputs are not permitted", f"tool_choice.{extra[0]}")
    if not isinstance(choice.get("disable_parallel_tool_use"), (bool, type(None))):
        raise bad_request("tool_choice.disable_parallel_tool_use: must be a boolean.",
                          "tool_choice.disable_parallel_tool_use")
    if choice.get("name") is not None and not isinstance(choice["name"], str):
        raise bad_request("tool_choice.name: must be a string.", "tool_choice.name")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: Field required", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if choice["type"] != "none" and not has_tools:
        raise bad_request("tool_choice: needs 'tools'.", "tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[choice["type"]], parallel


def to_chat(body, fields=FIELDS) -> tuple[dict, list[str]]:
    """A Messages request -> (the chat body, not yet checked: check() does that; the field each chat message came
    from). 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_body")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"{unknown[0]}: Extra inputs are not permitted", unknown[0], "unknown_parameter")
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            raise bad_request(f"{name}: Field required", name, "missing_required_parameter")
    if body["max_tokens"] is None:
        raise bad_request("max_tokens: must be an integer", "max_tokens")
    if body.get("service_tier") is not None and body["service_tier"] not in ANTHROPIC_TIERS:
        raise bad_request(f"service_tier: must be one of {list(ANTHROPIC_TIERS)}.", "service_tier")
    if body.get("sla_class") is not None and body["sla_class"] not in ONLINE_CLASSES:
        raise bad_request(f"sla_class: must be one of {list(ONLINE_CLASSES)}.", "sla_class")
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1):
        raise bad_request(f"temperature: must be a number in [0, 1], got {t!r}.", "temperature")
    if body.get("stop_sequences") is not None and not isinstance(body["stop_sequences"], list):
        raise bad_request("stop_sequences: must be a list of strings.", "stop_sequences")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or set(meta) - {"user_id"}
                             or not isinstance(meta.get("user_id", ""), (str, type(None)))):
        raise bad_request("metadata: only 'user_id' (a string) is supported.", "metadata")
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), bool(tools))
    msgs, origin = _messages(body["messages"], body.get("system"))
    chat = {"model": body["model"], "max_tokens": body["max_tokens"], "messages": msgs,
            "stop": body.get("stop_sequences") or None, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "top_k": body.get("top_k"), "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel, "user": (meta or {}).get("user_id")}
    return {k: v for k, v in chat.items() if v is not None}, origin


_RENAMES = [(re.compile(r"^stop$"), "stop_sequences"), (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\.?"), r"tools.\1."), (re.compile(r"^tool_choice\.function\."),
                                                                         "tool_choice.")]


def check(body: dict, origin: list[str], check_chat) -> bodies.Checked:
    """The chat body checked by check_chat(body), its errors named as the Messages fields."""
    try:
        return check_chat(body)
    except APIError as exc:
        m = re.match(r"^messages\[(\d+)\]", exc.param or "")
        if m:
            new = origin[int(m.group(1))] if int(m.group(1)) < len(origin) else "messages"
            exc.message = f"{new}: " + exc.message.replace(f"'{exc.param}'", f"'{new}'")
            exc.param = new
        elif exc.param:
            new = exc.param
            for pattern, repl in _RENAMES:
                new = pattern.sub(repl, new).rstrip(".")
            if new != exc.param:
                exc.message = f"{new}: " + exc.message.replace(f"'{exc.param}'", f"'{new}'")
                exc.param = new
        raise exc from None


def content(chat: dict, text: str, finish_reason: str | None, msg_id: str) -> tuple[list[dict], str | None]:
    """(content blocks, stop_reason) of a finished job's text."""
    if structured.uses_tools(chat):
        body_text, calls = structured.parse(chat, text, msg_id)
    else:
        body_text, calls = text, []
    blocks = [{"type": "text", "text": body_text}] if body_text or not calls else []
    for call in calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
    return blocks, STOP_REASONS.get(reason, "end_turn")


def message(msg_id: str, model: str | None, job) -> dict:
    """The message of a completed job (anything with request, output, finish_reason, prompt_tokens,
    completion_tokens)."""
    blocks, reason = content(job.request, job.output or "", job.finish_reason, msg_id)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens or 0, "output_tokens": job.completion_tokens or 0}}
