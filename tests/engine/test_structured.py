"""Constrained decoding with the random-weight model: unconstrained its output is noise, constrained it must
parse and validate, whatever the batch, the seed or the preemption."""
import json
import re

import jsonschema
import pytest

from tidepool.workers.engine import LLM, LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.sampling_params import StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "paid": {"type": "boolean"},
        "items": {"type": "array", "minItems": 2, "maxItems": 4,
                  "items": {"type": "object", "required": ["sku", "qty"], "additionalProperties": False,
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "status": {"type": "string", "enum": ["open", "shipped", "closed"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["id", "paid", "items", "status", "note"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama-gqa"))


def _prompts(n):
    return [[5 + i % 40, 7, 9 + i % 3] for i in range(n)]


def test_fifty_seeded_json_schema_requests_validate(llm):
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=i,
                             structured=StructuredOutput(json_schema=SCHEMAS[i % 2])) for i in range(50)]
    outs = llm.generate(_prompts(50), params)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % 2])
    assert len({o.text for o in outs}) > 40        # seeds differ, so do outputs
    assert llm.engine.stats()["structured_masked_rows"] > 0


def test_fifty_seeded_regex_and_choice_requests_match(llm):
    pattern = r"[a-z]{3,8}-[0-9]{2}"
    choices = ["yes", "no", "maybe later"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured={"regex": pattern}) for i in range(50)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured={"choice": choices})
               for i in range(50)]
    outs = llm.generate(_prompts(100), params)
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(pattern, o.text) for o in outs[:50]), [o.text for o in outs[:50]]
    assert all(o.text in choices for o in outs[50:])
    assert {o.text for o in outs[50:]} == set(choices)


def test_fifty_seeded_json_object_requests_are_objects(llm):
    """Any JSON object: the noise model's free strings can outrun max_tokens (finish_reason 'length', as with
    any model); every one that stops parses as an object and every cut one is a prefix the grammar accepts."""
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured={"json_object": True})
              for i in range(50)]
    outs = llm.generate(_prompts(50), params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 5
    for out in stopped:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:
        assert out.text.startswith("{")
        llm.engine.structured.matcher(StructuredOutput(json_object=True), out.token_ids)   # raises if off-grammar


def test_greedy_constrained_output_is_batch_independent(tiny_model_dir, run_staggered, random_prompts):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa")))
    prompts = random_prompts(8, engine.config.model_config.vocab_size, seed=3, lengths=(5, 60))
    params = [SamplingParams(max_tokens=400, temperature=0.0, structured={"json_schema": SCHEMAS[i % 2]})
              for i in range(8)]
    alone = []
    for prompt, p in zip(prompts, params):
        engine.add_request("solo", prompt, p)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    alone.append(out.token_ids)
    batched = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        if i % 2:
            for out in engine.step():
                if out.finished:
                    batched[out.request_id] = out.token_ids
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                batched[out.request_id] = out.token_ids
    assert [batched[f"r{i}"] for i in range(8)] == alone
    for ids, schema in zip(alone, params):
        jsonschema.validate(json.loads(engine.tokenizer.decode(ids)), schema.structured.json_schema)


def test_grammar_state_survives_preemption(tiny_model_dir, random_prompts):
    model_dir = tiny_model_dir("llama-gqa")
    roomy = LLMEngine(EngineConfig(model=model_dir))
    prompts = random_prompts(10, roomy.config.model_config.vocab_size, seed=11, lengths=(20, 50))
    params = SamplingParams(max_tokens=400, temperature=0.0, structured={"json_schema": ORDER})

    def run(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, sla_class="batch")
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[f"r{i}"].token_ids for i in range(len(prompts))]

    expected = run(roomy)
    for swap_gib, kind in ((0.0, "recompute"), (0.001, "swap")):
        tight = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=40, block_size=8, swap_space_gib=swap_gib))
        assert run(tight) == expected
        assert tight.stats()["preemptions_by_kind"][kind] > 0
    for ids in expected:
        jsonschema.validate(json.loads(roomy.tokenizer.decode(ids)), ORDER)


