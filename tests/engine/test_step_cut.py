"""The step cut: an online arrival's first-token step runs between two layers of the step in flight.
Which arrivals may cut (the scheduler alone, fake cost model and clock), and that a cut changes no output token
and leaves the block manager whole (the engine on a tiny model)."""
from types import SimpleNamespace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.scheduler import Scheduler
from tidepool.workers.engine.sequence import SLA_CLASSES, Sequence

COST = SimpleNamespace(fixed=0.010, per_token=0.001, per_context=0.0)
TARGETS = {"realtime": {"ttft_ms": 1000.0, "itl_ms": 50.0}, "interactive": {"ttft_ms": 2000.0, "itl_ms": 100.0}}


class Sim:
    def __init__(self, max_num_seqs=8):
        self.bm = BlockManager(200, 4)
        self.sched = Scheduler(self.bm, max_num_seqs, 512, cost_model=COST, sla_targets=TARGETS, clock=lambda: 0.0)
        self.n = 0

    def seq(self, prompt_len, sla_class="realtime", tenant="a"):
        self.n += 1
        return Sequence(f"s{self.n}", [5 + self.n] * prompt_len, SamplingParams(max_tokens=4), sla_class=sla_class,
                        tenant=tenant)

    def add(self, *args, **kw):
        seq = self.seq(*args, **kw)
        self.sched.add(seq)
        return seq


def test_an_idle_tenant_cuts_into_a_floods_first_token_step_and_the_flood_never_cuts_into_anyones():
    sim = Sim()
    a1, a2 = sim.add(100, tenant="a"), sim.add(100, tenant="a")
    inflight = sim.sched.schedule()
    assert a1 in inflight.seqs and a2 not in inflight.seqs       # one prompt a step within the idle cap (100 ms)
    b, a3 = sim.seq(40, tenant="b"), sim.seq(40, tenant="a")
    assert sim.sched.cut_in_tenants(inflight, [a3, b], remaining_s=0.08) == {"b"}
    assert sim.sched.cut_in_tenants(inflight, [b], remaining_s=0.04) == set()    # less than one 50 ms gap left
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(40, "batch", "c")], remaining_s=1.0) == set()
    sim.sched.add(b)
    sim.sched.add(a3)
    cut = sim.sched.schedule_cut_in(inflight, {"b"})
    assert cut.seqs == [b] and cut.num_new_tokens == [40] and cut.predicted_s == pytest.approx(0.050)
    assert a1 in sim.sched.running and inflight.num_new_tokens == [100]    # the step in flight is untouched
    # the flood's next prompt arriving during B's step: a is now less served than b (b was lifted level with a and
    # then served its prompt), but a holds more of the class's seats: no cut
    assert sim.sched.served[(0, "a")] < sim.sched.served[(0, "b")]
    assert sim.sched.cut_in_tenants(cut, [sim.seq(40, tenant="a")], remaining_s=1.0) == set()


def stream_beside_the_batch(sim, sla_class, first_token_s):
    """A running online stream with one token out at first_token_s, and a batch sequence: their step (the stream's
    decode, the batch sequence's prompt)."""
    stream, off = sim.add(8, sla_class=sla_class, tenant="a"), sim.add(8, sla_class="batch", tenant="c")
    for seq in sim.sched.postprocess(sim.sched.schedule()):
        seq.token_ids.append(7)
    stream.first_token_s = first_token_s
    inflight = sim.sched.schedule()
    assert set(inflight.seqs) == {stream, off} and inflight.num_new_tokens[inflight.seqs.index(stream)] == 1
    return inflight


def test_a_decode_step_is_cut_only_while_its_streams_stay_on_pace_through_it_and_the_cut_in_step():
    # a realtime stream banks at most one 50 ms gap: a cut with more than a gap of the step left always makes it
    # late, so it waits for the arrival's first-token step instead
    sim = Sim()
    inflight = stream_beside_the_batch(sim, "realtime", first_token_s=0.0)
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(20, tenant="b")], remaining_s=0.08) == set()
    # an interactive stream (100 ms pace) that delivered its token a gap ago has 100 ms of room: 20 ms of the
    # step plus the cut-in's 10 + 20 ms fit, 80 ms of it does not
    sim = Sim()
    inflight = stream_beside_the_batch(sim, "interactive", first_token_s=0.0)
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(20, tenant="b")], remaining_s=0.06) == {"b"}
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(20, tenant="b")], remaining_s=0.08) == set()
    # a stream already behind its pace: no room at all
    sim = Sim()
    inflight = stream_beside_the_batch(sim, "interactive", first_token_s=-0.5)
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(20, tenant="b")], remaining_s=0.06) == set()
    # no stream in the step (offline work alone): any online arrival may cut
    sim = Sim()
    sim.add(8, sla_class="batch", tenant="c")
    inflight = sim.sched.schedule()
    assert sim.sched.cut_in_tenants(inflight, [sim.seq(20, tenant="b")], remaining_s=0.08) == {"b"}


