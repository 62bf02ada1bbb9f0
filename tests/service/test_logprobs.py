"""Logprobs from the ledger (and the token stream) to users: online endpoints through the official openai
client, streamed and whole, the native job, and Batch output lines. A fake worker thread plays the gpu
worker: it claims the job, streams part of it with logprobs entries and completes it in the ledger."""
import io
import json
import threading
import time

import openai
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from tidepool.service.ledger import batches as ledger, jobs
from tidepool.service.protocol import CHAT, COMPLETIONS, logprobs
from tidepool.service.ledger.models import Batch, Job, JobStatus
from tidepool.service.ledger import token_stream

from .conftest import Admin

TOKENS = [("Hel", -0.25), ("lo", -0.5), (" wor\u00e9", -1.5)]
ALTERNATIVES = ["x", "y", "z", "w", "v"]


def _entries(n_top: int) -> list[dict]:
    """Greedy-shaped entries: the chosen token heads its own top list."""
    out = []
    for token, lp in TOKENS:
        top = [{"token": token, "logprob": lp, "bytes": list(token.encode())}]
        top += [{"token": t, "logprob": lp - 1 - k, "bytes": list(t.encode())} for k, t in enumerate(ALTERNATIVES)]
        out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": top[:n_top]})
    return out


def _top_n(job: Job) -> int:
    if job.endpoint == CHAT:
        return job.request.get("top_logprobs") or 0
    return job.request["logprobs"]


class FakeWorker:
    """Serves one online job at a time: streams all but the last token, then completes from the ledger."""

    def __init__(self, app, redis_client):
        self.engine = app.services.database
        self.redis = redis_client
        self.hub = token_stream.for_redis(redis_client)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def _next_job(self) -> str | None:
        with Session(self.engine) as s:
            job_id = s.scalar(select(Job.id).where(Job.status == JobStatus.queued).order_by(Job.id))
        if job_id and self.hub.listening(job_id):
            return job_id     # its API request listens: nothing published now can be missed
        return None

    def run(self):
        while not self.stop.is_set():
            job_id = self._next_job()
            if job_id is None:
                time.sleep(0.02)
                continue
            with Session(self.engine) as s:
                lease = jobs.start(s, job_id, "fake").lease_token
                job = s.get(Job, job_id)
                entries = _entries(_top_n(job)) if logprobs.requested(job.endpoint, job.request) else None
                s.commit()
            pos = 0
            for i, (token, _) in enumerate(TOKENS[:-1]):   # the last token's event is "lost" on the way
                event = {"t": "tok", "d": token, "p": pos}
                if entries is not None:
                    event.update(l=entries[i:i + 1], i=i)
                self.hub.publish(job_id, event)
                self.hub.publish(job_id, event)            # a replayed event is not sent twice
                pos += len(token)
            with Session(self.engine) as s:
                assert jobs.complete(s, job_id, lease, output="".join(t for t, _ in TOKENS), output_token_ids=[1, 2, 3],
                                     prompt_tokens=2, completion_tokens=3, finish_reason="length", logprobs=entries)
                s.commit()
            self.hub.publish(job_id, {"t": "end", "status": "completed"})

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def online(app, live_server, redis_client):
    worker = FakeWorker(app, redis_client)
    _, key = Admin(app.test_client()).tenant()
    yield openai.OpenAI(base_url=f"{live_server}/v1", api_key=key["Authorization"].split()[1], max_retries=0,
                        timeout=30), key
    worker.close()


TEXT = "".join(t for t, _ in TOKENS)


def _check_completion_logprobs(lp, n_top: int):
    assert lp.tokens == [t for t, _ in TOKENS]
    assert lp.token_logprobs == [v for _, v in TOKENS]
    assert lp.text_offset == [0, 3, 5]
    assert [len(top) for top in lp.top_logprobs] == [n_top] * 3
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and max(top.values()) == logprob == top[token]


def _check_chat_logprobs(content, n_top: int):
    assert [(c.token, c.logprob) for c in content] == TOKENS
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == n_top
        assert c.logprob <= 0
        if n_top:
            assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)


@pytest.mark.production_shape
def test_completions_logprobs_whole_and_streamed(online):
    oa, _ = online
    r = oa.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=2)
    assert r.choices[0].text == TEXT
    _check_completion_logprobs(r.choices[0].logprobs, 2)

    chunks = list(oa.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=4, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == TEXT
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs is not None]
    assert len(parts) == 3     # one per streamed token, the last (missed on the stream) from the ledger
    merged = type(parts[0])(tokens=[t for p in parts for t in p.tokens],
                            token_logprobs=[v for p in parts for v in p.token_logprobs],
                            top_logprobs=[d for p in parts for d in p.top_logprobs],
                            text_offset=[o for p in parts for o in p.text_offset])
    _check_completion_logprobs(merged, 4)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].logprobs is None

    r = oa.completions.create(model="m", prompt="hi", max_tokens=3, logprobs=0)
    assert r.choices[0].logprobs.top_logprobs == [{}, {}, {}] and r.choices[0].logprobs.tokens[0] == "Hel"


