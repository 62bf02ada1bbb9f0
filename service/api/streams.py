"""One online job's text as it streams, for the API shapes that build their own events (Responses, Anthropic
Messages): one choice, no logprobs. A rerun of the job (a new attempt after a worker died) continues the stream only
while its text extends what was sent, as in openai_compat._sse."""
import logging

from ..protocol.errors import APIError
from ..ledger.models import JobStatus
from .openai_compat import _Waiter, _job_error, _restarted

log = logging.getLogger("tidepool.online")


def text_deltas(waiter: _Waiter, first: dict):
    """Yields each new piece of text (None after a quiet second: the caller writes a keep-alive), then the rest of
    the final text; returns the completed Job. Raises APIError when the job did not complete (or restarted with
    different text); the job is cancelled if the client goes away before the end."""
    sent, attempt, done = "", "", False
    try:
        ev = first
        while ev is None or ev["t"] != "end" or ev.get("status") == "queued":
            if ev is None:
                yield None
            elif ev["t"] == "tok" and not ev.get("c") and ev["p"] <= len(attempt):
                attempt = attempt[:ev["p"]] + ev["d"]
                if not attempt.startswith(sent):
                    if not sent.startswith(attempt):
                        raise _restarted(waiter.job_id)
                elif len(attempt) > len(sent):
                    piece, sent = attempt[len(sent):], attempt
                    yield piece
            ev = waiter.next_event(keepalive=True)
        job = waiter.finish(ev)
        if job.status != JobStatus.completed:
            raise _job_error(job)
        text = job.output or ""
        if not text.startswith(sent):
            raise _restarted(job.id)
        if len(text) > len(sent):
            yield text[len(sent):]
        done = True
        return job
    except APIError:
        done = True
        raise
    except GeneratorExit:
        raise
    except Exception:
        log.exception("stream of job %s failed", waiter.job_id)
        done = True
        raise APIError(500, f"The stream of job '{waiter.job_id}' failed; its result will be at "
                            f"GET /v1/jobs/{waiter.job_id}.", "stream_failed") from None
    finally:
        waiter.close(cancel=not done)
