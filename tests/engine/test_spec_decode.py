"""Speculative decoding: the target's outputs, token for token (greedy) or in distribution (sampling), whatever
is drafted, batched, chunked, preempted or cached; and the policy that decides who drafts."""
import random

import pytest
from scipy.stats import chi2_contingency

from tests.engine.test_parity import hf_greedy
from tidepool.workers.engine import LLM, LLMEngine, SamplingParams
from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.cost_model import CostModel
from tidepool.workers.engine.drafters import NgramDrafter
from tidepool.workers.engine.scheduler import Scheduler
from tidepool.workers.engine.sequence import Sequence, SequenceStatus
from tidepool.workers.engine.config import SpeculativeConfig
from tidepool.workers.engine.spec_decode import RETRY_EVERY, Speculator, match_bucket

FORCED = {"method": "ngram", "num_tokens": 4, "adaptive": False}     # every eligible decode drafts
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive_prompts(n: int, vocab: int, seed: int, lengths=(12, 120)) -> list[list[int]]:
    """Prompts that repeat a phrase with a little noise (what prompt lookup is for), a few plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.randint(*lengths)
        if i % 4 == 3:
            prompts.append([rng.randint(3, vocab - 1) for _ in range(length)])
            continue
        phrase = [rng.randint(3, vocab - 1) for _ in range(rng.randint(3, 9))]
        body = []
        while len(body) < length:
            body += phrase if rng.random() < 0.8 else [rng.randint(3, vocab - 1)]
        prompts.append(body[:length])
    return prompts


def run(engine, prompts, params, classes=None, every=2):
    """One request every `every` steps; returns each request's final output."""
    pending = list(enumerate(prompts))
    results, step = {}, 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            p = params[i] if isinstance(params, list) else params
            engine.add_request(f"r{i}", prompt, p, sla_class=classes[i] if classes else "realtime")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(min_n=1, max_n=3)
    assert d.lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2) == [7, 2]        # the latest occurrence wins
    assert d.lookup([8, 2, 3, 9, 1, 5, 3], 2) == [9, 1]                 # falls back to shorter n-grams
    assert d.lookup([1, 2, 3], 2) == [] and d.lookup([5], 4) == [] and d.lookup([1, 1], 0) == []
    assert d.lookup([256, 1, 256], 2) == [1, 256]                       # byte search stays on token edges
    assert d.lookup([(3 << 16) + 1, 7, 1], 2) == []
    assert NgramDrafter(min_n=2, max_n=2).lookup([4, 5, 6, 5], 2) == []


def test_speculative_config_from_dict_text_and_bad_values(tiny_model_dir):
    assert SpeculativeConfig.parse("ngram:6") == SpeculativeConfig(method="ngram", num_tokens=6)
    assert SpeculativeConfig.parse(None).method == "none" and not SpeculativeConfig.parse("none").enabled
    assert SpeculativeConfig.parse({"method": "draft", "draft_model": "/m"}).draft_model == "/m"
    for bad in ("beam:4", "ngram:x", {"method": "ngram", "num_tokens": 0}, {"method": "draft"},
                {"method": "ngram", "k": 4}, 7):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    llm = LLM(tiny_model_dir("llama-gqa"), speculative={"method": "ngram", "num_tokens": 4})
    assert llm.engine.config.speculative == SpeculativeConfig(method="ngram", num_tokens=4)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=tiny_model_dir("llama-gqa"), speculative="ngram:99")


