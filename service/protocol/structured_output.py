"""Structured output and tool calls, the parts the API and the workers share:
checking `response_format`, `tools`, `tool_choice` and tool messages; the grammar a request needs
(`grammar`, the engine's structured-output fields); the tools' prompt; and the model's text back
into `content` + `tool_calls`, whole or streamed. No torch, no workers: both sides import it."""
import json
import re

from .errors import bad_request

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 1 << 16
MAX_SCHEMA_DEPTH = 32
# A pattern's repetition bounds ({n}, {n,}, {n,m}) are what its grammar's compile time grows with (in the worker:
# .{0,500} takes 0.2 s, (.{0,20}){0,25} nine minutes), so they are bounded: each, all of a schema's together, and
# never nested with another repetition. Lengths and item counts (maxLength, maxItems) cost the compiler nothing.
MAX_PATTERN_REPEAT = 500
MAX_SCHEMA_REPEAT = 2000
_BOUND = re.compile(r"\{(\d+)(,(\d*))?\}")
# JSON Schema keywords the grammar enforces (xgrammar); the rest are annotations it may ignore safely.
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
            "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties", "maxProperties"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
               "writeOnly", "strict", "nullable"}
FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer"}       # the string formats the grammar enforces
NAMED_SCHEMAS = {"properties", "$defs", "definitions"}      # keyword -> {name: schema}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_PROMPT = ("You may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
               "\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}}\n</tool_call>")


def pattern_bounds(pattern: str) -> list[int]:
    """The repetition bounds of a regex (the larger number of each {n,m}; n + 1 for {n,}). ValueError when a
    bound repeats a group that repeats itself, or a group holding a bound repeats (nested repetition)."""
    bounds: list[int] = []
    frames = [[False, False]]           # per open group: holds a repetition, holds a bound
    last = None                         # the atom a quantifier would repeat: None, or a closed group's flags
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, (False, False)
            continue
        if c == "[":                    # a character class, to its closing bracket
            j = i + 2 if pattern[i + 1:i + 2] == "]" else i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, (False, False)
            continue
        if c == "(":
            frames.append([False, False])
            i, last = i + 1, None
            continue
        if c == ")" and len(frames) > 1:
            inner = frames.pop()
            frames[-1][0] |= inner[0]
            frames[-1][1] |= inner[1]
            i, last = i + 1, tuple(inner)
            continue
        bound = _BOUND.match(pattern, i) if c == "{" else None
        if bound is not None or c in "*+?":
            if last is None:            # a lazy modifier (*?, +?) or nothing to repeat
                i += 1
                continue
            if bound is not None:
                n, m = int(bound.group(1)), bound.group(3)
                bounds.append(n + 1 if bound.group(2) and not m else max(n, int(m or n)))
                if last[0]:
                    raise ValueError("a repetition bound {n,m} cannot repeat a group that itself repeats")
                frames[-1][1] = True
                i = bound.end()
            else:
                if last[1]:
                    raise ValueError("a group holding a repetition bound {n,m} cannot repeat")
                i += 1
            frames[-1][0] = True
            last = None
            continue
        i, last = i + 1, (False, False) if c != "|" else None
    return bounds


def _check_pattern(pattern: str, where: str, repeats: list[int]) -> None:
    why = None
    try:
        bounds = pattern_bounds(pattern)
    except ValueError as exc:
        why = f"{exc} (write the repetition out, or use * or +)"
    else:
        repeats[0] += sum(bounds)
        if bounds and max(bounds) > MAX_PATTERN_REPEAT:
            why = f"a repetition bound may be at most {MAX_PATTERN_REPEAT} (use maxLength to bound a string's length)"
        elif repeats[0] > MAX_SCHEMA_REPEAT:
            why = f"the repetition bounds of a schema's patterns may add up to at most {MAX_SCHEMA_REPEAT}"
    if why is not None:
        raise bad_request(f"'{where}' is too costly to turn into a grammar: {why}.", where, "schema_too_complex")


