"""Iteration-level scheduling: which sequences run this step, and how many tokens each computes.

Order: SLA class, then (within a class) running before waiting, tenant fair share (tokens served
divided by tenant weight) and arrival. Each step fills a token budget up to max_num_seqs; a prompt
that doesn't fit the budget is prefilled in chunks. When the KV pool runs dry, sequences are
preempted by recompute: the lowest class first, the latest arrival first, and never one that
ranks above the sequence that needs the room.
"""
from collections import defaultdict, deque
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.served: dict[tuple[int, str], float] = defaultdict(float)   # (class rank, tenant) -> tokens / weight
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._activate_tenant(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _activate_tenant(self, seq: Sequence) -> None:
        # A tenant coming back from idle starts level with the least-served active tenant of its class,
        # so banked idleness can't buy it a monopoly later.
        key = (seq.rank, seq.tenant)
        active = {(s.rank, s.tenant) for s in self.waiting + self.running if s.rank == seq.rank}
        if key not in active:
            floor = min((self.served[k] for k in active), default=self.served[key])
            self.served[key] = max(self.served[key], floor)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED

    def _share(self, seq: Sequence) -> float:
        return self.served[(seq.rank, seq.tenant)]

    def _candidates(self):
        """Yield sequences in scheduling order, fair share updated as tokens are handed out."""
        by_class_running = defaultdict(list)
        for seq in self.running:
            by_class_running[seq.rank].append(seq)
        by_class_waiting = defaultdict(lambda: defaultdict(deque))
        for seq in sorted(self.waiting, key=lambda s: s.arrival):
            by_class_waiting[seq.rank][seq.tenant].append(seq)
        for rank in range(len(SLA_CLASSES)):
            yield from sorted(by_class_running.get(rank, ()),
                              key=lambda s: (s.num_uncomputed_tokens > 1, self._share(s), s.arrival))
            tenants = by_class_waiting.get(rank, {})
            while tenants:
                tenant = min(tenants, key=lambda t: (self.served[(rank, t)], tenants[t][0].arrival))
                seq = tenants[tenant].popleft()
                if not tenants[tenant]:
                    del tenants[tenant]
                yield seq

    def _victim(self, seq: Sequence, scheduled: set[int], strictly_lower: bool) -> Sequence | None:
        """The running sequence to preempt for seq: lowest class, then latest arrival; None if none may go."""
        pool = [s for s in self.running if s is not seq and id(s) not in scheduled
                and (s.rank > seq.rank if strictly_lower else (s.rank, s.arrival) > (seq.rank, seq.arrival))]
        return max(pool, key=lambda s: (s.rank, s.arrival), default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self._candidates()):
            if budget == 0:
                break
            if seq in batch.preempted:
                continue   # made room for a higher-ranked sequence in this very step
            waiting = seq.status == SequenceStatus.WAITING
            if waiting and any(p.rank <= seq.rank for p in batch.preempted):
                break      # don't admit work that ranks no higher than what this step just evicted
            if waiting and len(self.running) >= self.max_num_seqs:
                victim = self._victim(seq, scheduled, strictly_lower=True)
                if victim is None:
                    break
                self._preempt(victim)
                batch.preempted.append(victim)
            if waiting:
                self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_new, scheduled, batch):
                if waiting:
                    self.block_manager.free_sequence(seq)
                    break   # nothing below it may jump the queue while it can't get memory
                continue
            if waiting:
                self.block_manager.prefix_queries += seq.num_tokens
                self.block_manager.prefix_hits += seq.num_cached_tokens
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
            scheduled.add(id(seq))
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            self.served[(seq.rank, seq.tenant)] += num_new / seq.weight
        return batch

    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        while not self.block_manager.allocate(seq, num_new):
            victim = self._victim(seq, scheduled, strictly_lower=False)
            if victim is None:
                if seq.status == SequenceStatus.RUNNING:
                    self._preempt(seq)
                    batch.preempted.append(seq)
                return False
            self._preempt(victim)
            batch.preempted.append(victim)
        return True

    def postprocess(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed counts; returns the sequences whose whole context is now computed (they sample)."""
        ready = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        return ready
