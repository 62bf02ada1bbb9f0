"""The Responses API, service_tier and Anthropic's Messages and Message Batches end to end through the official
`openai` and `anthropic` clients, unmodified: web app, one worker process and beat over Postgres and Redis, with the
random-weight model. Each shape must give what the chat path gives for the same conversation, and run through the
same ledger (classes, usage, batches)."""
import json
import time

import anthropic
import jsonschema
import openai
import pytest
import requests
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tidepool.service.ledger.models import Batch, Job, JobStatus, Quota, Usage

from .conftest import served_stack

WORKER = "shapes-gpu"
QUESTION = "What is the weather in Paris?"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}


@pytest.fixture(scope="module")
def st(pg_databases, tiny_model, tmp_path_factory, redis_url):
    yield from served_stack(pg_databases, tiny_model, tmp_path_factory.mktemp("shapes"), redis_url, WORKER)


@pytest.fixture(scope="module")
def keyed(st):
    tenant_id, key = st.tenant()
    return tenant_id, key


@pytest.fixture(scope="module")
def oa(st, keyed):
    return openai.OpenAI(base_url=f"{st.url}/v1", api_key=keyed[1], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(st, keyed):
    return anthropic.Anthropic(base_url=st.url, api_key=keyed[1], max_retries=0, timeout=120)


def _job(st, job_id: str) -> Job:
    return st.jobs(Job.id == job_id)[0]


def _job_of(resp_id: str) -> str:
    return "job_" + resp_id.split("_", 1)[1]


def _billed(st, tenant_id: str):
    with Session(st.engine) as s:
        u = s.scalar(select(Usage).where(Usage.tenant_id == tenant_id))
        return None if u is None else (u.requests, u.prompt_tokens, u.completion_tokens)


# ---- OpenAI Responses ------------------------------------------------------------------------------------

def test_response_equals_the_chat_completion_and_continues_a_stored_conversation(st, oa):
    chat = oa.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    r = oa.responses.create(model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=8,
                            temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.service_tier == "default"
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    job = _job(st, _job_of(r.id))
    assert job.sla_class.value == "interactive" and job.worker == WORKER and job.endpoint == "/v1/chat/completions"

    # previous_response_id: the stored conversation (not its instructions), the answer, then the new input
    follow = oa.responses.create(model="tiny", previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": "And Rome?"}]}])
    assert follow.previous_response_id == r.id and follow.instructions is None
    assert _job(st, _job_of(follow.id)).request["messages"] == [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "And Rome?"}]
    got = oa.responses.retrieve(follow.id)
    assert got.output_text == follow.output_text and got.usage.total_tokens == follow.usage.total_tokens
    items = oa.responses.input_items.list(follow.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And Rome?")]

    # store false: nothing to retrieve or continue; delete: gone
    gone = oa.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model="tiny", input="Hi", max_output_tokens=2, previous_response_id=gone.id)
    assert e.value.param == "previous_response_id"
    assert oa.responses.delete(follow.id) is None
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(follow.id)


def test_streamed_response_events_add_up_to_the_response(st, oa):
    events = list(oa.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=12,
                                      temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    plain = oa.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=12, temperature=0)
    assert plain.output_text == text and final.usage.output_tokens == plain.usage.output_tokens


def test_json_schema_and_function_tools_with_a_function_call_output_round_trip(st, oa):
    for seed in range(2):
        r = oa.responses.create(model="tiny", input=QUESTION, max_output_tokens=120, temperature=1,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                 "strict": True}},
                                extra_body={"sla_class": "interactive"} if seed else None)
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), CITY)

    called = oa.responses.create(model="tiny", input=QUESTION, max_output_tokens=80, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in called.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and called.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = oa.responses.create(model="tiny", previous_response_id=called.id, max_output_tokens=4, temperature=0,
                                 tools=[WEATHER], tool_choice="none", input=[
                                     {"type": "function_call_output", "call_id": calls[0].call_id,
                                      "output": "18 degrees"}])
    assert follow.output[0].type == "message"
    messages = _job(st, _job_of(follow.id)).request["messages"]
    assert messages[-2]["tool_calls"][0]["id"] == calls[0].call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 degrees"}

    # the same call given back as input items (no stored conversation), streamed
    events = list(oa.responses.create(model="tiny", max_output_tokens=80, tools=[WEATHER], stream=True,
                                      tool_choice={"type": "function", "name": "get_weather"}, input=[
                                          {"role": "user", "content": QUESTION},
                                          {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                           "arguments": '{"city": "Paris"}'},
                                          {"type": "function_call_output", "call_id": "c1", "output": "18"},
                                          {"role": "user", "content": "And Rome?"}]))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    delta = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert delta == done.arguments and events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done.arguments


def test_background_response_is_a_queued_job_then_retrieved_or_cancelled(st, oa):
    r = oa.responses.create(model="tiny", input="Hi", max_output_tokens=4, background=True)
    assert r.status in ("queued", "in_progress") and r.background and r.output == []
    got = st.wait(lambda: (x := oa.responses.retrieve(r.id)).status in ("completed", "incomplete") and x, 60,
                  "the background response")
    assert got.output_text and got.usage.output_tokens == _job(st, _job_of(r.id)).completion_tokens

    long = oa.responses.create(model="tiny", input="Count to a thousand.", max_output_tokens=600,
                               background=True, extra_body={"sla_class": "interactive"})
    cancelled = oa.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert _job(st, _job_of(long.id)).status == JobStatus.cancelled
    foreground = oa.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(openai.ConflictError):         # only a background response can be cancelled
        oa.responses.cancel(foreground.id)


def test_another_tenants_response_is_a_404(st, oa):
    r = oa.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    _, other = st.tenant()
    theirs = openai.OpenAI(base_url=f"{st.url}/v1", api_key=other, max_retries=0)
    for call in (lambda: theirs.responses.retrieve(r.id), lambda: theirs.responses.delete(r.id),
                 lambda: theirs.responses.cancel(r.id), lambda: theirs.responses.input_items.list(r.id),
                 lambda: theirs.responses.create(model="tiny", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert oa.responses.retrieve(r.id).id == r.id


def test_bad_responses_input_is_a_400_naming_the_field_and_bills_nothing(st):
    tenant_id, key = st.tenant()
    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0)
    cases = [
        (dict(input=[{"type": "input_image", "image_url": "x"}]), "input[0].type"),
        (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input[0].content[0].type"),
        (dict(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
        (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
        (dict(input="x" * ((1 << 21) + 1)), "input"),
        (dict(input="a\x00b"), "input"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {"oneOf": []}}}),
         "text.format.schema.oneOf"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        (dict(input="x", background=True, store=False), "background"),
        (dict(input="x", service_tier="scale"), "service_tier"),
        (dict(input="x", service_tier="priority", extra_body={"sla_class": "interactive"}), "service_tier"),
        (dict(), "input"),
    ]
    for kwargs, param in cases:
        extra = kwargs.pop("extra_body", None)
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model="tiny", max_output_tokens=kwargs.pop("max_output_tokens", 4),
                                extra_body=extra, **kwargs)
        if param is not None:
            assert e.value.param == param, (kwargs, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    assert st.count(Job.tenant_id == tenant_id) == 0 and _billed(st, tenant_id) is None


# ---- service_tier ----------------------------------------------------------------------------------------

def test_service_tier_picks_the_class_on_every_route_and_is_reported(st):
    tenant_id, key = st.tenant()
    oa = openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=120)
    c = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   service_tier="priority")
    assert c.service_tier == "priority" and _job(st, c.id).sla_class.value == "realtime"
    t = oa.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"service_tier": "flex"})
    assert t.to_dict()["service_tier"] == "flex" and _job(st, t.id).sla_class.value == "batch"
    r = oa.responses.create(model="tiny", input="Hi", max_output_tokens=2, service_tier="flex")
    assert r.service_tier == "flex" and _job(st, _job_of(r.id)).sla_class.value == "batch"
    a = oa.responses.create(model="tiny", input="Hi", max_output_tokens=2, service_tier="auto")
    assert a.service_tier == "default" and _job(st, _job_of(a.id)).sla_class.value == "interactive"
    streamed = list(oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, service_tier="flex", stream=True))
    assert {ch.service_tier for ch in streamed} == {"flex"}
    assert _job(st, streamed[0].id).status == JobStatus.completed
    job = requests.post(f"{st.url}/v1/jobs", json={"prompt": "Hi", "max_tokens": 2, "service_tier": "priority"},
                        headers={"Authorization": f"Bearer {key}"}).json()
    assert job["sla_class"] == "realtime" and job["service_tier"] == "priority"
    both = requests.post(f"{st.url}/v1/jobs", json={"prompt": "Hi", "max_tokens": 2, "service_tier": "flex",
                                                     "sla_class": "batch"}, headers={"Authorization": f"Bearer {key}"})
    assert both.status_code == 202 and both.json()["sla_class"] == "batch"
    bad = requests.post(f"{st.url}/v1/jobs", json={"prompt": "Hi", "service_tier": "flex", "sla_class": "realtime"},
                        headers={"Authorization": f"Bearer {key}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "service_tier"

    with st.engine.begin() as conn:     # a tier the quota does not allow: 403, as for sla_class
        conn.execute(update(Quota).where(Quota.tenant_id == tenant_id).values(allowed_sla_classes=["interactive"]))
    time.sleep(2.1)                     # the web process's authentication cache
    for call in (lambda: oa.responses.create(model="tiny", input="Hi", max_output_tokens=2, service_tier="priority"),
                 lambda: oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=2, service_tier="flex")):
        with pytest.raises(openai.PermissionDeniedError) as e:
            call()
        assert e.value.code == "sla_class_not_allowed"


# ---- Anthropic Messages ----------------------------------------------------------------------------------

def test_anthropic_message_equals_the_chat_completion_plain_and_streamed(st, oa, an):
    chat = oa.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    m = an.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
                           messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert _job(st, "job_" + m.id.split("_", 1)[1]).sla_class.value == "interactive"

    with an.messages.stream(model="tiny", max_tokens=8, extra_body={"temperature": 0}, system=[{"type": "text", "text": "Be brief."}],
                            messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == m.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens

    # Bearer works as well as x-api-key
    r = requests.post(f"{st.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}]}, headers={"Authorization": f"Bearer {an.api_key}",
                                                      "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_anthropic_tools_with_a_tool_result_round_trip(st, an):
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["parameters"]}
    m = an.messages.create(model="tiny", max_tokens=80, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": QUESTION}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["parameters"])
    follow = an.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0}, tools=[tool],
                                tool_choice={"type": "none"}, messages=[
                                    {"role": "user", "content": QUESTION},
                                    {"role": "assistant", "content": m.content},
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                                  "content": "18 degrees"}]}])
    assert follow.content[0].type == "text" and follow.stop_reason in ("end_turn", "max_tokens")
    messages = _job(st, "job_" + follow.id.split("_", 1)[1]).request["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": uses[0].id, "content": "18 degrees"}

    with an.messages.stream(model="tiny", max_tokens=80, tools=[tool], tool_choice={"type": "any"},
                            messages=[{"role": "user", "content": QUESTION}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["parameters"])


def test_bad_anthropic_input_is_a_400_in_anthropics_shape_and_bills_nothing(st):
    tenant_id, key = st.tenant()
    an = anthropic.Anthropic(base_url=st.url, api_key=key, max_retries=0)
    user = [{"role": "user", "content": "Hi"}]
    missing = requests.post(f"{st.url}/v1/messages", json={"model": "tiny", "messages": user},
                            headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert missing.status_code == 400 and missing.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    cases = [
        (dict(max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
         "messages.0.content.0.type"),
        (dict(max_tokens=4, messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": "a\x00b"}]), "messages"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": "x" * ((1 << 21) + 1)}]), "messages"),
        (dict(max_tokens=4, messages=user, tool_choice={"type": "any"}), "tool_choice"),
        (dict(max_tokens=4, messages=user, extra_body={"temperature": 1.5}), "temperature"),
        (dict(max_tokens=4, messages=user, stop_sequences=[""]), "stop_sequences"),
    ]
    for kwargs, field in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model="tiny", **kwargs)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert field in e.value.body["error"]["message"], (kwargs, e.value.body)
    with pytest.raises(anthropic.NotFoundError) as e:
        an.messages.create(model="claude-nope", max_tokens=4, messages=user)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=st.url, api_key="tp-wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=user)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert st.count(Job.tenant_id == tenant_id) == 0 and _billed(st, tenant_id) is None


