"""End to end through the official openai client: the web app on a socket, one `tidepool worker`
process and `tidepool beat`, over Postgres and Redis. Results must equal the engine's offline output."""
import io
import json
import time

import openai
import pytest
import requests
from sqlalchemy import select
from sqlalchemy.orm import Session

from tidepool.service.ledger.dispatch import _publish_task
from tidepool.service.ledger import fair
from tidepool.service.ledger.models import Job, JobStatus, Usage
from tidepool.workers.engine import LLM, SamplingParams

from .conftest import served_stack

WORKER = "e2e-gpu"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def st(pg_databases, tiny_model, tmp_path_factory, redis_url):
    yield from served_stack(pg_databases, tiny_model, tmp_path_factory.mktemp("e2e"), redis_url, WORKER)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(tiny_model)


def _client(st) -> tuple[openai.OpenAI, str]:
    _, key = st.tenant()
    return openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60), key


def test_completion_chat_and_models_match_the_engine(st, reference):
    oa, _ = _client(st)
    assert [m.id for m in oa.models.list()] == ["tiny"]
    assert oa.models.retrieve("tiny").id == "tiny"

    r = oa.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    ref = reference.generate(["Hello there"], GREEDY)[0]
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    c = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    ref = reference.chat([messages], GREEDY)[0]
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == ref.text
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))

    job = st.jobs(Job.id == c.id)[0]     # the response id is the ledger job
    assert job.status.value == "completed" and job.sla_class.value == "interactive" and job.worker == WORKER
    assert job.started_at <= job.first_token_at <= job.finished_at


def test_tenant_default_class_applies_to_online_requests_that_name_none(st):
    from sqlalchemy import update
    from tidepool.service.ledger.models import Tenant
    tenant_id, key = st.tenant()
    with st.engine.begin() as conn:
        conn.execute(update(Tenant).where(Tenant.id == tenant_id).values(default_sla_class="realtime"))
    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=60)
    plain = oa.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
    named = oa.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0,
                                  extra_body={"sla_class": "interactive"})
    assert st.jobs(Job.id == plain.id)[0].sla_class.value == "realtime"
    assert st.jobs(Job.id == named.id)[0].sla_class.value == "interactive"


def test_streaming_chunks_add_up_to_the_engine_output(st, reference):
    oa, _ = _client(st)
    messages = [{"role": "user", "content": "Tell me a story."}]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = reference.chat([messages], params)[0]
    chunks = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    ref = reference.generate(["Once upon"], params)[0]
    chunks = list(oa.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0,
                                        stream=True, extra_body={"sla_class": "realtime"}))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert st.jobs(Job.id == chunks[0].id)[0].sla_class.value == "realtime"

    # the raw wire format ends with data: [DONE]
    _, key = _client(st)
    with requests.post(f"{st.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": "Hi", "max_tokens": 3, "stream": True}, timeout=60, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 3


def test_bad_input_is_an_openai_error(st):
    oa, _ = _client(st)
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    failed = len(st.jobs(Job.status == JobStatus.failed))
    for stream in (False, True):   # too long for the model: the worker refuses it, the API answers 400
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="tiny", prompt=[5] * 1100, max_tokens=2, stream=stream)
        assert e.value.code == "context_length_exceeded" and "fewer than" in e.value.message, e.value.message
    assert len(st.jobs(Job.status == JobStatus.failed)) == failed     # refused work leaves no job, as other 400s
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=17)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="x", extra_body={"sla_class": "batch"})
    assert e.value.param == "sla_class"
    bad = openai.OpenAI(base_url=f"{st.url}/v1", api_key="tp_nope_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x")


def test_batch_file_to_output_matches_offline_generate(st, reference):
    oa, _ = _client(st)
    prompts = [f"Item {i}:" for i in range(6)]
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0}})
             for i, p in enumerate(prompts)]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    batch = st.wait(lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b, 90, "batch done")
    assert batch.request_counts.completed == 6 and batch.request_counts.failed == 0
    out = [json.loads(ln) for ln in oa.files.content(batch.output_file_id).read().decode().splitlines()]
    refs = reference.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
    for o in out:
        ref = refs[int(o["custom_id"][1:])]
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["choices"][0]["text"] == ref.text
        assert body["usage"]["completion_tokens"] == len(ref.token_ids)


