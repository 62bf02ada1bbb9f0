"""The worker's engine thread: it only steps the engine and hands finished requests to the intake thread
(Worker.finish_done writes them). Reads and writes on the Worker: engine, metrics, inflight, _done, _wake,
_stop, _step_at, _error; stepper,
when the process's engines share the device in turns (workers/device_stepper.py)."""
import logging
import threading
import time

from workers.attempt import Inflight

log = logging.getLogger("workers.worker")


class EngineThread:
    # A DeviceStepper (workers/device_stepper.py) shared with the process's other engines steps this one in turns
    # with them (`tidepool worker --models a,b`, ModelHost sets it); None: this thread steps the engine itself.
    stepper = None

    def _warm_grammars(self) -> None:
        try:
            self.engine.structured.warm()
        except Exception as exc:  # the first structured request then pays for it (or fails with the reason)
            log.warning("worker %s: grammar warm-up failed: %s", self.cfg.name, exc)

    def _engine_loop(self) -> None:
        threading.Thread(target=self._warm_grammars, name=f"{self.cfg.name}-grammars", daemon=True).start()
        if self.stepper is not None:
            self.stepper.serve(self.cfg.name, self.engine, self.engine_step, self._stop, self._engine_failed)
            return
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished():
                    self.engine.wait_for_work(0.25)   # add_request wakes it; the timeout only notices stop()
                    continue
                self.engine_step()
        except BaseException as exc:  # a broken engine ends the worker; leases lapse, jobs are requeued
            log.exception("worker %s: engine loop failed", self.cfg.name)
            self._error = exc
            self._stop.set()

    def _engine_failed(self, exc: BaseException) -> None:
        self._error = exc
        self._stop.set()
        self._wake.set()

    def engine_step(self) -> None:
        """One engine step: finished requests are observed and queued for finish_done (the engine thread's loop;
        tests call it to drive a worker without threads)."""
        self._step_at = time.time()
        for out in self.engine.step():
            if out.finished:
                self._observe(out)
                self._done.put(out)
                self._wake.set()
        self.metrics.update_from_stats(self.engine.stats())

    def _attempt(self, request_id: str) -> Inflight | None:
        """The in-flight attempt an engine request belongs to; None for an earlier attempt's leftovers."""
        inf = self.inflight.get(request_id.rpartition("@")[0])
        return inf if inf is not None and inf.request_id == request_id else None

    def _observe(self, out) -> None:
        inf = self._attempt(out.request_id)
        if inf is not None and not inf.dropped:
            self.metrics.observe_request(out, inf.sla_class, inf.tenant, queue_time=inf.queue_time)