# ---- Anthropic Message Batches ---------------------------------------------------------------------------

def test_message_batch_create_retrieve_results_cancel_delete(st, an, keyed):
    params = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    reference = an.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Hi"}])
    b = an.messages.batches.create(requests=[
        {"custom_id": "a", "params": {**params, "messages": [{"role": "user", "content": "Hi"}]}},
        {"custom_id": "b", "params": {**params, "system": "Be brief.", "messages": [{"role": "user", "content": "Yo"}]}},
    ])
    assert b.type == "message_batch" and b.processing_status == "in_progress" and b.results_url is None
    with Session(st.engine) as s:    # a Tidepool batch underneath: class batch, jobs in the ledger
        row = s.get(Batch, b.id)
        assert row.sla_class.value == "batch" and row.total == 2
    ended = st.wait(lambda: (x := an.messages.batches.retrieve(b.id)).processing_status == "ended" and x, 90,
                    "the message batch")
    assert ended.request_counts.succeeded == 2 and ended.results_url and ended.ended_at
    results = {r.custom_id: r.result for r in an.messages.batches.results(b.id)}
    assert set(results) == {"a", "b"} and all(r.type == "succeeded" for r in results.values())
    assert results["a"].message.content[0].text == reference.content[0].text
    assert b.id in [x.id for x in an.messages.batches.list(limit=10)]

    big = an.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": {**params, "max_tokens": 500, "messages": [{"role": "user", "content": "Go"}]}}
        for i in range(6)])
    cancelled = an.messages.batches.cancel(big.id)
    assert cancelled.processing_status in ("canceling", "ended")
    ended = st.wait(lambda: (x := an.messages.batches.retrieve(big.id)).processing_status == "ended" and x, 60,
                    "the cancelled batch")
    counts = ended.request_counts
    assert counts.canceled + counts.succeeded == 6 and counts.canceled >= 1
    kinds = {r.result.type for r in an.messages.batches.results(big.id)}
    assert "canceled" in kinds and kinds <= {"canceled", "succeeded"}
    assert an.messages.batches.delete(big.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        an.messages.batches.retrieve(big.id)

    with pytest.raises(anthropic.BadRequestError) as e:     # a bad request names it; nothing is queued
        an.messages.batches.create(requests=[{"custom_id": "ok", "params": {**params, "messages": [
            {"role": "user", "content": "Hi"}]}}, {"custom_id": "bad", "params": {"model": "tiny", "messages": [
                {"role": "user", "content": "Hi"}]}}])
    assert "requests.1.params" in e.value.body["error"]["message"] and "max_tokens" in e.value.body["error"]["message"]
    _, other = st.tenant()
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=st.url, api_key=other, max_retries=0).messages.batches.retrieve(b.id)


