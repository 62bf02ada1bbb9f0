"""LoRA adapters in one batch: greedy outputs equal transformers + peft (adapter applied, not merged) token for
token for adapters of different ranks and target modules mixed with base-model requests, under chunked prefill,
each kind of preemption, prefix-cache hits and slot eviction; slots are evicted least recently used first and
pinned adapters never; a loading adapter holds up no one; a folder that does not fit is refused with the reason."""
import json
import threading

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tidepool.workers.engine import LLMEngine, LoRAError, LoRARequest, SamplingParams
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.lora import check_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ADAPTERS = {   # name: LoraConfig arguments (different ranks, modules, alphas, rsLoRA)
    "a-qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b-all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]),
    "c-od-r16": dict(r=16, lora_alpha=32, target_modules=["o_proj", "down_proj"]),
    "d-kgu-r2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj", "up_proj"], use_rslora=True),
}
ROTATION = [None, *ADAPTERS]
# name: (engine overrides, stat that must show the scenario happened)
SCENARIOS = {
    "mixed": (dict(), None),
    "chunked-prefill": (dict(max_num_batched_tokens=40), None),
    "suspend": (dict(max_num_seqs=4, online_reserve=0.0), ("preemptions_by_kind", "suspend")),
    "swap": (dict(num_kv_blocks=36, block_size=8, swap_space_gib=0.001), ("preemptions_by_kind", "swap")),
    "recompute": (dict(num_kv_blocks=36, block_size=8, swap_space_gib=0.0), ("preemptions_by_kind", "recompute")),
    "slot-eviction": (dict(max_loras=2, max_cpu_loras=2), ("lora", "evicted")),
}


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("llama-gqa")
    root = tmp_path_factory.mktemp("adapters")
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))
        with torch.no_grad():       # larger than the default init, so every adapter changes the greedy tokens
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        peft_model.save_pretrained(root / name)
    return model_dir, {name: LoRARequest(name, str(root / name)) for name in ADAPTERS}


_reference: dict = {}


def peft_greedy(model_dir, adapter_dir, prompts):
    key = (adapter_dir, tuple(map(tuple, prompts)))
    if key not in _reference:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        model.eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                     pad_token_id=0)
                outs.append(ids[0, len(p):].tolist())
        _reference[key] = outs
    return _reference[key]


def expected(model_dir, loras, prompts, names):
    out = [None] * len(prompts)
    for name in set(names):
        idx = [i for i, n in enumerate(names) if n == name]
        ref = peft_greedy(model_dir, None if name is None else loras[name].path, [prompts[i] for i in idx])
        for i, tokens in zip(idx, ref):
            out[i] = tokens
    return out


def run_mixed(engine, prompts, names, loras, every=2):
    """One request every `every` steps, adapters round-robin; the last third realtime (they preempt the rest)."""
    pending = list(enumerate(prompts))
    online_from = len(prompts) - len(prompts) // 3
    results, step = {}, 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY, sla_class="realtime" if i >= online_from else "batch",
                               lora=None if names[i] is None else loras[names[i]])
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_parity_with_peft(lora_setup, random_prompts, scenario):
    model_dir, loras = lora_setup
    overrides, must = SCENARIOS[scenario]
    engine = LLMEngine(EngineConfig(model=model_dir, **{"max_loras": 4, "max_lora_rank": 16, **overrides}))
    prompts = random_prompts(15, engine.config.model_config.vocab_size, seed=7, lengths=(20, 70), shared_prefix=24)
    names = [ROTATION[i % len(ROTATION)] for i in range(len(prompts))]
    want = expected(model_dir, loras, prompts, names)
    assert len({tuple(want[i]) for i in range(len(ROTATION))}) > 1
    assert run_mixed(engine, prompts, names, loras) == want
    stats = engine.stats()
    if must is not None:
        value = stats[must[0]][must[1]]
        assert value > 0, stats
    assert stats["kv_blocks_used"] == 0 and stats["lora"]["loading"] == 0
    assert set(stats["lora"]["tokens"]) == set(ADAPTERS)
    # calibration timed the decode batch over the (zero) slots for the per-adapter term, and left no plan behind
    assert engine.lora.calibration_slots is None and stats["cost_model"]["per_adapter_s"] >= 0