def test_a_cut_takes_only_free_seats_and_preempts_nothing():
    sim = Sim(max_num_seqs=2)
    a1, a2 = sim.add(30, tenant="a"), sim.add(30, tenant="a")
    inflight = sim.sched.schedule()
    assert set(inflight.seqs) == {a1, a2}
    b = sim.add(10, tenant="b")
    assert not sim.sched.schedule_cut_in(inflight, {"b"})        # both seats held: b waits for the next step
    assert sim.sched.num_preemptions == 0 and b in sim.sched.waiting


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run_with_an_arrival_mid_step(model_dir: str, step_cut: bool, **overrides) -> tuple[dict, list, dict]:
    """Tenant a's realtime prompts and a batch job run; tenant b's realtime request arrives while the first step is
    in its first layer (added from a hook on layer 0, as the intake thread would add it). Returns the token ids
    by request, the request ids of the first step's outputs, and the engine's stats."""
    engine = LLMEngine(EngineConfig(model=model_dir, step_cut=step_cut,
                                    sla_targets={"realtime": {"ttft_ms": 1000.0, "itl_ms": 0.001}}, **overrides))
    for i in range(2):
        engine.add_request(f"a{i}", list(range(10 + i, 70 + i)), GREEDY, sla_class="realtime", tenant="a")
    engine.add_request("off", list(range(3, 40)), GREEDY, sla_class="batch", tenant="c")
    arrived = []

    def arrive(module, args):
        if not arrived:
            arrived.append(True)
            engine.add_request("b", list(range(200, 230)), GREEDY, sla_class="realtime", tenant="b")
    hook = engine.runner.model.layers[0].register_forward_pre_hook(arrive)
    tokens, first = {}, None
    while engine.has_unfinished():
        outs = engine.step()
        if first is None:
            first = [o.request_id for o in outs]
        for out in outs:
            if out.finished:
                tokens[out.request_id] = out.token_ids
    hook.remove()
    assert engine.block_manager.num_used_blocks == 0
    return tokens, first, engine.stats()


def test_a_cut_brings_the_arrivals_first_token_within_the_step_and_changes_no_token(tiny_model_dir):
    model = tiny_model_dir("llama-gqa")
    cut, first_cut, stats_cut = run_with_an_arrival_mid_step(model, step_cut=True)
    whole, first_whole, stats_whole = run_with_an_arrival_mid_step(model, step_cut=False)
    assert stats_cut["total_step_cuts"] == 1 and stats_whole["total_step_cuts"] == 0
    assert first_cut[0] == "b" and "b" not in first_whole   # its first token came inside the step in flight
    assert cut == whole and set(cut) == {"a0", "a1", "b", "off"}


arrivals = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.sampled_from(SLA_CLASSES),
                              st.sampled_from("abc"), st.integers(0, 40), st.booleans()), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(arrivals, st.integers(16, 60), st.integers(2, 6), st.floats(0.0, 0.3))
