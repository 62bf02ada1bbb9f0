"""Validation of completion and chat request bodies (native jobs and batch lines alike).

Returns the normalised body the worker interprets, plus the admission token estimate
(prompt estimate + max_tokens). Every failure is an APIError(400) naming the parameter.

The prompt's tokens are counted with the model's tokenizer where the web side can read it (Registry.token_counter);
elsewhere they are estimated from the text's UTF-8 bytes, one token per byte: no tokenizer makes more tokens than
that (byte-level BPE and byte fallback give at most one per byte), so tokens per minute and the monthly budget hold
whatever the text (bytes / 4 let text that falls back to bytes through at four times its limit).
"""
import codecs
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from . import CHAT, COMPLETIONS, EMBEDDINGS
from . import embeddings, structured_output as structured
from .errors import APIError, bad_request

DEFAULT_MAX_TOKENS = {COMPLETIONS: 16, CHAT: 512}
MAX_OUTPUT_TOKENS = 1 << 20     # max_tokens where the model's context is not known (run-batch checks before loading)
# Bounds on every list and string of a request (docs/guides/online-api.md, "Request limits"); beyond them, a 400
# naming the field.
MAX_PROMPT_TOKEN_IDS = 1 << 20     # ids in a token-id prompt
MAX_TOKEN_ID = (1 << 31) - 1       # largest token id (prompt, stop_token_ids)
MAX_PROMPT_CHARS = 1 << 21         # characters of a prompt, or of all messages' text together
MAX_MESSAGES = 2048                # messages in a chat request
MAX_CONTENT_PARTS = 256            # text parts of one message
MAX_NAME_CHARS = 256               # model, user, a message's name
MAX_STOP = 16                      # stop strings
MAX_STOP_CHARS = 256               # characters of one stop string
MAX_STOP_TOKEN_IDS = 256           # stop_token_ids
MAX_CHOICES = 16                   # n, and best_of on completions
ROLES = ("system", "developer", "user", "assistant", "tool")

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "n", "user", "stream",
           "response_format", "speculate"}
ALLOWED = {COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo", "best_of"},
           CHAT: _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                            "parallel_tool_calls"}}
NATIVE_EXTRA = {"sla_class", "service_tier", "deadline", "metadata"}


def bad_text(value: str) -> str | None:
    """Why a string cannot be stored (Postgres text holds no NUL) or encoded (a lone surrogate is not valid
    Unicode); None when it is fine."""
    if "\x00" in value:
        return "must not contain NUL characters"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain lone surrogates (invalid Unicode)"
    return None


MAX_JSON_DEPTH = 64   # nesting of a client's JSON (objects and arrays); deeper is a 400, never a RecursionError


