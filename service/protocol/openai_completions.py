"""OpenAI's completion and chat completion bodies as the online API, /v1/jobs, batch result files and the workers'
offline runner build them: the usage object, a body's head, its choice objects, and a job's choices (n > 1, best_of).
The ledger keeps a job's first choice in Job.output, output_token_ids, finish_reason and logprobs (exactly as for one
choice) and the others in Job.choices; choices_of reads them back in order. Flask- and torch-free."""
from . import CHAT
from . import logprobs, structured_output as structured


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict:
    p, c = prompt_tokens or 0, completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def head(endpoint: str, response_id: str, created: int | None, model: str | None, chunk: bool = False) -> dict:
    """The id, object, created and model of a chat.completion(.chunk) or text_completion body."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if endpoint == CHAT else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model}


def call_id_base(request_id: str, index: int) -> str:
    """Tool-call ids of choice `index`: the request id for the first choice, request-id-index for the others."""
    return request_id if index == 0 else f"{request_id}-{index}"


def choices_of(job) -> list[dict]:
    """Every choice of a completed job, in order: {"text", "token_ids", "finish_reason", "logprobs"}.
    Job.choices is deferred: load it (undefer) or read it inside the job's session."""
    first = {"text": job.output, "token_ids": job.output_token_ids, "finish_reason": job.finish_reason,
             "logprobs": job.logprobs}
    return [first, *(job.choices or [])]


def choice_objects(endpoint: str, every: list[dict], request: dict | None, request_id: str,
                   want_logprobs: bool) -> list[dict]:
    """The `choices` of a chat.completion / text_completion body, from a job's choices as choices_of gives them
    ({"text", "finish_reason", "logprobs"}, in order)."""
    out = []
    for i, c in enumerate(every):
        lps = logprobs.shaped(endpoint, c["logprobs"]) if want_logprobs else None
        if endpoint == CHAT:
            message, reason = structured.message(request or {}, c["text"], c["finish_reason"],
                                                 call_id_base(request_id, i))
            out.append({"index": i, "message": message, "logprobs": lps, "finish_reason": reason})
        else:
            out.append({"index": i, "text": c["text"], "logprobs": lps, "finish_reason": c["finish_reason"]})
    return out
