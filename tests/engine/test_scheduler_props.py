"""Scheduler invariants, driven by a pure-Python simulation of the engine loop (no model, no tensors)."""
import random
from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.scheduler import Scheduler
from tidepool.workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus


class Sim:
    """schedule -> 'compute' -> append one fake token per finished context, like LLMEngine.step."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=32):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs, budget)
        self.served = Counter()
        self.steps = []
        self.n = 0

    def add(self, prompt_len, max_tokens, sla_class="batch", tenant="t", weight=1.0):
        self.n += 1
        seq = Sequence(f"s{self.n}", [7] * prompt_len, SamplingParams(max_tokens=max_tokens),
                       sla_class=sla_class, tenant=tenant, weight=weight)
        self.sched.add(seq)
        return seq

    def step(self):
        running_before = {id(s) for s in self.sched.running}
        batch = self.sched.schedule()
        self.steps.append((batch, running_before))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            self.served[seq.tenant] += n
        for seq in self.sched.postprocess(batch):
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.remove(seq)
        return batch


requests = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from(SLA_CLASSES),
                              st.sampled_from("ab"), st.integers(0, 3)), min_size=1, max_size=30)


# A seat handed over within the realtime class while an interactive sequence kept its seat (found by this test)
HANDOVER_ABOVE_A_LOWER_CLASS = [(1, 1, "realtime", "a", 3)] + [(1, 1, "interactive", "a", 1)] * 2 + \
    [(1, 2, "realtime", "b", 2)] * 2 + [(1, 1, "realtime", "a", 2)] * 3 + [(1, 1, "realtime", "b", 0)] * 2 + \
    [(1, 1, "interactive", "a", 1)] * 6 + [(1, 3, "interactive", "a", 0)] * 3 + [(1, 1, "realtime", "a", 0)] * 2 + \
    [(1, 3, "interactive", "a", 0)]


@settings(max_examples=120, deadline=None)
@given(requests, st.integers(12, 40), st.integers(2, 6), st.integers(4, 48))
@example(HANDOVER_ABOVE_A_LOWER_CLASS, 12, 6, 6)
def test_budget_capacity_and_preemption_order(reqs, num_blocks, max_num_seqs, budget):
    sim = Sim(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget)
    pending = sorted(reqs, key=lambda r: r[4])
    empty = 0              # consecutive steps with nothing in them while work waits
    for step in range(600):
        while pending and pending[0][4] <= step:
            plen, out, cls, tenant, _ = pending.pop(0)
            sim.add(min(plen, num_blocks * 4 - 13), out, cls, tenant)
        batch = sim.step()
        empty = empty + 1 if not batch and sim.sched.has_unfinished() else 0
        assert empty < 3, f"{empty} empty steps in a row while work waits: a livelock"
        assert batch.num_tokens <= budget
        assert len(sim.sched.running) <= max_num_seqs
        assert all(n >= 1 for n in batch.num_new_tokens)
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        if batch.preempted:
            # Nothing that ran this step ranks below what was evicted for it.
            assert max(s.rank for s in batch.seqs) <= min(p.rank for p in batch.preempted) if batch.seqs else True
            assert not {id(s) for s in batch.seqs} & {id(p) for p in batch.preempted}
        if not pending and not sim.sched.has_unfinished():
            break
    assert not sim.sched.has_unfinished(), "every request must finish: no livelock, no starvation"
    assert sim.bm.num_free_blocks == num_blocks


def test_online_request_displaces_offline_work_when_seats_are_full():
    sim = Sim(num_blocks=200, max_num_seqs=4, budget=64)
    offline = [sim.add(8, 100, "batch") for _ in range(4)]
    sim.step()
    assert all(s.status == SequenceStatus.RUNNING for s in offline)
    online = sim.add(8, 4, "realtime")
    batch = sim.step()
    assert online in batch.seqs
    assert len(batch.preempted) == 1 and batch.preempted[0].sla_class == "batch"
    assert batch.preempted[0] is offline[-1], "latest offline arrival goes first"


def test_online_request_displaces_offline_work_when_memory_is_full():
    sim = Sim(num_blocks=12, block_size=4, max_num_seqs=16, budget=64)
    offline = [sim.add(15, 100, "deferrable") for _ in range(3)]     # 4 blocks each: the pool is full
    sim.step()
    assert sim.bm.num_free_blocks == 0
    online = sim.add(6, 4, "interactive")
    batch = sim.step()
    assert online in batch.seqs
    assert batch.preempted and all(p.sla_class == "deferrable" for p in batch.preempted)
    assert batch.preempted[0] is offline[-1]


def test_lower_class_never_preempts_higher_class():
    sim = Sim(num_blocks=40, block_size=4, max_num_seqs=2, budget=64)
    online = [sim.add(12, 50, "interactive") for _ in range(2)]
    sim.step()
    late = sim.add(4, 4, "batch")
    for _ in range(5):
        batch = sim.step()
        assert late not in batch.seqs
        assert not any(p.sla_class == "interactive" and late.status == SequenceStatus.RUNNING for p in batch.preempted)
    assert all(s.status == SequenceStatus.RUNNING for s in online)


def test_running_decodes_go_before_prefills_and_long_prompts_are_chunked():
    sim = Sim(num_blocks=200, max_num_seqs=8, budget=16)
    decoders = [sim.add(4, 50) for _ in range(3)]
    sim.step()
    big = sim.add(100, 1)
    batch = sim.step()
    assert batch.seqs[:3] == decoders and batch.num_new_tokens[:3] == [1, 1, 1]
    assert batch.seqs[3] is big and batch.num_new_tokens[3] == 13      # the rest of the budget
    while not big.is_finished:
        assert sim.step().num_tokens <= 16


def test_realtime_flood_cannot_stop_a_new_realtime_request_and_online_beats_offline_backlog():
    sim = Sim(num_blocks=400, max_num_seqs=8, budget=24)
    for _ in range(50):
        sim.add(20, 30, "batch")
    for _ in range(10):
        sim.step()
    online = sim.add(10, 5, "interactive")
    assert online in sim.step().seqs


def _service_ratio(weights, steps=400):
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=6, budget=24)
    rng = random.Random(0)
    for _ in range(150):       # both tenants flood the same class with varied requests
        for tenant in weights:
            sim.add(rng.randint(4, 30), rng.randint(4, 20), "batch", tenant, weights[tenant])
    for _ in range(steps):
        sim.step()
    return sim.served


def test_equal_weight_tenants_get_equal_service_under_contention():
    served = _service_ratio({"a": 1.0, "b": 1.0})
    assert abs(served["a"] - served["b"]) / max(served.values()) <= 0.10, served


def test_tenant_weight_buys_proportional_service():
    served = _service_ratio({"a": 2.0, "b": 1.0})
    assert 1.7 <= served["a"] / served["b"] <= 2.3, served


def test_flooding_tenant_does_not_starve_a_late_tenant_of_the_same_class():
    sim = Sim(num_blocks=400, max_num_seqs=4, budget=24)
    for _ in range(200):
        sim.add(20, 10, "batch", "flood")
    for _ in range(20):
        sim.step()
    late = sim.add(20, 10, "batch", "late")
    for _ in range(60):
        sim.step()
        if late.is_finished:
            break
    assert late.is_finished


class _Costs:
    def __init__(self, fixed, per_token, per_context):
        self.fixed, self.per_token, self.per_context = fixed, per_token, per_context


@settings(max_examples=300, deadline=None)
# an offline prompt opening a step under the idle cap, its start moved by a prefix-cache hit past the room for a token
@example(0.05, 0.05, 4.354382052268563e-05, "max_utilization", 0.0, [(1, 4, "realtime", 0), (5, 1, "batch", 0)])
@given(st.floats(0.0, 0.05), st.floats(1e-5, 0.05), st.floats(0.0, 1e-4), st.sampled_from(["max_utilization", "no_evict"]),
       st.floats(0.0, 0.9), st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.sampled_from(SLA_CLASSES),
                                               st.integers(0, 6)), min_size=1, max_size=12))
def test_a_step_is_never_empty_while_work_can_run(fixed, per_token, per_context, policy, floor, reqs):
    """Whatever a (possibly badly fitted) cost model predicts, under either capacity policy, every step with
    unfinished work computes something: an online request the policy keeps out must not leave the offline work
    that holds the blocks it needs without a step (the livelock a load-distorted model once made)."""
    clock = [0.0]
    sched = Scheduler(BlockManager(24, 4), 4, 32, cost_model=_Costs(fixed, per_token, per_context),
                      sla_targets={"realtime": {"ttft_ms": 200, "itl_ms": 50}, "interactive": {"itl_ms": 100}},
                      capacity_policy=policy, offline_floor=floor, clock=lambda: clock[0])
    pending = sorted(enumerate(reqs), key=lambda r: r[1][3])
    for step in range(2000):
        while pending and pending[0][1][3] <= step:
            i, (plen, out, cls, _) = pending.pop(0)
            sched.add(Sequence(f"s{i}", [7] * plen, SamplingParams(max_tokens=out), sla_class=cls))
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        batch = sched.schedule()
        assert batch.seqs, "an empty step while work waits: nothing can ever change"
        clock[0] += fixed + per_token * batch.num_tokens
        for seq in sched.postprocess(batch):
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.remove(seq)
    assert not sched.has_unfinished() and not pending


def test_a_suspended_sequence_ranked_below_one_kept_out_for_memory_does_not_hold_its_blocks_forever():
    """Fair share ranks a's recomputed interactive request s28 ahead of b's suspended s27 (a has less service), but
    s27 arrived first, so the memory rule alone never displaces it for s28: s28 was kept out for want of blocks
    and, ranked above it, kept out s27 too, with nothing running, every later step empty (found by the step cut's
    property test)."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 2, 64)

    def add(n, plen, out, cls):
        sched.add(Sequence(f"s{n}", [5 + n] * plen, SamplingParams(max_tokens=out), sla_class=cls,
                           tenant="b" if n == 27 else "a"))

    for n in range(1, 27):
        add(n, 1, 1, "realtime")
    add(27, 36, 3, "interactive")
    add(28, 24, 2, "interactive")
    for step in range(60):
        if step == 15:
            add(29, 1, 1, "realtime"), add(30, 1, 1, "realtime")
        batch = sched.schedule()
        assert batch.seqs or batch.preempted or not sched.has_unfinished(), f"an empty step ({step}) while work waits"
        for seq in sched.postprocess(batch):
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.remove(seq)
    assert not sched.has_unfinished() and bm.num_free_blocks == 16