# name: (engine overrides, classes by request index, stat that must show the scenario happened)
SCENARIOS = {
    "staggered": (dict(), None, None),
    "chunked-prefill": (dict(max_num_batched_tokens=48), None, "chunked"),
    "prefix-cache": (dict(), None, "prefix_cache_hits"),
    "suspend": (dict(max_num_seqs=4, online_reserve=0.0), "mixed", "suspend"),
    "swap": (dict(num_kv_blocks=48, block_size=8, swap_space_gib=0.001), "mixed", "swap"),
    "recompute": (dict(num_kv_blocks=48, block_size=8, swap_space_gib=0.0), "mixed", "recompute"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_outputs_equal_a_run_without_speculation(tiny_model_dir, scenario):
    model_dir = tiny_model_dir("llama-gqa")
    overrides, classes, must_see = SCENARIOS[scenario]
    vocab = EngineConfig(model=model_dir).model_config.vocab_size
    prompts = repetitive_prompts(12, vocab, seed=11)
    if scenario == "prefix-cache":
        prompts = [prompts[0][:64] + p if i % 2 else p for i, p in enumerate(prompts)]
    if classes == "mixed":      # offline first, the last third realtime while they run
        classes = ["batch"] * 8 + ["realtime"] * 4
    # every third request opts out: speculating and plain decodes share the steps
    params = [SamplingParams(**{**GREEDY.__dict__, "speculate": i % 3 != 1}) for i in range(len(prompts))]
    plain = run(LLMEngine(EngineConfig(model=model_dir, **overrides)), prompts, params, classes)
    engine = LLMEngine(EngineConfig(model=model_dir, speculative=FORCED, **overrides))
    spec = run(engine, prompts, params, classes)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    if scenario == "staggered":
        assert [o.token_ids for o in spec] == hf_greedy(model_dir, prompts, max_tokens=24)
    stats = engine.stats()
    tally = {k: sum(c[k] for c in stats["spec_decode"]["ngram"].values()) for k in ("drafted", "accepted")}
    assert tally["accepted"] > 0 and tally["drafted"] > tally["accepted"], stats["spec_decode"]
    if must_see == "chunked":
        assert max(map(len, prompts)) > overrides["max_num_batched_tokens"]
    elif must_see in ("suspend", "swap", "recompute"):
        assert stats["preemptions_by_kind"][must_see] > 0, stats
    elif must_see:
        assert stats[must_see] > 0, stats
    assert stats["kv_blocks_used"] == 0 and stats["total_generation_tokens"] == 24 * len(prompts)


def test_stop_strings_logprobs_grammars_and_n_keep_their_meaning(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    vocab = EngineConfig(model=model_dir).model_config.vocab_size
    prompts = repetitive_prompts(8, vocab, seed=5, lengths=(30, 60))
    plain_run = run(LLMEngine(EngineConfig(model=model_dir)), prompts[:1], GREEDY)[0]
    stop = plain_run.text[len(plain_run.text) // 2:][:3]    # a stop string the greedy text reaches
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, structured={"regex": "(ab|cd){2,6}x"}),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, seed=3, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0.8, seed=9, structured={"json_object": True}),
    ]
    plain = run(LLMEngine(EngineConfig(model=model_dir)), prompts, params)
    engine = LLMEngine(EngineConfig(model=model_dir, speculative=FORCED))
    spec = run(engine, prompts, params)
    for a, b in zip(plain, spec):
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason)
        assert [(c.token_ids, c.text, c.finish_reason) for c in b.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in a.outputs]
        if a.logprobs is not None:
            assert [e["token_id"] for e in b.logprobs] == [e["token_id"] for e in a.logprobs]
            assert [e["logprob"] for e in b.logprobs] == pytest.approx([e["logprob"] for e in a.logprobs], abs=1e-4)
    assert spec[0].finish_reason == "stop" and stop not in spec[0].text
    assert spec[2].finish_reason == "stop" and spec[2].text.endswith("x")
    assert sum(c["accepted"] for c in engine.stats()["spec_decode"]["ngram"].values()) > 0
    assert engine.stats()["kv_blocks_used"] == 0


