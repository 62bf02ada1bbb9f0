"""OpenAI request bodies -> engine requests, and engine outputs -> OpenAI response bodies.

Bodies arrive already validated and normalised by `tidepool.service.protocol.request_bodies.check`.
"""
import time
from types import SimpleNamespace

from tidepool.service.protocol import CHAT, COMPLETIONS, EMBEDDINGS  # noqa: F401 (the workers' import point)
from tidepool.service.protocol import embeddings, logprobs, openai_completions, structured_output as structured
from tidepool.workers.engine import RequestOutput, SamplingParams
from tidepool.workers.engine.pooling import PoolingParams

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "n", "best_of",
                    "speculate")


def sampling_params(endpoint: str, body: dict) -> SamplingParams:
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if endpoint == CHAT:
        if body.get("logprobs"):
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
        if body.get("echo"):        # the echoed prompt's tokens carry logprobs too (the first one null)
            kwargs["prompt_logprobs"] = body["logprobs"]
    return SamplingParams(**kwargs, structured=structured.grammar(body))


def embedding_request(body: dict) -> tuple[list, PoolingParams]:
    """An embeddings body (checked by service.embeddings.check) -> (its inputs, PoolingParams)."""
    return embeddings.inputs(body["input"]), PoolingParams(truncate=bool(body.get("truncate")),
                                                           dimensions=body.get("dimensions"))


def prompt_ids(endpoint: str, body: dict, tokenizer) -> list[int]:
    if endpoint == CHAT:
        messages, tools = chat_messages(body, tokenizer.renders_tools)
        return tokenizer.encode_chat(messages, tools=tools)
    prompt = body["prompt"]
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def chat_messages(body: dict, template_renders_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. A template that does not render tools gets them as a system
    message, assistant tool calls as <tool_call> blocks and tool results as <tool_response> blocks."""
    messages = [{**m, "content": m.get("content") if isinstance(m.get("content"), str)
                 else "".join(part["text"] for part in m.get("content") or [])} for m in body["messages"]]
    tools = body.get("tools") if structured.uses_tools(body) else None
    if not tools or template_renders_tools:
        return messages, tools
    for m in messages:
        if m.get("tool_calls"):
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + [structured.call_text(c)
                                                                               for c in m.pop("tool_calls")])
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    prompt = structured.tool_prompt(tools)
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def usage(out: RequestOutput) -> dict:
    """The prompt once; the tokens of every sequence generated (all n choices, and best_of's discarded ones)."""
    prompt, completion = len(out.prompt_token_ids), out.generated_tokens or len(out.token_ids)
    return openai_completions.usage(prompt, completion)


def echo_text(endpoint: str, body: dict, tokenizer, prompt: list[int]) -> str | None:
    """Completions with `echo`: the prompt text each choice's text starts with (a token-id prompt decoded)."""
    if endpoint == CHAT or not body.get("echo"):
        return None
    return body["prompt"] if isinstance(body["prompt"], str) else tokenizer.decode(prompt, skip_special_tokens=False)


def prompt_entries(tokenizer, out: RequestOutput) -> list[dict]:
    """The echoed prompt's logprob entries: the first token's logprob and top_logprobs are null (OpenAI)."""
    first = {**_token(tokenizer, out.prompt_token_ids[0], {}), "logprob": None, "top_logprobs": None}
    return [first] + (logprob_entries(tokenizer, out.prompt_logprobs[1:]) or [])


def ledger_result(out: RequestOutput, tokenizer, text=lambda t: t, echo: str | None = None) -> dict:
    """A finished request as service.ledger.jobs.complete's keyword arguments: the first choice in output & co., the
    others in `choices` (service/protocol/openai_completions.py choices_of reads them back). `text` makes a text
    storable (ledger_text); `echo` (echo_text) goes before each choice's text, and its prompt logprobs before the
    choice's."""
    if out.embeddings is not None:
        return dict(output=embeddings.stored(out.embeddings), output_token_ids=None, finish_reason="stop",
                    prompt_tokens=len(out.prompt_token_ids), completion_tokens=0, logprobs=None, choices=None)
    first, more = (out.outputs[0], out.outputs[1:]) if out.outputs else (out, [])
    head = prompt_entries(tokenizer, out) if echo is not None and out.prompt_logprobs else []

    def lps(c):
        entries = logprob_entries(tokenizer, c.logprobs)
        return entries if entries is None else head + entries

    return dict(output=text((echo or "") + first.text), output_token_ids=list(first.token_ids),
                finish_reason=first.finish_reason, prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=usage(out)["completion_tokens"], logprobs=lps(first),
                choices=[{"text": text((echo or "") + c.text), "token_ids": list(c.token_ids),
                          "finish_reason": c.finish_reason, "logprobs": lps(c)} for c in more] or None)


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, reversed."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def _token(tokenizer, token_id: int, cache: dict) -> dict:
    """{"token", "bytes"} of one token id. A token holding part of a UTF-8 character decodes to U+FFFD;
    its bytes then come from the vocabulary piece (byte-level BPE, or SentencePiece's <0xNN>)."""
    got = cache.get(token_id)
    if got is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        raw = text.encode()
        if "\ufffd" in text:
            piece = tokenizer.id_to_token(token_id) or ""
            if piece and all(c in _BYTES for c in piece):
                raw = bytes(_BYTES[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
        # Postgres text cannot hold NUL (see workers.attempt.ledger_text); bytes keep the truth.
        got = cache[token_id] = {"token": text.replace("\x00", "\ufffd"), "bytes": list(raw)}
    return got


def logprob_entries(tokenizer, raw: list[dict] | None) -> list[dict] | None:
    """Engine logprobs ({"token_id", "logprob", "top": [(id, logprob)]} per generated token) -> the
    entries the ledger stores and the token stream carries (see service.protocol.logprobs)."""
    if raw is None:
        return None
    cache: dict = {}
    return [{**_token(tokenizer, e["token_id"], cache), "logprob": e["logprob"],
             "top_logprobs": [{**_token(tokenizer, t, cache), "logprob": lp} for t, lp in e["top"]]}
            for e in raw]


def response_body(endpoint: str, request_id: str, model: str, out: RequestOutput, tokenizer,
                  created: int | None = None, body: dict | None = None) -> dict:
    created = created or int(time.time())
    if endpoint == EMBEDDINGS:
        return embeddings.response_body(embeddings.stored(out.embeddings), body, model, len(out.prompt_token_ids))
    stored = ledger_result(out, tokenizer, echo=echo_text(endpoint, body or {}, tokenizer, out.prompt_token_ids))
    every = openai_completions.choices_of(SimpleNamespace(**stored))
    picked = openai_completions.choice_objects(endpoint, every, body, request_id, logprobs.requested(endpoint, body))
    response_id = f"chatcmpl-{request_id}" if endpoint == CHAT else f"cmpl-{request_id}"
    return {**openai_completions.head(endpoint, response_id, created, model), "choices": picked, "usage": usage(out)}