def test_adapters_differ_from_base_and_prefix_cache_is_per_adapter(lora_setup, random_prompts):
    model_dir, loras = lora_setup
    engine = LLMEngine(EngineConfig(model=model_dir, max_loras=4, num_kv_blocks=64, block_size=16))
    prompt = list(range(5, 74))      # 4 full blocks and a tail

    def run(request_id, lora):
        before = engine.stats()["prefix_cache_hits"]
        engine.add_request(request_id, prompt, GREEDY, lora=lora)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return engine.stats()["prefix_cache_hits"] - before, outs[0].token_ids

    a, b = loras["a-qv-r4"], loras["b-all-r8"]
    runs = [run("n1", None), run("a1", a), run("b1", b), run("a2", a), run("n2", None)]
    assert [hits for hits, _ in runs] == [0, 0, 0, 64, 64]
    outs = [tokens for _, tokens in runs]
    assert outs[0] == outs[4] and outs[1] == outs[3]
    assert outs[1] != outs[0] and outs[2] != outs[0]
    assert [outs[0], outs[1], outs[2]] == expected(model_dir, loras, [prompt] * 3, [None, "a-qv-r4", "b-all-r8"])


def test_eviction_is_lru_and_pinned_adapters_stay(lora_setup):
    model_dir, loras = lora_setup
    engine = LLMEngine(EngineConfig(model=model_dir, max_loras=3, max_cpu_loras=3, calibrate=False))
    pinned = LoRARequest("c-od-r16", loras["c-od-r16"].path, pinned=True)
    order = [pinned, loras["a-qv-r4"], loras["b-all-r8"], loras["d-kgu-r2"], loras["a-qv-r4"],
             loras["b-all-r8"], pinned]
    for i, lora in enumerate(order):
        engine.add_request(f"r{i}", [3, 4, 5, 6], SamplingParams(max_tokens=2), lora=lora)
        while engine.has_unfinished():
            engine.step()
    stats = engine.stats()["lora"]
    assert engine.lora.evictions == ["a-qv-r4", "b-all-r8", "d-kgu-r2"]
    assert stats["resident"] == 3 and "c-od-r16" in stats["resident_adapters"] and stats["pinned"] == ["c-od-r16"]
    assert stats["host_copies"] <= 3 and stats["evicted"] == 3
    # a second pin leaves one of the three slots to the unpinned adapters; a third would leave none
    engine.add_request("x", [3], GREEDY, lora=LoRARequest("b-all-r8", loras["b-all-r8"].path, pinned=True))
    with pytest.raises(LoRAError, match="no slot"):
        engine.add_request("y", [3], GREEDY, lora=LoRARequest("a-qv-r4", loras["a-qv-r4"].path, pinned=True))


def test_a_loading_adapter_holds_up_no_one(lora_setup):
    model_dir, loras = lora_setup
    engine = LLMEngine(EngineConfig(model=model_dir, max_loras=2, calibrate=False))
    gate = threading.Event()
    engine.lora._executor.submit(gate.wait)          # the loader thread is busy: the adapter's load queues
    engine.add_request("lora", [7, 8, 9], GREEDY, lora=loras["b-all-r8"])
    engine.add_request("base", [7, 8, 9], GREEDY)
    done = {}
    for _ in range(MAX_TOKENS + 2):
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert "base" in done and "lora" not in done and engine.stats()["lora"]["loading"] == 1
    gate.set()
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done["base"], done["lora"]] == expected(model_dir, loras, [[7, 8, 9]] * 2, [None, "b-all-r8"])
    assert engine.stats()["lora"]["load_s"] > 0


def test_folders_that_do_not_fit_are_refused(lora_setup, tiny_model_dir, tmp_path):
    model_dir, loras = lora_setup
    cfg = EngineConfig(model=model_dir).model_config
    assert check_adapter(loras["c-od-r16"].path, cfg, 16).modules == ("o_proj", "down_proj")
    with pytest.raises(LoRAError, match="rank 16 exceeds max_lora_rank 8"):
        check_adapter(loras["c-od-r16"].path, cfg, 8)
    other = EngineConfig(model=tiny_model_dir("mistral")).model_config     # other dims
    if other.hidden_size != cfg.hidden_size or other.num_key_value_heads != cfg.num_key_value_heads:
        with pytest.raises(LoRAError, match="the base model needs"):
            check_adapter(loras["b-all-r8"].path, other, 16)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "target_modules": ["lm_head"]}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, cfg.hidden_size)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="not supported"):
        check_adapter(bad, cfg, 16)
    with pytest.raises(LoRAError, match="adapter_config.json"):
        check_adapter(tmp_path, cfg, 16)
    engine = LLMEngine(EngineConfig(model=model_dir, max_loras=2, max_lora_rank=8, calibrate=False))
    with pytest.raises(LoRAError, match="exceeds max_lora_rank"):
        engine.add_request("r", [3, 4], GREEDY, lora=loras["c-od-r16"])
    assert not engine.has_unfinished()
