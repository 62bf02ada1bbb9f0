"""Checking response_format / tools / tool messages, and the model's text back into tool calls (no servers)."""
import json

import pytest

from tidepool.service.protocol import CHAT, request_bodies as bodies, structured_output as structured
from tidepool.service.protocol.errors import APIError

from .conftest import Admin

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
AUTO = {"tools": [WEATHER], "tool_choice": "auto"}


def _check(**body):
    return bodies.check({"messages": [{"role": "user", "content": "hi"}], **body}, CHAT,
                        served_model=None, max_tokens_cap=None)


@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "not": {}}, "response_format.json_schema.schema.not"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}},
     "response_format.json_schema.schema.properties.a.allOf"),
    ({"$defs": {"x": {"type": "array", "uniqueItems": True}}}, "response_format.json_schema.schema.$defs.x.uniqueItems"),
    ({"type": "array", "items": {"type": "string", "format": "iri"}}, "response_format.json_schema.schema.items.format"),
    ({"anyOf": []}, "response_format.json_schema.schema.anyOf"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "response_format.json_schema.schema.patternProperties"),
])
def test_schema_keywords_the_grammar_cannot_enforce_are_400s_naming_where(schema, param):
    with pytest.raises(APIError) as e:
        _check(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert e.value.param == param


def test_a_supported_schema_passes_and_becomes_the_grammar():
    schema = {"type": "object", "required": ["a"], "additionalProperties": False, "title": "T",
              "properties": {"a": {"anyOf": [{"type": "null"}, {"type": "string", "format": "date", "maxLength": 9}]},
                             "b": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer", "minimum": 0}}}
    body = _check(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).body
    assert structured.grammar(body) == {"json_schema": schema}
    assert structured.grammar(_check(response_format={"type": "json_object"}).body) == {"json_object": True}
    assert structured.grammar(_check(response_format={"type": "text"}).body) is None


@pytest.mark.parametrize("body, param", [
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
     "response_format.json_schema.name"),
    (dict(response_format={"type": "json_object", "schema": {}}), "response_format.schema"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(messages=[{"role": "tool", "content": "18"}]), "messages[0].tool_call_id"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "strict": True}}]}]),
     "messages[0].tool_calls[0]"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": {}}}), "tool_choice"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]),
     "messages[0].content"),
    (dict(tools=[WEATHER], parallel_tool_calls=0), "parallel_tool_calls"),
    (dict(functions=[]), "functions"),
])
def test_bad_structured_fields_are_400s(body, param):
    with pytest.raises(APIError) as e:
        _check(**body)
    assert e.value.param == param


HOSTILE = [   # each compiles for seconds to minutes in the worker (nested bounds: (.{0,20}){0,25} took 9 minutes)
    ("(.{0,20}){0,25}", "cannot repeat a group that itself repeats"),
    ("(.?){0,64}", "cannot repeat a group that itself repeats"),
    ("(.{0,50})+", "cannot repeat"),
    ("[a-z]{1,5000}", "at most 500"),
    ("a{2000,}", "at most 500"),
]


@pytest.mark.parametrize("pattern, why", HOSTILE)
def test_patterns_too_costly_to_compile_are_400s_naming_where(pattern, why):
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    with pytest.raises(APIError) as e:
        _check(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert (e.value.status, e.value.code, e.value.param) == \
        (400, "schema_too_complex", "response_format.json_schema.schema.properties.a.pattern")
    assert why in e.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(APIError) as e:
        _check(tools=[tool], tool_choice="required")
    assert e.value.param == "tools[0].function.parameters.properties.a.pattern"


def test_many_patterns_add_up_to_a_bound():
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,400}"} for i in range(6)}
    with pytest.raises(APIError) as e:
        _check(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": props}}})
    assert e.value.code == "schema_too_complex" and "add up to at most 2000" in e.value.message


@pytest.mark.parametrize("pattern", ["^[A-Z]{3}$", r"^\d{3}-\d{4}$", ".{0,500}", "(ab|cd){1,50}", r"(\w+\s?)+",
                                     "a*?b+?", r"\{x\}", "[]{}]{3}", "x{a}", "^(?:[a-z]+-)*[a-z]+$"])
def test_patterns_people_use_pass(pattern):
    _check(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": pattern, "maxLength": 10**9}}})


def test_a_hostile_schema_is_refused_by_the_api(embedded_app):
    _, headers = Admin(embedded_app.test_client()).tenant()
    r = embedded_app.test_client().post("/v1/jobs", headers=headers, json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                          "pattern": "(.{0,20}){0,25}"}}}})
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["code"] == "schema_too_complex"


def test_tool_messages_are_accepted():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    _check(tools=[WEATHER], messages=[{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "18"}])


def test_a_tool_call_whose_arguments_are_not_json_is_sent_back_as_written():
    """A model does not always write valid JSON arguments; a client sends its calls back as they came."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    _check(tools=[WEATHER], messages=[{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "18"}])
    assert json.loads(structured.call_text(call).split("\n")[1]) == {"name": "get_weather",
                                                                     "arguments": "{city: Paris"}
    call["function"]["arguments"] = '{"city": "Paris"}'
    assert json.loads(structured.call_text(call).split("\n")[1])["arguments"] == {"city": "Paris"}


def test_forced_call_grammar_and_parse():
    body = {**AUTO, "tools": [WEATHER, {"type": "function", "function": {"name": "noop"}}], "tool_choice": "required"}
    g = structured.grammar(body)["json_schema"]
    assert [b["properties"]["name"]["const"] for b in g["anyOf"]] == ["get_weather", "noop"]
    content, calls = structured.parse(body, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "job1")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    message, reason = structured.message(body, '{"name": "noop", "arguments": {}}', "stop", "job1")
    assert reason == "tool_calls" and message["tool_calls"][0]["id"] == "call_job1_0"


def test_auto_parse_keeps_content_and_bad_blocks():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = structured.parse(AUTO, text, "j")
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    broken = "x <tool_call>{not json}</tool_call>"
    assert structured.parse(AUTO, broken, "j") == (broken, [])
    assert structured.message({}, "plain", "stop", "j") == ({"role": "assistant", "content": "plain"}, "stop")


def test_stream_splitter_holds_back_a_possible_tag_and_sends_calls_at_the_end():
    sp = structured.StreamSplitter(AUTO, "j")
    pieces = ["Hel", "lo <to", "ol_call>\n", '{"name": "get_weather", "arguments": {}}', "\n</tool_call>"]
    assert [sp.feed(p) for p in pieces] == ["Hel", "lo ", "", "", ""]
    rest, calls = sp.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_weather"
    sp = structured.StreamSplitter(AUTO, "j")
    assert [sp.feed(p) for p in ["a <", "b"]] == ["a ", "<b"]
    assert sp.finish() == ("", [])
    plain = structured.StreamSplitter({}, "j")
    assert plain.feed("<tool") == "<tool" and plain.finish() == ("", [])
