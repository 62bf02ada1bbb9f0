"""Several choices (n, best_of) end to end through the openai client: web app, one worker process and beat
over Postgres and Redis, with the random-weight model; also /v1/jobs, a batch file and run-batch."""
import io
import json

import jsonschema
import openai
import pytest

from tidepool.workers.batch_runner import run_batch
from tidepool.workers.engine import LLMEngine
from tidepool.workers.engine.config import EngineConfig

from .conftest import served_stack

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"type": "string", "maxLength": 12}}}}}


@pytest.fixture(scope="module")
def st(pg_databases, tiny_model, tmp_path_factory, redis_url):
    yield from served_stack(pg_databases, tiny_model, tmp_path_factory.mktemp("choices"), redis_url, "choices-gpu")


@pytest.fixture(scope="module")
def oa(st):
    _, key = st.tenant()
    return openai.OpenAI(base_url=f"{st.url}/v1", api_key=key, max_retries=0, timeout=120)


def _stream(chunks):
    """{index: (text, finish_reason)} of a streamed response; also the usage, if a chunk carried it."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                assert c.index not in reasons, "one finish chunk per choice"
                reasons[c.index] = c.finish_reason
    return {i: (texts[i], reasons.get(i)) for i in texts}, usage


def test_chat_n_returns_n_choices_and_counts_every_token(oa):
    one = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, seed=3, temperature=1.0,
                                     extra_body={"ignore_eos": True})
    many = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, seed=3, temperature=1.0, n=4,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.choices[0].message.content == one.choices[0].message.content    # choice i: seed + i
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.prompt_tokens == one.usage.prompt_tokens                  # the prompt counted once
    assert many.usage.completion_tokens == 4 * 8 and many.usage.total_tokens == many.usage.prompt_tokens + 32


def test_greedy_n2_equals_n1(oa):
    one = oa.completions.create(model="tiny", prompt="The reef at dawn", max_tokens=12, temperature=0)
    two = oa.completions.create(model="tiny", prompt="The reef at dawn", max_tokens=12, temperature=0, n=2)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2


def test_best_of_returns_the_n_best_and_bills_them_all(oa):
    r = oa.completions.create(model="tiny", prompt="Waves", max_tokens=6, temperature=1.0, seed=2, n=2, best_of=5,
                              logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1] - 1e-4
    assert r.usage.completion_tokens == 5 * 6


def test_streamed_choices_carry_their_index(oa):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, seed=7, temperature=1.0, n=3)
    whole = oa.chat.completions.create(**kwargs)
    got, usage = _stream(oa.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert got == {c.index: (c.message.content, c.finish_reason) for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    got, _ = _stream(oa.completions.create(model="tiny", prompt="Tides", max_tokens=9, seed=1, n=2, stream=True,
                                           logprobs=1))
    whole = oa.completions.create(model="tiny", prompt="Tides", max_tokens=9, seed=1, n=2, logprobs=1)
    assert got == {c.index: (c.text, c.finish_reason) for c in whole.choices}


def test_tool_calls_in_each_choice(oa):
    r = oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, tools=[WEATHER], n=2, seed=4,
                                   tool_choice="required")
    ids = set()
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            ids.add(call.id)
    assert len(ids) == sum(len(c.message.tool_calls) for c in r.choices)      # ids unique across choices


def test_choice_counts_are_validated(oa):
    for kwargs, param in [(dict(n=17), "n"), (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"),
                          (dict(best_of=17), "best_of"), (dict(n=1, best_of=2, stream=True), "best_of")]:
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)
        assert err.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"best_of": 2})
    assert err.value.body["param"] == "best_of"


def test_jobs_api_and_batch_file_carry_every_choice(st, oa):
    _, key = st.tenant()
    client = st.app.test_client()
    auth = {"Authorization": f"Bearer {key}"}
    r = client.post("/v1/jobs", headers=auth, json={"prompt": "Gulls", "max_tokens": 5, "n": 3, "seed": 9,
                                                    "ignore_eos": True, "sla_class": "batch"})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]
    job = st.wait(lambda: (j := client.get(f"/v1/jobs/{job_id}", headers=auth).get_json())["status"] == "completed"
                  and j, 90, "job done")
    assert [c["index"] for c in job["output"]["choices"]] == [0, 1, 2]
    assert job["output"]["choices"][0]["text"] == job["output"]["text"]
    assert job["usage"]["completion_tokens"] == 15
    lines = [{"custom_id": "many", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "Gulls", "max_tokens": 5, "n": 3, "seed": 9, "ignore_eos": True}},
             {"custom_id": "one", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "Gulls", "max_tokens": 5, "seed": 9, "ignore_eos": True}}]
    f = oa.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                        purpose="batch")
    batch = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    batch = st.wait(lambda: (b := oa.batches.retrieve(batch.id)).status == "completed" and b, 120, "batch done")
    out = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, oa.files.content(batch.output_file_id)
                                                               .read().decode().splitlines())}
    texts = [c["text"] for c in out["many"]["choices"]]
    assert texts == [c["text"] for c in job["output"]["choices"]]
    assert out["one"]["choices"][0]["text"] == texts[0]
    assert out["many"]["usage"]["completion_tokens"] == 15


def test_run_batch_carries_every_choice(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "tiny", "prompt": "Gulls", "max_tokens": 5, "seed": 9, "ignore_eos": True}
    src.write_text(json.dumps({"custom_id": "many", "method": "POST", "url": "/v1/completions",
                               "body": {**body, "n": 3, "best_of": 4}}) + "\n")
    counts = run_batch(LLMEngine(EngineConfig(model=tiny_model)), src, dst, "tiny", progress=False)
    assert counts["completed"] == 1
    out = json.loads(dst.read_text())["response"]["body"]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 20


def test_echo_prepends_the_prompt_and_its_logprobs(oa):
    prompt = "The sea at night"
    r = oa.completions.create(model="tiny", prompt=prompt, max_tokens=5, echo=True, n=2, seed=3, logprobs=2,
                              extra_body={"ignore_eos": True})
    plain = oa.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2, seed=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    for echoed, c in zip(r.choices, plain.choices):
        assert echoed.text == prompt + c.text
        lp = echoed.logprobs
        head = len(lp.tokens) - len(c.logprobs.tokens)
        assert head == r.usage.prompt_tokens and "".join(lp.tokens[:head]) == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:head])
        assert all(len(t) == 2 for t in lp.top_logprobs[1:head])
        assert lp.token_logprobs[head:] == c.logprobs.token_logprobs
        assert lp.text_offset[head] == len(prompt)
    assert r.usage.completion_tokens == plain.usage.completion_tokens == 10
    got, _ = _stream(oa.completions.create(model="tiny", prompt=prompt, max_tokens=5, echo=True, n=2, seed=3,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert got == {c.index: (c.text, c.finish_reason) for c in r.choices}
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"echo": True})
    assert err.value.body["param"] == "echo"


def test_run_batch_echo(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "tiny", "prompt": "Gulls", "max_tokens": 3, "echo": True,
                                        "logprobs": 0}}) + "\n")
    assert run_batch(LLMEngine(EngineConfig(model=tiny_model)), src, dst, "tiny", progress=False)["completed"] == 1
    choice = json.loads(dst.read_text())["response"]["body"]["choices"][0]
    assert choice["text"].startswith("Gulls") and choice["logprobs"]["token_logprobs"][0] is None
