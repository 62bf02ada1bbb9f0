import random

import pytest

from tidepool.workers.tools.tiny_model import make_tiny_model

# Parity scenarios cover the architectures the engine claims: GQA Llama, tied embeddings, Qwen2 biases,
# llama3 rope scaling, Mistral, and the older config spelling.
TINY_VARIANTS = {
    "llama-gqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "qwen2-bias": dict(arch="qwen2", num_key_value_heads=1),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(arch="mistral"),
    "llama-legacy-config": dict(arch="llama", legacy_config=True),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    cache = {}

    def build(variant: str = "llama-gqa"):
        if variant not in cache:
            cache[variant] = make_tiny_model(tmp_path_factory.mktemp(variant), seed=1, init_std=0.08,
                                             **TINY_VARIANTS[variant])
        return str(cache[variant])
    return build


@pytest.fixture(scope="session")
def run_staggered():
    return run_requests_staggered


def run_requests_staggered(engine, prompts, params, every: int = 2) -> list[list[int]]:
    """Add one request every `every` steps, so requests join a batch that is already running."""
    pending = list(enumerate(prompts))
    results = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def random_prompts():
    return make_random_prompts


def make_random_prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 300), shared_prefix: int = 0):
    """n prompts of random token ids; every other one starts with the same shared_prefix tokens."""
    rng = random.Random(seed)
    prefix = [rng.randint(3, vocab - 1) for _ in range(shared_prefix)]
    prompts = []
    for i in range(n):
        length = lengths[0] if i == 0 else lengths[1] if i == 1 else rng.randint(*lengths)
        body = [rng.randint(3, vocab - 1) for _ in range(length)]
        prompts.append(prefix + body if shared_prefix and i % 2 else body)
    return prompts
