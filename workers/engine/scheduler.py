"""Iteration-level scheduling: which sequences run this step, and how many tokens each computes.

Order: SLA class, then (within a class) running, then the others by tenant fair share (tokens served divided by
tenant weight; on a tie, the tenant holding fewer of the class's seats first): a tenant's displaced (suspended or
swapped) before its waiting, each by arrival. A sequence whose tenant holds less than its weighted share of its
class's seats may take one from a tenant that holds more (suspended, it keeps its blocks), so a flood that filled
the seats first does not keep them. A step holds at most max_num_seqs sequences and max_num_batched_tokens
tokens; a prompt that doesn't fit is prefilled in chunks.

The step policy while online work (realtime, interactive) is running or waiting, as users feel it:
  - first token as soon as the device allows: a waiting online prompt goes whole (up to the token budget) into
    the very next step, and that step carries no offline tokens beyond what offline is owed (below); a step starts
    the online prompts of one tenant only (the least served first), so a tenant's flood of prompts never rides in
    another's first-token step and lengthens it, and a prompt after the first joins only while the step stays
    within the idle cap (below): a backlog of prompts taken at once made steps of seconds that every stream and
    every other tenant's arrival waited out; an online arrival that ranks ahead of the step's prompt tenants and
    holds fewer seats need not wait for the step in flight at all: its first-token step runs between two of that
    step's layers (cut_in_tenants, schedule_cut_in; LLMEngine's step cut);
  - smoothness by delivered pace: a running online stream is on pace while it has delivered at least one token
    per `itl_ms` of its class since its first token. The next token of each stream is due at first token +
    delivered x itl_ms; the step may last until the earliest due time (a stream ahead of its pace absorbs a
    longer step, banking at most PACE_CREDIT gaps; one verifying speculative drafts counts those it is expected to
    have accepted), and offline tokens fill that room (stall-free batching);
  - offline never starved: while offline work waits, it gets at least `offline_floor` of each step's predicted
    time (its tokens' cost against the online tokens and the fixed cost). What a first-token step without running
    streams could not give it is owed and paid back in the next such steps (at most one floor's worth extra a
    step) and by steps of offline work alone; while streams run, no debt is kept or paid, since paying it would
    stretch every stream's gaps, and a first-token step beside running streams carries no offline tokens even with
    the debt at OWED_CAP_S, since carrying them would lengthen both the new request's first token and every
    stream's gap.
Without online work the token budget applies, and a step is kept within the tightest `ttft_ms - itl_ms` of the
online classes and IDLE_GAPS of their tightest pace: an online prompt arriving while it runs waits for it, so an
offline prefill wave must not hold it up longer than a few of its tokens would take (each such step still makes
progress). Offline embedding inputs fill a step only up to the tightest
`itl_ms` (an input that opens the step runs whole whatever it costs): an embedding input is computed whole and
gives nothing back until its step ends, and a realtime prompt arriving mid-step, for this engine or another on the
device (workers/device_stepper.py starts it beside the step in flight), must find that step short, so an embedding
batch leaves realtime TTFT about where it is idle.

Preemption keeps work where it can: a sequence displaced for a seat is suspended and keeps its blocks; one
displaced for memory goes to the host pool when there is one with room (swap), else is recomputed. Victims:
lowest class first, suspended before running, latest arrival first; never one that ranks above the sequence
that needs the room. Seats and blocks of the online reserve are never given to offline work. Under the
`no_evict` capacity policy a sequence is admitted only if it can run to max_tokens without evicting anyone,
and nothing is ever preempted.
"""
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from itertools import chain

from workers.engine.block_manager import BlockManager
from workers.engine.cost_model import attended
from workers.engine.sequence import SLA_CLASSES, Sequence, SequenceStatus

CAPACITY_POLICIES = ("max_utilization", "no_evict")
PREEMPTION_KINDS = ("suspend", "swap", "recompute")

