"""Prompt logprobs (SamplingParams.prompt_logprobs): computed in prefill, chunked or not, equal to the model's
distribution; the prompt bypasses the prefix cache so every position is computed."""
import math

import pytest
import torch

from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams


def _run(engine, prompt, params, request_id):
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                final = out
    return final


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_are_the_models_distribution(tiny_model_dir, chunk):
    model_dir = tiny_model_dir("llama-gqa")
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=16, num_kv_blocks=64, calibrate=False,
                                    max_num_batched_tokens=chunk))
    prompt = [(7 * i + 3) % 500 + 1 for i in range(41)]
    _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0), "warm")     # fills the prefix cache
    out = _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, n=2), "p")
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry["token_id"] == prompt[p]
        assert math.isclose(entry["logprob"], ref[p - 1, prompt[p]].item(), abs_tol=1e-4)
        assert [t for t, _ in entry["top"]] == ref[p - 1].topk(3).indices.tolist()
    assert engine.stats()["kv_blocks_used"] == 0
