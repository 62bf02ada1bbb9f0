"""Fair use of the device by several models' engines (workers/device_stepper.py): two real
random-weight engines of different architectures, stepped through DeviceStepper's public interface (step_once
drives the turns one at a time on a clock only steps move, serve() runs them on threads as `tidepool worker
--models a,b` does). The two-model worker process itself (ModelHost sets the stepper) is covered end to end,
kill -9 included, in test_model_routing.py."""
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.workers.device_stepper import OFFLINE, DeviceStepper, urgency
from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams
from tidepool.workers.engine.pooling import PoolingParams


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tidepool.workers.tools.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("stepper-models")
    a = make_tiny_model(str(root / "a"), seed=1)
    b = make_tiny_model(str(root / "b"), arch="qwen2", seed=7, hidden_size=96, num_hidden_layers=3,
                        num_attention_heads=6, num_key_value_heads=2)
    kw = {"device": "cpu", "num_kv_blocks": 64, "max_num_seqs": 8, "calibrate": False}
    return LLMEngine(EngineConfig(model=str(a), **kw)), LLMEngine(EngineConfig(model=str(b), **kw))


def _add(engine, tag: str, n: int, max_tokens: int, sla_class: str = "batch", done=None):
    def on_token(out):
        if out.finished and done is not None:
            done.append(out.request_id)
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [5 + i, 17, 42, 99, 7], SamplingParams(max_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True), sla_class=sla_class, on_token=on_token)


def _drain(stepper) -> list[str]:
    names = []
    while (name := stepper.step_once()) is not None:
        names.append(name)
    return names


class Clock:
    """The stepper's clock in the turn tests: only steps move it, by what each engine's step is said to take."""
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, engine, seconds: float):
        def step():
            self.now += seconds
            engine.step()
        return step


def _join(stepper, clock, **seconds):
    engines = dict(zip(("a", "b"), seconds.pop("engines")))
    for name, engine in engines.items():
        stepper.join(name, engine, clock.step(engine, seconds[name]))


def test_two_models_with_work_share_turns_by_step_time(engines):
    a, b = engines
    clock = Clock()
    stepper = DeviceStepper(clock=clock)
    _join(stepper, clock, engines=(a, b), a=1 / 64, b=1 / 64)
    _add(a, "ta", 3, 6)
    _add(b, "tb", 3, 6)
    names = _drain(stepper)
    assert not a.has_unfinished() and not b.has_unfinished()
    k = min(names.count("a"), names.count("b"))
    assert k > 1 and names[:2 * k] == ["a", "b"] * k      # equal steps: round robin while both had work
    assert stepper.steps == {"a": names.count("a"), "b": names.count("b")}
    assert stepper.step_once() is None                     # idle engines are not stepped

    clock = Clock()
    stepper = DeviceStepper(clock=clock)
    _join(stepper, clock, engines=(a, b), a=4 / 64, b=1 / 64)     # A's steps take four times B's
    _add(a, "sa", 2, 12)
    _add(b, "sb", 2, 40)
    names = _drain(stepper)
    assert names[:10] == ["a", "b", "b", "b", "b"] * 2     # each gets the device for the same time


def test_a_realtime_request_of_one_model_goes_before_offline_work_of_the_other(engines):
    a, b = engines
    clock = Clock()
    stepper = DeviceStepper(clock=clock, offline_floor=0)        # the precedence alone: no floor turns
    _join(stepper, clock, engines=(a, b), a=1 / 64, b=1 / 64)
    _add(a, "off-a", 4, 24)
    assert [stepper.step_once() for _ in range(2)] == ["a", "a"]      # A's batch runs alone
    done: list[str] = []
    _add(b, "rt-b", 1, 4, sla_class="realtime", done=done)
    names = []
    for _ in range(50):
        if done:
            break
        names.append(stepper.step_once())
    assert done and set(names) == {"b"}            # every turn went to B's realtime request until it finished
    _add(b, "off-b", 2, 4)                # then offline work of both shares the device again, A first until its
    rest = _drain(stepper)                # steps have taken as long as B's (the realtime ones included)
    n = len(names)
    assert rest[:n + 4] == ["a"] * n + ["b", "a", "b", "a"] and not a.has_unfinished() and not b.has_unfinished()


def test_less_urgent_online_work_is_slowed_by_another_models_realtime_work_but_never_stopped(engines):
    a, b = engines
    clock = Clock()
    stepper = DeviceStepper(starve_limit=2, clock=clock)
    _join(stepper, clock, engines=(a, b), a=1 / 64, b=1 / 64)
    _add(a, "rt-a", 1, 16, sla_class="realtime")
    _add(b, "chat-b", 2, 16, sla_class="interactive")
    names = _drain(stepper)
    assert names[:6] == ["a", "a", "b", "a", "a", "b"]   # B: a turn once A's steps took twice B's step time

    clock = Clock()
    stepper = DeviceStepper(starve_limit=2, clock=clock, offline_floor=0)   # offline work without a floor: the same
    _join(stepper, clock, engines=(a, b), a=1 / 64, b=4 / 64)     # B's steps take four times A's
    _add(a, "chat-a", 1, 24, sla_class="interactive")
    _add(b, "off-b", 2, 16)
    names = _drain(stepper)
    assert names[:12] == ["a", "a", "b"] + ["a"] * 8 + ["b"]   # so it waits through eight of A's steps