PACE_CREDIT = 1.0          # a stream ahead of its pace banks at most this many of its class's token gaps
IDLE_GAPS = 2.0            # an offline-only step lasts at most this many of the tightest online pace
ODD_SEAT_LEAD = 16.0       # weighted tokens of service the giver of an odd seat must be ahead (Scheduler._rebalance)
OWED_CAP_S = 1.0           # offline time owed beyond this is paid even in a step that brings a first token
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
        """cost_model: any object with `fixed`, `per_token`, `per_context` (seconds); None: no time bound.
        sla_targets: {class: {"ttft_ms": .., "itl_ms": ..}} for the online classes (itl_ms: the class's pace).
        offline_floor: the least share of a step's time offline work gets while it waits beside online work.
        admit_gate(seq, running) -> bool: False keeps a sequence out for now without holding up those below it
        (its LoRA adapter is loading or has no slot: workers.engine.lora.LoRAManager.admissible)."""
        if capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {capacity_policy!r}")
        if not 0 <= offline_floor < 1:
            raise ValueError(f"offline_floor must be in [0, 1), got {offline_floor!r}")
        if not 0 <= reserve_seats < max_num_seqs or not 0 <= reserve_blocks < block_manager.num_blocks:
            raise ValueError("the online reserve must leave offline work at least one seat and one block")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost_model = cost_model
        self.sla_targets = sla_targets or {}
        self.reserve_seats = reserve_seats
        self.reserve_blocks = reserve_blocks
        self.capacity_policy = capacity_policy
        self.max_model_len = max_model_len
        self.offline_floor = offline_floor
        self.offline_owed = 0.0                # seconds of step time offline work is owed (see the module docstring)
        self.clock = clock
        self.admit_gate = admit_gate
        self.kv_cache = kv_cache               # False: an encoder's engine (embedding inputs take no blocks)
        self.waiting: list[Sequence] = []      # WAITING, SUSPENDED and SWAPPED sequences
        self.running: list[Sequence] = []
        self.served: dict[tuple[int, str], float] = defaultdict(float)   # (class rank, tenant) -> tokens / weight
        self.left_level: dict[int, float] = {}   # class rank -> service of the tenant whose sequence left it last
        self.preemptions = dict.fromkeys(PREEMPTION_KINDS, 0)
        self.recomputed_tokens = 0             # computed tokens thrown away by recompute and computed again
        # Without online work a step stays within what lets an online prompt arriving mid-step still meet its
        # ttft (wait for this step, then one step (<= itl) of its own) and within IDLE_GAPS of the tightest pace.
        idle = [t["ttft_ms"] - t["itl_ms"] for t in self.sla_targets.values() if "ttft_ms" in t and "itl_ms" in t]
        itl = [t["itl_ms"] for t in self.sla_targets.values() if "itl_ms" in t]
        if itl:
            idle.append(IDLE_GAPS * min(itl))
        self.idle_limit_s = min(idle) / 1000 if cost_model is not None and idle and min(idle) > 0 else None
        # Offline embedding inputs fill a step up to the tightest online pace (see the module docstring).
        self.embed_limit_s = min(itl) / 1000 if cost_model is not None and itl else None

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

    def offline_seats_free(self) -> int:
        running = list(self.running)
        offline = sum(not s.is_online for s in running)
        return max(0, min(self.max_num_seqs - len(running), self.max_num_seqs - self.reserve_seats - offline))

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

    @staticmethod
    def _online_prompt(seq: Sequence) -> bool:
        """An online sequence whose first token is not out yet (its step is a first-token step)."""
        return seq.is_online and seq.first_token_s is None

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
            holding = defaultdict(int)
            for seq in running:
                holding[seq.tenant] += 1
            while tenants:
                tenant = min(tenants, key=lambda t: (served.get((rank, t), 0.0), holding[t], tenants[t][0].arrival))
                seq = tenants[tenant].popleft()
                if not tenants[tenant]:
                    del tenants[tenant]
                yield seq

    # -- time ---------------------------------------------------------------------------------------
    def _pace(self, seq: Sequence) -> float | None:
        """The class's pace (seconds a token) of an online sequence; None for offline work or no target."""
        itl = self.sla_targets.get(seq.sla_class, {}).get("itl_ms") if seq.is_online else None
        return None if itl is None else itl / 1000

    def _pace_room(self, now: float) -> tuple[float | None, bool]:
        """(room, streaming). room: None when no online work with a pace is here (no time bound), else how long this
        step may last with every running online stream still on pace: the earliest next-token due time (first token
        + delivered x pace, banking at most PACE_CREDIT gaps) from now; 0 when a stream is behind or none streams
        yet. streaming: such a stream is running (its first token is out)."""
        if self.cost_model is None:
            return None, False
        if not any(self._pace(s) is not None for s in self.running + self.waiting):
            return None, False
        room = self._stream_room(self.running, now)
        return max(0.0, room or 0.0), room is not None

    def _stream_room(self, seqs, now: float) -> float | None:
        """How long from now the online streams among seqs (first token out, a pace) stay on pace: the earliest
        next-token due time (first token + delivered x pace, banking at most PACE_CREDIT gaps); None: no stream.
        A stream verifying drafts this step counts the drafts it is expected to have accepted (spec_decode) as
        delivered: a step that brings it several tokens may last as long as they take at its pace, so the step
        time speculation saves goes to offline work instead of running the stream ahead of its pace."""
        room = None
        for seq in seqs:
            pace = self._pace(seq)
            if pace is None or seq.first_token_s is None:
                continue
            ahead = seq.draft_expected
            slack = min(seq.first_token_s + (seq.num_output_tokens + ahead) * pace - now, (PACE_CREDIT + ahead) * pace)
            room = slack if room is None else min(room, slack)
        return room

    def _offline_limit(self, pace_room: float, online_s: float, first_token_step: bool, streaming: bool) -> float:
        """The predicted step time offline tokens may fill up to, once the online tokens (online_s with the fixed
        cost) are in: the pace room, or offline's floor share of the step plus, while no stream runs, up to as much
        again of what it is owed. A step that computes an online prompt (its first token is not out yet) gives
        offline nothing, unless no stream runs and the debt has reached OWED_CAP_S: the first token comes as soon as
        the device allows."""
        share = self.offline_floor / (1 - self.offline_floor) * online_s
        if first_token_step and (streaming or self.offline_owed < OWED_CAP_S):
            return online_s
        return max(pace_room, online_s + share + (0.0 if streaming else min(self.offline_owed, share)))

    def _tokens_within(self, seconds: float, start: int, most: int) -> int:
        """The most new tokens (<= most) of a sequence at `start` whose predicted cost fits in `seconds`."""
        c = self.cost_model
        if seconds <= 0:
            return 0
        if c.per_context <= 0:
            return most if c.per_token <= 0 else min(most, int(seconds / c.per_token))
        # per_token * n + per_context * (n * start + n * (n + 1) / 2) <= seconds, solved for n
        # in the form that doesn't cancel when per_context is tiny beside per_token
        a, b = c.per_context / 2, c.per_token + c.per_context * (start + 0.5)
        n = int(2 * seconds / (b + (b * b + 4 * a * seconds) ** 0.5))
        return max(0, min(most, n))

    def _step_cost(self, start: int, n: int) -> float:
        c = self.cost_model
        return c.per_token * n + c.per_context * attended(start, n)

    def _adapter_cost(self, seq: Sequence, adapters: set) -> float:
        """What the sequence's LoRA adapter adds to a step whose sequences so far use `adapters` (the cost
        model's per_adapter when it is the first of its adapter, else 0; objects without the term: 0)."""
        if seq.lora is None or seq.lora in adapters:
            return 0.0
        return getattr(self.cost_model, "per_adapter", 0.0)

    def _num_new(self, seq: Sequence, budget: int, limit: float | None, time_left: float, first: bool = False) -> int:
        """Online work runs whole (a prompt up to the token budget; a decode with its speculative drafts, which
        spec_decode sized to pay for themselves); offline tokens, drafts included, fit in the time left. An
        embedding input runs whole or waits: an online one goes in this step, an offline one when it fits the time
        left (or opens the step)."""
        if seq.pooling is not None:
            n = seq.num_uncomputed_tokens
            if n > budget or (limit is not None and not seq.is_online and not first
                              and self._tokens_within(time_left, 0, n) < n):
                return 0
            return n
        n = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
        if limit is None or seq.is_online:
            return n
        fit = self._tokens_within(time_left, seq.num_computed_tokens, n)
        # one that opens the step takes a token whatever the bound (its prefix-cache hit may have moved its start
        # past the one-token room the step was given): an empty step changes nothing
        return max(fit, min(n, 1)) if first else fit

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        bm.end_step()
        pace_room, streaming = self._pace_room(self.clock())
        batch = ScheduledBatch(time_limit_s=pace_room)
        limit = None               # the bound offline tokens fit under; with online work, set at the first one
        if pace_room is None and self.idle_limit_s is not None and self.idle_limit_s > self.cost_model.fixed + sum(
                self._step_cost(s.num_computed_tokens, 1) for s in self.running) + getattr(
                self.cost_model, "per_adapter", 0.0) * len({s.lora for s in self.running if s.lora is not None}):
            # (a device too slow for the cap, one token of every running sequence above it, gets no cap: the cap
            # can't be met, and would leave a step one token of all its work)
            limit = batch.idle_limit_s = self.idle_limit_s
        online_s = None            # with online work: the step's predicted time before any offline token
        first_token_step = False   # an online prompt is computed in this step
        time_used = self.cost_model.fixed if self.cost_model is not None else 0.0
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        offline_running = sum(not s.is_online for s in self.running)    # kept current: O(1) per admission
        rebalanced = self._rebalance(batch)
        preempted_seen = 0
        admitting = True           # once a sequence is kept out, nothing below it may jump the queue
        passed_over = 0            # offline embedding inputs that did not fit (EMBED_LOOKAHEAD)
        adapters: set[str] = set()     # the LoRA adapters of the step's sequences so far
        prompt_tenant = None       # the tenant whose online prompt this step starts (one tenant's a step)
        for seq in self._candidates():
            if budget == 0:
                break
            if len(batch.preempted) != preempted_seen:     # suspensions or evictions changed the running set
                offline_running = sum(not s.is_online for s in self.running)
                preempted_seen = len(batch.preempted)
            if id(seq) in scheduled or any(p is seq for p in batch.preempted):
                continue   # made room for a higher-ranked sequence in this very step
            if pace_room is not None and online_s is None and not seq.is_online:
                online_s = time_used     # candidates come by class: the online part of the step is complete
                limit = batch.time_limit_s = self._offline_limit(pace_room, online_s, first_token_step, streaming)
            seq_limit = limit
            if seq.pooling is not None and not seq.is_online and self.embed_limit_s is not None:
                seq_limit = self.embed_limit_s if limit is None else min(limit, self.embed_limit_s)
            adapter_s = 0.0 if self.cost_model is None else self._adapter_cost(seq, adapters)
            time_left = 0.0 if seq_limit is None else seq_limit - time_used - adapter_s
            if seq_limit is not None and not batch.seqs:    # no time bound stops all work: an empty step changes
                time_left = max(time_left, 1.000001 * self._step_cost(seq.num_computed_tokens, 1))   # nothing
            if seq_limit is not None and not seq.is_online and \
                    time_left < self._step_cost(seq.num_computed_tokens, 1):
                continue   # not even one more offline token fits in the time bound
            new = seq.status != RUNNING
            if new and self.admit_gate is not None and not self.admit_gate(seq, self.running):
                continue
            if new and self._online_prompt(seq) and prompt_tenant not in (None, seq.tenant) \
                    and not any(p.rank <= seq.rank for p in batch.preempted):
                # another tenant's prompt waits for the next step instead of lengthening this one, and nothing ranked
                # below it takes its place (unless a seat was just given up for it: then it takes the seat now)
                admitting = False
                continue
            if new and prompt_tenant is not None and self._online_prompt(seq) and seq.pooling is None \
                    and self.idle_limit_s is not None \
                    and time_used + self._step_cost(0, seq.num_uncomputed_tokens) > self.idle_limit_s:
                # a further prompt rides in a first-token step only while the step stays within what an arrival
                # can afford to wait for (the idle cap): a flood's backlog of prompts taken in one step made
                # seconds-long steps that every stream and every other tenant's request waited out (an embedding
                # request's inputs still go together: the request is done only when all of them are)
                admitting = False
                continue
            if new:
                # Don't admit work that ranks no higher than what this step just evicted.
                admitting = admitting and not any(p.rank <= seq.rank for p in batch.preempted
                                                  if all(p is not r for r in rebalanced))
                if not admitting or not self._seat(seq, offline_running, scheduled, batch):
                    admitting = False
                    continue
                n = self._admit(seq, budget, seq_limit, time_left, scheduled, batch)
                if n is None:
                    admitting = False
                    continue
            else:
                n = self._num_new(seq, budget, seq_limit, time_left)
            if n == 0:
                # an embedding input too long for what is left: smaller ones behind it may fit, but a step looks
                # only so far (with thousands of inputs waiting, a scan of all of them would cost more than a step)
                if seq.pooling is not None and not seq.is_online:
                    passed_over += 1
                    if passed_over >= EMBED_LOOKAHEAD:
                        break
                continue
            if not self._make_room(seq, n, scheduled, batch):
                if new:
                    self._unadmit(seq)
                    admitting = False
                continue
            if new:
                self._start(seq)
                offline_running += not seq.is_online
                if self._online_prompt(seq) and prompt_tenant is None:
                    prompt_tenant = seq.tenant
            del seq.draft_token_ids[n - 1:]
            scheduled.add(id(seq))
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.attended += attended(seq.num_computed_tokens, n)
            if self.cost_model is not None:
                time_used += self._step_cost(seq.num_computed_tokens, n) + adapter_s
            if seq.lora is not None:
                adapters.add(seq.lora)
            budget -= n
            self.served[(seq.rank, seq.tenant)] += n / seq.weight
            first_token_step = first_token_step or self._online_prompt(seq)
        if pace_room is not None and not streaming and any(not s.is_online for s in self.running + self.waiting):
            offline_s = 0.0 if online_s is None else time_used - online_s
            self.offline_owed = min(OWED_CAP_S, max(0.0, self.offline_owed + self.offline_floor * time_used
                                                    - offline_s))
        elif pace_room is None and self.offline_owed and batch:
            # a step of offline work alone pays what it is owed: it had the whole step, its floor share and more
            self.offline_owed = max(0.0, self.offline_owed - (1 - self.offline_floor) * time_used)
        if self.cost_model is not None and batch:
            batch.predicted_s = time_used
        batch.copies = bm.take_copies()
        return batch

    # -- the step cut ------------------------------------------------------------------------------
    def cut_in_tenants(self, inflight: ScheduledBatch, arrivals: list[Sequence], remaining_s: float) -> set[str]:
        """The tenants of arrivals (not yet added) whose first-token step should run between two layers of the step
        in flight (LLMEngine's step cut): an online prompt, while the step has more than one token gap of its class
        still to run, whose tenant has no prompt in that step and, against every tenant that has, both ranks ahead
        for the next step (as _candidates ranks them: less service, then fewer seats of the class; a tenant back
        from idle at its lifted level) and holds fewer of the class's seats. So a tenant with one request at a time
        cuts into a flood's first-token step, and a flood never cuts into another's (the lift puts a returning
        tenant level with the flood, and its own prompt then puts it ahead on service: the seats tell them apart);
        no arrival cuts into its own tenant's first-token step. Into a step that starts no online prompt (decode
        and offline work) any may cut, as long as the step's online streams stay on their pace through the rest of
        it and the cut-in step (its fixed cost and the arrival's prompt, predicted): a cut into a decode step makes
        each such stream's gap the whole step plus the cut-in step, where without it the stream waits one
        first-token step. (A stream banks at most PACE_CREDIT gaps, so a realtime stream never has that room; an
        interactive stream well ahead of its pace may.)"""
        if self.cost_model is None:
            return set()           # (schedule_cut_in needs it too)
        prompts = {(s.rank, s.tenant) for s in inflight.seqs if self._online_prompt(s)}
        stream_room = None if prompts else self._stream_room(inflight.seqs, self.clock())
        holding = defaultdict(int)        # (class rank, tenant) -> seats held
        for s in self.running:
            holding[(s.rank, s.tenant)] += 1
        tenants = set()
        for seq in arrivals:
            if not self._online_prompt(seq) or seq.pooling is not None or seq.lora is not None \
                    or (pace := self._pace(seq)) is None or remaining_s <= pace \
                    or any(t == seq.tenant for _, t in prompts):
                continue
            if stream_room is not None and remaining_s + self.cost_model.fixed + \
                    self._step_cost(0, seq.num_uncomputed_tokens) > stream_room:
                continue
            mine = (self._level(seq.rank, seq.tenant), holding[(seq.rank, seq.tenant)])
            if all(rank > seq.rank or (rank == seq.rank and mine < (self.served[(rank, t)], holding[(rank, t)])
                                       and mine[1] < holding[(rank, t)]) for rank, t in prompts):
                tenants.add(seq.tenant)
        return tenants

    def schedule_cut_in(self, inflight: ScheduledBatch, tenants: set[str]) -> ScheduledBatch:
        """A first-token step to run between two layers of the step in flight: the waiting online prompts of the most
        urgent, least-served of `tenants` (one tenant, as in schedule), whole, into free seats and free blocks only.
        Nothing is preempted and nothing of the step in flight is touched: its sequences hold their seats and
        blocks, their computed counts move only when it ends, and the blocks it fills are not shared before then
        (BlockManager.commit runs in postprocess). The step in flight has paid its weight reads for the layers
        already done, so the arrival waits one layer of it, not all of it; the cut costs that step the weight reads
        of its remaining layers once more (at most one fixed cost)."""
        batch = ScheduledBatch()
        if self.cost_model is None:
            return batch
        ready = [s for s in self.waiting if s.status == WAITING and s.tenant in tenants and self._online_prompt(s)
                 and s.pooling is None and s.lora is None and self._pace(s) is not None]
        if not ready:
            return batch
        first = min(ready, key=lambda s: (s.rank, self.served[(s.rank, s.tenant)], s.arrival))
        bm = self.block_manager
        time_used, budget = self.cost_model.fixed, self.max_num_batched_tokens
        for seq in sorted((s for s in ready if s.tenant == first.tenant and s.rank == first.rank),
                          key=lambda s: s.arrival):
            if len(self.running) >= self.max_num_seqs or budget == 0:
                break
            if batch.seqs and self.idle_limit_s is not None and \
                    time_used + self._step_cost(0, seq.num_uncomputed_tokens) > self.idle_limit_s:
                break      # as in schedule: a further prompt rides only within the idle cap
            bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate(seq, n, 0):
                bm.free_sequence(seq)
                break
            self._start(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.attended += attended(seq.num_computed_tokens, n)
            time_used += self._step_cost(seq.num_computed_tokens, n)
            budget -= n
            self.served[(seq.rank, seq.tenant)] += n / seq.weight
        if batch:
            batch.predicted_s = time_used
            batch.copies = bm.take_copies()
        return batch

    def _seat(self, seq: Sequence, offline_running: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """A seat for a sequence that isn't running, suspending a lower-class one if need be."""
        while True:
            full = len(self.running) >= self.max_num_seqs
            offline_full = not seq.is_online and offline_running >= self.max_num_seqs - self.reserve_seats
            if not full and not offline_full:
                return True
            if self.capacity_policy == "no_evict":
                return False
            pool = [s for s in self.running if id(s) not in scheduled and s.rank > seq.rank
                    and (full or not s.is_online)]
            victim = max(pool, key=lambda s: (s.rank, s.arrival), default=None)
            if victim is None:
                return False
            self.running.remove(victim)
            victim.status = SUSPENDED
            self.waiting.append(victim)
            self._count(victim, "suspend", batch)
            offline_running -= not victim.is_online

    def _rebalance(self, batch: ScheduledBatch) -> list[Sequence]:
        """With every seat taken: suspend sequences of tenants holding more than their weighted share of their
        class's seats, for the least-served waiting tenant of that class holding less (a suspended one keeps its
        blocks; the waiting one takes its seat in this step), online classes too: a tenant whose realtime flood
        holds every seat does not make another's request wait for one of its streams to end. Each time the
        latest-arrived sequence of the tenant with the most seats per weight goes, and only if handing its seat
        over leaves that tenant no worse off than the other (no seat flips back). Returns the suspended ones."""
        moved: list[Sequence] = []
        if self.capacity_policy == "no_evict":
            return moved
        handed: dict[str, int] = defaultdict(int)      # seats handed to a waiting tenant in this step
        while (victim := self._fair_victim(handed, len(moved))) is not None:
            victim, tenant = victim
            self.running.remove(victim)
            victim.status = SUSPENDED
            self.waiting.append(victim)
            self._count(victim, "suspend", batch)
            moved.append(victim)
            handed[tenant] += 1
        return moved

    def _fair_victim(self, handed: dict[str, int], moved: int) -> tuple[Sequence, str] | None:
        """(the running sequence to suspend, the waiting tenant its seat goes to), or None."""
        full = len(self.running) + moved >= self.max_num_seqs
        offline_full = full or sum(not s.is_online for s in self.running) + moved >= \
            self.max_num_seqs - self.reserve_seats
        if not offline_full:
            return None        # a free seat: nobody needs to give one up (the usual step: no scan of the waiting)
        running = set(map(id, self.running))
        for rank in sorted({s.rank for s in self.waiting if (offline_full, full)[s.is_online]}):
            if any(s.rank > rank and (full or not s.is_online) for s in self.running):
                continue       # a lower class holds a seat _seat gives this class first: no handover within it
            seats: dict[str, list[Sequence]] = defaultdict(list)
            for s in self.running:
                if s.rank == rank:
                    seats[s.tenant].append(s)
            tenant = max(seats, key=lambda t: len(seats[t]) / seats[t][0].weight, default=None)
            if tenant is None:
                continue
            waiting: dict[str, list[Sequence]] = defaultdict(list)
            for s in self.waiting:
                if s.rank == rank and id(s) not in running:
                    waiting[s.tenant].append(s)
            takers = [t for t in waiting if t != tenant and len(waiting[t]) > handed[t]]
            if not takers:
                continue
            taker = min(takers, key=lambda t: (self.served[(rank, t)], min(s.arrival for s in waiting[t])))
            weight = waiting[taker][0].weight
            lead = self.served[(rank, tenant)] - self.served[(rank, taker)]
            left, has = (len(seats[tenant]) - 1) / seats[tenant][0].weight, len(seats.get(taker, ())) + handed[taker]
            # a seat that evens the split moves; one that would leave the giver holding what the taker held (the
            # odd seat of an uneven number) moves only with a lead in service, and back after as long
            if lead > 0 and left >= (has + 1) / weight or lead > ODD_SEAT_LEAD and left >= has / weight:
                return max(seats[tenant], key=lambda s: s.arrival), taker
        return None

    def _admit(self, seq: Sequence, budget: int, limit: float | None, time_left: float,
               scheduled: set[int], batch: ScheduledBatch) -> int | None:
        """Bring a waiting, suspended or swapped sequence back onto device blocks; returns its token count
        (0: nothing fits in the time bound), None when memory (or the capacity policy) keeps it out."""
        bm = self.block_manager
        keep = 0 if seq.is_online else self.reserve_blocks
        if seq.status == WAITING and seq.pooling is None:
            bm.match_prefix(seq)
            if self.capacity_policy == "no_evict" and \
                    self._blocks_to_finish(seq) > bm.num_free_blocks - keep - self._future_blocks():
                bm.free_sequence(seq)
                return None
        elif seq.status == SWAPPED:
            while not bm.can_swap_in(seq, keep):
                victim = self._memory_victim(seq, scheduled)
                if victim is None or self.capacity_policy == "no_evict":
                    return None
                self._evict(victim, batch)
            batch.swap_in.extend(bm.swap_in(seq))
            seq.status = SUSPENDED
        n = self._num_new(seq, budget, limit, time_left, first=not batch.seqs)
        if n == 0 and seq.status == WAITING:
            bm.free_sequence(seq)
        return n

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
    def _make_room(self, seq: Sequence, num_new: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        if seq.pooling is not None and not self.kv_cache:
            return True        # an encoder: no KV at all
        keep = 0 if seq.is_online else self.reserve_blocks
        while not self.block_manager.allocate(seq, num_new, keep):
            if self.capacity_policy == "no_evict":
                return False
            victim = self._memory_victim(seq, scheduled)
            if victim is None:
                if seq.status == RUNNING:
                    self._evict(seq, batch)
                return False
            self._evict(victim, batch)
        return True

    def _memory_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """The sequence holding device blocks to displace for seq: lowest class, suspended before running,
        latest arrival; None if none may go."""
        best, best_key = None, None
        for s in self.running + [w for w in self.waiting if w.status == SUSPENDED]:
            if s is seq or id(s) in scheduled or not s.block_table:
                continue
            if (s.rank, s.arrival) <= (seq.rank, seq.arrival):
                continue
            key = (s.rank, s.status == SUSPENDED, s.arrival)
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best

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

    # -- no_evict -----------------------------------------------------------------------------------
    def _blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks seq still needs to reach max_tokens (or max_model_len), beyond those it holds."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        bs = self.block_manager.block_size
        need = max(0, -(-total // bs) - len(seq.block_table))
        if seq.params.num_seqs > 1 and seq.index == 0 and seq.num_output_tokens == 0:
            # siblings still to be forked: each writes its own output (and a copy of the shared partial block)
            need += (seq.params.num_seqs - 1) * (-(-(total - seq.num_prompt_tokens) // bs) + 1)
        return need

    def _future_blocks(self) -> int:
        return sum(self._blocks_to_finish(s) for s in self.running) + \
            sum(self._blocks_to_finish(s) for s in self.waiting if s.status == SUSPENDED)

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