def test_one_stream_event_per_step_carries_every_accepted_token(tiny_model_dir):
    model_dir = tiny_model_dir("llama-gqa")
    engine = LLMEngine(EngineConfig(model=model_dir, speculative=FORCED))
    prompt = repetitive_prompts(1, engine.config.model_config.vocab_size, seed=11)[0]
    events = []
    engine.add_request("x", prompt, GREEDY, sla_class="realtime", on_token=events.append)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert sum(len(e.new_token_ids) for e in events) == 24 and len(events) < 24 and len(events) <= steps
    assert "".join(e.delta_text for e in events) == events[-1].text
    assert events[-1].finished and events[-1].token_ids == [t for e in events for t in e.new_token_ids]


class TableDrafter(NgramDrafter):
    """Proposes a fixed continuation for the contexts in its table (nothing elsewhere)."""
    method = "ngram"

    def __init__(self, table: dict[tuple, list[int]]):
        super().__init__()
        self.table = table

    def propose(self, seqs, ks):
        return [self.table.get(tuple(s.token_ids), [])[:k] for s, k in zip(seqs, ks)]


def _joint_counts(model_dir, seeds, prompt, table=None):
    speculative = {"method": "ngram", "num_tokens": 2, "adaptive": False} if table else None
    engine = LLMEngine(EngineConfig(model=model_dir, speculative=speculative))
    if table:
        engine.speculator.drafter = TableDrafter(table)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=s, ignore_eos=True) for s in seeds]
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", prompt, p, sla_class="realtime")
    counts: dict[tuple, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                key = tuple(out.token_ids)
                counts[key] = counts.get(key, 0) + 1
    return counts, engine.stats()


def test_sampled_distribution_is_unchanged_chi_square(tiny_model_dir):
    """Three sampled tokens (top-2 at temperature 1: eight outcomes) drawn 600 times each way, with disjoint
    seeds: with speculation and without, the joint distributions agree. The drafter guesses the second token
    as the target's most likely one, so drafts are accepted and rejected about as often."""
    model_dir = tiny_model_dir("llama-gqa")
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    llm = LLM(model_dir)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0].logprobs[0]
    table = {}
    for token, _ in first["top"]:
        second = llm.generate([prompt + [token]], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
        table[tuple(prompt + [token])] = second
    n = 600
    plain, _ = _joint_counts(model_dir, range(n), prompt)
    spec, stats = _joint_counts(model_dir, range(n, 2 * n), prompt, table)
    tally = stats["spec_decode"]["ngram"]["realtime"]
    assert tally["drafted"] > n // 3 and 0.2 * tally["drafted"] < tally["accepted"] < 0.95 * tally["drafted"], tally
    keys = sorted(set(plain) | set(spec))
    table = [[plain.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]]
    assert len(keys) >= 4 and chi2_contingency(table).pvalue > 0.01, table


# -- policy -----------------------------------------------------------------------------------------


def _running(scheduler, n, sla_class, length=40, vocab=50):
    rng = random.Random(n)
    phrase = [rng.randint(3, vocab) for _ in range(5)]
    seqs = []
    for i in range(n):
        seq = Sequence(f"{sla_class}{i}", (phrase * 10)[:length], SamplingParams(max_tokens=64), sla_class=sla_class)
        seq.token_ids.append(phrase[length % 5])            # a sampled token, not yet computed: a decode
        seq.num_computed_tokens = length
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def _scheduler(max_num_seqs=64):
    return Scheduler(BlockManager(512, 16), max_num_seqs, 2048)


def test_policy_online_drafts_while_it_pays_and_offline_only_when_it_raises_throughput():
    cpu = CostModel(fixed=0.040, per_token=0.0003, per_context=1e-7)     # a CPU-like step: mostly fixed cost
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    sched = _scheduler()
    online = _running(sched, 1, "realtime")
    offline = _running(sched, 3, "batch")
    chosen = spec.propose(sched, cpu, 4096)
    assert online[0] in chosen and len(online[0].draft_token_ids) == 4
    assert all(s in chosen for s in offline)              # small batch: drafts raise predicted tok/s
    # Under full load (work waits for a seat) offline sequences stop drafting; online ones go on.
    for s in chosen:
        s.draft_token_ids = []
    waiting = Sequence("w", [1, 2, 3], SamplingParams(), sla_class="batch")
    sched.add(waiting)
    chosen = spec.propose(sched, cpu, 4096)
    assert chosen == [online[0]]
    # A big batch where tokens, not the fixed cost, dominate: offline drafts no longer pay.
    sched = _scheduler(256)
    big = _running(sched, 200, "batch")
    heavy = CostModel(fixed=0.040, per_token=0.004, per_context=1e-7)
    assert spec.propose(sched, heavy, 4096) == [] and not any(s.draft_token_ids for s in big)


def test_policy_k_follows_acceptance_and_room():
    cpu = CostModel(fixed=0.040, per_token=0.0005, per_context=0.0)
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    sched = _scheduler()
    seq = _running(sched, 1, "realtime")[0]
    assert spec.choose_k(seq, 4, 0.041, cpu) == 4                    # prior 0.5: extra tokens cost little
    assert spec.choose_k(seq, 4, 0.041, CostModel(0.040, 0.002, 0.0)) == 3     # dearer tokens: fewer
    assert spec.choose_k(seq, 4, 0.041, CostModel(0.040, 0.030, 0.0)) == 0
    for _ in range(6):
        spec.record(seq, 4, 0)                                       # nothing accepted: stop drafting ...
    ks = [spec.choose_k(seq, 4, 0.041, cpu) for _ in range(16)]
    assert ks.count(0) == 14 and ks.count(1) == 2                   # ... but for a probe now and then
    seq.params = SamplingParams(max_tokens=seq.num_output_tokens + 2)
    assert spec.room(seq, 4096) == 1                                 # the last token is always the target's
    assert spec.room(seq, seq.num_tokens + 1) == 1
    seq.params = SamplingParams(max_tokens=64, speculate=False)
    seq.draft_token_ids = []
    assert spec.propose(sched, cpu, 4096) == []


def test_online_drafts_run_whole_and_are_trimmed_to_the_token_budget():
    cost = CostModel(fixed=0.040, per_token=0.004, per_context=0.0)
    for budget, want in ((2048, 7), (3, 3)):
        sched = Scheduler(BlockManager(512, 16), 64, budget, cost_model=cost,
                          sla_targets={"realtime": {"ttft_ms": 600, "itl_ms": 50}})
        seq = _running(sched, 1, "realtime")[0]
        assert sched.block_manager.allocate(seq, 0)           # the blocks of its computed tokens
        seq.draft_token_ids = [1, 2, 3, 4, 5, 6]
        batch = sched.schedule()
        # online work runs whole (the step policy); spec_decode sized k for the cost model, the budget trims it
        assert batch.num_new_tokens == [want] and seq.draft_token_ids == [1, 2, 3, 4, 5, 6][:want - 1]
        sched.postprocess(batch)
        assert seq.num_computed_tokens == seq.num_tokens      # drafts count only once the engine verified them


# -- draft model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["itself", "smaller"])
def test_draft_model_drafter_keeps_greedy_outputs(tiny_model_dir, tmp_path, draft):
    """A draft model of the same tokenizer: the target itself (drafts almost always accepted) or a smaller random
    one (mostly rejected); a pool of 12 blocks makes shadows get dropped and catch up again."""
    from tidepool.workers.tools.tiny_model import make_tiny_model
    model_dir = tiny_model_dir("llama-gqa")
    draft_dir = model_dir if draft == "itself" else str(make_tiny_model(tmp_path / "draft", seed=5, init_std=0.08,
                                                                        hidden_size=32, num_hidden_layers=1))
    overrides = dict(num_kv_blocks=48, block_size=8, swap_space_gib=0.0)
    vocab = EngineConfig(model=model_dir).model_config.vocab_size
    prompts = repetitive_prompts(10, vocab, seed=4, lengths=(12, 40))
    classes = ["batch"] * 6 + ["realtime"] * 4
    plain = run(LLMEngine(EngineConfig(model=model_dir, **overrides)), prompts, GREEDY, classes)
    engine = LLMEngine(EngineConfig(model=model_dir, speculative={"method": "draft", "draft_model": draft_dir,
                                                                  "num_tokens": 3, "adaptive": False,
                                                                  "draft_kv_blocks": 12}, **overrides))
    spec = run(engine, prompts, GREEDY, classes)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    tally = engine.stats()["spec_decode"]["draft"]
    drafted = sum(c["drafted"] for c in tally.values())
    accepted = sum(c["accepted"] for c in tally.values())
    assert drafted > 0 and (accepted > 0.9 * drafted if draft == "itself" else accepted < drafted)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.speculator.drafter.blocks.num_used_blocks == 0


def test_draft_model_must_share_the_tokenizer(tiny_model_dir, tmp_path):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    other = make_tiny_model(tmp_path / "other", seed=1, vocab_size=600)
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"),
                               speculative={"method": "draft", "draft_model": str(other)}))


