"""Several choices per request (n, best_of): the siblings fork off the first sequence after its prompt is
computed and share its KV blocks (copy-on-write for the partly filled last one)."""
import pytest

from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), block_size=BLOCK, num_kv_blocks=128,
                                  calibrate=False))


def run(engine, prompt, params, request_id="r", streamed=None):
    engine.add_request(request_id, prompt, params, sla_class="batch",
                       on_token=None if streamed is None else streamed.append)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                final = out
    return final


def test_n4_computes_the_prompt_once_and_returns_every_block(engine):
    prompt = list(range(3, 3 + 2 * BLOCK + 5))          # two full blocks and a shared partial one
    before = engine.stats()
    out = run(engine, prompt, SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True), "n4")
    after = engine.stats()
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1       # four seed streams, not one
    assert after["total_prompt_tokens"] - before["total_prompt_tokens"] == len(prompt)     # computed once
    # the prompt once, then each choice's own tokens (its last sampled token is never computed)
    assert after["total_computed_tokens"] - before["total_computed_tokens"] == len(prompt) + 4 * 19
    assert after["forked_seqs"] - before["forked_seqs"] == 3
    assert after["cow_copies"] - before["cow_copies"] == 3      # the partial block: copied for all but the last
    assert out.generated_tokens == 80
    assert after["kv_blocks_used"] == 0 and after["running"] == after["waiting"] == 0


def test_greedy_n2_equals_n1(engine):
    prompt = list(range(40, 40 + BLOCK + 3))
    one = run(engine, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), "g1")
    two = run(engine, prompt, SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True), "g2")
    assert [o.token_ids for o in two.outputs] == [one.token_ids, one.token_ids]
    assert two.outputs[0].text == two.outputs[1].text == one.text
    assert engine.stats()["kv_blocks_used"] == 0


def test_seeded_n4_is_reproducible_and_choice_i_is_seed_plus_i(engine):
    prompt = list(range(60, 60 + 21))
    params = dict(max_tokens=16, temperature=0.9, ignore_eos=True)
    a = run(engine, prompt, SamplingParams(n=4, seed=11, **params), "s1")
    b = run(engine, prompt, SamplingParams(n=4, seed=11, **params), "s2")
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for i in range(4):       # each choice is the n=1 request with seed + i
        single = run(engine, prompt, SamplingParams(seed=11 + i, **params), f"s1-{i}")
        assert a.outputs[i].token_ids == single.token_ids


def test_prompt_on_a_block_boundary_needs_no_copy(engine):
    prompt = list(range(5, 5 + 2 * BLOCK))
    before = engine.stats()["cow_copies"]
    out = run(engine, prompt, SamplingParams(n=3, max_tokens=5, temperature=0.0, ignore_eos=True), "b")
    assert engine.stats()["cow_copies"] == before
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1


def test_best_of_returns_the_n_most_likely(engine):
    prompt = list(range(80, 80 + 10))
    out = run(engine, prompt, SamplingParams(n=2, best_of=5, max_tokens=12, temperature=1.0, seed=4,
                                             ignore_eos=True), "bo")
    assert [o.index for o in out.outputs] == [0, 1]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    every = run(engine, prompt, SamplingParams(n=5, max_tokens=12, temperature=1.0, seed=4, ignore_eos=True,
                                               logprobs=0), "all")     # the same five sequences, with logprobs
    ranked = sorted(every.outputs, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked[:2]]
    assert out.generated_tokens == 60 and out.outputs[0].logprobs is None


def test_streamed_events_carry_each_choice_index(engine):
    prompt = list(range(90, 90 + 7))
    events = []
    out = run(engine, prompt, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=8, ignore_eos=True,
                                             logprobs=1), "st", streamed=events)
    for o in out.outputs:
        mine = [e for e in events if e.index == o.index]
        assert "".join(e.delta_text for e in mine) == o.text
        assert [t for e in mine for t in e.new_token_ids] == o.token_ids
        assert [lp["token_id"] for lp in o.logprobs] == o.token_ids
    assert sum(e.finished for e in events) == 1 and events[-1].finished


def test_abort_before_and_after_the_fork_frees_every_block(engine):
    prompt = list(range(100, 100 + 40))
    params = SamplingParams(n=4, max_tokens=50, temperature=1.0, ignore_eos=True)
    engine.add_request("early", prompt, params)
    engine.abort("early")
    engine.add_request("late", prompt, params)
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort("late")
    assert finished["early"].finish_reason == finished["late"].finish_reason == "abort"
    assert len(finished["late"].outputs) == 4
    assert engine.stats()["kv_blocks_used"] == 0


def test_forked_siblings_wait_for_seats(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), block_size=BLOCK, num_kv_blocks=64,
                                    max_num_seqs=2, calibrate=False))
    prompt = list(range(7, 7 + 19))
    out = run(engine, prompt, SamplingParams(n=5, max_tokens=6, temperature=0.0, ignore_eos=True), "seats")
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1 and len(out.outputs) == 5
    assert engine.stats()["kv_blocks_used"] == 0


def test_bad_choice_counts_are_rejected():
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


@pytest.mark.parametrize("swap_space_gib", [0.0, 0.01])
def test_forked_choices_survive_preemption(tiny_model_dir, swap_space_gib):
    """A pool too small for every choice at once: siblings are recomputed (or swapped) and still give the
    greedy tokens of the request run alone, and every block comes back."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=40,
                                    swap_space_gib=swap_space_gib, calibrate=False))
    prompts = [list(range(10 + i, 10 + i + 9)) for i in range(3)]
    params = SamplingParams(n=4, max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params, sla_class="batch")
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.stats()["preemptions"] > 0
    assert engine.stats()["kv_blocks_used"] == 0
    for i, prompt in enumerate(prompts):
        alone = run(engine, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), f"a{i}")
        assert [o.token_ids for o in finished[f"p{i}"].outputs] == [alone.token_ids] * 4
