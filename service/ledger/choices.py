"""Several choices of one job (n > 1, best_of). The ledger keeps the first choice in Job.output,
output_token_ids, finish_reason and logprobs (exactly as for one choice) and the others in Job.choices; of_job
reads them back in order (service/ledger/openai_shapes.py's choice_objects turns them into OpenAI choice objects).
Flask- and torch-free."""


def of_job(job) -> list[dict]:
    """Every choice of a completed job, in order: {"text", "token_ids", "finish_reason", "logprobs"}.
    Job.choices is deferred: load it (undefer) or read it inside the job's session."""
    first = {"text": job.output, "token_ids": job.output_token_ids, "finish_reason": job.finish_reason,
             "logprobs": job.logprobs}
    return [first, *(job.choices or [])]
