"""Fair use of one device by several engines: `tidepool worker --models a,b` and `tidepool serve` load one engine
per model into one process; each engine keeps its own thread, which asks one DeviceStepper before every step
whether it may start one:

  - while no engine holds realtime or interactive work, engines with batch or deferrable work step at once, each
    on its own thread, so one engine's Python work overlaps another's arithmetic (benchmarks/multi_model.py
    measures this against one step at a time);
  - as soon as an engine holds realtime or interactive work (waiting, running, or just added), engines take their
    steps one at a time and the most urgent SLA class of any model goes first (workers/engine/sequence.py ranks):
    that engine starts at once, and a step of offline work in flight (one from before, or a floor turn, below) is
    neither interrupted nor waited for, so a realtime arrival's first token never waits out another model's
    batch step; the others start no new step until it is served, but for the floor;
  - offline work keeps its floor beside online work, the cross-engine form of the engine's own `offline_floor`
    (workers/engine/pace.py; the stepper's `offline_floor`, the engines' TIDEPOOL_OFFLINE_FLOOR, default 0.5):
    while an engine with only offline work waits, each online step that ends adds floor x its seconds to
    `offline_owed`, and each floor turn takes (1 - floor) x its own seconds off; while something is owed, the
    waiting offline engine (the most urgent class, then the least served) gets the next step, one floor turn at a
    time. So offline holds at least the floor's share of the device time the two have taken (less one online
    step's worth): beside a realtime stream of 25 ms steps an embedding engine of 60 ms steps gets one for every
    two or three of the stream's at 0.5. What is owed carries from turn to turn, so steps that do not divide
    evenly do not cost offline its share, and starts from nothing whenever online work appears afresh (a step
    while all work is offline) or an online step ends with no offline work left on any engine;
  - a floor turn does not hold the online engines either: they start their next steps beside it, so the stream
    is never stopped for an offline step, only shares the device with it while it lasts (on a CPU the two steps'
    threads share the cores; on a GPU their kernels take turns on its queue). The offline engine keeps such steps
    short (pace.py: its offline embedding steps fill up to the tightest online pace, its other steps stay within
    the idle cap), so a stream's token gap grows by at most one such step, and offline steps for about the floor's
    share of the time online work lasts;
  - engines of the same urgency share one-at-a-time turns by measured step time, not step count: the one whose
    steps have taken the least time goes next (an engine coming back from idle starts level with the least
    served), so a slow model's long steps do not take most of the device from a fast model;
  - an engine held back while others' one-at-a-time steps have taken `starve_limit` times its own step time (or,
    before its first step, passed over `starve_limit` turns) gets the next turn whatever it holds: a steady stream
    of one model's realtime work slows another model's interactive chats to about 1/(starve_limit+1) of the device
    but never stops them. Offline work has the floor instead (turns long before that); with a floor of 0 this is
    all it gets;
  - an engine without work is not looked at: its thread sleeps in engine.wait_for_work().

`overlap_offline=False` takes every step one at a time (turns only; the benchmark's `turns` mode); online steps
still start beside an offline step in flight.

Each engine thread ends its OpenMP team after every step while others share the device (workers/engine/openmp.py:
teams of idle engine threads make libgomp throttle the stepping thread's; a new team costs one thread start).

The crash story is the engine loop's: a step that raises ends only that engine's worker (on_error, on its own
thread), and leave() returns only once no step of that engine is in flight, so the worker's shutdown (release,
hand-back) never races a step."""
import logging
import threading
import time
from collections import deque

from tidepool.workers.engine.config import EngineConfig
from tidepool.workers.engine.openmp import release_team
from tidepool.workers.engine.sequence import CLASS_RANK, SLA_CLASSES

log = logging.getLogger(__name__)

IDLE = len(SLA_CLASSES)                 # the urgency of an engine without work
OFFLINE = CLASS_RANK["batch"]           # ranks from here on are offline work: such steps may overlap
EWMA = 0.2                              # weight of the latest step in an engine's step time estimate


def urgency(engine) -> int:
    """The rank of the most urgent SLA class among the engine's unfinished requests (0 = realtime); IDLE if none."""
    rank = engine.most_urgent_rank()
    return IDLE if rank is None else rank


class _Member:
    def __init__(self, name: str, engine, step, on_error, order: int):
        self.name, self.engine, self.step, self.on_error, self.order = name, engine, step, on_error, order
        self.failed = False
        self.stepping = False     # a step of it is in flight
        self.rank = IDLE          # its urgency when that step started
        self.alone = False        # ... taken as a one-at-a-time turn
        self.floor = False        # ... taken as a floor turn (offline work owed its share beside online work)
        self.active = False       # had work when last looked at (coming back from idle: see _ready)
        self.used = 0.0           # seconds its steps took (turn fairness: least first)
        self.step_s = 0.0         # its step time, a moving average (0 before its first step)
        self.waited = 0.0         # seconds of others' one-at-a-time steps since its last step, while it had work
        self.passed_over = 0      # one-at-a-time turns given to others since its last step, while it had work
        self.last_start = -1      # the stepper's count of steps started at its last start (ties: oldest first)


