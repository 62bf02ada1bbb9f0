"""One attempt of a job in a worker (its lease, its engine request, what it streamed), the worker's table of
attempts in flight, and the ledger job's request mapped to an engine request."""
import queue
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone

from tidepool.service.protocol import CHAT, EMBEDDINGS
from tidepool.workers.openai_bodies import embedding_request, prompt_ids, sampling_params

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
    result: dict | None = None        # what its completion wrote to the ledger (sent with its end event)
    held: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def request_id(self) -> str:
        """This attempt's engine request. Never the job id alone: an abort or an output meant for an
        earlier attempt of the job (the engine applies aborts by id, at its next step) must not reach this one."""
        return f"{self.job_id}@{self.lease_token[:8]}"


class Attempts:
    """The worker's attempts in flight, by job id, and what passes between its threads about them: messages held
    for an earlier attempt of their job to leave the engine, finished engine outputs and first tokens (the engine
    thread puts them, the intake thread writes them to the ledger)."""

    def __init__(self):
        self.by_job: dict[str, Inflight] = {}
        self.held: list[tuple[str, object]] = []      # (queue, message) waiting for an earlier attempt to leave
        self.done: queue.SimpleQueue = queue.SimpleQueue()      # finished RequestOutputs
        self.firsts: queue.SimpleQueue = queue.SimpleQueue()    # online attempts whose first token came

    def __len__(self) -> int:
        return len(self.by_job)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.by_job

    def add(self, inf: Inflight) -> None:
        self.by_job[inf.job_id] = inf

    def forget(self, inf: Inflight) -> None:
        if self.by_job.get(inf.job_id) is inf:
            del self.by_job[inf.job_id]

    def current(self, inf: Inflight) -> bool:
        """inf is its job's attempt in flight (not an earlier one's leftovers)."""
        return self.by_job.get(inf.job_id) is inf

    def of_request(self, request_id: str) -> Inflight | None:
        """The attempt an engine request belongs to; None for an earlier attempt's leftovers."""
        inf = self.by_job.get(request_id.rpartition("@")[0])
        return inf if inf is not None and inf.request_id == request_id else None

    def values(self) -> list[Inflight]:
        return list(self.by_job.values())

    def drain(self, q: queue.SimpleQueue) -> list:
        out = []
        while True:
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                return out


def ledger_text(text: str) -> str:
    """Postgres text cannot hold NUL, which byte-level tokens can produce; stream and ledger both get U+FFFD."""
    return text.replace("\x00", "\ufffd")


def build_request(tokenizer, endpoint: str, body: dict):
    """A ledger job's normalised request body -> (prompt token ids, SamplingParams), or for an embedding job
    (its inputs, PoolingParams). Raises ValueError."""
    if endpoint == EMBEDDINGS:
        return embedding_request(body)
    try:
        prompt = prompt_ids(endpoint, body, tokenizer)
    except Exception as exc:  # template errors (jinja raise_exception) are the caller's input
        if endpoint != CHAT:
            raise
        raise ValueError(f"the chat template rejected these messages: {exc}") from exc
    return prompt, sampling_params(endpoint, body)


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)
