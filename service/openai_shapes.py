"""OpenAI's shapes that the online API, /v1/jobs, batch result files and the workers' offline runner share:
the endpoint paths, the usage object, a completion body's head. Flask- and torch-free."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict:
    p, c = prompt_tokens or 0, completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def head(endpoint: str, response_id: str, created: int | None, model: str | None, chunk: bool = False) -> dict:
    """The id, object, created and model of a chat.completion(.chunk) or text_completion body."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if endpoint == CHAT else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model}