def nesting(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return deepest


def loads(text: str | bytes):
    """A client's JSON document (a request body, a batch line): ValueError when it is not valid JSON or nests
    deeper than MAX_JSON_DEPTH (the checks below walk it recursively)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    if nesting(value) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return value


_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


def array_items(stream, key: str, max_item_bytes: int, chunk: int = 1 << 16):
    """The items of the array `key` of a JSON object read from a binary stream, one at a time: memory holds one
    item (at most max_item_bytes of text; past it a 413), not the document. The object must have no other member
    (a 400 naming it); invalid JSON, or an item nesting past MAX_JSON_DEPTH, is a 400 invalid_json."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof = "", 0, False

    def invalid(why: str) -> APIError:
        return bad_request(f"The request body must be valid JSON ({why}).", None, "invalid_json")

    def read(at_least: int) -> None:
        """Append at least `at_least` more characters to the buffer (fewer at the end of the stream)."""
        nonlocal buf, pos, eof
        parts, got = [], 0
        while got < at_least and not eof:
            data = stream.read(chunk)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError:
                raise invalid("not UTF-8") from None
            eof = not data
            parts.append(text)
            got += len(text)
        buf, pos = buf[pos:] + "".join(parts), 0

    def peek() -> str:
        """The next character that is not whitespace ("" at the end)."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in _SPACE:
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            read(1)

    def expect(char: str) -> None:
        nonlocal pos
        if peek() != char:
            raise invalid(f"expected '{char}' at character {pos}")
        pos += 1

    def value():
        nonlocal pos
        peek()
        while True:
            try:
                v, end = _DECODER.raw_decode(buf, pos)
            except RecursionError:
                raise invalid(f"nests deeper than {MAX_JSON_DEPTH} levels") from None
            except ValueError as exc:
                if eof:
                    raise invalid(exc.msg) from None
                end = None
            if end is not None and (end < len(buf) or eof):    # (a value that ends the buffer may go on)
                pos = end
                return v
            if len(buf) - pos > max_item_bytes:
                raise APIError(413, f"An item of '{key}' is larger than {max_item_bytes} bytes.", "request_too_large",
                               key)
            read(len(buf) - pos + chunk)      # twice as much each time: parsing an item is linear overall

    expect("{")
    if peek() != '"':
        raise bad_request(f"{key}: Field required.", key)
    name = value()
    if name != key:
        raise bad_request(f"{name}: Extra inputs are not permitted", str(name), "unknown_parameter")
    expect(":")
    if peek() != "[":
        raise bad_request(f"{key}: must be a list.", key)
    pos += 1
    if peek() == "]":
        pos += 1
    else:
        while True:
            item = value()
            if nesting(item) > MAX_JSON_DEPTH - 2:
                raise invalid(f"nests deeper than {MAX_JSON_DEPTH} levels")
            yield item
            if peek() == ",":
                pos += 1
                continue
            expect("]")
            break
    if peek() == ",":
        pos += 1
        name = value() if peek() == '"' else None
        if not isinstance(name, str):
            raise invalid("expected a member name")
        if name == key:
            raise invalid(f"'{key}' given twice")
        raise bad_request(f"{name}: Extra inputs are not permitted", name, "unknown_parameter")
    expect("}")
    if peek():
        raise invalid("extra data after the object")


def integral(value):
    """value with every integral float made an int (JSON does not tell 8.0 from 8, nor does JSON Schema)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    if isinstance(value, list) and not all(type(v) is int for v in value):
        return [integral(v) for v in value]
    return value


def check_text(value, param: str) -> None:
    """Every string in a JSON value (keys included), as bad_text; the 400 names where the bad one is."""
    if isinstance(value, str):
        why = bad_text(value)
        if why:
            raise bad_request(f"'{param}' {why}.", param)
    elif isinstance(value, dict):
        for k, v in value.items():
            where = f"{param}.{k}" if param else str(k)
            if isinstance(k, str) and bad_text(k):
                raise bad_request(f"'{param or 'body'}' has a key that {bad_text(k)}.", param or None)
            check_text(v, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not isinstance(v, int):
                check_text(v, f"{param}[{i}]")


@dataclass
class Checked:
    endpoint: str
    body: dict
    estimated_tokens: int


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one_of(v, *allowed) -> bool:
    """v is None or one of allowed, of the same type (0 is not False, True is not 1)."""
    return v is None or any(type(v) is type(a) and v == a for a in allowed)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _number(body, name, lo, hi, *, integer=False, lo_open=False):
    if name not in body or body[name] is None:
        return
    v = body[name]
    if not (_is_int(v) if integer else _is_num(v)) or v < lo or v > hi or (lo_open and v == lo):
        kind = "an integer" if integer else "a number"
        raise bad_request(f"'{name}' must be {kind} in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}.", name)


def _check_max_tokens(body, name: str, context_len: int | None) -> None:
    """`max_tokens` / `max_completion_tokens`: a positive integer below the model's context (prompt and output
    share it), which every message states as the one limit; MAX_OUTPUT_TOKENS where the context is not known."""
    v = body.get(name)
    if v is None:
        return
    if context_len is None:
        return _number(body, name, 1, MAX_OUTPUT_TOKENS, integer=True)
    if not _is_int(v) or v < 1:
        raise bad_request(f"'{name}' must be a positive integer below this model's context ({context_len} tokens), "
                          f"got {v!r}.", name)
    if v >= context_len:
        raise bad_request(f"'{name}' is {v}, but this model's context is {context_len} tokens, prompt and output "
                          f"together: ask for fewer than {context_len} (output that reaches the context stops with "
                          f"finish_reason 'length').", name, "context_length_exceeded")


def _estimate_text(text: str, count=None) -> int:
    """The tokens of a text: count(text) with the model's tokenizer, else its UTF-8 bytes (an upper bound)."""
    return max(1, count(text) if count is not None else len(text.encode()))


def _check_prompt(prompt, count=None, vocab_size: int | None = None, context_len: int | None = None) -> int:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", "prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise bad_request(f"'prompt' has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are allowed.",
                              "prompt", "string_above_max_length")
        return _estimate_text(prompt, count)
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_TOKEN_IDS:
        raise bad_request(f"'prompt' has {len(prompt)} token ids; at most {MAX_PROMPT_TOKEN_IDS} are allowed.",
                          "prompt", "array_above_max_length")
    if isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in prompt):
        past = next((t for t in prompt if vocab_size is not None and t >= vocab_size), None)
        if past is not None:
            raise bad_request(f"'prompt' holds the token id {past}, but this model's vocabulary has {vocab_size} "
                              f"tokens (ids 0 to {vocab_size - 1}).", "prompt")
        if context_len is not None and len(prompt) >= context_len:
            raise bad_request(f"'prompt' has {len(prompt)} token ids, but this model's context is {context_len} "
                              f"tokens, prompt and output together: send fewer than {context_len}.", "prompt",
                              "context_length_exceeded")
        return len(prompt)
    raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids "
                      "(one prompt per request).", "prompt")


