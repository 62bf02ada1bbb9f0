"""Sampling behaviour through the public engine API: seeds, stops, penalties, logprobs, abort, streaming."""
import math

import pytest
import torch

from tidepool.workers.engine import LLM, LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama-gqa"))


def test_same_seed_same_output_whatever_else_is_in_the_batch(llm, random_prompts):
    target = [5, 17, 99, 3]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    others = random_prompts(6, llm.tokenizer.vocab_size, seed=2, lengths=(3, 80))
    mixed = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(max_tokens=20, temperature=0.7, seed=i, ignore_eos=True) for i in range(3)]
                         + [params] + [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 3)
    assert mixed[3].token_ids == alone
    different_seed = llm.generate([target], SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids
    assert different_seed != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3,
                                                    ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    eos_engine = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {stop_at}
    try:
        assert llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0))[0].finish_reason == "stop"
        assert llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0] \
            .finish_reason == "length"
    finally:
        llm.engine.eos_token_ids = eos_engine


def test_stop_string_truncates_text_and_is_never_streamed(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa")))
    full = LLM.__new__(LLM)
    full.engine, full.tokenizer, full._counter = engine, engine.tokenizer, 0
    text = full.generate([[7, 8, 9]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    streamed = []
    engine.add_request("s", [7, 8, 9], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
                       on_token=lambda out: streamed.append(out.delta_text))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    assert final.finish_reason == "stop"
    assert final.text == text[:text.index(stop)]
    assert "".join(streamed) == final.text


def test_penalties_discourage_repeats(llm):
    prompt = [11, 12, 13]
    plain = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    penalised = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                      frequency_penalty=2.0, presence_penalty=2.0))[0].token_ids
    assert len(set(penalised)) > len(set(plain))


def test_logprobs_are_the_models_distribution(llm):
    prompt = [21, 22, 23, 24]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(llm.engine.config.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1], -1)
    for step, entry in enumerate(out.logprobs):
        assert entry["token_id"] == out.token_ids[step]
        assert math.isclose(entry["logprob"], ref[step, entry["token_id"]].item(), abs_tol=1e-4)
        top_ids = [t for t, _ in entry["top"]]
        assert top_ids[0] == out.token_ids[step] and len(top_ids) == 5
        assert top_ids == ref[step].topk(5).indices.tolist()


def test_abort_finishes_with_abort_and_frees_blocks(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa")))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort("a")
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].finish_reason == "abort" and len(finished["a"].token_ids) < 100
    assert finished["b"].finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0


def test_streaming_deltas_add_up_to_the_text(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa")))
    prompt = engine.tokenizer.encode("The whale sings to the reef at dawn.")
    deltas = []
    engine.add_request("x", prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
                       on_token=lambda out: deltas.append(out))
    while engine.has_unfinished():
        engine.step()
    assert deltas[-1].finished and len(deltas) == 30
    assert "".join(d.delta_text for d in deltas) == deltas[-1].text == engine.tokenizer.decode(deltas[-1].token_ids)
    assert deltas[0].first_token_time is not None


def test_bad_requests_are_rejected_clearly(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_model_len=64))
    with pytest.raises(ValueError, match="context is 64 tokens"):
        engine.add_request("long", list(range(3, 80)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", [10 ** 6], SamplingParams())
    with pytest.raises(ValueError, match="sla_class"):
        engine.add_request("cls", [1, 2], SamplingParams(), sla_class="urgent")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    engine.add_request("dup", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams())


def test_generation_stops_at_max_model_len(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_model_len=40))
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    out = llm.generate([list(range(3, 33))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 40


def test_repetition_penalty_matches_transformers_greedy(llm):
    from transformers import AutoModelForCausalLM
    prompt = [11, 12, 13, 11, 12]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                repetition_penalty=1.8))[0]
    model = AutoModelForCausalLM.from_pretrained(llm.engine.config.model, dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=20, min_new_tokens=20, do_sample=False, repetition_penalty=1.8, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_min_p_one_keeps_only_the_top_token(llm):
    greedy = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=2.0, min_p=1.0, seed=1,
                                                   ignore_eos=True))[0]
    assert out.token_ids == greedy.token_ids