def test_cut_in_steps_keep_the_step_in_flight_whole_and_every_request_finishes(reqs, num_blocks, max_num_seqs,
                                                                              remaining):
    """Arrivals come between steps or mid-step (then a cut-in step may run before the step in flight ends, as
    LLMEngine's step cut runs it): the cut never touches the step in flight's sequences or blocks, preempts
    nothing, never overfills the seats, and every request still finishes with every block back."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, max_num_seqs, 64, cost_model=COST, sla_targets=TARGETS, clock=lambda: 0.0)
    pending = sorted(reqs, key=lambda r: r[4])
    n = 0

    def finish(batch):
        for seq in sched.postprocess(batch):
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.remove(seq)

    for step in range(800):
        due = []
        while pending and pending[0][4] <= step:
            plen, out, cls, tenant, _, mid = pending.pop(0)
            n += 1
            seq = Sequence(f"s{n}", [5 + n % 50] * min(plen, num_blocks * 4 - 9), SamplingParams(max_tokens=out),
                           sla_class=cls, tenant=tenant)
            if mid:
                due.append(seq)        # reaches the engine while the next step runs
            else:
                sched.add(seq)
        inflight = sched.schedule()
        assert len(sched.running) <= max_num_seqs
        held = {id(s): (list(s.block_table), s.num_computed_tokens) for s in inflight.seqs}
        tenants = sched.cut_in_tenants(inflight, due, remaining) if inflight else set()
        preemptions = sched.num_preemptions
        for seq in due:
            sched.add(seq)
        if tenants:
            cut = sched.schedule_cut_in(inflight, tenants)
            event("a cut-in step ran" if cut else "a cut found no free seat or block")
            assert sched.num_preemptions == preemptions and not cut.preempted
            assert not {id(s) for s in cut.seqs} & set(held)
            assert all(s.tenant in tenants and s.is_online and s.first_token_s is None for s in cut.seqs)
            # past the seat limit only by seats of offline work, which the next step takes back (_trim)
            assert sum(s.is_online for s in sched.running) <= max_num_seqs
            inflight_blocks = {b for s in inflight.seqs for b in s.block_table}
            assert not inflight_blocks & {b for s in cut.seqs for b in s.block_table}
            finish(cut)
            assert all((list(s.block_table), s.num_computed_tokens) == held[id(s)] for s in inflight.seqs)
        finish(inflight)
        if not pending and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "every request must finish"
    assert bm.num_free_blocks == num_blocks


def test_a_realtime_arrival_cuts_into_a_quiet_engines_step_and_takes_back_a_lent_seat(tiny_model_dir):
    """No online work yet: the reserve's seat is lent, every seat holds a batch sequence and the step is as large as
    the token budget. A realtime request arriving mid-step gets its first token inside that step (past the seat
    limit), the next step gives the seat back by suspending the latest batch sequence, and everything finishes with
    the tokens it would have had without the arrival."""
    def run(arrival: bool):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=4, online_reserve=0.25,
                                        sla_targets={"realtime": {"ttft_ms": 1000.0, "itl_ms": 0.001}}))
        for i in range(6):
            engine.add_request(f"off{i}", list(range(3 + i, 40 + i)), GREEDY, sla_class="batch", tenant="c")
        assert engine.stats()["offline_seats"] == 4       # quiet: the reserve's seat is lent
        added = []

        def arrive(module, args):
            if arrival and not added:
                added.append(True)
                engine.add_request("rt", list(range(200, 230)), GREEDY, sla_class="realtime", tenant="b")
        hook = engine.runner.model.layers[0].register_forward_pre_hook(arrive)
        first = [o.request_id for o in engine.step()]
        hook.remove()
        if arrival:
            assert first[0] == "rt" and len(engine.scheduler.running) == 5     # its first token, past the limit
        engine.step()
        assert len(engine.scheduler.running) <= 4
        tokens = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        assert engine.block_manager.num_used_blocks == 0
        return tokens, engine.stats()

    cut, stats = run(arrival=True)
    alone, _ = run(arrival=False)
    assert stats["total_step_cuts"] == 1 and stats["preemptions_by_kind"]["suspend"] >= 1
    assert stats["offline_seats"] == 3                    # online work was here: the reserve holds again
    assert {k: v for k, v in cut.items() if k != "rt"} == alone and len(cut["rt"]) == GREEDY.max_tokens


def test_two_arrivals_during_one_step_both_cut_in(tiny_model_dir):
    """A quiet engine's budget-sized batch step sees realtime requests of two tenants arrive before one of its layers:
    each tenant's first-token step runs inside that step (two cuts, one tenant's prompts each), and no token
    changes."""
    def run(step_cut: bool):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama-gqa"), max_num_seqs=8, step_cut=step_cut,
                                        sla_targets={"realtime": {"ttft_ms": 1000.0, "itl_ms": 0.001}}))
        for i in range(4):
            engine.add_request(f"off{i}", list(range(3 + i, 60 + i)), GREEDY, sla_class="batch", tenant="c")
        added = set()

        def arrive(module, args):
            for i in (0, 1):
                if i not in added:
                    added.add(i)
                    engine.add_request(f"rt{i}", list(range(200 + i, 230 + i)), GREEDY, sla_class="realtime",
                                       tenant=f"t{i}")
        hooks = [engine.runner.model.layers[0].register_forward_pre_hook(arrive)]
        first = [o.request_id for o in engine.step()]
        for hook in hooks:
            hook.remove()
        tokens = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        return first, tokens, engine.stats()

    first, tokens, stats = run(step_cut=True)
    _, whole, _ = run(step_cut=False)
    assert stats["total_step_cuts"] == 2 and first[:2] == ["rt0", "rt1"]
    assert tokens == whole
