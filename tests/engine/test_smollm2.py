"""Parity on the real default model (SmolLM2-135M-Instruct), once it has been pulled (`make test` pulls it)."""
import os
from pathlib import Path

import pytest
import torch

from tidepool.workers.engine import LLM, SamplingParams

MODEL = Path(os.environ.get("TIDEPOOL_MODELS_DIR", "models")) / "smollm2-135m"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                 reason="run `tidepool models pull smollm2-135m` (make test does) to include this")]


def test_smollm2_greedy_matches_transformers_and_answers():
    from transformers import AutoModelForCausalLM
    llm = LLM(str(MODEL), num_kv_blocks=64, max_num_batched_tokens=96)   # chunked prefill and a small pool
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "Write one sentence about the ocean."}]]
    prompts = [tok.encode_chat(c) for c in chats] + [tok.encode("The quick brown fox"), tok.encode("1, 2, 3, 4,")]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in outs[0].text
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        if ref and ref[-1] in llm.engine.eos_token_ids:
            assert out.finish_reason == "stop"
        assert out.token_ids == ref