def _clean(*engines):
    for engine in engines:
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()


def _stream_and_batch(a, b, inputs: int = 400):
    """A: one realtime stream (work at every turn of these tests); B: an offline embedding batch."""
    _add(a, "stream", 1, 120, sla_class="realtime")
    b.add_request("emb", [[5 + i % 50, 17, 42] for i in range(inputs)], PoolingParams(), sla_class="batch")


def _seconds(names, took) -> dict:
    out = {"a": 0.0, "b": 0.0}
    for name, s in zip(names, took):
        out[name] += s
    return out


def test_offline_work_beside_a_realtime_stream_keeps_its_floor(engines):
    a, b = engines
    clock = Clock()
    stepper = DeviceStepper(clock=clock)            # the engines' default floor, 0.5
    _join(stepper, clock, engines=(a, b), a=2 / 64, b=5 / 64)     # B's steps take 2.5 times A's
    _stream_and_batch(a, b)
    try:
        names = [stepper.step_once() for _ in range(40)]
    finally:
        _clean(a, b)
    # the stream first; B's turn once A's steps since took as long as B's step, what is left over carried on
    assert names[:16] == ["a", "b"] + ["a", "a", "b", "a", "a", "a", "b"] * 2
    spent = _seconds(names, [2 / 64 if n == "a" else 5 / 64 for n in names])
    total = spent["a"] + spent["b"]
    assert 0.5 - 0.5 * (2 / 64) / total <= spent["b"] / total <= 0.5 + 0.5 * (5 / 64) / total
    with pytest.raises(ValueError, match="offline_floor"):
        DeviceStepper(offline_floor=1.0)


