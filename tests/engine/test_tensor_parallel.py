"""Tensor parallelism (workers/engine/tensor_parallel.py, models/sharding.py): the sharded layers equal their unsharded
references exactly (integer-valued fp32, so every sum is exact whatever its order) over a real gloo group, through
the shared-memory collectives and through gloo alone; the head split covers every head once for each size a model
allows; and a TP=2 engine gives transformers' greedy tokens under chunked prefill, a shared prefix, every kind of
preemption, LoRA adapters, a step cut, n > 1, grammars and speculative decoding."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_lora import ADAPTERS, ROTATION, expected, lora_setup  # noqa: F401 - the fixture
from tests.engine.test_lora import run_mixed as run_mixed_lora
from tests.engine.test_parity import hf_greedy
from tests.engine.test_preemption_parity import SCENARIOS as PREEMPTION
from tests.engine.test_preemption_parity import run_mixed
from tests.engine.test_step_cut import run_with_an_arrival_mid_step
from tests.engine.tp_layers_rank import check_layers, config
from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
from tidepool.workers.engine.models.sharding import Shard, head_split

TP = dict(tensor_parallel_size=2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.data())
def test_every_rank_holds_whole_kv_groups_and_every_query_head_is_held_once(kv, group, data):
    cfg = config(num_attention_heads=kv * group, num_key_value_heads=kv)
    size = data.draw(st.sampled_from(cfg.tensor_parallel_sizes(16)))
    splits = [head_split(cfg, Shard(r, size)) for r in range(size)]
    held = [h for s in splits for h in range(*s.q)]
    assert sorted(held) == list(range(cfg.num_attention_heads))
    for s in splits:
        assert s.num_heads and s.num_kv_heads <= cfg.kv_heads_per_rank(size)
        assert all(s.kv[0] <= q // group < s.kv[1] for q in range(*s.q))    # its queries' KV heads are its own
        assert s.num_heads == s.num_kv_heads * group or s.num_kv_heads == 1     # the model's grouping, per rank
    held_kv = [h for s in splits for h in range(*s.kv)]      # each KV head once, or by size / kv ranks each
    assert sorted(held_kv) == sorted(list(range(kv)) * max(1, size // kv))


def test_sharded_layers_equal_the_unsharded_ones_over_a_real_group():
    """Rank 1 in a child process (tp_layers_rank.py holds both ranks' checks), rank 0 here; once through the
    shared-memory collectives and once through gloo alone."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)     # a free port for the group
    port = store.port
    del store
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm_file:
        other = torch.multiprocessing.get_context("spawn").Process(target=check_layers,
                                                                   args=(1, 2, port, shm_file.name))
        other.start()
        check_layers(0, 2, port, shm_file.name)
        other.join(60)
    assert other.exitcode == 0


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama-tied"])
def test_tp2_greedy_parity_under_chunked_prefill_and_a_shared_prefix(tiny_model_dir, random_prompts, run_staggered,
                                                                     variant):
    """llama-gqa splits its KV heads, qwen2-bias (one KV head) replicates it on both ranks and splits the queries and
    the q/k/v biases, llama-tied shares the vocabulary-parallel rows between embedding and LM head."""
    model_dir = tiny_model_dir(variant)
    engine = LLMEngine(EngineConfig(model=model_dir, max_num_batched_tokens=48, **TP))
    prompts = random_prompts(8, engine.config.model_config.vocab_size, seed=3, lengths=(20, 90), shared_prefix=40)
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got == hf_greedy(model_dir, prompts)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("scenario", ["swap", "recompute"])
def test_tp2_greedy_parity_with_each_preemption_kind(tiny_model_dir, random_prompts, scenario):
    model_dir = tiny_model_dir("llama-gqa")
    overrides, must, _ = PREEMPTION[scenario]
    engine = LLMEngine(EngineConfig(model=model_dir, **overrides, **TP))
    prompts = random_prompts(12, engine.config.model_config.vocab_size, seed=7, lengths=(20, 90))
    assert run_mixed(engine, prompts) == hf_greedy(model_dir, prompts)
    assert engine.stats()["preemptions_by_kind"][must] > 0


def test_tp2_lora_adapters_give_peft_tokens(lora_setup, random_prompts):
    """Column-parallel stacks hold their rows of each B, row-parallel ones their columns of each A (the partial
    products summed by the layer's all-reduce); adapters are filled into slots on every rank as rank 0 fills them."""
    model_dir, loras = lora_setup
    engine = LLMEngine(EngineConfig(model=model_dir, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
                                    max_num_batched_tokens=40, **TP))
    prompts = random_prompts(10, engine.config.model_config.vocab_size, seed=7, lengths=(20, 70), shared_prefix=24)
    names = [ROTATION[i % len(ROTATION)] for i in range(len(prompts))]
    assert run_mixed_lora(engine, prompts, names, loras) == expected(model_dir, loras, prompts, names)
    stats = engine.stats()["lora"]
    assert set(stats["tokens"]) == set(ADAPTERS) and stats["evicted"] > 0


def test_tp2_step_cut_changes_no_token(tiny_model_dir):
    """A cut-in step runs on every rank between the same two layers of the step in flight."""
    model = tiny_model_dir("llama-gqa")
    cut, first, stats = run_with_an_arrival_mid_step(model, step_cut=True, **TP)
    whole, _, _ = run_with_an_arrival_mid_step(model, step_cut=False)
    assert stats["total_step_cuts"] == 1 and first[0] == "b"
    assert cut == whole


def test_tp2_choices_grammars_and_speculation_match_tp1(tiny_model_dir, random_prompts):
    model_dir = tiny_model_dir("llama-gqa")
    prompts = random_prompts(4, 200, seed=11, lengths=(10, 40))
    params = [SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, structured={"regex": r"[a-c]{3,8}"}),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]

    def outputs(**kw):
        engine = LLMEngine(EngineConfig(model=model_dir, speculative={"method": "ngram", "num_tokens": 3,
                                                                      "adaptive": False}, **kw))
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
        return done, engine.stats()
    one, _ = outputs()
    two, stats = outputs(**TP)
    assert sum(t["drafted"] for t in stats["spec_decode"]["ngram"].values()) > 0
    assert one.keys() == two.keys()
    assert one == two