def test_grammar_rebuilt_from_tokens_continues_where_it_stopped(llm):
    spec = StructuredOutput(json_schema=PERSON)
    out = llm.generate([[5, 7, 9]], SamplingParams(max_tokens=300, seed=1, structured=spec))[0]
    ids = out.token_ids
    replayed = llm.engine.structured.matcher(spec, ids[:len(ids) // 2])
    for t in ids[len(ids) // 2:]:
        assert replayed.accept_token(t)
    assert replayed.is_terminated()


@pytest.mark.parametrize("structured, reason", [
    ({"json_schema": {"type": "strin"}}, "strin"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
    ({"regex": "(?<=a)b"}, "regex"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"grammar": "x"}, "grammar"),
])
def test_bad_grammar_is_a_value_error_at_add_request(llm, structured, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured=structured))
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5, 7]], SamplingParams(max_tokens=5, structured={"choice": ["ok"]}))[0]
    assert out.text == "ok"


def test_unconstrained_rows_beside_constrained_ones_are_untouched(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], plain)[0].token_ids
    mixed = llm.generate([[9, 8, 7], [5, 7, 9]], [plain, SamplingParams(max_tokens=30, structured={"json_schema": PERSON})])
    assert mixed[0].token_ids == alone


def test_warm_up_builds_the_compiler_before_any_request(tiny_model_dir):
    import torch

    from tidepool.workers.engine.structured import StructuredDecoding
    config = EngineConfig(model=tiny_model_dir("llama-gqa"))
    sd = StructuredDecoding(config.model, config.model_config.vocab_size, config.model_config.eos_token_ids,
                            torch.device("cpu"))
    assert sd._compiler is None
    sd.warm()
    assert sd._compiler is not None and len(sd._cache) == 1
    compiled = next(iter(sd._cache.values()))
    assert sd.compile(StructuredOutput(json_object=True)) is compiled      # the first request finds it ready


NAME_AGE = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def _allowed(sd, grammar, size):
    mask = sd.bitmask([grammar])[0][0]
    return [t for t in range(size) if (int(mask[t // 32]) >> (t % 32)) & 1]


def test_the_mask_admits_only_token_bytes_that_stay_valid_utf8(tiny_model_dir):
    """The mask must not admit token bytes that are not valid UTF-8 inside a JSON string (a surrogate's encoding,
    stray continuation bytes): they decode to U+FFFD and push the string past maxLength. Walks that
    prefer non-ASCII tokens among those the mask allows (any model could pick any of them) must spell valid UTF-8
    that parses and validates; after the lead byte ED only 80-9F may follow (A0-BF would encode a surrogate)."""
    import random

    import torch

    from tidepool.workers.engine.structured import StructuredDecoding
    config = EngineConfig(model=tiny_model_dir("llama-gqa"))
    size = config.model_config.vocab_size
    sd = StructuredDecoding(config.model, size, config.model_config.eos_token_ids, torch.device("cpu"))
    sd.warm()
    vocab = sd.token_bytes
    spec = StructuredOutput(json_schema=NAME_AGE)

    one = {raw[0]: t for t, raw in enumerate(vocab) if len(raw) == 1}     # the byte-level vocabulary's byte tokens
    grammar = sd.matcher(spec, [one[b] for b in b'{"name": "'] + [one[0xED]])
    allowed = set(_allowed(sd, grammar, size))
    assert one[0x80] in allowed and one[0x9F] in allowed
    assert not allowed & {one[b] for b in range(0xA0, 0x100)} and not allowed & {one[b] for b in range(0x80)}

    for walk in range(25):
        rnd, grammar, text = random.Random(walk), sd.matcher(spec), b""
        for _ in range(300):
            allowed = _allowed(sd, grammar, size)
            wide = [t for t in allowed if not vocab[t].isascii()]
            token = rnd.choice(wide if wide and rnd.random() < 0.9 else allowed)
            grammar.accept_token(token)
            if grammar.is_terminated():
                break
            text += vocab[token]
        assert grammar.is_terminated(), text
        jsonschema.validate(json.loads(text.decode("utf-8")), NAME_AGE)


def test_sampled_constrained_strings_hold_no_replacement_characters(llm):
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=StructuredOutput(json_schema=NAME_AGE))
              for i in range(30)]
    for out in llm.generate(_prompts(30), params):
        assert "\ufffd" not in out.text, out.text
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), NAME_AGE)
