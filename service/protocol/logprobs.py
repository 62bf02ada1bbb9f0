"""Log-probabilities in OpenAI's shapes. Never imports torch (the service uses it).

Workers store and stream one entry per generated token, in the chat shape:

    {"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob", "bytes"}]}

With `echo` (completions), the prompt's tokens come first; the first one's logprob and top_logprobs are null.

`top_logprobs` holds as many alternatives as the request asked for (completions' `logprobs`, chat's
`top_logprobs`). The API turns a list of entries into the endpoint's shape:

    /v1/completions       {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    /v1/chat/completions  {"content": [entry, ...]}
"""
from . import CHAT


def requested(endpoint: str, body: dict | None) -> bool:
    """Did this (normalised) request body ask for logprobs? Chat: `logprobs: true`; completions: an int."""
    body = body or {}
    if endpoint == CHAT:
        return bool(body.get("logprobs"))
    return body.get("logprobs") is not None


def text_length(entries: list[dict]) -> int:
    """Characters the entries' token strings cover (the next completions `text_offset`)."""
    return sum(len(e["token"]) for e in entries)


def completion(entries: list[dict], offset: int = 0) -> dict:
    """Completions shape; `offset` is where the first entry's token starts in the output text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def chat(entries: list[dict]) -> dict:
    return {"content": list(entries)}


def shaped(endpoint: str, entries: list[dict] | None, offset: int = 0) -> dict:
    entries = entries or []
    return chat(entries) if endpoint == CHAT else completion(entries, offset)