@settings(max_examples=8, deadline=None)
@given(floor=st.sampled_from([0.2, 0.5, 0.8]), a_units=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       b_units=st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_the_floor_holds_whatever_the_step_times(engines, floor, a_units, b_units):
    """Of the device time a stream and a batch take, the batch gets the floor, give or take one step: no less
    (less one step of the stream's) and no more (plus one of its own: the stream goes first whenever nothing is
    owed)."""
    a, b = engines
    clock, took, names = Clock(), [], []
    stepper = DeviceStepper(clock=clock, offline_floor=floor)
    for name, engine, units in (("a", a, a_units), ("b", b, b_units)):
        def step(engine=engine, times=itertools.cycle(units)):
            took.append(next(times) / 256)          # its steps take these times, in turn
            clock.now += took[-1]
            engine.step()
        stepper.join(name, engine, step)
    _stream_and_batch(a, b)
    try:
        names = [stepper.step_once() for _ in range(30)]
    finally:
        _clean(a, b)
    spent = _seconds(names, took)
    total = spent["a"] + spent["b"]
    share = spent["b"] / total
    assert names[0] == "a"
    assert floor - floor * max(a_units) / 256 / total - 1e-9 <= share <= floor + (1 - floor) * max(b_units) / 256 \
        / total + 1e-9


def _serve(stepper, stop, errors, **steps):
    threads = [threading.Thread(target=stepper.serve, args=(name, engine, step, stop, errors.append), daemon=True)
               for name, (engine, step) in steps.items()]
    for t in threads:
        t.start()
    return threads


def _wait(cond, what: str, limit: float = 60.0):
    for _ in range(int(limit * 20)):
        if cond():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def test_engines_with_only_offline_work_step_at_once(engines):
    a, b = engines
    stepper, stop, errors, done = DeviceStepper(), threading.Event(), [], []
    both = threading.Barrier(2, timeout=60)
    first = {"a": True, "b": True}

    def gated(name, engine):
        def step():
            if first[name]:
                first[name] = False
                both.wait()     # passes only while the other engine is in a step too (else: BrokenBarrierError)
            engine.step()
        return step
    _add(a, "ov-a", 2, 4, done=done)
    _add(b, "ov-b", 2, 4, done=done)
    threads = _serve(stepper, stop, errors, a=(a, gated("a", a)), b=(b, gated("b", b)))
    _wait(lambda: len(done) == 4 or errors, "both batches")
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == [] and sorted(done) == ["ov-a-0", "ov-a-1", "ov-b-0", "ov-b-1"]


def test_a_realtime_request_starts_beside_an_offline_step_in_flight_and_holds_the_others(engines):
    a, b = engines
    stepper, stop, errors, done = DeviceStepper(starve_limit=1000, offline_floor=0), threading.Event(), [], []
    a_in_step, a_go, a_first_done, b_holding, b_go = (threading.Event() for _ in range(5))
    a_starts: list[bool] = []      # at each of A's step starts: whether B held online work
    b_calls = [0]

    def a_step():
        a_starts.append(urgency(b) < OFFLINE)
        if len(a_starts) == 1:
            a_in_step.set()
            assert a_go.wait(60)
            a.step()
            a_first_done.set()
            return
        a.step()

    def b_step():
        b_calls[0] += 1
        if b_calls[0] == 2:         # B's realtime request got its first step while A's was still in flight
            b_holding.set()
            assert b_go.wait(60)
        b.step()
    _add(a, "bg-a", 3, 12, done=done)
    threads = _serve(stepper, stop, errors, a=(a, a_step), b=(b, b_step))
    assert a_in_step.wait(60)
    _add(b, "rt-b", 1, 6, sla_class="realtime", done=done)
    _wait(lambda: b_holding.is_set() or errors, "B's realtime request to step beside A's step in flight")
    a_go.set()                      # A's step ends while B's request is unfinished: A must start no new step
    assert a_first_done.wait(60)
    b_go.set()
    _wait(lambda: len(done) == 4 or errors, "every request")
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == [] and "rt-b-0" in done
    assert a_starts[0] is False and len(a_starts) > 2 and not any(a_starts[1:])
    assert done.index("rt-b-0") < done.index("bg-a-0")


def test_a_floor_turn_holds_no_step_of_the_online_engine(engines):
    a, b = engines
    stepper, stop, errors = DeviceStepper(), threading.Event(), []
    a_steps, beside = [0], []
    floor_at: list[int] = []               # A's steps done when B's first step beside A's online work started
    more = threading.Event()

    def a_step():
        a.step()
        a_steps[0] += 1
        if floor_at and a_steps[0] >= floor_at[0] + 2:
            more.set()

    def b_step():
        if not floor_at and urgency(a) < OFFLINE:
            floor_at.append(a_steps[0])
            beside.append(more.wait(60))    # A starts and ends a step while this one is still in flight
        b.step()
    _add(a, "stream", 1, 40, sla_class="realtime")
    b.add_request("emb", [[5 + i % 50, 17, 42] for i in range(400)], PoolingParams(), sla_class="batch")
    threads = _serve(stepper, stop, errors, a=(a, a_step), b=(b, b_step))
    try:
        _wait(lambda: beside or errors, "B's floor turn")
        _wait(lambda: not a.has_unfinished() or errors, "A's stream")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        _clean(a, b)
    assert errors == [] and beside == [True]


def test_a_failing_engine_ends_only_itself(engines):
    a, b = engines
    stepper = DeviceStepper()
    stops = {"a": threading.Event(), "b": threading.Event()}
    errors = []

    def broken_step():
        raise RuntimeError("device lost")
    threads = [threading.Thread(target=stepper.serve, args=("a", a, a.step, stops["a"]), daemon=True),
               threading.Thread(target=stepper.serve, args=("b", b, broken_step, stops["b"], errors.append),
                                daemon=True)]
    for t in threads:
        t.start()
    done: list[str] = []
    _add(b, "doomed", 1, 4)
    threads[1].join(60)
    assert not threads[1].is_alive() and [str(e) for e in errors] == ["device lost"]   # b's serve() ended
    _add(a, "ok", 3, 5, done=done)
    _add(a, "ok-rt", 1, 5, sla_class="realtime", done=done)
    for _ in range(600):
        if len(done) == 4:
            break
        threading.Event().wait(0.1)
    assert sorted(done) == ["ok-0", "ok-1", "ok-2", "ok-rt-0"] and stepper.steps["a"] > 0
    stops["a"].set()
    threads[0].join(60)
    assert not threads[0].is_alive()
    for rid in list(b.requests):          # leave the shared engine clean for other tests
        b.abort(rid)
    while b.has_unfinished():
        b.step()


TEAMS = """
import os, threading, time
import torch
from tidepool.workers.device_stepper import DeviceStepper


class Busy:
    \"\"\"An engine stand-in whose steps run a parallel region (a team of OMP_NUM_THREADS threads).\"\"\"
    def __init__(self, steps):
        self.left = steps
        self.cond = threading.Event()

    def has_unfinished(self):
        return self.left > 0

    def most_urgent_rank(self):
        return 2 if self.left else None

    def wait_for_work(self, timeout):
        if self.left:
            return True
        self.cond.wait(timeout)
        return False

    def step(self):
        torch.randn(400_000).exp_()
        self.left -= 1


base = len(os.listdir("/proc/self/task"))
stepper, stop = DeviceStepper(), threading.Event()
engines = {"a": Busy(5), "b": Busy(5)}
threads = [threading.Thread(target=stepper.serve, args=(n, e, e.step, stop)) for n, e in engines.items()]
for t in threads:
    t.start()
while any(e.left for e in engines.values()):
    threading.Event().wait(0.05)
# the two serve threads, and no team threads: a team thread of the last step may take a moment to exit (CI once
# counted 3 after 0.3 s), one kept between steps never does
extra, end = len(os.listdir("/proc/self/task")) - base, time.monotonic() + 5
while extra > 2 and time.monotonic() < end:
    threading.Event().wait(0.1)
    extra = len(os.listdir("/proc/self/task")) - base
print(extra)
stop.set()
for t in threads:
    t.join(10)
"""


def test_engine_threads_sharing_the_device_keep_no_openmp_team_between_steps():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", TEAMS], capture_output=True, text=True, timeout=120, cwd=root,
                          env=dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "2"