def check_schema(schema, param: str, depth: int = 0, repeats: list[int] | None = None) -> None:
    """A 400 naming the place of any keyword the grammar cannot enforce (it would be silently ignored), or of a
    pattern too costly to compile (its repetition bounds; `repeats` adds up those of the whole schema)."""
    repeats = [0] if repeats is None else repeats
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels.", param)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON Schema object.", param)
    for key, value in schema.items():
        where = f"{param}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            hint = " (use anyOf)" if key == "oneOf" else ""
            raise bad_request(f"'{where}': the JSON Schema keyword '{key}' is not supported for structured output"
                              f"{hint}; supported: {sorted(ENFORCED)}.", where, "unsupported_schema")
        if key in NAMED_SCHEMAS:
            if not isinstance(value, dict):
                raise bad_request(f"'{where}' must be an object of schemas.", where)
            for name, sub in value.items():
                check_schema(sub, f"{where}.{name}", depth + 1, repeats)
        elif key in ("items", "additionalProperties"):
            check_schema(value, where, depth + 1, repeats)
        elif key in ("anyOf", "prefixItems"):
            if not isinstance(value, list) or not value:
                raise bad_request(f"'{where}' must be a non-empty list of schemas.", where)
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}[{i}]", depth + 1, repeats)
        elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise bad_request(f"'{where}' must be a list of property names.", where)
        elif key == "enum" and not (isinstance(value, list) and value):
            raise bad_request(f"'{where}' must be a non-empty list.", where)
        elif key in ("pattern", "format", "$ref") and not isinstance(value, str):
            raise bad_request(f"'{where}' must be a string.", where)
        elif key == "format" and value not in FORMATS:
            raise bad_request(f"'{where}': the string format '{value}' is not supported for structured output; "
                              f"supported: {sorted(FORMATS)}.", where, "unsupported_schema")
        elif key == "pattern":
            _check_pattern(value, where, repeats)


def _sized_schema(schema, param: str) -> None:
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise bad_request(f"'{param}' is larger than {MAX_SCHEMA_CHARS} characters of JSON.", param,
                          "string_above_max_length")
    check_schema(schema, param)


def _check_response_format(rf) -> None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'response_format.type' must be one of 'text', 'json_object', 'json_schema'.",
                          "response_format.type")
    allowed = {"type", "json_schema"} if rf["type"] == "json_schema" else {"type"}
    extra = sorted(set(rf) - allowed)
    if extra:
        raise bad_request(f"'response_format' has unsupported field '{extra[0]}'.", f"response_format.{extra[0]}")
    if rf["type"] != "json_schema":
        return
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("'response_format.json_schema' is required: {name, schema, strict}.",
                          "response_format.json_schema")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad_request(f"'response_format.json_schema' has unsupported field '{extra[0]}'.",
                          f"response_format.json_schema.{extra[0]}")
    if not isinstance(js.get("name"), str) or not TOOL_NAME.fullmatch(js["name"]):
        raise bad_request("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'.",
                          "response_format.json_schema.name")
    if not isinstance(js.get("strict"), (bool, type(None))):
        raise bad_request("'response_format.json_schema.strict' must be a boolean.", "response_format.json_schema.strict")
    if "description" in js and not isinstance(js["description"], str):
        raise bad_request("'response_format.json_schema.description' must be a string.",
                          "response_format.json_schema.description")
    if not isinstance(js.get("schema"), dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON Schema object.",
                          "response_format.json_schema.schema")
    _sized_schema(js["schema"], "response_format.json_schema.schema")


def _check_tools(tools) -> set[str]:
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a non-empty list of at most {MAX_TOOLS} functions.", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"'{where}.function' must be an object.", f"{where}.function")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise bad_request(f"'{where}.function' has unsupported field '{extra[0]}'.", f"{where}.function.{extra[0]}")
        if not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'.",
                              f"{where}.function.name")
        if fn["name"] in names:
            raise bad_request(f"'{where}.function.name' repeats '{fn['name']}'.", f"{where}.function.name")
        names.add(fn["name"])
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string.", f"{where}.function.description")
        if not isinstance(fn.get("strict"), (bool, type(None))):
            raise bad_request(f"'{where}.function.strict' must be a boolean.", f"{where}.function.strict")
        if "parameters" in fn:
            if not isinstance(fn["parameters"], dict):
                raise bad_request(f"'{where}.function.parameters' must be a JSON Schema object.",
                                  f"{where}.function.parameters")
            _sized_schema(fn["parameters"], f"{where}.function.parameters")
    return names


