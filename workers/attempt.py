"""One attempt of a job in a worker: its lease, its engine request, what it streamed; and the ledger job's
request mapped to an engine request."""
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone

from service.openai_shapes import CHAT
from workers.openai_bodies import prompt_ids, sampling_params

@dataclass
class Inflight:
    job_id: str
    lease_token: str
    sla_class: str
    message: object
    online: bool
    tenant: str = "default"
    queue_time: float | None = None   # seconds between queued and started in the ledger
    pos: dict = field(default_factory=dict)   # characters streamed so far, by choice index
    echo: str | None = None           # completions `echo`: the prompt text each choice's text starts with
    first_token_at: float | None = None
    marks: dict = field(default_factory=dict)   # online: stage timestamps, sent with the first token
    first_recorded: bool = False
    aborted: bool = False
    # An online attempt enters the engine before its claim commits: its stream events wait in `held` until
    # the claim succeeded (claimed), and a refused claim drops the attempt unseen (dropped, then aborted).
    claimed: bool = True
    dropped: bool = False
    entered_at: float | None = None   # when an early attempt was added to the engine
    held: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def request_id(self) -> str:
        """This attempt's engine request. Never the job id alone: an abort or an output meant for an
        earlier attempt of the job (the engine applies aborts by id, at its next step) must not reach this one."""
        return f"{self.job_id}@{self.lease_token[:8]}"


def ledger_text(text: str) -> str:
    """Postgres text cannot hold NUL, which byte-level tokens can produce; stream and ledger both get U+FFFD."""
    return text.replace("\x00", "\ufffd")


def build_request(tokenizer, endpoint: str, body: dict):
    """A ledger job's normalised request body -> (prompt token ids, SamplingParams). Raises ValueError."""
    try:
        prompt = prompt_ids(endpoint, body, tokenizer)
    except Exception as exc:  # template errors (jinja raise_exception) are the caller's input
        if endpoint != CHAT:
            raise
        raise ValueError(f"the chat template rejected these messages: {exc}") from exc
    return prompt, sampling_params(endpoint, body)


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)
