"""Iteration-level scheduling: which sequences run this step, and how many tokens each computes.

Order: SLA class, then (within a class) running, then the others by tenant fair share (tokens served divided by
tenant weight; on a tie, the tenant holding fewer of the class's seats first): a tenant's displaced (suspended or
swapped) before its waiting, each by arrival. A sequence whose tenant holds less than its weighted share of its
class's seats may take one from a tenant that holds more (suspended, it keeps its blocks), so a flood that filled
the seats first does not keep them. A step holds at most max_num_seqs sequences and max_num_batched_tokens
tokens; a prompt that doesn't fit is prefilled in chunks.

The pace rule (how long a step lasts, how much offline work fills it beside online work) and the step cut (an
online arrival's first-token step inside the step in flight) are pace.py; whom a step displaces is victims.py.

Blocks of the online reserve are never given to offline work; its seats are lent to offline work while the
engine is quiet (no online work for a while: Pace.quiet), and the first online arrival takes one back. Under the
`no_evict` capacity policy a sequence is admitted only if it can run to max_tokens without evicting anyone, and
nothing is ever preempted.
"""
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from itertools import chain

from tidepool.workers.engine.block_manager import BlockManager
from tidepool.workers.engine.cost_model import attended
from tidepool.workers.engine.pace import Pace
from tidepool.workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus
from tidepool.workers.engine.victims import VictimChooser