def test_cancel_reaches_the_running_engine(st):
    tenant_id, key = st.tenant()
    headers = {"Authorization": f"Bearer {key}"}
    job = requests.post(f"{st.url}/v1/jobs", headers=headers, json={
        "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}).json()
    st.wait(lambda: st.jobs(Job.id == job["id"])[0].first_token_at, 30, "first token")
    aborted = st.heartbeat(WORKER).get("aborted", 0)
    t0 = time.monotonic()
    r = requests.post(f"{st.url}/v1/jobs/{job['id']}/cancel", headers=headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    # the worker's own counter (published each heartbeat) shows the engine sequence was aborted
    st.wait(lambda: st.heartbeat(WORKER).get("aborted", 0) > aborted, 10, "abort", every=0.05)
    print(f"cancel -> abort seen via heartbeat in {time.monotonic() - t0:.2f}s (heartbeat every 2s)")
    row = st.jobs(Job.id == job["id"])[0]      # what it generated until then is billed (tests/workers/test_billing.py)
    assert row.status.value == "cancelled" and row.output is None and row.completion_tokens > 0
    with Session(st.engine) as s:
        usage = s.query(Usage).filter_by(tenant_id=tenant_id).one()
    assert (usage.prompt_tokens, usage.completion_tokens) == (row.prompt_tokens, row.completion_tokens)


def test_client_disconnect_cancels_the_job(st):
    _, key = _client(st)
    with requests.post(f"{st.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 1000,
                             "ignore_eos": True, "stream": True}, timeout=60, stream=True) as r:
        lines = r.iter_lines(decode_unicode=True)
        first = next(ln for ln in lines if ln.startswith("data: "))
        next(lines)
    job_id = json.loads(first[6:])["id"]
    row = st.wait(lambda: (j := st.jobs(Job.id == job_id)[0]).status.value != "running" and j, 15, "cancel")
    assert row.status.value == "cancelled" and row.output is None


def test_a_message_delivered_twice_completes_once(st):
    tenant_id, key = st.tenant()
    job = requests.post(f"{st.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                     json={"prompt": "twice", "max_tokens": 4, "sla_class": "interactive"}).json()
    with st.app.services.celery.producer_or_acquire() as producer:
        for _ in range(2):
            _publish_task(producer, job["id"], "interactive")
    st.wait(lambda: st.jobs(Job.id == job["id"])[0].status.value == "completed", 30, "completion")
    st.wait(lambda: fair.lane_depth(st.redis, "interactive") == 0, 10, "duplicates consumed")
    time.sleep(0.3)
    row = st.jobs(Job.id == job["id"])[0]
    assert row.attempts == 1 and row.completion_tokens == 4
    with Session(st.engine) as s:
        usage = s.query(Usage).filter_by(tenant_id=tenant_id).one()
    assert usage.requests == 1 and usage.completion_tokens == 4


def test_batch_cancel_aborts_its_running_jobs(st):
    oa, _ = _client(st)
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"long {i}", "max_tokens": 1000, "ignore_eos": True}}) for i in range(2)]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    st.wait(lambda: st.count(Job.batch_id == batch.id, Job.status == JobStatus.running) == 2, 30, "both running")
    aborted = st.heartbeat(WORKER).get("aborted", 0)
    cancelled = oa.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 0
    st.wait(lambda: st.heartbeat(WORKER).get("aborted", 0) >= aborted + 2, 10, "both aborted", every=0.05)
    assert all(j.status.value == "cancelled" and j.output is None for j in st.jobs(Job.batch_id == batch.id))


