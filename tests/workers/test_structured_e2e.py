"""Structured output and tool calls end to end through the openai client: web app, one worker process
and beat over Postgres and Redis, with the random-weight model (unconstrained, its output is noise)."""
import io
import json

import jsonschema
import openai
import pytest

from tidepool.workers.batch_runner import run_batch
from tidepool.workers.engine import LLMEngine
from tidepool.workers.engine.config import EngineConfig

from .conftest import served_stack

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
                       "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]},
                                "minItems": 1, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def st(pg_databases, tiny_model, tmp_path_factory, redis_url):
    yield from served_stack(pg_databases, tiny_model, tmp_path_factory.mktemp("structured"), redis_url, "structured-gpu")


@pytest.fixture(scope="module")
def oa(st):
    _, key = st.tenant()
    return openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=120)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def _check_call(call, tools):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.type == "function" and call.id


def test_response_format_json_schema_and_json_object(oa):
    for seed in range(3):
        r = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, seed=seed,
                                       response_format=_schema_format(CITY))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    r = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                   response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_forced_tool_calls_whole_and_streamed(oa):
    tools = [WEATHER, TIME]
    named = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, tools=tools, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _check_call(choice.message.tool_calls[0], tools)

    required = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, tools=tools, seed=2,
                                          tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    _check_call(required.choices[0].message.tool_calls[0], tools)

    chunks = list(oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, tools=tools, seed=2,
                                             tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == required.choices[0].message.tool_calls[0].function.name
    assert deltas[0].function.arguments == required.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)

    # the call and its result go back in; tool_choice none leaves the model free (no tool_calls)
    call = required.choices[0].message.tool_calls[0]
    follow = oa.chat.completions.create(model="tiny", max_tokens=8, temperature=0, tools=tools, tool_choice="none",
                                        messages=MESSAGES + [
                                            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}])
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason == "length"
    auto = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, tools=tools)
    plain = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50     # the tools are described in the prompt


def test_bad_structured_requests_are_400s_naming_the_field(oa):
    cases = [
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(response_format=_schema_format({"type": "object", "not": {"required": ["a"]}})),
         "response_format.json_schema.schema.not"),
        (dict(response_format=_schema_format({"oneOf": [{"type": "string"}]})), "response_format.json_schema.schema.oneOf"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]),
         "tools[0].function.parameters.properties.a.uniqueItems"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
        assert e.value.param == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:     # unknown parameters stay a 400
        oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"guided_json": {}})
    assert e.value.param == "guided_json"
    # keywords pass the API's check but the grammar library refuses the schema: a 400 from the worker
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                   response_format=_schema_format({"type": "string", "pattern": "(?<=a)b"}))
    assert (e.value.param, e.value.code) == ("response_format", "invalid_response_format")
    assert "structured output json_schema cannot be compiled" in e.value.message


def _batch_lines():
    chat = "/v1/chat/completions"
    return [
        {"custom_id": "schema", "url": chat, "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 200,
                                                       "seed": 4, "response_format": _schema_format(CITY)}},
        {"custom_id": "tool", "url": chat, "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 120,
                                                     "tools": [WEATHER, TIME], "tool_choice": "required", "seed": 5}},
        {"custom_id": "choice-free", "url": chat, "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                            "temperature": 0}},
        {"custom_id": "bad", "url": chat, "body": {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                    "response_format": {"type": "yaml"}}},
    ]


def _check_batch_output(out: dict):
    assert out["bad"]["error"] is not None and out["bad"]["response"] is None
    body = out["schema"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), CITY)
    body = out["tool"]["response"]["body"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    call = body["choices"][0]["message"]["tool_calls"][0]
    fn = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["function"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
    assert "tool_calls" not in out["choice-free"]["response"]["body"]["choices"][0]["message"]


def test_batch_file_mixing_structured_requests(st, oa):
    lines = [{**line, "method": "POST"} for line in _batch_lines()]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                        purpose="batch")
    failed = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = st.wait(lambda: (b := oa.batches.retrieve(failed.id)).status == "failed" and b, 60, "batch refused")
    assert [(e.line, e.param) for e in failed.errors.data] == [(4, "body.response_format.type")]
    good = [x for x in lines if x["custom_id"] != "bad"]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in good).encode())),
                        purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = st.wait(lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b, 120, "batch done")
    assert batch.request_counts.completed == 3
    out = {o["custom_id"]: o for o in map(json.loads, oa.files.content(batch.output_file_id).read().decode()
                                          .splitlines())}
    out["bad"] = {"error": {"code": "x"}, "response": None}
    _check_batch_output(out)


def test_jobs_api_carries_tool_calls(st, oa):
    _, key = st.tenant()
    client = st.app.test_client()
    r = client.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                    json={"messages": MESSAGES, "max_tokens": 120, "tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]
    job = st.wait(lambda: (j := client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
                           .get_json())["status"] == "completed" and j, 90, "job done")
    call = job["output"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_run_batch_mixing_structured_requests(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({**x, "method": "POST"}) for x in _batch_lines()) + "\n")
    counts = run_batch(LLMEngine(EngineConfig(model=tiny_model)), src, dst, "tiny", progress=False)
    assert counts["completed"] == 3 and counts["failed"] == 1
    _check_batch_output({o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())})
