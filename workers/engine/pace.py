"""The online pace rule and the step cut: how long a step may last and how much offline work fills it.

The step policy while online work (realtime, interactive) is running or waiting, as users feel it:
  - first token as soon as the device allows: a waiting online prompt goes whole (up to the token budget) into
    the very next step, and that step carries no offline tokens beyond what offline is owed (below); a step starts
    the online prompts of one tenant only (the least served first), so a tenant's flood of prompts never rides in
    another's first-token step and lengthens it, and a prompt after the first joins only while the step stays
    within the idle cap (below): a backlog of prompts taken at once made steps of seconds that every stream and
    every other tenant's arrival waited out; an online arrival that ranks ahead of the step's prompt tenants and
    holds fewer seats need not wait for the step in flight at all: its first-token step runs between two of that
    step's layers (Pace.cut_in_tenants, Scheduler.schedule_cut_in; LLMEngine's step cut);
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
progress). That idle cap holds only while online work is expected: once none has been here for QUIET_S seconds
(or ever), the engine is quiet (Pace.quiet) and offline steps are bound by the token budget alone, as in an engine
without online targets, since steps of a few dozen tokens pay the step's fixed cost (the weight reads) over and
over and cost offline work a third of its throughput. The first online arrival after a quiet spell does not wait
for such a step: its first-token step cuts in between two of its layers (the step cut); its second token waits
for the rest of that step, once, and from then on the cap holds again. While quiet, the online reserve's seats
are lent to offline work too (Scheduler.reserved_seats). Offline embedding inputs fill a step only up to the tightest
`itl_ms` (an input that opens the step runs whole whatever it costs): an embedding input is computed whole and
gives nothing back until its step ends, and a realtime prompt arriving mid-step, for this engine or another on the
device (workers/device_stepper.py starts it beside the step in flight), must find that step short, so an embedding
batch leaves realtime TTFT about where it is idle.

Plain Python over the cost model's coefficients (`fixed`, `per_token`, `per_context`, optionally `per_adapter`):
Pace holds the rule's settings and what offline work is owed across steps; StepTime is one step's account.
"""
from collections import defaultdict

from tidepool.workers.engine.cost_model import attended
from tidepool.workers.engine.sequence import Sequence, SequenceStatus

PACE_CREDIT = 1.0          # a stream ahead of its pace banks at most this many of its class's token gaps
IDLE_GAPS = 2.0            # an offline-only step lasts at most this many of the tightest online pace
OWED_CAP_S = 1.0           # offline time owed beyond this is paid even in a step that brings a first token
QUIET_S = 10.0             # no online work for this long: the engine is quiet (no idle cap, the reserve lent)


def online_prompt(seq: Sequence) -> bool:
    """An online sequence whose first token is not out yet (its step is a first-token step)."""
    return seq.is_online and seq.first_token_s is None


