"""The worker's engine thread: it only steps the engine and hands finished requests to the intake thread (through
the attempts table's `done` queue; Results.finish_done writes them)."""
import logging
import threading
import time

from tidepool.workers.attempt import Attempts

log = logging.getLogger("tidepool.workers.worker")


class EngineThread:
    def __init__(self, name: str, engine, metrics, attempts: Attempts, wake: threading.Event, stop: threading.Event,
                 after_step=lambda ended: None):
        self.name = name
        # after each step, whether it ended requests (Streaming.flush): their token events go out before their ends
        # are queued
        self.after_step = after_step
        self.engine = engine
        self.metrics = metrics
        self.attempts = attempts
        self.wake = wake        # the intake thread waits on it
        self.stop = stop
        # A DeviceStepper (workers/device_stepper.py) shared with the process's other engines steps this one in
        # turns with them (`tidepool worker --models a,b`, ModelHost sets it); None: this thread steps the engine.
        self.stepper = None
        self.step_at = 0.0      # when the engine's current step began
        self.error: BaseException | None = None
        self.warming: threading.Thread | None = None    # the grammar warm-up, if started

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name=f"{self.name}-engine", daemon=True)
        thread.start()
        return thread

    def _warm_grammars(self) -> None:
        try:
            self.engine.structured.warm()
        except Exception as exc:  # the first structured request then pays for it (or fails with the reason)
            log.warning("worker %s: grammar warm-up failed: %s", self.name, exc)

    def join_warmup(self, timeout: float) -> None:
        """Wait for the grammar warm-up: a process that ends while xgrammar's compiler threads run is aborted
        (std::terminate, exit -6), as a worker drained right after its start would be."""
        if self.warming is not None:
            self.warming.join(timeout)

    def _loop(self) -> None:
        self.warming = threading.Thread(target=self._warm_grammars, name=f"{self.name}-grammars", daemon=True)
        self.warming.start()
        if self.stepper is not None:
            self.stepper.serve(self.name, self.engine, self.step, self.stop, self._failed)
            return
        try:
            while not self.stop.is_set():
                if not self.engine.has_unfinished():
                    self.engine.wait_for_work(0.25)   # add_request wakes it; the timeout only notices stop()
                    continue
                self.step()
        except BaseException as exc:  # a broken engine ends the worker; leases lapse, jobs are requeued
            log.exception("worker %s: engine loop failed", self.name)
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.error = exc
        self.stop.set()
        self.wake.set()

    def step(self) -> None:
        """One engine step: finished requests are observed and queued for the intake thread."""
        self.step_at = time.time()
        outs = self.engine.step()
        self.after_step(any(out.finished for out in outs))
        for out in outs:
            if out.finished:
                inf = self.attempts.of_request(out.request_id)
                if inf is not None and not inf.dropped:
                    self.metrics.observe_request(out, inf.sla_class, inf.tenant, queue_time=inf.queue_time)
                self.attempts.done.put(out)
                self.wake.set()
        self.metrics.update_from_stats(self.engine.stats())