def test_an_offline_sequence_whose_drafts_missed_is_probed_and_drafts_again_once_they_hit():
    """A sequence whose drafts miss stops drafting at once, however long its n-gram match; it is probed every
    RETRY_EVERY steps (a probe is judged at the prior inside the throughput test, or one early miss, a copy not
    begun yet, would end drafting for the rest of the sequence), and drafts in full again once a probe hits."""
    cpu = CostModel(fixed=0.040, per_token=0.0003, per_context=1e-7)
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    sched = _scheduler()
    seq = _running(sched, 1, "batch")[0]
    assert spec.propose(sched, cpu, 4096) == [seq] and len(seq.draft_token_ids) == 4    # a long match: k = 4
    spec.record(seq, 4, 0)                                      # ... and all of it missed
    drafted = []
    for _ in range(2 * RETRY_EVERY):
        seq.draft_token_ids = []
        drafted.append(len(seq.draft_token_ids) if spec.propose(sched, cpu, 4096) == [seq] and
                       (seq.draft_token_ids or None) else 0)
    assert drafted.count(1) == 2 and drafted.count(0) == 2 * RETRY_EVERY - 2     # a probe every RETRY_EVERY steps
    spec.record(seq, 1, 1)                                      # the probe hit: the copy has begun
    seq.draft_token_ids = []
    assert spec.propose(sched, cpu, 4096) == [seq] and len(seq.draft_token_ids) > 1