def test_a_lapsed_lease_on_a_live_worker_reruns_the_job_once(st):
    from tidepool.service.ledger import jobs
    tenant_id, key = st.tenant()
    job_id = requests.post(f"{st.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}, json={
        "prompt": "lapse", "max_tokens": 1000, "ignore_eos": True}).json()["id"]     # long enough to still run
    st.wait(lambda: st.jobs(Job.id == job_id)[0].first_token_at, 30, "running")
    with Session(st.engine) as s:       # what the sweeper does when a lease lapses, then republishes at once
        assert jobs.fail(s, job_id, s.get(Job, job_id).lease_token, {"code": "lease_expired"}, retry=True)
        s.commit()
    assert st.app.services.dispatcher.republish_undispatched(older_than=0) == 1
    row = st.wait(lambda: (j := st.jobs(Job.id == job_id)[0]).status.value == "completed" and j, 60, "rerun")
    assert row.attempts == 2 and row.completion_tokens == 1000
    with Session(st.engine) as s:
        assert s.query(Usage).filter_by(tenant_id=tenant_id).one().requests == 1


def _merge_completion_logprobs(parts) -> dict:
    return {k: [x for p in parts for x in getattr(p, k)] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}


def test_logprobs_reach_the_client_whole_and_streamed(st, reference):
    oa, _ = _client(st)
    tok = reference.tokenizer
    ref = reference.generate(["Tell me"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]

    r = oa.completions.create(model="tiny", prompt="Tell me", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text and len(lp.tokens) == r.usage.completion_tokens == len(ref.token_ids)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [3] * len(lp.tokens)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and logprob == max(top.values()) == top[token]       # greedy: the top choice
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chunks = list(oa.completions.create(model="tiny", prompt="Tell me", max_tokens=8, temperature=0, logprobs=3,
                                        stream=True))
    streamed = _merge_completion_logprobs([ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs])
    # another run of the same request: same tokens, logprobs equal up to float noise of the batch shape
    assert (streamed["tokens"], streamed["text_offset"]) == (lp.tokens, lp.text_offset)
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in streamed["top_logprobs"]] == [sorted(t) for t in lp.top_logprobs]
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text

    messages = [{"role": "user", "content": "Say something."}]
    c = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                   top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and isinstance(e.bytes, list)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace").startswith(c.choices[0].message.content)

    chunks = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes, sorted(t.token for t in e.top_logprobs)) for e in streamed] == \
        [(e.token, e.bytes, sorted(t.token for t in e.top_logprobs)) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.choices[0].message.content

    only_chosen = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                             logprobs=True)
    assert all(e.top_logprobs == [] for e in only_chosen.choices[0].logprobs.content)


def test_no_logprobs_unless_asked(st):
    oa, _ = _client(st)
    messages = [{"role": "user", "content": "Hi"}]
    assert oa.completions.create(model="tiny", prompt="Hi", max_tokens=3).choices[0].logprobs is None
    assert oa.chat.completions.create(model="tiny", messages=messages, max_tokens=3).choices[0].logprobs is None
    chunks = list(oa.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True))
    assert all(ch.choices[0].logprobs is None for ch in chunks if ch.choices)
    with Session(st.engine) as s:
        assert s.scalar(select(Job.logprobs).where(Job.id == chunks[0].id)) is None


def test_batch_output_carries_logprobs_when_asked(st):
    oa, _ = _client(st)
    bodies = {"lp": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "temperature": 0,
                     "logprobs": True, "top_logprobs": 3},
              "plain": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "temperature": 0}}
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b})
             for k, b in bodies.items()]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = st.wait(lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b, 90, "batch done")
    out = {o["custom_id"]: o["response"]["body"] for o in
           map(json.loads, oa.files.content(batch.output_file_id).read().decode().splitlines())}
    assert out["plain"]["choices"][0]["logprobs"] is None
    content = out["lp"]["choices"][0]["logprobs"]["content"]
    assert len(content) == out["lp"]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 and e["top_logprobs"][0]["token"] == e["token"]
               for e in content)


def test_logprob_entries_carry_the_raw_bytes_of_partial_characters(reference):
    from tidepool.workers.openai_bodies import logprob_entries
    tok = reference.tokenizer
    text = "naïve 龘 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    entries = logprob_entries(tok, [{"token_id": i, "logprob": -1.0, "top": [(i, -1.0)]} for i in ids])
    assert any("\ufffd" in e["token"] for e in entries)       # some tokens hold part of a character
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert all(e["top_logprobs"] == [{"token": e["token"], "bytes": e["bytes"], "logprob": -1.0}] for e in entries)