def _check_messages(messages, count=None) -> int:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES} are allowed.",
                          "messages", "array_above_max_length")
    total = chars = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object.", where)
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise bad_request(f"'{where}' has unsupported field '{sorted(extra)[0]}'.", where)
        if m.get("role") not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {list(ROLES)}.", f"{where}.role")
        structured.check_message(m, where)
        content = m.get("content")
        if content is None and "tool_calls" in m:
            content = ""
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise bad_request(f"'{where}.content' has more than {MAX_CONTENT_PARTS} parts.", f"{where}.content",
                                  "array_above_max_length")
            if not all(isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                       and isinstance(p["text"], str) for p in content):
                raise bad_request(f"'{where}.content' parts must be {{'type': 'text', 'text': str}}.",
                                  f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or a list of text parts.", f"{where}.content")
        if "name" in m and (not isinstance(m["name"], str) or len(m["name"]) > MAX_NAME_CHARS):
            raise bad_request(f"'{where}.name' must be a string of at most {MAX_NAME_CHARS} characters.",
                              f"{where}.name")
        chars += len(content)
        if chars > MAX_PROMPT_CHARS:
            raise bad_request(f"'messages' hold more than {MAX_PROMPT_CHARS} characters.", "messages",
                              "string_above_max_length")
        total += _estimate_text(content, count) + 4 if content else 4
    return total


def _check_stop(body):
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) and len(stop) <= MAX_STOP_CHARS) and (
            not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and s and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings, each of at "
                          f"most {MAX_STOP_CHARS} characters.", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                            or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids)):
        raise bad_request(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids.",
                          "stop_token_ids")


def check_metadata(meta, param="metadata"):
    if meta is None:
        return None
    check_text(meta, param)
    if not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items()):
        raise bad_request("'metadata' must be an object of at most 16 string keys (≤64 chars) "
                          "and string values (≤512 chars).", param)
    return meta


# RFC 3339 date-time (the document's `format: date-time`), the one text form a deadline takes
_RFC3339 = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?"
                      r"([Zz]|[+-][0-9]{2}:[0-9]{2})")
MIN_DEADLINE, MAX_DEADLINE = -62135596800, 253402300799     # Unix seconds of 0001-01-01T00:00:00Z, 9999-12-31T23:59:59Z


def parse_deadline(value) -> datetime | None:
    """A job's deadline: an RFC 3339 date-time or Unix seconds. One already past is accepted: the job expires
    without running, as one whose deadline passes while it waits (it cannot be told from a deadline that passed
    on its way here)."""
    if value is None:
        return None
    try:
        if _is_num(value):
            if not MIN_DEADLINE <= value <= MAX_DEADLINE:
                raise ValueError
            return datetime.fromtimestamp(value, timezone.utc)
        m = _RFC3339.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise ValueError
        year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
        frac, offset = m.group(7) or "", m.group(8).upper()
        off_h, off_m = (0, 0) if offset == "Z" else (int(offset[1:3]), int(offset[4:6]))
        if hour > 23 or minute > 59 or second > 60 or off_h > 23 or off_m > 59:
            raise ValueError
        tz = timezone((-1 if offset[0] == "-" else 1) * timedelta(hours=off_h, minutes=off_m))
        if year == 0:                   # RFC 3339 has a year 0; Python's datetime does not: long past anyway
            return datetime.min.replace(tzinfo=timezone.utc)
        when = datetime(year, month, day, hour, minute, min(second, 59),   # a leap second ends its minute
                        int((frac[1:] + "000000")[:6]) if frac else 0, tzinfo=tz)
        try:
            return when.astimezone(timezone.utc)
        except OverflowError:           # within a day of the ends of time: as close as a datetime gets
            return (datetime.min if year == 1 else datetime.max).replace(tzinfo=timezone.utc)
    except (ValueError, OverflowError, OSError):
        raise bad_request("'deadline' must be an RFC 3339 date-time (e.g. 2030-01-01T00:00:00Z) or Unix seconds.",
                          "deadline") from None


