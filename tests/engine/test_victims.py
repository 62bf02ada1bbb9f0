"""The choice of whom to displace (workers/engine/victims.py), on plain sequences: no scheduler, no blocks."""
from collections import defaultdict

from tidepool.workers.engine.sampling_params import SamplingParams
from tidepool.workers.engine.sequence import Sequence, SequenceStatus
from tidepool.workers.engine.victims import ODD_SEAT_LEAD, VictimChooser

RUNNING, SUSPENDED, WAITING = SequenceStatus.RUNNING, SequenceStatus.SUSPENDED, SequenceStatus.WAITING


def seq(sla_class="batch", tenant="a", status=RUNNING, weight=1.0, blocks=(1,)):
    s = Sequence("r", [7] * 4, SamplingParams(max_tokens=4), sla_class=sla_class, tenant=tenant, weight=weight)
    s.status, s.block_table = status, list(blocks)
    return s


def test_a_seat_comes_from_the_lowest_class_below_latest_arrival_first():
    rt, batch1, defer1, batch2, defer2 = seq("realtime"), seq(), seq("deferrable"), seq(), seq("deferrable")
    running = [rt, batch1, defer1, batch2, defer2]
    assert VictimChooser.for_seat(seq("interactive", status=WAITING), running, set(), full=True) is defer2
    assert VictimChooser.for_seat(seq("interactive", status=WAITING), running, {id(defer2)}, True) is defer1
    assert VictimChooser.for_seat(seq("deferrable", status=WAITING), running, set(), full=True) is None
    assert VictimChooser.for_seat(seq("realtime", status=WAITING), [rt], set(), full=True) is None


def test_with_seats_free_but_the_offline_ones_taken_only_offline_work_gives_one_up():
    interactive, batch = seq("interactive"), seq("batch")
    waiting = seq("realtime", status=WAITING)
    assert VictimChooser.for_seat(waiting, [batch, interactive], set(), full=False) is batch
    assert VictimChooser.for_seat(waiting, [interactive], set(), full=False) is None
    assert VictimChooser.for_seat(waiting, [interactive], set(), full=True) is interactive


def test_memory_comes_from_the_lowest_class_suspended_first_never_from_one_ranked_above():
    needy = seq("interactive", status=WAITING)
    early = seq("batch")
    suspended_batch, running_batch = seq("batch", status=SUSPENDED), seq("batch")    # the running one is later
    late_rt = seq("realtime")
    no_blocks = seq("deferrable", status=SUSPENDED, blocks=())
    chosen = VictimChooser.for_memory(needy, [early, running_batch, late_rt], [suspended_batch, no_blocks], set())
    assert chosen is suspended_batch                       # suspended before running within the lowest class
    assert VictimChooser.for_memory(needy, [early, running_batch, late_rt], [no_blocks], set()) is running_batch
    assert VictimChooser.for_memory(needy, [early], [], {id(early)}) is None        # already in this step
    # a sequence of the same class that arrived earlier ranks above: it is never displaced for a later one
    late = seq("batch", status=WAITING)
    assert VictimChooser.for_memory(late, [early, running_batch], [], set()) is None
    assert VictimChooser.for_memory(running_batch, [running_batch], [], set()) is None   # never itself


def test_with_nothing_running_a_suspended_sequence_ranked_later_in_the_step_gives_its_memory_though_it_came_first():
    """Fair share may rank a later arrival ahead of a suspended one of its class; with nothing running, the step is
    empty unless the suspended one (which nothing ranked below the kept-out one may join) gives up its blocks."""
    early_b = seq("interactive", tenant="b", status=SUSPENDED)
    needy = seq("interactive", tenant="a", status=WAITING)
    passed = {id(needy)}                                  # the step's order: needy, then early_b
    assert VictimChooser.for_memory(needy, [], [needy, early_b], set()) is None       # no order given: it stays
    assert VictimChooser.for_memory(needy, [], [needy, early_b], set(), passed) is early_b
    # ranked before needy in the step (passed over: its adapter is loading, say): it stays
    assert VictimChooser.for_memory(needy, [], [early_b, needy], set(), passed | {id(early_b)}) is None
    # with something running, the step is not empty: the usual rule alone
    assert VictimChooser.for_memory(needy, [seq("realtime")], [needy, early_b], set(), passed) is None
    # one the usual rule allows goes first, though it runs
    late = seq("interactive", tenant="c")
    assert VictimChooser.for_memory(needy, [late], [needy, early_b], set(), passed) is late
    # never a higher class, whatever the order
    rt = seq("realtime", tenant="b", status=SUSPENDED)
    assert VictimChooser.for_memory(needy, [], [rt, needy], set(), {id(rt), id(needy)}) is None


