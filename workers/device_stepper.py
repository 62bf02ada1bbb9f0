"""Fair use of one device by several engines: `tidepool worker --models a,b` and `tidepool serve` load one engine
per model into one process; each engine keeps its own thread, which asks one DeviceStepper before every step
whether it may start one:

  - while no engine holds realtime or interactive work, engines with batch or deferrable work step at once, each
    on its own thread, so one engine's Python work overlaps another's arithmetic (benchmarks/multi_model.py
    measures this against one step at a time);
  - as soon as an engine holds realtime or interactive work (waiting, running, or just added), steps are taken
    one at a time and the most urgent SLA class of any model goes first (workers/engine/sequence.py ranks):
    that engine starts at once (a step already in flight is not interrupted, and not waited for either) and the
    others start no new step until it is served;
  - engines of the same urgency share those one-at-a-time turns by measured step time, not step count: the one
    whose steps have taken the least time goes next (an engine coming back from idle starts level with the least
    served), so a slow model's long steps do not take most of the device from a fast model;
  - an engine held back while others' steps have taken `starve_limit` times its own step time (or, before its
    first step, passed over `starve_limit` turns) gets the next turn whatever it holds, so a steady stream of
    one model's chats slows another model's batch to about 1/(starve_limit+1) of the device but never stops it;
  - an engine without work is not looked at: its thread sleeps in engine.wait_for_work().

`overlap_offline=False` takes every step one at a time (turns only; the benchmark's `turns` mode).

Each engine thread ends its OpenMP team after every step while others share the device (workers/engine/openmp.py:
teams of idle engine threads make libgomp throttle the stepping thread's; a new team costs one thread start).

The crash story is the engine loop's: a step that raises ends only that engine's worker (on_error, on its own
thread), and leave() returns only once no step of that engine is in flight, so the worker's shutdown (release,
hand-back) never races a step."""
import logging
import threading
import time
from collections import deque

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
        self.alone = False        # ... taken as a one-at-a-time turn (others wait for it)
        self.active = False       # had work when last looked at (coming back from idle: see _ready)
        self.used = 0.0           # seconds its steps took (turn fairness: least first)
        self.step_s = 0.0         # its step time, a moving average (0 before its first step)
        self.waited = 0.0         # seconds of others' one-at-a-time steps since its last step, while it had work
        self.passed_over = 0      # one-at-a-time turns given to others since its last step, while it had work
        self.last_start = -1      # the stepper's count of steps started at its last start (ties: oldest first)


class DeviceStepper:
    """The gate every registered engine's thread passes before each step (see the module docstring)."""

    def __init__(self, starve_limit: int = 16, overlap_offline: bool = True, clock=time.perf_counter,
                 history: int = 4096):
        self.starve_limit, self.overlap_offline, self.clock = starve_limit, overlap_offline, clock
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
        the name of the engine stepped, None if none has work."""
        with self._cond:
            ready = self._ready()
            if not ready:
                return None
            ranks = self._ranks(ready)
            member = self._choose(ready, ranks)
            self._start(member, ready, ranks, alone=True)
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
                # one at a time: a step in flight from before (overlapping offline) is not waited for
                if not any(m.stepping and m.alone for m in self._members) \
                        and self._choose(ready, ranks) is member:
                    self._start(member, ready, ranks, alone=True)
                    return True
                self._cond.wait(0.25)       # a step's end or a leave notifies; the timeout only notices stop
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

    def _choose(self, ready: list[_Member], ranks: dict) -> _Member:
        pool = [m for m in ready if self._starving(m)]
        if not pool:
            top = min(ranks.values())
            pool = [m for m in ready if ranks[id(m)] == top]
        return min(pool, key=lambda m: (m.used, m.last_start, m.order))

    def _start(self, member: _Member, ready: list[_Member], ranks: dict, alone: bool) -> None:
        member.stepping, member.alone, member.rank = True, alone, ranks[id(member)]
        member.waited, member.passed_over = 0.0, 0
        member.last_start = self._started
        self._started += 1
        if alone:
            for m in ready:
                if m is not member and not m.stepping:
                    m.passed_over += 1
        self.turns.append(member.name)
        self.steps[member.name] = self.steps.get(member.name, 0) + 1

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
                self._cond.notify_all()