# ---- errors on unknown routes ----------------------------------------------------------------------------

def test_unknown_routes_answer_in_the_apis_error_shape(st, keyed):
    auth = {"Authorization": f"Bearer {keyed[1]}"}
    r = requests.get(f"{st.url}/v1/nope", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "/v1/nope" in r.json()["error"]["message"]
    r = requests.post(f"{st.url}/v1/messages/nope", headers=auth, json={})
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": "Invalid URL (POST /v1/messages/nope): no such route."}}
    r = requests.get(f"{st.url}/v1/responses", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# ---- batch files with /v1/responses lines ----------------------------------------------------------------

def _line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_openai_batch_of_responses_lines(st, oa):
    lines = [_line("plain", "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 4,
                                              "temperature": 0}),
             _line("schema", "/v1/responses", {"model": "tiny", "input": QUESTION, "max_output_tokens": 120,
                                               "text": {"format": {"type": "json_schema", "name": "city",
                                                                   "schema": CITY}}})]
    f = oa.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    done = st.wait(lambda: (x := oa.batches.retrieve(b.id)).status in ("completed", "failed") and x, 90, "the batch")
    assert done.status == "completed" and done.request_counts.completed == 2
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, oa.files.content(
        done.output_file_id).text.splitlines())}
    assert out["plain"]["object"] == "response" and out["plain"]["service_tier"] == "flex"
    reference = oa.responses.create(model="tiny", input="Hi", max_output_tokens=4, temperature=0)
    assert out["plain"]["output"][0]["content"][0]["text"] == reference.output_text
    jsonschema.validate(json.loads(out["schema"]["output"][0]["content"][0]["text"]), CITY)


