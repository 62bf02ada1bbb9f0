"""The engine must reproduce transformers token for token, whatever the batching does to it."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tidepool.workers.engine import LLM, LLMEngine, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.scheduler import ScheduledBatch
from tidepool.workers.engine.sequence import Sequence

MAX_TOKENS = 12
_reference_cache: dict = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    key = (model_dir, tuple(map(tuple, prompts)), max_tokens)
    if key not in _reference_cache:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=0)
                outs.append(ids[0, len(p):].tolist())
        _reference_cache[key] = outs
    return _reference_cache[key]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

SCENARIOS = {
    # name: (engine overrides, shared prefix, stat that must show the scenario really happened)
    "staggered": (dict(), 0, None),
    "preemption": (dict(num_kv_blocks=40, block_size=8), 0, "preemptions"),
    "chunked-prefill": (dict(max_num_batched_tokens=48), 0, "chunked"),
    "prefix-cache": (dict(), 96, "prefix_cache_hits"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_parity_llama_scenarios(tiny_model_dir, random_prompts, run_staggered, scenario):
    model_dir = tiny_model_dir("llama-gqa")
    overrides, shared, must_see = SCENARIOS[scenario]
    engine = LLMEngine(EngineConfig(model=model_dir, **overrides))
    prompts = random_prompts(16, engine.config.model_config.vocab_size, seed=3, shared_prefix=shared)
    assert min(map(len, prompts)) == 1 + 0 and max(map(len, prompts)) >= 300
    got = run_staggered(engine, prompts, GREEDY)
    assert got == hf_greedy(model_dir, prompts)
    stats = engine.stats()
    if must_see == "chunked":
        assert max(map(len, prompts)) > overrides["max_num_batched_tokens"]
        assert stats["last_step"]["tokens"] <= overrides["max_num_batched_tokens"]
    elif must_see:
        assert stats[must_see] > 0, stats
    assert stats["kv_blocks_used"] == 0, "every block must be returned when all requests finished"


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "llama3-rope", "mistral", "llama-legacy-config"])
def test_greedy_parity_architectures_under_stress(tiny_model_dir, random_prompts, run_staggered, variant):
    """Each architecture under everything at once: small pool, small budget, shared prefixes, staggered."""
    model_dir = tiny_model_dir(variant)
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=48, block_size=8, max_num_batched_tokens=64))
    prompts = random_prompts(16, engine.config.model_config.vocab_size, seed=5, shared_prefix=40)
    got = run_staggered(engine, prompts, GREEDY, every=3)
    assert got == hf_greedy(model_dir, prompts)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_prefill_logits_match_transformers(tiny_model_dir, random_prompts, variant):
    """Last-position logits of every prefix length of a prompt, computed in one mixed batch, within 1e-4."""
    model_dir = tiny_model_dir(variant)
    engine = LLMEngine(EngineConfig(model=model_dir))
    vocab = engine.config.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=11, lengths=(200, 200))[0]
    lengths = [1, 2, 15, 16, 17, 33, 100, 200]
    seqs = [Sequence(f"p{n}", prompt[:n], GREEDY) for n in lengths]
    batch = ScheduledBatch()
    for seq in seqs:
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(seq.num_tokens)
    logits = engine.runner.run(batch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    for row, n in enumerate(lengths):
        torch.testing.assert_close(logits[row], ref[n - 1], atol=1e-4, rtol=0)


def test_llm_generate_matches_transformers_and_reports_outputs(tiny_model_dir, random_prompts):
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir, max_num_seqs=4)     # fewer slots than prompts: later ones wait their turn
    prompts = random_prompts(6, llm.tokenizer.vocab_size, seed=9, lengths=(5, 60))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, prompts)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_text_prompt_is_tokenized_like_transformers(tiny_model_dir):
    from transformers import AutoTokenizer
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir)
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    text = "The octopus hides in a crack of the reef."
    out = llm.generate([text], GREEDY)[0]
    assert out.prompt_token_ids == hf_tok(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert llm.tokenizer.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