@pytest.mark.production_shape
def test_chat_logprobs_whole_and_streamed(online):
    oa, _ = online
    messages = [{"role": "user", "content": "hi"}]
    c = oa.chat.completions.create(model="m", messages=messages, max_tokens=3, logprobs=True, top_logprobs=3)
    assert c.choices[0].message.content == TEXT
    _check_chat_logprobs(c.choices[0].logprobs.content, 3)

    c = oa.chat.completions.create(model="m", messages=messages, max_tokens=3, logprobs=True)
    _check_chat_logprobs(c.choices[0].logprobs.content, 0)

    chunks = list(oa.chat.completions.create(model="m", messages=messages, max_tokens=3, logprobs=True,
                                             top_logprobs=5, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == TEXT
    content = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    _check_chat_logprobs(content, 5)
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.production_shape
def test_no_logprobs_unless_asked(online):
    oa, key = online
    r = oa.completions.create(model="m", prompt="hi", max_tokens=3)
    assert r.choices[0].text == TEXT and r.choices[0].logprobs is None
    c = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                   logprobs=False, top_logprobs=2)
    assert c.choices[0].logprobs is None
    for stream in (oa.completions.create(model="m", prompt="hi", max_tokens=3, stream=True),
                   oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, stream=True)):
        chunks = list(stream)
        assert chunks and all(ch.choices[0].logprobs is None for ch in chunks)


def test_native_job_returns_logprobs_only_when_asked(app, online):
    _, key = online
    client = app.test_client()
    with_lp = client.post("/v1/jobs", json={"prompt": "hi", "logprobs": 1}, headers=key).get_json()["id"]
    without = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}]},
                          headers=key).get_json()["id"]
    engine = app.services.database
    with Session(engine) as s:
        for job_id, entries in ((with_lp, _entries(1)), (without, None)):
            lease = jobs.start(s, job_id, "w").lease_token
            jobs.complete(s, job_id, lease, output=TEXT, output_token_ids=[1, 2, 3], prompt_tokens=1,
                          completion_tokens=3, finish_reason="length", logprobs=entries)
        s.commit()
    got = client.get(f"/v1/jobs/{with_lp}", headers=key).get_json()["output"]
    assert got["logprobs"]["tokens"] == [t for t, _ in TOKENS] and got["logprobs"]["text_offset"] == [0, 3, 5]
    assert "logprobs" not in client.get(f"/v1/jobs/{without}", headers=key).get_json()["output"]
    listed = client.get("/v1/jobs", headers=key).get_json()["data"]
    assert all("logprobs" not in (j["output"] or {}) for j in listed)     # listings never load them


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_batch_output_lines_carry_logprobs_when_asked(embedded_app, endpoint):
    client = embedded_app.test_client()
    _, key = Admin(client).tenant()
    if endpoint == CHAT:
        bodies = [{"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2},
                  {"messages": [{"role": "user", "content": "b"}]}]
    else:
        bodies = [{"prompt": "a", "logprobs": 2}, {"prompt": "b"}]
    data = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": b})
                     for i, b in enumerate(bodies)).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
                    headers=key).get_json()
    b = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                         "completion_window": "24h"}, headers=key).get_json()
    with Session(embedded_app.services.database) as s:
        batch = s.get(Batch, b["id"])
        ids = s.scalars(select(Job.id).where(Job.batch_id == batch.id).order_by(Job.custom_id)).all()
        for job_id, entries in zip(ids, (_entries(2), None)):
            lease = jobs.start(s, job_id, "w").lease_token
            jobs.complete(s, job_id, lease, output=TEXT, output_token_ids=[1, 2, 3], prompt_tokens=1,
                          completion_tokens=3, finish_reason="length", logprobs=entries)
        assert ledger.finalize(s, embedded_app.services.storage, batch)
        s.commit()
    out_id = client.get(f"/v1/batches/{b['id']}", headers=key).get_json()["output_file_id"]
    lines = {o["custom_id"]: o for o in map(json.loads, client.get(f"/v1/files/{out_id}/content",
                                                                    headers=key).data.splitlines())}
    asked, plain = (lines[k]["response"]["body"]["choices"][0]["logprobs"] for k in ("r0", "r1"))
    assert plain is None
    if endpoint == CHAT:
        assert [(e["token"], e["logprob"]) for e in asked["content"]] == TOKENS
        assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in asked["content"])
    else:
        assert asked["tokens"] == [t for t, _ in TOKENS] and asked["text_offset"] == [0, 3, 5]
        assert [len(t) for t in asked["top_logprobs"]] == [2, 2, 2]


def test_shapes_are_computed_without_torch():
    entries = _entries(1)
    assert logprobs.shaped(CHAT, entries) == {"content": entries}
    assert logprobs.shaped(COMPLETIONS, entries[1:], offset=3)["text_offset"] == [3, 5]
    assert logprobs.text_length(entries) == len(TEXT)
    assert logprobs.requested(COMPLETIONS, {"logprobs": 0})
    assert not logprobs.requested(CHAT, {"logprobs": False, "top_logprobs": 3})
