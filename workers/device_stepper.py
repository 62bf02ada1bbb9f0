"""Fair use of one device by several engines (issue 17 point 4): `tidepool worker --models a,b` loads one engine
per model into one process, and instead of each engine stepping on its own thread (two threads fighting for the
same cores or GPU, whichever grabs it more often winning), one DeviceStepper thread gives the engines that have
work their turns, one step each:

  - an engine holding realtime or interactive work (waiting, running, or just added) goes before one holding only
    batch or deferrable work: the most urgent SLA class of any model first (workers/engine/sequence.py ranks);
  - engines of the same urgency take turns round robin (the one whose last turn is oldest goes next);
  - an engine passed over `starve_limit` turns in a row gets the next one whatever it holds, so a steady stream
    of one model's chats slows another model's batch but never stops it;
  - an engine without work is not looked at: each engine's own thread (the worker's engine thread) sleeps in
    engine.wait_for_work() and marks it ready when work arrives; the stepper sleeps when nothing is ready.

The worker keeps its engine thread and its crash story: that thread runs serve() instead of stepping, a step that
raises ends that worker (on_error, as the engine loop does), and serve() returns only once the stepper is not in
the middle of that engine's step, so the worker's shutdown (release, hand-back) never races a step."""
import itertools
import logging
import threading
from collections import deque

from workers.engine.sequence import SLA_CLASSES

log = logging.getLogger(__name__)

IDLE = len(SLA_CLASSES)      # the urgency of an engine without work


def urgency(engine) -> int:
    """The rank of the most urgent SLA class among the engine's unfinished requests (0 = realtime); IDLE if none."""
    rank = engine.most_urgent_rank()
    return IDLE if rank is None else rank


class _Member:
    def __init__(self, name: str, engine, step, on_error):
        self.name, self.engine, self.step, self.on_error = name, engine, step, on_error
        self.ready = False        # has work; set by its own thread, cleared by the stepper when it runs out
        self.failed = False
        self.last_turn = -1       # the stepper's turn counter at its last step (round robin: oldest first)
        self.passed_over = 0      # turns in a row it was ready and another engine stepped


class DeviceStepper:
    """One thread stepping every engine that serve() registers, in turns (see the module docstring)."""

    def __init__(self, starve_limit: int = 16, history: int = 4096):
        self.starve_limit = starve_limit
        self.turns: deque[str] = deque(maxlen=history)    # the names stepped, oldest first (tests, debugging)
        self.steps: dict[str, int] = {}                    # name -> steps given
        self._members: list[_Member] = []
        self._current: _Member | None = None
        self._cond = threading.Condition()
        self._clock = itertools.count()
        self._thread: threading.Thread | None = None

    def join(self, name: str, engine, step, on_error=None) -> _Member:
        """Register an engine (no thread of its own is started: serve() is join + wait + leave). `step()` is one
        engine step with its bookkeeping (Worker.engine_step); on_error(exc) runs on the stepping thread if a step
        raises, and the engine gets no further turns."""
        member = _Member(name, engine, step, on_error)
        with self._cond:
            self._members.append(member)
            self.steps.setdefault(name, 0)
        return member

    def leave(self, member: _Member) -> None:
        """Unregister; returns once the stepper is not in the middle of this engine's step."""
        with self._cond:
            member.ready = False
            if member in self._members:
                self._members.remove(member)
            while self._current is member:
                self._cond.wait()
            self._cond.notify_all()

    def serve(self, name: str, engine, step, stop: threading.Event, on_error=None) -> None:
        """Run on the engine's own thread until stop is set (or its step failed): register the engine, mark it
        ready whenever it has work (waking the stepping thread, started here if none runs) and wait while the
        stepper drains it; leave() on the way out."""
        member = self.join(name, engine, step, on_error)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="device-stepper", daemon=True)
                self._thread.start()
        try:
            while not stop.is_set() and not member.failed:
                if not engine.wait_for_work(0.25):    # add_request wakes it; the timeout only notices stop
                    continue
                with self._cond:
                    if not member.ready:
                        member.ready = True
                        self._cond.notify_all()
                    while member.ready and not member.failed and not stop.is_set():
                        self._cond.wait(0.25)
        finally:
            self.leave(member)

    def step_once(self) -> str | None:
        """Give one turn (the stepping thread's loop body; tests call it to drive members without that thread):
        the name of the engine stepped, None if none was ready."""
        with self._cond:
            member = self._pick()
            if member is None:
                return None
            self._current = member
        more = False
        try:
            member.step()
            more = member.engine.has_unfinished()
        except BaseException as exc:  # that engine is broken: its worker ends (leases lapse, jobs are requeued)
            member.failed = True
            log.exception("device stepper: engine %s failed", member.name)
            if member.on_error is not None:
                try:
                    member.on_error(exc)
                except Exception:     # the stepper thread goes on for the other engines
                    log.exception("device stepper: on_error of %s failed", member.name)
        finally:
            with self._cond:
                self._current = None
                self.turns.append(member.name)
                self.steps[member.name] = self.steps.get(member.name, 0) + 1
                if not more:
                    member.ready = False
                self._cond.notify_all()
        return member.name

    def _pick(self) -> _Member | None:
        ready = []
        for m in self._members:      # work added since its thread last marked it counts at once
            if not m.failed and m.engine.has_unfinished():
                ready.append(m)
            else:
                m.ready = False
        if not ready:
            return None
        starving = [m for m in ready if m.passed_over >= self.starve_limit]
        if starving:
            pool = starving
        else:
            ranks = {id(m): urgency(m.engine) for m in ready}
            top = min(ranks.values())
            pool = [m for m in ready if ranks[id(m)] == top]
        member = min(pool, key=lambda m: m.last_turn)
        for m in ready:
            m.passed_over = 0 if m is member else m.passed_over + 1
        member.last_turn = next(self._clock)
        return member

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not any(m.ready and not m.failed for m in self._members):
                    if not self._members:        # the last engine left: the thread ends (serve starts another)
                        self._thread = None
                        return
                    self._cond.wait()
            if self.step_once() is None:      # the flagged engines had no work after all: flags cleared
                continue