class DeviceStepper:
    """The gate every registered engine's thread passes before each step (see the module docstring)."""

    def __init__(self, starve_limit: int = 16, overlap_offline: bool = True, clock=time.perf_counter,
                 history: int = 4096, offline_floor: float = EngineConfig.offline_floor):
        """offline_floor: the least share of the device time an engine with only offline work gets while another
        holds online work (the engines' offline_floor)."""
        if not 0 <= offline_floor < 1:
            raise ValueError(f"offline_floor must be in [0, 1), got {offline_floor!r}")
        self.starve_limit, self.overlap_offline, self.clock = starve_limit, overlap_offline, clock
        self.offline_floor = offline_floor
        self.offline_owed = 0.0                            # seconds of device time owed to waiting offline work
        self.turns: deque[str] = deque(maxlen=history)    # the names stepped, in order of start (tests, debugging)
        self.steps: dict[str, int] = {}                    # name -> steps started
        self._members: list[_Member] = []
        self._cond = threading.Condition()
        self._started = 0
        self._joined = 0

    def join(self, name: str, engine, step, on_error=None) -> _Member:
        """Register an engine. `step()` is one engine step with its bookkeeping (Worker.engine_step); if it
        raises, on_error(exc) runs and the engine gets no further steps."""
        with self._cond:
            member = _Member(name, engine, step, on_error, self._joined)
            self._joined += 1
            self._members.append(member)
            self.steps.setdefault(name, 0)
        return member

    def leave(self, member: _Member) -> None:
        """Unregister; returns once no step of this engine is in flight."""
        with self._cond:
            if member in self._members:
                self._members.remove(member)
            while member.stepping:
                self._cond.wait()
            self._cond.notify_all()

    def serve(self, name: str, engine, step, stop: threading.Event, on_error=None) -> None:
        """Run on the engine's own thread until stop is set (or its step failed): wait for work, wait until the
        gate lets it start a step, step; leave() on the way out."""
        member = self.join(name, engine, step, on_error)
        try:
            while not stop.is_set() and not member.failed:
                if not engine.wait_for_work(0.25):    # add_request wakes it; the timeout only notices stop
                    continue
                if self._acquire(member, stop):
                    self._run(member)
        finally:
            self.leave(member)

    def step_once(self) -> str | None:
        """Give one one-at-a-time turn on the calling thread (tests drive the turns with it, no serve() threads):
        the name of the engine stepped, None if none has work. A floor turn goes first when one is owed, else the
        turn the gate gives."""
        with self._cond:
            ready = self._ready()
            if not ready:
                return None
            ranks = self._ranks(ready)
            member = self._floor_turn(ready, ranks)
            floor = member is not None
            if not floor:
                member = self._turn(ready, ranks)
            self._start(member, ready, ranks, alone=True, floor=floor)
        self._run(member)
        return member.name

    # ---- the gate -------------------------------------------------------------------------------------------

    def _acquire(self, member: _Member, stop: threading.Event) -> bool:
        """Block until this engine may start a step (True, marked in flight) or has no work or stop is set."""
        with self._cond:
            while not stop.is_set() and not member.failed:
                ready = self._ready()
                if member not in ready:
                    return False
                ranks = self._ranks(ready)
                if self.overlap_offline and min(ranks.values()) >= OFFLINE:
                    self._start(member, ready, ranks, alone=False)
                    return True
                if self._floor_turn(ready, ranks) is member:
                    self._start(member, ready, ranks, alone=True, floor=True)
                    self._cond.notify_all()
                    return True
                if self._turn(ready, ranks) is member and not self._held(member, ranks):
                    self._start(member, ready, ranks, alone=True)
                    self._cond.notify_all()     # one that waited for this start may go now
                    return True
                self._cond.wait(0.25)       # a step's end or start notifies; the timeout only notices stop
            return False

    def _ready(self) -> list[_Member]:
        """The members with work (one in a step counts as having some until the step ends). One coming back
        from idle starts level with the least served of the others, so time banked while idle buys it no run of
        turns."""
        ready, fresh = [], []
        for m in self._members:
            if m.failed or not (m.stepping or m.engine.has_unfinished()):
                m.active = False
                continue
            ready.append(m)
            if not m.active:
                fresh.append(m)
        if fresh:
            floor = min((m.used for m in ready if m.active), default=None)
            for m in fresh:
                m.active, m.waited, m.passed_over = True, 0.0, 0
                if floor is not None:
                    m.used = max(m.used, floor)
        return ready

    @staticmethod
    def _ranks(ready: list[_Member]) -> dict:
        """Each member's urgency; one in a step is asked too (work added meanwhile counts), but keeps at least
        the urgency it had when the step started (a request the step is taking in may be missed by the ask)."""
        return {id(m): min(m.rank, urgency(m.engine)) if m.stepping else urgency(m.engine) for m in ready}

    def _starving(self, m: _Member) -> bool:
        if m.passed_over == 0:
            return False
        if m.step_s > 0:
            return m.waited >= self.starve_limit * m.step_s
        return m.passed_over >= self.starve_limit

    @staticmethod
    def _order(m: _Member):
        return m.used, m.last_start, m.order

    def _turn(self, ready: list[_Member], ranks: dict) -> _Member:
        """Whose one-at-a-time turn is next among those not in a step: one starving, else the most urgent; the
        least served of them."""
        free = [m for m in ready if not m.stepping]
        pool = [m for m in free if self._starving(m)]
        if not pool:
            top = min(ranks[id(m)] for m in free)
            pool = [m for m in free if ranks[id(m)] == top]
        return min(pool, key=self._order)

    def _floor_turn(self, ready: list[_Member], ranks: dict) -> _Member | None:
        """The engine with only offline work whose floor turn is due now, beside online work elsewhere: while
        something is owed and no other one-at-a-time step of offline work (a floor turn among them) is in flight,
        the most urgent offline engine waiting, then the least served; None otherwise."""
        if self.offline_owed <= 0 or min(ranks.values()) >= OFFLINE \
                or any(m.stepping and m.alone and m.rank >= OFFLINE for m in self._members):
            return None
        waiting = [m for m in ready if not m.stepping and ranks[id(m)] >= OFFLINE]
        return min(waiting, key=lambda m: (ranks[id(m)], *self._order(m)), default=None)

    def _held(self, member: _Member, ranks: dict) -> bool:
        """A one-at-a-time step in flight holds this engine back: any for offline work, only an online one for
        online work (an online step never waits for an offline step to end)."""
        online = ranks[id(member)] < OFFLINE
        return any(m.stepping and m.alone and (not online or m.rank < OFFLINE) for m in self._members)

    def _start(self, member: _Member, ready: list[_Member], ranks: dict, alone: bool, floor: bool = False) -> None:
        if min(ranks.values()) >= OFFLINE:
            self.offline_owed = 0.0      # no online work: the floor's account starts afresh when some comes
        member.stepping, member.alone, member.floor, member.rank = True, alone, floor, ranks[id(member)]
        member.waited, member.passed_over = 0.0, 0
        member.last_start = self._started
        self._started += 1
        if alone:
            for m in ready:
                if m is not member and not m.stepping:
                    m.passed_over += 1
        self.turns.append(member.name)
        self.steps[member.name] = self.steps.get(member.name, 0) + 1

    def _settle_floor(self, member: _Member, took: float) -> None:
        """Keep offline's account after a step: a floor turn pays for itself, an online step that ends while
        offline work waits adds to what offline is owed, one that ends with no offline work left clears it."""
        if member.floor:
            self.offline_owed -= (1 - self.offline_floor) * took
            return
        if member.rank >= OFFLINE:
            return
        offline = [m for m in self._members if m is not member and m.active and not m.failed
                   and OFFLINE <= (m.rank if m.stepping else urgency(m.engine)) < IDLE]
        if any(not m.stepping for m in offline):
            self.offline_owed += self.offline_floor * took
        elif not offline:
            self.offline_owed = 0.0

    def _run(self, member: _Member) -> None:
        started = self.clock()
        try:
            member.step()
        except BaseException as exc:  # that engine is broken: its worker ends (leases lapse, jobs are requeued)
            member.failed = True
            log.exception("device stepper: engine %s failed", member.name)
            if member.on_error is not None:
                try:
                    member.on_error(exc)
                except Exception:     # the other engines go on
                    log.exception("device stepper: on_error of %s failed", member.name)
        finally:
            took = self.clock() - started
            if len(self._members) > 1:
                release_team()      # an idle engine thread's OpenMP team would throttle the next stepper's
            with self._cond:
                member.stepping = False
                member.used += took
                member.step_s = took if member.step_s == 0 else (1 - EWMA) * member.step_s + EWMA * took
                if member.alone:
                    for m in self._members:
                        if m is not member and m.active and not m.stepping:
                            m.waited += took
                self._settle_floor(member, took)
                member.floor = False
                self._cond.notify_all()
