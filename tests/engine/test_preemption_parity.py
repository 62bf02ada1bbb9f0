"""Every kind of preemption gives token-for-token the greedy outputs of an undisturbed run (transformers)."""
import pytest

from tests.engine.test_parity import GREEDY, hf_greedy
from tidepool.workers.engine import LLMEngine
from tidepool.workers.engine.config import EngineConfig

# name: (engine overrides, preemption kind that must have happened, kinds that must not)
SCENARIOS = {
    "suspend": (dict(max_num_seqs=4, online_reserve=0.0), "suspend", ("swap", "recompute")),
    "swap": (dict(num_kv_blocks=36, block_size=8, swap_space_gib=0.001), "swap", ("recompute",)),
    "recompute": (dict(num_kv_blocks=36, block_size=8, swap_space_gib=0.0), "recompute", ("swap",)),
    "no-evict": (dict(num_kv_blocks=36, block_size=8, capacity_policy="no_evict", online_reserve=0.0), None,
                 ("suspend", "swap", "recompute")),
}


def run_mixed(engine, prompts, every=2):
    """Offline prompts first, one every `every` steps; the last third arrive as realtime while they run."""
    pending = list(enumerate(prompts))
    online_from = len(prompts) - len(prompts) // 3
    results, step = {}, 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY, sla_class="realtime" if i >= online_from else "batch")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_parity_with_each_preemption_kind(tiny_model_dir, random_prompts, scenario):
    model_dir = tiny_model_dir("llama-gqa")
    overrides, must, must_not = SCENARIOS[scenario]
    engine = LLMEngine(EngineConfig(model=model_dir, **overrides))
    prompts = random_prompts(12, engine.config.model_config.vocab_size, seed=7, lengths=(20, 90))
    got = run_mixed(engine, prompts)
    assert got == hf_greedy(model_dir, prompts)
    stats = engine.stats()
    kinds = stats["preemptions_by_kind"]
    if must:
        assert kinds[must] > 0, stats
    assert all(kinds[k] == 0 for k in must_not), stats
    assert (stats["recomputed_tokens"] > 0) == (kinds["recompute"] > 0), stats
    assert stats["kv_blocks_used"] == 0 and stats["swapped"] == 0 and stats["suspended"] == 0
    assert engine.block_manager.host_free == [] or \
        len(engine.block_manager.host_free) == engine.block_manager.num_host_blocks