def shares(running, waiting, served, max_num_seqs=4, reserve_seats=0, handed=None, moved=0):
    return VictimChooser(max_num_seqs, reserve_seats).for_share(running, waiting, served, handed or defaultdict(int),
                                                                moved)


def test_a_free_seat_moves_nobody():
    a = [seq(tenant="a") for _ in range(3)]
    assert shares(a, [seq(tenant="b", status=WAITING)], defaultdict(float, {(2, "a"): 100.0})) is None


def test_a_tenant_holding_every_seat_hands_its_latest_to_a_less_served_waiting_tenant():
    a = [seq(tenant="a") for _ in range(4)]
    b = seq(tenant="b", status=WAITING)
    served = defaultdict(float, {(2, "a"): 40.0, (2, "b"): 10.0})
    assert shares(a, [b], served) == (a[-1], "b")
    served[(2, "b")] = 40.0                                # no lead in service: nothing moves
    assert shares(a, [b], served) is None
    # one seat already handed over in this step (a[-1] suspended): b has no other waiting sequence to take another
    served = defaultdict(float, {(2, "a"): 40.0})
    assert shares(a[:3], [b, a[-1]], served, handed=defaultdict(int, {"b": 1}), moved=1) is None
    assert shares(a[:3], [b, seq(tenant="b", status=WAITING), a[-1]], served, handed=defaultdict(int, {"b": 1}),
                  moved=1) == (a[2], "b")


def test_the_odd_seat_moves_only_with_a_lead_of_odd_seat_lead():
    """2 seats to 1: handing one over would leave a with what b held (1 to 2), so it moves only when a is ahead
    by more than ODD_SEAT_LEAD (and back after as long)."""
    a = [seq(tenant="a") for _ in range(2)]
    b_running, b_waiting = seq(tenant="b"), seq(tenant="b", status=WAITING)
    running = a + [b_running]
    assert shares(running, [b_waiting], defaultdict(float, {(2, "a"): ODD_SEAT_LEAD, (2, "b"): 0.0}),
                  max_num_seqs=3) is None
    assert shares(running, [b_waiting], defaultdict(float, {(2, "a"): ODD_SEAT_LEAD + 1, (2, "b"): 0.0}),
                  max_num_seqs=3) == (a[-1], "b")


def test_weight_buys_seats():
    """a holds 3 seats of 4 and b 1, with a ahead in service: at equal weights a seat moves (2 to 2); with weight 2,
    3 seats are about a's share (2.7) and handing one over would leave it 1 seat per weight to b's 2: none moves."""
    for weight, moves in ((1.0, True), (2.0, False)):
        a = [seq(tenant="a", weight=weight) for _ in range(3)]
        b = [seq(tenant="b"), seq(tenant="b", status=WAITING)]
        assert (shares(a + b[:1], b[1:], defaultdict(float, {(2, "a"): 10.0})) == (a[-1], "b")) == moves


def test_no_handover_within_a_class_while_a_lower_class_holds_a_seat():
    """The seat goes to the waiting class from the lower class first (for_seat), not from a peer tenant."""
    a = [seq("interactive", tenant="a") for _ in range(3)] + [seq("batch", tenant="c")]
    b = seq("interactive", tenant="b", status=WAITING)
    assert shares(a, [b], defaultdict(float, {(1, "a"): 40.0})) is None


def test_the_online_reserve_counts_offline_seats_as_full():
    """Offline seats full (the reserve keeps one): offline tenants hand seats among themselves."""
    a = [seq(tenant="a") for _ in range(3)]
    b = seq(tenant="b", status=WAITING)
    served = defaultdict(float, {(2, "a"): 40.0})
    assert shares(a, [b], served, max_num_seqs=4, reserve_seats=1) == (a[-1], "b")
    assert shares(a, [b], served, max_num_seqs=4, reserve_seats=0) is None