def check(body: dict, estimate=lambda text: len(text.encode())) -> int:
    """400 for a bad response_format / tools / tool_choice / parallel_tool_calls; returns the prompt tokens
    the tools add (estimate(text): the tokens of the tools' JSON as the prompt shows it)."""
    if body.get("response_format") is not None:
        _check_response_format(body["response_format"])
    names = _check_tools(body["tools"]) if body.get("tools") is not None else set()
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or set(fn) != {"name"} \
                    or set(choice) != {"type", "function"} or not isinstance(fn["name"], str):
                raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
            if fn["name"] not in names:
                raise bad_request(f"'tool_choice.function.name' names '{fn['name']}', which is not in 'tools'.",
                                  "tool_choice.function.name")
        elif choice not in ("none", "auto", "required"):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
        elif choice != "none" and not names:
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice")
    if not isinstance(body.get("parallel_tool_calls"), (bool, type(None))):
        raise bad_request("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    if forced_tools(body) and (body.get("response_format") or {}).get("type", "text") != "text":
        raise bad_request("'response_format' cannot constrain the output while 'tool_choice' forces a tool call.",
                          "response_format")
    return estimate(json.dumps(body["tools"], ensure_ascii=False)) if names else 0


def check_message(m: dict, where: str) -> None:
    """The tool fields of one chat message: assistant `tool_calls`, tool `tool_call_id`."""
    if "tool_calls" in m:
        calls = m["tool_calls"]
        if m.get("role") != "assistant" or not isinstance(calls, list) or not calls:
            raise bad_request(f"'{where}.tool_calls' must be a non-empty list on an assistant message.",
                              f"{where}.tool_calls")
        for j, call in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or call.get("type", "function") != "function" \
                    or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), str) or set(call) - {"id", "type", "function"} \
                    or set(fn) - {"name", "arguments"}:
                raise bad_request(f"'{w}' must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.", w)
    if m.get("role") == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"'{where}.tool_call_id' is required on a tool message.", f"{where}.tool_call_id")
    elif "tool_call_id" in m:
        raise bad_request(f"'{where}.tool_call_id' belongs on a tool message.", f"{where}.tool_call_id")


def forced_tools(body: dict) -> list[dict]:
    """The functions one of which the output must call (tool_choice 'required' or named); [] when none is forced."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if choice == "required":
        return [t["function"] for t in tools]
    if isinstance(choice, dict):
        return [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
    return []


def uses_tools(body: dict) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def grammar(body: dict) -> dict | None:
    """The engine's structured-output fields (workers.engine.sampling_params.StructuredOutput) for a checked body."""
    forced = forced_tools(body)
    if forced:
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": fn["name"]},
                                 "arguments": fn.get("parameters") or {"type": "object"}}} for fn in forced]
        return {"json_schema": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_object":
        return {"json_object": True}
    if rf.get("type") == "json_schema":
        return {"json_schema": rf["json_schema"]["schema"]}
    return None


def tool_prompt(tools: list[dict]) -> str:
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict) -> str:
    """An assistant message's tool call as the model writes it. `arguments` is the model's text, JSON or not (a
    model does not always write valid JSON, and a client sends its calls back as they came): JSON is written as
    the object it is, anything else as the string."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = fn["arguments"]
    return f"{CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args})}\n{CALL_CLOSE}"


def _call(request_id: str, i: int, obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{request_id}_{i}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse(body: dict, text: str, request_id: str) -> tuple[str | None, list[dict]]:
    """The model's text -> (content, tool_calls). A forced call's output is the call's JSON; otherwise calls
    are the well-formed <tool_call> blocks, and a block that does not parse stays in the content."""
    if forced_tools(body):
        try:
            call = _call(request_id, 0, json.loads(text))
        except ValueError:
            call = None
        return (None, [call]) if call else (text, [])
    content, calls, at = [], [], 0
    while True:
        start = text.find(CALL_OPEN, at)
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start != -1 else -1
        if end == -1:
            content.append(text[at:])
            break
        try:
            call = _call(request_id, len(calls), json.loads(text[start + len(CALL_OPEN):end]))
        except ValueError:
            call = None
        content.append(text[at:start] if call else text[at:end + len(CALL_CLOSE)])
        if call:
            calls.append(call)
        at = end + len(CALL_CLOSE)
    rest = "".join(content)
    return (rest.strip() or None) if calls else rest, calls


def message(body: dict, text: str, finish_reason: str | None, request_id: str) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a chat completion."""
    if not uses_tools(body):
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse(body, text, request_id)
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, \
        "tool_calls" if finish_reason == "stop" else finish_reason


class StreamSplitter:
    """Streamed text -> content deltas to send now; tool calls come whole at the end (finish). Text that
    could be the start of a <tool_call> block is held back until it is known not to be one."""

    def __init__(self, body: dict, request_id: str):
        self.body, self.request_id = body, request_id
        self.active = uses_tools(body)
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if not self.active:
            self.sent = len(self.text)
            return piece
        if forced_tools(self.body):
            return ""
        upto = self.text.find(CALL_OPEN, self.sent)
        if upto == -1:
            upto = len(self.text)
            for k in range(min(len(CALL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(CALL_OPEN[:k]):
                    upto -= k
                    break
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, tool calls)."""
        if not self.active:
            return "", []
        _, calls = parse(self.body, self.text, self.request_id)
        first = self.text.find(CALL_OPEN)
        if not calls:
            rest = self.text[self.sent:]
        else:      # a forced call's text is all call; otherwise the content before the first block
            rest = "" if forced_tools(self.body) else self.text[self.sent:max(first, self.sent)]
        self.sent = len(self.text)
        return rest, calls