def test_acceptance_follows_the_match_length_and_is_learned_per_class():
    """A draft backed by a long n-gram match is trusted more than one backed by a single token; verified drafts
    move the class's rate for their match length, and a realtime stream beside offline work drafts only the
    positions that raise the step's predicted tokens per second."""
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    sched = _scheduler()
    seq = _running(sched, 1, "realtime")[0]
    short, long = match_bucket(1), match_bucket(16)
    assert spec.base_acceptance(seq, short) < 0.5 < 0.9 < spec.base_acceptance(seq, long)
    before = spec.base_acceptance(seq, long)
    for _ in range(20):
        spec._state(seq)[3] = long
        spec.record(seq, 4, 1)
    assert spec.base_acceptance(seq, long) < before - 0.3                 # learned: long matches miss here
    other = _running(_scheduler(), 1, "interactive")[0]
    assert spec.base_acceptance(other, long) == before                    # per class
    # Beside a large offline batch on a token-bound device, a draft must beat the batch's own tokens/s.
    sched = _scheduler(256)
    online = _running(sched, 1, "realtime", length=41)[0]
    _running(sched, 100, "batch")
    heavy = CostModel(fixed=0.004, per_token=0.004, per_context=0.0)      # the fixed cost is 1% of the step
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    assert spec.propose(sched, heavy, 4096) == [] and online.draft_token_ids == []
    light = CostModel(fixed=0.040, per_token=0.0001, per_context=0.0)
    assert online in spec.propose(sched, light, 4096) and len(online.draft_token_ids) == 4
