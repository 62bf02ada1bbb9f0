"""Several choices of one job (n > 1, best_of). The ledger keeps the first choice in Job.output,
output_token_ids, finish_reason and logprobs (exactly as for one choice) and the others in Job.choices;
this turns a completed job into OpenAI choice objects for non-streamed bodies and batch result lines.
Flask- and torch-free."""
from . import bodies, logprobs, structured


def of_job(job) -> list[dict]:
    """Every choice of a completed job, in order: {"text", "token_ids", "finish_reason", "logprobs"}.
    Job.choices is deferred: load it (undefer) or read it inside the job's session."""
    first = {"text": job.output, "token_ids": job.output_token_ids, "finish_reason": job.finish_reason,
             "logprobs": job.logprobs}
    return [first, *(job.choices or [])]


def call_id_base(request_id: str, index: int) -> str:
    """Tool-call ids of choice `index`: the request id for the first choice, request-id-index for the others."""
    return request_id if index == 0 else f"{request_id}-{index}"


def openai_choices(job, request: dict | None, request_id: str, want_logprobs: bool) -> list[dict]:
    """The `choices` of the job's chat.completion / text_completion body."""
    return shaped(job.endpoint, of_job(job), request, request_id, want_logprobs)


def shaped(endpoint: str, every: list[dict], request: dict | None, request_id: str, want_logprobs: bool) -> list[dict]:
    """OpenAI choice objects of choices as of_job gives them (also how run-batch writes its lines)."""
    out = []
    for i, c in enumerate(every):
        lps = logprobs.shaped(endpoint, c["logprobs"]) if want_logprobs else None
        if endpoint == bodies.CHAT:
            message, reason = structured.message(request or {}, c["text"], c["finish_reason"],
                                                 call_id_base(request_id, i))
            out.append({"index": i, "message": message, "logprobs": lps, "finish_reason": reason})
        else:
            out.append({"index": i, "text": c["text"], "logprobs": lps, "finish_reason": c["finish_reason"]})
    return out
