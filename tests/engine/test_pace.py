"""The pace rule and the step cut (workers/engine/pace.py), on plain sequences with a fake cost model: no
scheduler, no blocks, no clock."""
from collections import defaultdict
from types import SimpleNamespace

import pytest

from tidepool.workers.engine.pace import IDLE_GAPS, OWED_CAP_S, PACE_CREDIT, QUIET_S, Pace
from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.sequence import Sequence

# 10 ms a step, 1 ms a new token, no context cost
COST = SimpleNamespace(fixed=0.010, per_token=0.001, per_context=0.0)
TARGETS = {"realtime": {"ttft_ms": 200.0, "itl_ms": 50.0}, "interactive": {"ttft_ms": 1000.0, "itl_ms": 100.0}}


def expecting_online(pace: Pace) -> Pace:
    """A pace that saw online work a moment ago (not quiet): steps without online work get the idle cap."""
    pace.step([seq(sla_class="realtime")], [], now=0.0)
    return pace


def seq(prompt=8, sla_class="batch", tenant="a", out=0, first_token_s=None, lora=None, pooling=None):
    s = Sequence("r", [7] * prompt, SamplingParams(max_tokens=50), sla_class=sla_class, tenant=tenant, lora=lora,
                 pooling=pooling)
    s.token_ids += [7] * out
    s.num_computed_tokens = s.num_tokens - 1 if out else 0
    s.first_token_s = first_token_s
    return s


def test_the_idle_cap_and_the_embedding_cap_come_from_the_tightest_targets():
    assert Pace(COST, TARGETS).idle_limit_s == IDLE_GAPS * 0.050                  # below ttft - itl (150 ms)
    assert Pace(COST, {"realtime": {"ttft_ms": 130.0, "itl_ms": 50.0}}).idle_limit_s == 0.080
    assert Pace(COST, TARGETS).embed_limit_s == 0.050
    assert Pace(None, TARGETS).idle_limit_s is None and Pace(None, TARGETS).embed_limit_s is None
    assert Pace(COST, {}).idle_limit_s is None
    with pytest.raises(ValueError, match="offline_floor"):
        Pace(COST, TARGETS, offline_floor=1.0)


def test_the_pace_of_a_sequence_is_its_class_itl():
    pace = Pace(COST, {"realtime": {"itl_ms": 50.0}, "interactive": {"ttft_ms": 500.0}})
    assert pace.pace(seq(sla_class="realtime")) == 0.050
    assert pace.pace(seq(sla_class="interactive")) is None        # no itl target
    assert pace.pace(seq(sla_class="batch")) is None               # offline work has no pace


def test_the_room_is_the_earliest_next_token_due_time_banking_at_most_pace_credit_gaps():
    pace = Pace(COST, TARGETS)
    offline = seq()
    assert pace.room([offline], [], now=0.0) == (None, False)                       # no paced work: no bound
    assert Pace(None, TARGETS).room([seq(sla_class="realtime")], [], 0.0) == (None, False)
    assert pace.room([offline], [seq(sla_class="realtime")], 0.0) == (0.0, False)   # a prompt, no stream yet
    # 3 tokens out since its first at t=0: the 4th is due at 150 ms; at 120 ms, 30 ms of room
    stream = seq(sla_class="realtime", out=3, first_token_s=0.0)
    room, streaming = pace.room([stream, offline], [], now=0.120)
    assert room == pytest.approx(0.030) and streaming
    # far ahead of its pace: it banks at most PACE_CREDIT gaps
    assert pace.room([stream], [], now=-1.0)[0] == pytest.approx(PACE_CREDIT * 0.050)
    assert pace.room([stream], [], now=1.0) == (0.0, True)                         # behind: no room
    # the tightest stream sets the room
    slow = seq(sla_class="interactive", out=3, first_token_s=0.0)
    assert pace.stream_room([slow, stream], 0.120) == pytest.approx(0.030)
    assert pace.stream_room([slow], 0.120) == pytest.approx(0.100)                 # credit: one 100 ms gap


def test_a_stream_verifying_drafts_counts_those_it_is_expected_to_accept():
    pace = Pace(COST, TARGETS)
    stream = seq(sla_class="realtime", out=1, first_token_s=0.0)
    stream.draft_token_ids, stream.draft_acceptance = [7, 7, 7], 0.5
    assert pace.stream_room([stream], 0.020) == pytest.approx((1 + 0.875) * 0.050 - 0.020)