class Pace:
    def __init__(self, cost_model=None, sla_targets: dict | None = None, offline_floor: float = 0.5):
        """cost_model: any object with `fixed`, `per_token`, `per_context` (seconds); None: no time bound.
        sla_targets: {class: {"ttft_ms": .., "itl_ms": ..}} for the online classes (itl_ms: the class's pace).
        offline_floor: the least share of a step's time offline work gets while it waits beside online work."""
        if not 0 <= offline_floor < 1:
            raise ValueError(f"offline_floor must be in [0, 1), got {offline_floor!r}")
        self.cost_model = cost_model
        self.sla_targets = sla_targets or {}
        self.offline_floor = offline_floor
        self.offline_owed = 0.0                # seconds of step time offline work is owed (see the module docstring)
        self.online_at: float | None = None    # when a step last saw online work (running or waiting)
        # Without online work a step stays within what lets an online prompt arriving mid-step still meet its
        # ttft (wait for this step, then one step (<= itl) of its own) and within IDLE_GAPS of the tightest pace.
        idle = [t["ttft_ms"] - t["itl_ms"] for t in self.sla_targets.values() if "ttft_ms" in t and "itl_ms" in t]
        itl = [t["itl_ms"] for t in self.sla_targets.values() if "itl_ms" in t]
        if itl:
            idle.append(IDLE_GAPS * min(itl))
        self.idle_limit_s = min(idle) / 1000 if cost_model is not None and idle and min(idle) > 0 else None
        # Offline embedding inputs fill a step up to the tightest online pace (see the module docstring).
        self.embed_limit_s = min(itl) / 1000 if cost_model is not None and itl else None

    def pace(self, seq: Sequence) -> float | None:
        """The class's pace (seconds a token) of an online sequence; None for offline work or no target."""
        itl = self.sla_targets.get(seq.sla_class, {}).get("itl_ms") if seq.is_online else None
        return None if itl is None else itl / 1000

    def room(self, running: list[Sequence], waiting: list[Sequence], now: float) -> tuple[float | None, bool]:
        """(room, streaming). room: None when no online work with a pace is here (no time bound), else how long this
        step may last with every running online stream still on pace: the earliest next-token due time (first token
        + delivered x pace, banking at most PACE_CREDIT gaps) from now; 0 when a stream is behind or none streams
        yet. streaming: such a stream is running (its first token is out)."""
        if self.cost_model is None:
            return None, False
        if not any(self.pace(s) is not None for s in running + waiting):
            return None, False
        room = self.stream_room(running, now)
        return max(0.0, room or 0.0), room is not None

    def stream_room(self, seqs, now: float) -> float | None:
        """How long from now the online streams among seqs (first token out, a pace) stay on pace: the earliest
        next-token due time (first token + delivered x pace, banking at most PACE_CREDIT gaps); None: no stream.
        A stream verifying drafts this step counts the drafts it is expected to have accepted (spec_decode) as
        delivered: a step that brings it several tokens may last as long as they take at its pace, so the step
        time speculation saves goes to offline work instead of running the stream ahead of its pace."""
        room = None
        for seq in seqs:
            pace = self.pace(seq)
            if pace is None or seq.first_token_s is None:
                continue
            ahead = seq.draft_expected
            slack = min(seq.first_token_s + (seq.num_output_tokens + ahead) * pace - now, (PACE_CREDIT + ahead) * pace)
            room = slack if room is None else min(room, slack)
        return room

    def offline_limit(self, pace_room: float, online_s: float, first_token_step: bool, streaming: bool) -> float:
        """The predicted step time offline tokens may fill up to, once the online tokens (online_s with the fixed
        cost) are in: the pace room, or offline's floor share of the step plus, while no stream runs, up to as much
        again of what it is owed. A step that computes an online prompt (its first token is not out yet) gives
        offline nothing, unless no stream runs and the debt has reached OWED_CAP_S: the first token comes as soon as
        the device allows."""
        share = self.offline_floor / (1 - self.offline_floor) * online_s
        if first_token_step and (streaming or self.offline_owed < OWED_CAP_S):
            return online_s
        return max(pace_room, online_s + share + (0.0 if streaming else min(self.offline_owed, share)))

    def tokens_within(self, seconds: float, start: int, most: int) -> int:
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

    def step_cost(self, start: int, n: int) -> float:
        c = self.cost_model
        return c.per_token * n + c.per_context * attended(start, n)

    def adapter_cost(self, seq: Sequence, adapters: set) -> float:
        """What the sequence's LoRA adapter adds to a step whose sequences so far use `adapters` (the cost
        model's per_adapter when it is the first of its adapter, else 0; objects without the term: 0)."""
        if seq.lora is None or seq.lora in adapters:
            return 0.0
        return getattr(self.cost_model, "per_adapter", 0.0)

    def num_new(self, seq: Sequence, budget: int, limit: float | None, time_left: float, first: bool) -> int:
        """Online work runs whole (a prompt up to the token budget; a decode with its speculative drafts, which
        spec_decode sized to pay for themselves); offline tokens, drafts included, fit in the time left. An
        embedding input runs whole or waits: an online one goes in this step, an offline one when it fits the time
        left (or opens the step)."""
        if seq.pooling is not None:
            n = seq.num_uncomputed_tokens
            if n > budget or (limit is not None and not seq.is_online and not first
                              and self.tokens_within(time_left, 0, n) < n):
                return 0
            return n
        n = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
        if limit is None or seq.is_online:
            return n
        fit = self.tokens_within(time_left, seq.num_computed_tokens, n)
        # one that opens the step takes a token whatever the bound (its prefix-cache hit may have moved its start
        # past the one-token room the step was given): an empty step changes nothing
        return max(fit, min(n, 1)) if first else fit

    def quiet(self, now: float) -> bool:
        """No online work for QUIET_S seconds (or ever): offline steps run to the token budget (see the module
        docstring)."""
        return self.online_at is None or now - self.online_at >= QUIET_S

    def step(self, running: list[Sequence], waiting: list[Sequence], now: float) -> "StepTime":
        """The account of a step about to be scheduled from these sequences."""
        online = any(s.is_online for s in running) or any(s.is_online for s in waiting)
        if online:
            self.online_at = now
        room, streaming = self.room(running, waiting, now) if online else (None, False)   # one scan, not two
        idle = None
        if room is None and self.idle_limit_s is not None and not self.quiet(now) and \
                self.idle_limit_s > self.cost_model.fixed + sum(
                self.step_cost(s.num_computed_tokens, 1) for s in running) + getattr(
                self.cost_model, "per_adapter", 0.0) * len({s.lora for s in running if s.lora is not None}):
            # (a device too slow for the cap, one token of every running sequence above it, gets no cap: the cap
            # can't be met, and would leave a step one token of all its work)
            idle = self.idle_limit_s
        return StepTime(self, room, streaming, idle)

    def settle(self, step: "StepTime", batch, running: list[Sequence], waiting: list[Sequence]) -> None:
        """After a step is scheduled: keep or pay what offline work is owed, and put the step's bounds and predicted
        time on its batch."""
        if step.room is not None and not step.streaming and any(not s.is_online for s in running + waiting):
            offline_s = 0.0 if step.online_s is None else step.used - step.online_s
            self.offline_owed = min(OWED_CAP_S, max(0.0, self.offline_owed + self.offline_floor * step.used
                                                    - offline_s))
        elif step.room is None and self.offline_owed and batch:
            # a step of offline work alone pays what it is owed: it had the whole step, its floor share and more
            self.offline_owed = max(0.0, self.offline_owed - (1 - self.offline_floor) * step.used)
        batch.time_limit_s, batch.idle_limit_s = step.time_limit_s, step.idle_limit_s
        if self.cost_model is not None and batch:
            batch.predicted_s = step.used

    # -- the step cut ------------------------------------------------------------------------------
    def cut_in_tenants(self, inflight, arrivals: list[Sequence], remaining_s: float, now: float,
                       running: list[Sequence], served: dict, level) -> set[str]:
        """The tenants of arrivals (not yet added) whose first-token step should run between two layers of the step
        in flight (LLMEngine's step cut): an online prompt, while the step has more than one token gap of its class
        still to run, whose tenant has no prompt in that step and, against every tenant that has, both ranks ahead
        for the next step (as the scheduler ranks them: less service, then fewer seats of the class; a tenant back
        from idle at its lifted level) and holds fewer of the class's seats. So a tenant with one request at a time
        cuts into a flood's first-token step, and a flood never cuts into another's (the lift puts a returning
        tenant level with the flood, and its own prompt then puts it ahead on service: the seats tell them apart);
        no arrival cuts into its own tenant's first-token step. Into a step that starts no online prompt (decode
        and offline work) any may cut, as long as the step's online streams stay on their pace through the rest of
        it and the cut-in step (its fixed cost and the arrival's prompt, predicted): a cut into a decode step makes
        each such stream's gap the whole step plus the cut-in step, where without it the stream waits one
        first-token step. (A stream banks at most PACE_CREDIT gaps, so a realtime stream never has that room; an
        interactive stream well ahead of its pace may.)
        running: the scheduler's running sequences (their seats); served: (class rank, tenant) -> service;
        level(rank, tenant): a tenant's service as it would be lifted if it arrived now."""
        if self.cost_model is None:
            return set()           # (cut_in_step needs it too)
        prompts = {(s.rank, s.tenant) for s in inflight.seqs if online_prompt(s)}
        stream_room = None if prompts else self.stream_room(inflight.seqs, now)
        holding = defaultdict(int)        # (class rank, tenant) -> seats held
        for s in running:
            holding[(s.rank, s.tenant)] += 1
        tenants = set()
        for seq in arrivals:
            if not online_prompt(seq) or seq.pooling is not None or seq.lora is not None \
                    or (pace := self.pace(seq)) is None or remaining_s <= pace \
                    or any(t == seq.tenant for _, t in prompts):
                continue
            if stream_room is not None and remaining_s + self.cost_model.fixed + \
                    self.step_cost(0, seq.num_uncomputed_tokens) > stream_room:
                continue
            mine = (level(seq.rank, seq.tenant), holding[(seq.rank, seq.tenant)])
            if all(rank > seq.rank or (rank == seq.rank and mine < (served[(rank, t)], holding[(rank, t)])
                                       and mine[1] < holding[(rank, t)]) for rank, t in prompts):
                tenants.add(seq.tenant)
        return tenants

    def cut_in_prompts(self, waiting: list[Sequence], tenants: set[str], served: dict) -> list[Sequence]:
        """What a cut-in step (Scheduler.schedule_cut_in) may start, in order: the waiting online prompts of the most
        urgent, least-served of `tenants` (one tenant, as in a step), by arrival (no embedding input, no LoRA
        adapter), whole, into free seats (or seats the next step takes back from offline work: Scheduler._trim) and
        free blocks only. Nothing is preempted and nothing of the step in
        flight is touched: its sequences hold their seats and blocks, their computed counts move only when it ends,
        and the blocks it fills are not shared before then (BlockManager.commit runs in postprocess). The step in
        flight has paid its weight reads for the layers already done, so the arrival waits one layer of it, not all
        of it; the cut costs that step the weight reads of its remaining layers once more (at most one fixed
        cost)."""
        ready = [s for s in waiting if s.status == SequenceStatus.WAITING and s.tenant in tenants
                 and online_prompt(s) and s.pooling is None and s.lora is None and self.pace(s) is not None]
        if not ready:
            return []
        first = min(ready, key=lambda s: (s.rank, served[(s.rank, s.tenant)], s.arrival))
        return sorted((s for s in ready if s.tenant == first.tenant and s.rank == first.rank), key=lambda s: s.arrival)

    def cut_in_step(self) -> "StepTime | None":
        """The account of a cut-in step (no time bound but the idle cap on further prompts); None without a cost
        model (no step cut)."""
        return None if self.cost_model is None else StepTime(self, None, False, None)