def test_run_batch_mixes_responses_chat_and_completions_lines(tiny_model, tmp_path):
    from tidepool.workers.batch_runner import run_batch
    from tidepool.workers.engine import LLMEngine
    from tidepool.workers.engine.config import EngineConfig
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([
        _line("r", "/v1/responses", {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief.",
                                     "max_output_tokens": 6, "temperature": 0}),
        _line("c", "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hi"}], "max_tokens": 6,
                                            "temperature": 0}),
        _line("t", "/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
        _line("bad", "/v1/responses", {"input": [{"type": "input_image"}], "max_output_tokens": 2}),
        _line("prev", "/v1/responses", {"input": "x", "previous_response_id": "resp_1"}),
    ]) + "\n")
    counts = run_batch(LLMEngine(EngineConfig(model=tiny_model)), src, dst, "tiny", progress=False)
    assert (counts["completed"], counts["failed"]) == (3, 2)
    out = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    resp, chat = out["r"]["response"]["body"], out["c"]["response"]["body"]
    assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
    assert resp["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert out["t"]["response"]["body"]["object"] == "text_completion"
    assert out["bad"]["error"]["code"] == "unsupported_value" and "input[0].type" in out["bad"]["error"]["message"]
    assert out["prev"]["error"]["code"] == "unknown_parameter"


# ---- the OpenAPI document ----------------------------------------------------------------------------------

def _sse(text: str) -> list[dict]:
    """Server-sent events as {event, data, id?}: 'event' defaults to message; comments (keep-alives) are no events."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = {}, []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name in ("event", "id"):
                event[name] = value
        if data:
            events.append({"event": event.pop("event", "message"), "data": "\n".join(data), **event})
    return events


def test_streams_and_answers_are_what_the_document_declares(st, keyed):
    """Each streaming route's events match its text/event-stream schema (JSON data where it says so), and the same
    request unstreamed matches its application/json schema."""
    import jsonschema_rs
    doc = requests.get(f"{st.url}/openapi.json").json()
    headers = {"Authorization": f"Bearer {keyed[1]}"}
    user = [{"role": "user", "content": QUESTION}]
    requests_ = {"/v1/completions": {"model": "tiny", "prompt": QUESTION, "max_tokens": 4,
                                     "stream_options": {"include_usage": True}},
                 "/v1/chat/completions": {"model": "tiny", "messages": user, "max_tokens": 4},
                 "/v1/responses": {"model": "tiny", "input": QUESTION, "max_output_tokens": 4},
                 "/v1/messages": {"model": "tiny", "max_tokens": 4, "messages": user}}
    for path, body in requests_.items():
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        events, answer = (jsonschema_rs.validator_for({**content[kind]["schema"], "components": doc["components"]})
                          for kind in ("text/event-stream", "application/json"))
        r = requests.post(f"{st.url}{path}", json={**body, "stream": True}, headers=headers, timeout=120)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        got = _sse(r.text)
        assert got, path
        for ev in got:
            events.validate(ev)
            if "contentMediaType" in content["text/event-stream"]["schema"]["properties"]["data"]:
                assert json.loads(ev["data"])["type"] == ev["event"], (path, ev)
        assert path in ("/v1/responses", "/v1/messages") or got[-1]["data"] == "[DONE]"
        body.pop("stream_options", None)
        r = requests.post(f"{st.url}{path}", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        answer.validate(r.json())