CAPACITY_POLICIES = ("max_utilization", "no_evict")
PREEMPTION_KINDS = ("suspend", "swap", "recompute")
EMBED_LOOKAHEAD = 16       # offline embedding inputs passed over for time before a step stops looking for smaller ones

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING
SUSPENDED, SWAPPED = SequenceStatus.SUSPENDED, SequenceStatus.SWAPPED


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block), after swap_out
    copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write (src, dst) device blocks,
                                                                    # after swap_out and before swap_in
    attended: int = 0                      # context tokens the step's new tokens attend to
    predicted_s: float = 0.0               # the cost model's estimate of the step (0 without a model)
    time_limit_s: float | None = None      # with online work here, the bound its offline tokens were fitted
                                           # under (pace room or offline floor); None: no online work here
    idle_limit_s: float | None = None      # without online work: the cap that leaves a new arrival its ttft

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_adapters(self) -> int:
        """Distinct LoRA adapters among the step's sequences (the cost model's per-adapter term)."""
        return len({s.lora for s in self.seqs if s.lora is not None})

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 cost_model=None, sla_targets: dict | None = None, reserve_seats: int = 0, reserve_blocks: int = 0,
                 capacity_policy: str = "max_utilization", max_model_len: int | None = None,
                 offline_floor: float = 0.5, clock=time.monotonic, admit_gate=None, kv_cache: bool = True):
        """cost_model, sla_targets, offline_floor: the pace rule's (workers.engine.pace.Pace).
        admit_gate(seq, running) -> bool: False keeps a sequence out for now without holding up those below it
        (its LoRA adapter is loading or has no slot: workers.engine.lora.LoRAManager.admissible)."""
        if capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {capacity_policy!r}")
        self.pace = Pace(cost_model, sla_targets, offline_floor)
        if not 0 <= reserve_seats < max_num_seqs or not 0 <= reserve_blocks < block_manager.num_blocks:
            raise ValueError("the online reserve must leave offline work at least one seat and one block")
        self.victims = VictimChooser(max_num_seqs, reserve_seats)
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.reserve_seats, self.reserve_blocks = reserve_seats, reserve_blocks      # the online reserve
        self.capacity_policy, self.max_model_len = capacity_policy, max_model_len
        self.clock, self.admit_gate = clock, admit_gate
        self.kv_cache = kv_cache               # False: an encoder's engine (embedding inputs take no blocks)
        self.waiting: list[Sequence] = []      # WAITING, SUSPENDED and SWAPPED sequences
        self.running: list[Sequence] = []
        self.served: dict[tuple[int, str], float] = defaultdict(float)   # (class rank, tenant) -> tokens / weight
        self.left_level: dict[int, float] = {}   # class rank -> service of the tenant whose sequence left it last
        self.preemptions = dict.fromkeys(PREEMPTION_KINDS, 0)
        self.recomputed_tokens = 0             # computed tokens thrown away by recompute and computed again

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def add(self, seq: Sequence) -> None:
        self._activate_tenant(seq)
        seq.status = WAITING
        self.waiting.append(seq)

    def add_forked(self, seq: Sequence) -> None:
        """A sibling forked off a running sequence (n / best_of): it holds its blocks and waits, suspended,
        for a seat (the next step gives it one if the seat limit allows)."""
        seq.status = SUSPENDED
        self.waiting.append(seq)

    def reserved_seats(self, now: float | None = None) -> int:
        """Seats of the online reserve offline work may not take now: none while the engine is quiet (Pace.quiet:
        no online work for a while); the first online arrival then takes a seat through the step cut, past the
        seat limit, and the next step gives it back by suspending an offline sequence (`_trim`)."""
        return 0 if self.pace.quiet(self.clock() if now is None else now) else self.reserve_seats

    def offline_seats(self) -> int:
        return self.max_num_seqs - self.reserved_seats()

    def offline_seats_free(self) -> int:
        running = list(self.running)
        offline = sum(not s.is_online for s in running)
        return max(0, min(self.max_num_seqs - len(running), self.offline_seats() - offline))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _activate_tenant(self, seq: Sequence) -> None:
        # A tenant coming back from idle starts level with the least-served active tenant of its class,
        # so banked idleness can't buy it a monopoly later.
        # The common case, a tenant already active (a batch of 10,000 inputs added at once), stops at its first
        # sequence: a full scan per add made adding n inputs O(n^2) (seconds of the GIL at 10,000).
        if any(s.tenant == seq.tenant and s.rank == seq.rank for s in chain(self.waiting, self.running)):
            return
        self.served[(seq.rank, seq.tenant)] = self._level(seq.rank, seq.tenant)

    def _level(self, rank: int, tenant: str) -> float:
        """The tenant's service in the class, lifted as it would be if it arrived now (_activate_tenant). With
        nobody active, the level is that of the last tenant to leave the class (as VTC lifts a newcomer): a
        low-rate tenant idle between its requests has otherwise just been served alone, and a tenant arriving
        in such a moment with no service yet would rank ahead of it until it had caught up (seconds of a flood)."""
        key = (rank, tenant)
        active = {s.tenant for s in chain(self.waiting, self.running) if s.rank == rank}
        if tenant in active:
            return self.served[key]
        floor = min((self.served[(rank, t)] for t in active), default=self.left_level.get(rank, self.served[key]))
        return max(self.served[key], floor)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give back its blocks."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.left_level[seq.rank] = self.served[(seq.rank, seq.tenant)]
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED

    def _candidates(self):
        """Yield sequences in scheduling order, by the fair shares at the step's start (a snapshot: the step hands
        out tokens as it goes, and the order must not shift under it). Lazy: a step that fills its budget early
        stops asking, so thousands of waiting inputs are not walked through every step."""
        served = dict(self.served)
        by_class_running = defaultdict(list)
        for seq in self.running:
            by_class_running[seq.rank].append(seq)
        by_class_waiting = defaultdict(lambda: defaultdict(deque))   # a tenant's parked ones, then its waiting
        for seq in sorted(self.waiting, key=lambda s: (s.status == WAITING, s.arrival)):
            by_class_waiting[seq.rank][seq.tenant].append(seq)
        for rank in range(len(SLA_CLASSES)):
            running = by_class_running.get(rank, ())
            yield from sorted(running, key=lambda s: (s.num_uncomputed_tokens > 1, served.get((rank, s.tenant), 0.0),
                                                      s.arrival))
            tenants = by_class_waiting.get(rank, {})
            # equal service (a tenant back from idle is lifted level with the least served): the one holding fewer
            # of the class's seats first, then the earliest
            holding = defaultdict(int, Counter(s.tenant for s in running))
            while tenants:
                tenant = min(tenants, key=lambda t: (served.get((rank, t), 0.0), holding[t], tenants[t][0].arrival))
                seq = tenants[tenant].popleft()
                if not tenants[tenant]:
                    del tenants[tenant]
                yield seq

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.block_manager.end_step()
        now = self.clock()
        step = self.pace.step(self.running, self.waiting, now)   # before the rebalance moves anyone
        self.victims.reserve_seats = self.reserved_seats(now)
        batch = ScheduledBatch()
        self._trim(batch)
        budget, scheduled, passed = self.max_num_batched_tokens, set(), set()   # passed: the candidates so far
        offline_running = sum(not s.is_online for s in self.running)    # kept current: O(1) per admission
        rebalanced = self._rebalance(batch)
        preempted_seen = passed_over = 0     # passed_over: offline embedding inputs that did not fit
        admitting = True           # once a sequence is kept out, nothing below it may jump the queue
        for seq in self._candidates():
            if budget == 0:
                break
            passed.add(id(seq))
            if len(batch.preempted) != preempted_seen:     # suspensions or evictions changed the running set
                offline_running = sum(not s.is_online for s in self.running)
                preempted_seen = len(batch.preempted)
            if id(seq) in scheduled or any(p is seq for p in batch.preempted):
                continue   # made room for a higher-ranked sequence in this very step
            if (bound := step.bound(seq, first=not batch.seqs)) is None:
                continue   # not even one more offline token fits in the time bound
            new = seq.status != RUNNING
            if new:
                if self.admit_gate is not None and not self.admit_gate(seq, self.running):
                    continue
                if step.prompt_waits(seq, batch.preempted):
                    admitting = False      # nothing ranked below it takes its place
                    continue
                # Don't admit work that ranks no higher than what this step just evicted.
                admitting = admitting and not any(p.rank <= seq.rank for p in batch.preempted
                                                  if all(p is not r for r in rebalanced))
                if not admitting or not self._seat(seq, offline_running, scheduled, batch) \
                        or not self._admit(seq, scheduled, batch, passed):
                    admitting = False
                    continue
            n = self.pace.num_new(seq, budget, bound[0], bound[1], new and not batch.seqs)
            if n == 0:
                if new:
                    self._unadmit(seq)
                # an embedding input too long for what is left: smaller ones behind it may fit, but a step looks
                # only so far (with thousands of inputs waiting, a scan of all of them would cost more than a step)
                if seq.pooling is not None and not seq.is_online:
                    passed_over += 1
                    if passed_over >= EMBED_LOOKAHEAD:
                        break
                continue
            if not self._make_room(seq, n, scheduled, batch, passed):
                if new:
                    self._unadmit(seq)
                    admitting = False
                continue
            if new:
                self._start(seq)
                offline_running += not seq.is_online
            del seq.draft_token_ids[n - 1:]
            scheduled.add(id(seq))
            self._take(batch, seq, n)
            step.add(seq, n, new)
            budget -= n
        self.pace.settle(step, batch, self.running, self.waiting)
        batch.copies = self.block_manager.take_copies()
        return batch

    def _take(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.attended += attended(seq.num_computed_tokens, n)
        self.served[(seq.rank, seq.tenant)] += n / seq.weight

    # -- the step cut ------------------------------------------------------------------------------
    def cut_in_tenants(self, inflight: ScheduledBatch, arrivals: list[Sequence], remaining_s: float) -> set[str]:
        """The tenants of arrivals whose first-token step runs inside the step in flight (Pace.cut_in_tenants)."""
        return self.pace.cut_in_tenants(inflight, arrivals, remaining_s, self.clock(), self.running, self.served,
                                        self._level)

    def schedule_cut_in(self, inflight: ScheduledBatch, tenants: set[str]) -> ScheduledBatch:
        """A first-token step to run between two layers of the step in flight (Pace.cut_in_prompts): whole prompts,
        into free seats and free blocks only (past the seat limit by seats `_trim` takes back from offline work in
        the next step, where the reserve was lent); nothing is preempted and nothing of the step in flight is
        touched."""
        batch, step = ScheduledBatch(), self.pace.cut_in_step()
        if step is None:
            return batch
        bm, budget = self.block_manager, self.max_num_batched_tokens
        # past the seat limit only by seats the next step takes back from offline work (`_trim`)
        offline = sum(not s.is_online for s in self.running)
        for seq in self.pace.cut_in_prompts(self.waiting, tenants, self.served):
            if len(self.running) >= self.max_num_seqs + offline or budget == 0:
                break
            if batch.seqs and step.over_idle_cap(seq):
                break      # as in schedule: a further prompt rides only within the idle cap
            bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate(seq, n, 0):
                bm.free_sequence(seq)
                break
            self._start(seq)
            self._take(batch, seq, n)
            step.add(seq, n, new=True)
            budget -= n
        if batch:
            batch.predicted_s = step.used
            batch.copies = bm.take_copies()
        return batch

    # -- seats --------------------------------------------------------------------------------------
    def _trim(self, batch: ScheduledBatch) -> None:
        """Back to the seat limit after a step cut took a seat past it (the reserve was lent): the latest-arrived
        offline sequences of the lowest class are suspended (they keep their blocks)."""
        while len(self.running) > self.max_num_seqs:
            victim = max((s for s in self.running if not s.is_online), key=lambda s: (s.rank, s.arrival), default=None)
            if victim is None:
                return
            self._suspend(victim, batch)

    def _seat(self, seq: Sequence, offline_running: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """A seat for a sequence that isn't running, suspending a lower-class one if need be."""
        while True:
            full = len(self.running) >= self.max_num_seqs
            offline_full = not seq.is_online and offline_running >= self.max_num_seqs - self.victims.reserve_seats
            if not full and not offline_full:
                return True
            if self.capacity_policy == "no_evict":
                return False
            victim = self.victims.for_seat(seq, self.running, scheduled, full)
            if victim is None:
                return False
            self._suspend(victim, batch)
            offline_running -= not victim.is_online

    def _rebalance(self, batch: ScheduledBatch) -> list[Sequence]:
        """With every seat taken: hand seats of tenants holding more than their weighted share of their class's
        seats to the least-served waiting tenant of that class holding less (VictimChooser.for_share; a suspended
        one keeps its blocks, the waiting one takes its seat in this step). Returns the suspended ones."""
        moved: list[Sequence] = []
        if self.capacity_policy == "no_evict":
            return moved
        handed: dict[str, int] = defaultdict(int)      # seats handed to a waiting tenant in this step
        while choice := self.victims.for_share(self.running, self.waiting, self.served, handed, len(moved)):
            victim, tenant = choice
            self._suspend(victim, batch)
            moved.append(victim)
            handed[tenant] += 1
        return moved

    def _suspend(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.status = SUSPENDED
        self.waiting.append(seq)
        self._count(seq, "suspend", batch)

    def _admit(self, seq: Sequence, scheduled: set[int], batch: ScheduledBatch, passed: set[int]) -> bool:
        """Bring a waiting, suspended or swapped sequence back onto device blocks; False when memory (or the
        capacity policy) keeps it out."""
        bm = self.block_manager
        keep = 0 if seq.is_online else self.reserve_blocks
        if seq.status == WAITING and seq.pooling is None:
            bm.match_prefix(seq)
            if self.capacity_policy == "no_evict" and \
                    bm.blocks_to_finish(seq, self.max_model_len) > bm.num_free_blocks - keep - self._future_blocks():
                bm.free_sequence(seq)
                return False
        elif seq.status == SWAPPED:
            while not bm.can_swap_in(seq, keep):
                victim = self.victims.for_memory(seq, self.running, self.waiting, scheduled, passed)
                if victim is None or self.capacity_policy == "no_evict":
                    return False
                self._evict(victim, batch)
            batch.swap_in.extend(bm.swap_in(seq))
            seq.status = SUSPENDED
        return True

    def _unadmit(self, seq: Sequence) -> None:
        if seq.status == WAITING:
            self.block_manager.free_sequence(seq)

    def _start(self, seq: Sequence) -> None:
        bm = self.block_manager
        if seq.status == WAITING:
            bm.prefix_queries += seq.num_tokens
            bm.prefix_hits += seq.num_cached_tokens
            if seq.num_lost_tokens:
                self.recomputed_tokens += max(0, seq.num_lost_tokens - seq.num_cached_tokens)
                seq.num_lost_tokens = 0
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = RUNNING

    # -- memory -------------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, n: int, scheduled: set[int], batch: ScheduledBatch, passed: set[int]) -> bool:
        if seq.pooling is not None and not self.kv_cache:
            return True        # an encoder: no KV at all
        keep = 0 if seq.is_online else self.reserve_blocks
        while not self.block_manager.allocate(seq, n, keep):
            if self.capacity_policy == "no_evict":
                return False
            victim = self.victims.for_memory(seq, self.running, self.waiting, scheduled, passed)
            if victim is None:
                if seq.status == RUNNING:
                    self._evict(seq, batch)
                return False
            self._evict(victim, batch)
        return True

    def _evict(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free seq's device blocks: to the host pool when it has room, else by dropping them (recompute)."""
        bm = self.block_manager
        if seq.status == RUNNING:
            self.running.remove(seq)
            self.waiting.append(seq)
        if bm.can_swap_out(seq):
            batch.swap_out.extend(bm.swap_out(seq))
            seq.status = SWAPPED
            self._count(seq, "swap", batch)
        else:
            lost = seq.num_computed_tokens
            bm.free_sequence(seq)
            seq.num_lost_tokens += lost
            seq.status = WAITING
            self._count(seq, "recompute", batch)

    def _count(self, seq: Sequence, kind: str, batch: ScheduledBatch) -> None:
        seq.num_preemptions += 1
        self.preemptions[kind] += 1
        batch.preempted.append(seq)

    def _future_blocks(self) -> int:
        """Blocks the running and suspended sequences still need to finish (the no_evict capacity policy)."""
        return sum(self.block_manager.blocks_to_finish(s, self.max_model_len) for s in self.running) + sum(
            self.block_manager.blocks_to_finish(s, self.max_model_len) for s in self.waiting if s.status == SUSPENDED)

    def postprocess(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed counts; returns the sequences whose whole context is now computed (they sample)."""
        ready = []
        now = self.clock()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.draft_token_ids)    # drafts count once verified (engine)
            if seq.pooling is None:
                self.block_manager.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
                if seq.first_token_s is None:
                    seq.first_token_s = now       # its pace is counted from here
        return ready