def test_offline_gets_its_floor_the_pace_room_or_nothing_in_a_first_token_step():
    pace = Pace(COST, TARGETS, offline_floor=0.5)
    assert pace.offline_limit(0.0, 0.020, first_token_step=False, streaming=True) == pytest.approx(0.040)
    assert pace.offline_limit(0.100, 0.020, first_token_step=False, streaming=True) == 0.100
    assert pace.offline_limit(0.100, 0.020, first_token_step=True, streaming=False) == 0.020
    pace.offline_owed = 0.005            # owed: paid back while no stream runs, at most one floor's worth a step
    assert pace.offline_limit(0.0, 0.020, False, streaming=False) == pytest.approx(0.045)
    assert pace.offline_limit(0.0, 0.020, False, streaming=True) == pytest.approx(0.040)
    pace.offline_owed = OWED_CAP_S       # at the cap, a first-token step without streams carries offline work
    assert pace.offline_limit(0.0, 0.020, first_token_step=True, streaming=False) == pytest.approx(0.060)
    assert pace.offline_limit(0.0, 0.020, first_token_step=True, streaming=True) == 0.020


@pytest.mark.parametrize("per_context", [0.0, 1e-9, 1e-6, 1e-4])
@pytest.mark.parametrize("start", [0, 100, 5000])
def test_tokens_within_is_the_most_tokens_whose_predicted_cost_fits(per_context, start):
    pace = Pace(SimpleNamespace(fixed=0.0, per_token=0.001, per_context=per_context))
    for seconds in (0.0, 0.0005, 0.003, 0.05, 0.7):
        n = pace.tokens_within(seconds, start, 10_000)
        assert pace.step_cost(start, n) <= seconds * (1 + 1e-12)
        assert n == 10_000 or pace.step_cost(start, n + 1) > seconds * (1 - 1e-12)
    assert pace.tokens_within(100.0, start, 5) == 5


def test_online_work_runs_whole_and_offline_tokens_fit_the_time_left():
    pace = Pace(COST, TARGETS)
    prompt = seq(40, sla_class="realtime")
    assert pace.num_new(prompt, budget=256, limit=0.02, time_left=0.001, first=False) == 40
    assert pace.num_new(prompt, budget=16, limit=0.02, time_left=0.001, first=False) == 16     # the budget
    offline = seq(40)
    assert pace.num_new(offline, 256, limit=0.02, time_left=0.005, first=False) == 5
    assert pace.num_new(offline, 256, limit=None, time_left=0.0, first=False) == 40          # no bound
    assert pace.num_new(offline, 256, limit=0.02, time_left=0.0, first=True) == 1            # opens the step
    decode = seq(out=2)
    decode.draft_token_ids = [7, 7]                                                          # drafts count
    assert pace.num_new(decode, 256, limit=0.02, time_left=0.1, first=False) == 3


def test_an_embedding_input_runs_whole_or_waits():
    pace = Pace(COST, TARGETS)
    embed = seq(30, pooling=object())
    assert pace.num_new(embed, 256, limit=0.05, time_left=0.030, first=False) == 30
    assert pace.num_new(embed, 256, limit=0.05, time_left=0.029, first=False) == 0
    assert pace.num_new(embed, 256, limit=0.05, time_left=0.001, first=True) == 30           # it opens the step
    assert pace.num_new(embed, 20, limit=None, time_left=0.0, first=True) == 0               # over the budget


def test_a_step_with_online_work_closes_its_online_part_at_the_first_offline_candidate():
    pace = Pace(COST, TARGETS, offline_floor=0.5)
    stream = seq(sla_class="realtime", out=3, first_token_s=0.0)
    step = pace.step([stream], [], now=0.140)              # 10 ms of room
    assert step.room == pytest.approx(0.010) and step.idle_limit_s is None
    assert step.bound(stream, first=True) == (None, 0.0)   # online work is not bounded
    step.add(stream, 1, new=False)
    assert step.used == pytest.approx(0.011)
    limit, left = step.bound(seq(40), first=False)         # the floor: as much offline time as online time
    assert limit == step.time_limit_s == pytest.approx(0.022) and left == pytest.approx(0.011)
    step.used = 0.022
    assert step.bound(seq(40), first=False) is None        # not one more offline token fits
    assert step.bound(seq(40), first=True) is not None     # but one that opens a step always does