def check(body, endpoint: str, *, served_model: str | None, max_tokens_cap: int | None,
          extra_allowed=frozenset(), context_len: int | None = None, embed_model=None,
          count_tokens=None, vocab_size: int | None = None) -> Checked:
    """embed_model: for /v1/embeddings, the model's embeddings.EmbedModel (None: not checked against it);
    count_tokens: the model's tokenizer as text -> tokens (None: the prompt is estimated from its bytes);
    context_len, vocab_size: the model's, where known (a token-id prompt is checked against them)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_body")
    check_text(body, "")
    if endpoint == EMBEDDINGS:
        return Checked(EMBEDDINGS, *embeddings.check(body, extra_allowed, embed_model))
    unknown = sorted(set(body) - ALLOWED[endpoint] - set(extra_allowed))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_NAME_CHARS):
        raise bad_request(f"'model' must be a string of at most {MAX_NAME_CHARS} characters.", "model")
    if model is not None and served_model and model != served_model:
        raise bad_request(f"The model '{model}' does not exist; this service serves '{served_model}'.",
                          "model", "model_not_found")
    if endpoint == COMPLETIONS:
        if "prompt" not in body:
            raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
        prompt_tokens = _check_prompt(body["prompt"], count_tokens, vocab_size, context_len)
        _number(body, "logprobs", 0, 20, integer=True)
        structured.check(body)
        if not _one_of(body.get("echo"), True, False):
            raise bad_request("'echo' must be a boolean.", "echo")
        _number(body, "best_of", 1, MAX_CHOICES, integer=True)
        if body.get("best_of") is not None and body["best_of"] < (body.get("n") if _is_int(body.get("n")) else 1):
            raise bad_request(f"'best_of' ({body['best_of']}) must be at least 'n' ({body['n']}).", "best_of")
    else:
        if "messages" not in body:
            raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
        prompt_tokens = _check_messages(body["messages"], count_tokens)
        prompt_tokens += structured.check(body, lambda text: _estimate_text(text, count_tokens))
        if not _one_of(body.get("logprobs"), True, False):
            raise bad_request("'logprobs' must be a boolean.", "logprobs")
        _number(body, "top_logprobs", 0, 20, integer=True)
        _check_max_tokens(body, "max_completion_tokens", context_len)
    _check_max_tokens(body, "max_tokens", context_len)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, lo_open=True)
    _number(body, "min_p", 0, 1)
    _number(body, "top_k", -1, 1 << 20, integer=True)
    _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    _number(body, "repetition_penalty", 0, 10, lo_open=True)
    _check_stop(body)
    if not _one_of(body.get("ignore_eos"), True, False):
        raise bad_request("'ignore_eos' must be a boolean.", "ignore_eos")
    if not _one_of(body.get("speculate"), True, False):
        raise bad_request("'speculate' must be a boolean.", "speculate")
    _number(body, "n", 1, MAX_CHOICES, integer=True)
    if not _one_of(body.get("stream"), False):
        raise bad_request("'stream' is not supported for queued jobs.", "stream", "unsupported_value")
    if body.get("user") is not None and (not isinstance(body["user"], str) or len(body["user"]) > MAX_NAME_CHARS):
        raise bad_request(f"'user' must be a string of at most {MAX_NAME_CHARS} characters.", "user")

    clean = {k: v for k, v in body.items() if k not in extra_allowed and v is not None}
    asked = clean.get("max_completion_tokens") or clean.get("max_tokens")
    max_tokens = clean.pop("max_completion_tokens", None) or clean.get("max_tokens") \
        or min(DEFAULT_MAX_TOKENS[endpoint], max_tokens_cap or DEFAULT_MAX_TOKENS[endpoint])
    if max_tokens_cap is not None and max_tokens > max_tokens_cap:
        raise bad_request(f"'max_tokens' is {max_tokens}; this tenant allows at most {max_tokens_cap}.",
                          "max_tokens", "max_tokens_exceeded")
    if context_len is not None and max_tokens >= context_len and not asked:
        max_tokens = max(1, context_len - 1)      # a default never asks for more than the context holds
    clean["max_tokens"] = max_tokens
    # every sequence generated (n, or best_of) may run to max_tokens
    return Checked(endpoint, clean, prompt_tokens + max_tokens * (clean.get("best_of") or clean.get("n") or 1))