class StepTime:
    """One step's time: its bound (the pace room, then the offline limit; or the idle cap without online work),
    the predicted time of the tokens taken so far, and the tenant whose online prompts the step starts."""

    def __init__(self, pace: Pace, room: float | None, streaming: bool, idle_limit_s: float | None):
        self.pace = pace
        self.room, self.streaming = room, streaming
        self.time_limit_s = room           # with online work: the bound offline tokens are fitted under
        self.idle_limit_s = idle_limit_s   # without online work: the cap that leaves a new arrival its ttft
        self.limit = idle_limit_s          # the bound offline tokens fit under; with online work, set at the first
        self.online_s = None               # with online work: the step's predicted time before any offline token
        self.first_token_step = False      # an online prompt is computed in this step
        self.used = pace.cost_model.fixed if pace.cost_model is not None else 0.0
        self.adapters: set[str] = set()    # the LoRA adapters of the step's sequences so far
        self.prompt_tenant = None          # the tenant whose online prompt this step starts (one tenant's a step)

    def bound(self, seq: Sequence, first: bool) -> tuple[float | None, float] | None:
        """(the time bound seq's tokens fit under (None: none), the time left under it), or None when not even one
        more offline token of seq fits. first: seq would open the step (an empty step changes nothing, so no bound
        stops it). Candidates come by class: the first offline one closes the online part of the step."""
        pace, online = self.pace, seq.is_online
        if not online and self.online_s is None and self.room is not None:
            self.online_s = self.used
            self.limit = self.time_limit_s = pace.offline_limit(self.room, self.online_s, self.first_token_step,
                                                                self.streaming)
        limit = self.limit
        if seq.pooling is not None and not online and pace.embed_limit_s is not None:
            limit = pace.embed_limit_s if limit is None else min(limit, pace.embed_limit_s)
        if limit is None:
            return None, 0.0
        time_left = limit - self.used - pace.adapter_cost(seq, self.adapters)
        if first or not online:
            one = pace.step_cost(seq.num_computed_tokens, 1)
            if first:
                time_left = max(time_left, 1.000001 * one)
            if not online and time_left < one:
                return None
        return limit, time_left

    def over_idle_cap(self, seq: Sequence) -> bool:
        """seq's whole prompt would take the step past the idle cap."""
        cap = self.pace.idle_limit_s
        return cap is not None and self.used + self.pace.step_cost(0, seq.num_uncomputed_tokens) > cap

    def prompt_waits(self, seq: Sequence, preempted: list[Sequence]) -> bool:
        """A new sequence's online prompt waits for the next step: another tenant's prompt is in this one (unless a
        seat was just given up for it: then it takes the seat now), or it would take this first-token step past
        the idle cap (a flood's backlog of prompts taken in one step made seconds-long steps that every stream and
        every other tenant's request waited out; an embedding request's inputs still go together: the request is
        done only when all of them are)."""
        if not online_prompt(seq) or self.prompt_tenant is None:
            return False
        if self.prompt_tenant != seq.tenant and not any(p.rank <= seq.rank for p in preempted):
            return True
        return seq.pooling is None and self.over_idle_cap(seq)

    def add(self, seq: Sequence, n: int, new: bool) -> None:
        """Count n tokens of seq in the step (new: it was admitted in this step)."""
        pace = self.pace
        if pace.cost_model is not None:
            self.used += pace.step_cost(seq.num_computed_tokens, n) + pace.adapter_cost(seq, self.adapters)
        if seq.lora is not None:
            self.adapters.add(seq.lora)
        if new and online_prompt(seq) and self.prompt_tenant is None:
            self.prompt_tenant = seq.tenant
        self.first_token_step = self.first_token_step or online_prompt(seq)