def test_without_online_work_a_step_is_capped_unless_the_device_is_too_slow_for_the_cap():
    pace = Pace(COST, TARGETS)
    pace.step([seq(sla_class="realtime")], [], now=0.0)               # online work was here a moment ago
    step = pace.step([seq(out=1) for _ in range(10)], [], now=1.0)
    assert step.room is None and step.idle_limit_s == step.limit == pytest.approx(0.100)
    assert step.bound(seq(40), first=False) == (pytest.approx(0.100), pytest.approx(0.090))
    slow = pace.step([seq(out=1) for _ in range(95)], [], now=1.0)     # one token each: 105 ms > the cap
    assert slow.idle_limit_s is None and slow.bound(seq(40), first=False) == (None, 0.0)


def test_a_quiet_engine_bounds_offline_steps_by_the_token_budget_alone():
    """No online work since start, or for QUIET_S: no idle cap (offline steps as large as the budget allows);
    any online sequence, running or waiting, ends the quiet spell for QUIET_S."""
    pace = Pace(COST, TARGETS)
    offline = [seq(out=1) for _ in range(10)]
    assert pace.quiet(0.0)
    step = pace.step(offline, [], now=0.0)
    assert step.idle_limit_s is None and step.bound(seq(40), first=False) == (None, 0.0)
    pace.step(offline, [seq(sla_class="interactive")], now=5.0)      # an online arrival, still waiting
    assert not pace.quiet(5.0) and not pace.quiet(5.0 + QUIET_S - 0.01)
    assert pace.step(offline, [], now=6.0).idle_limit_s == pytest.approx(0.100)
    assert pace.quiet(5.0 + QUIET_S)
    assert pace.step(offline, [], now=5.0 + QUIET_S).idle_limit_s is None


def test_offline_embedding_inputs_fill_a_step_only_up_to_the_tightest_pace():
    step = expecting_online(Pace(COST, TARGETS)).step([], [], now=0.0)     # no online work: the idle cap
    assert step.bound(seq(30, pooling=object()), first=False)[0] == 0.050
    assert step.bound(seq(30, pooling=object(), sla_class="realtime"), first=False)[0] == 0.100


def test_a_first_token_step_starts_one_tenants_prompts_within_the_idle_cap():
    pace = Pace(COST, TARGETS)
    step = pace.step([], [], now=0.0)
    first = seq(40, sla_class="realtime", tenant="a")
    assert not step.prompt_waits(first, [])
    step.add(first, 40, new=True)                               # 10 + 40 ms
    assert step.prompt_tenant == "a" and step.first_token_step
    assert step.prompt_waits(seq(40, sla_class="realtime", tenant="b"), [])          # another tenant's: next step
    assert not step.prompt_waits(seq(40, sla_class="realtime", tenant="b"), [seq(sla_class="realtime")])
    assert not step.prompt_waits(seq(40, sla_class="realtime", tenant="a"), [])      # 90 ms: within the 100 ms cap
    assert step.prompt_waits(seq(60, sla_class="realtime", tenant="a"), [])          # 110 ms: past it
    assert not step.prompt_waits(seq(60, sla_class="realtime", tenant="a", pooling=object()), [])
    assert not step.prompt_waits(seq(60, tenant="b"), [])                            # offline: no first token
    assert not step.prompt_waits(seq(sla_class="realtime", tenant="b", out=1, first_token_s=0.0), [])


def test_each_lora_adapter_is_paid_once_a_step():
    pace = expecting_online(Pace(SimpleNamespace(fixed=0.010, per_token=0.001, per_context=0.0, per_adapter=0.020),
                                 TARGETS))
    step = pace.step([], [], now=0.0)
    step.add(seq(10, lora="x"), 10, new=True)
    step.add(seq(10, lora="x"), 10, new=True)
    step.add(seq(10), 10, new=True)
    assert step.used == pytest.approx(0.010 + 0.030 + 0.020)
    assert step.bound(seq(10, lora="y"), first=False)[1] == pytest.approx(0.100 - 0.060 - 0.020)


class _Batch(SimpleNamespace):
    def __init__(self, seqs=1):
        super().__init__(seqs=[object()] * seqs, predicted_s=0.0, time_limit_s=None, idle_limit_s=None)

    def __bool__(self):
        return bool(self.seqs)


