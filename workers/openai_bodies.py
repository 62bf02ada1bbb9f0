"""OpenAI request bodies -> engine requests, and engine outputs -> OpenAI response bodies.

Bodies arrive already validated and normalised by `service.bodies.check`.
"""
import time

from workers.engine import RequestOutput, SamplingParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos")


def sampling_params(endpoint: str, body: dict) -> SamplingParams:
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if endpoint == CHAT:
        if body.get("logprobs"):
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    return SamplingParams(**kwargs)


def prompt_ids(endpoint: str, body: dict, tokenizer) -> list[int]:
    if endpoint == CHAT:
        messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                     else "".join(part["text"] for part in m["content"])} for m in body["messages"]]
        return tokenizer.encode_chat(messages)
    prompt = body["prompt"]
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(out: RequestOutput, tokenizer) -> dict | None:
    if out.logprobs is None:
        return None
    tokens = [_token_str(tokenizer, e["token_id"]) for e in out.logprobs]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in out.logprobs],
            "top_logprobs": [{_token_str(tokenizer, t): lp for t, lp in e["top"]} for e in out.logprobs],
            "text_offset": offsets}


def chat_logprobs(out: RequestOutput, tokenizer) -> dict | None:
    if out.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = _token_str(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(e["token_id"], e["logprob"]), "top_logprobs": [entry(t, lp) for t, lp in e["top"]]}
                        for e in out.logprobs]}


def response_body(endpoint: str, request_id: str, model: str, out: RequestOutput, tokenizer,
                  created: int | None = None) -> dict:
    created = created or int(time.time())
    if endpoint == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": chat_logprobs(out, tokenizer), "finish_reason": out.finish_reason}
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage(out)}
    choice = {"index": 0, "text": out.text, "logprobs": completion_logprobs(out, tokenizer),
              "finish_reason": out.finish_reason}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(out)}