def test_offline_is_owed_what_a_first_token_step_without_streams_could_not_give_it_and_paid_back_later():
    pace = Pace(COST, TARGETS, offline_floor=0.5)
    waiting = [seq(40, sla_class="realtime"), seq(40)]
    step = pace.step([], waiting, now=0.0)
    step.add(waiting[0], 40, new=True)                         # a 50 ms first-token step, no offline token
    batch = _Batch()
    pace.settle(step, batch, [], waiting)
    assert pace.offline_owed == pytest.approx(0.025) and batch.predicted_s == pytest.approx(0.050)
    assert batch.time_limit_s == 0.0 and batch.idle_limit_s is None
    offline_alone = pace.step([], [seq(40)], now=0.0)          # a step of offline work alone pays it back
    offline_alone.add(seq(40), 30, new=True)
    pace.settle(offline_alone, _Batch(), [], [seq(40)])
    assert pace.offline_owed == pytest.approx(0.025 - 0.5 * 0.040)
    # while a stream runs, the debt is neither kept nor paid
    stream = seq(sla_class="realtime", out=1, first_token_s=0.0)
    streaming = pace.step([stream], [seq(40)], now=0.0)
    streaming.add(stream, 1, new=False)
    pace.settle(streaming, _Batch(), [stream], [seq(40)])
    assert pace.offline_owed == pytest.approx(0.005)
    pace.offline_owed = 5.0
    pace.settle(pace.step([], waiting, now=0.0), _Batch(), [], waiting)
    assert pace.offline_owed == OWED_CAP_S


def test_an_arrival_cuts_into_a_floods_first_token_step_but_not_into_its_own_tenants():
    pace = Pace(COST, TARGETS)
    a1, a2 = seq(100, sla_class="realtime", tenant="a"), seq(100, sla_class="realtime", tenant="a")
    inflight = SimpleNamespace(seqs=[a1, a2])
    served = defaultdict(float, {(0, "a"): 200.0, (0, "b"): 200.0})

    def level(rank, tenant):
        return served[(rank, tenant)]

    b, a3 = seq(40, sla_class="realtime", tenant="b"), seq(40, sla_class="realtime", tenant="a")
    assert pace.cut_in_tenants(inflight, [a3, b], 0.08, 0.0, [a1, a2], served, level) == {"b"}
    assert pace.cut_in_tenants(inflight, [b], 0.04, 0.0, [a1, a2], served, level) == set()    # < one 50 ms gap
    assert pace.cut_in_tenants(inflight, [seq(40, tenant="c")], 1.0, 0.0, [a1, a2], served, level) == set()
    assert pace.cut_in_tenants(inflight, [seq(40, sla_class="realtime", tenant="c", lora="x")], 1.0, 0.0,
                               [a1, a2], served, level) == set()
    # b more served than a, or holding as many seats: no cut
    served[(0, "b")] = 300.0
    assert pace.cut_in_tenants(inflight, [b], 0.08, 0.0, [a1, a2], served, level) == set()
    served[(0, "b")] = 100.0
    b_seat = seq(sla_class="realtime", tenant="b", out=1, first_token_s=0.0)
    assert pace.cut_in_tenants(inflight, [b], 0.08, 0.0, [a1, a2, b_seat, b_seat], served, level) == set()
    assert Pace(None, TARGETS).cut_in_tenants(inflight, [b], 0.08, 0.0, [a1, a2], served, level) == set()


def test_a_decode_step_is_cut_only_while_its_streams_stay_on_pace():
    pace = Pace(COST, TARGETS)
    stream = seq(sla_class="interactive", out=1, first_token_s=0.0)        # 100 ms of room at t=0
    inflight = SimpleNamespace(seqs=[stream, seq(40)])
    served = defaultdict(float)
    arrival = seq(20, sla_class="realtime", tenant="b")
    assert pace.cut_in_tenants(inflight, [arrival], 0.06, 0.0, [stream], served, lambda r, t: 0.0) == {"b"}
    assert pace.cut_in_tenants(inflight, [arrival], 0.08, 0.0, [stream], served, lambda r, t: 0.0) == set()


def test_a_cut_in_step_starts_the_least_served_tenants_waiting_prompts_by_arrival():
    pace = Pace(COST, TARGETS)
    b1, b2 = seq(10, sla_class="realtime", tenant="b"), seq(10, sla_class="realtime", tenant="b")
    c1 = seq(10, sla_class="realtime", tenant="c")
    others = [seq(10, tenant="b"), seq(10, sla_class="realtime", tenant="b", lora="x"),
              seq(10, sla_class="realtime", tenant="d")]
    served = defaultdict(float, {(0, "b"): 1.0, (0, "c"): 2.0})
    assert pace.cut_in_prompts([b2, c1, b1] + others, {"b", "c"}, served) == [b1, b2]
    served[(0, "b")] = 3.0
    assert pace.cut_in_prompts([b2, c1, b1] + others, {"b", "c"}, served) == [c1]
    assert pace.cut_in_prompts(others, {"b"}, served) == []
    assert Pace(None, TARGETS).cut_in_step() is None
    step = pace.cut_in_step()
    assert step.used == COST.fixed and step.room is None and step.limit is None
