"""Fair use of the device by several models' engines (issue 17 point 4, workers/device_stepper.py): two real
random-weight engines of different architectures, stepped through DeviceStepper's public interface (step_once
drives the turns one at a time, serve() runs them on threads as `tidepool worker --models a,b` does). The
two-model worker process itself (ModelHost sets the stepper) is covered end to end, kill -9 included, in
test_model_routing.py."""
import threading

import pytest

from workers.device_stepper import DeviceStepper
from workers.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from workers.engine.tiny_model import make_tiny_model
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


def test_two_models_with_work_take_turns_and_both_finish(engines):
    a, b = engines
    stepper = DeviceStepper()
    stepper.join("a", a, a.step)
    stepper.join("b", b, b.step)
    _add(a, "ta", 3, 6)
    _add(b, "tb", 3, 6)
    names = _drain(stepper)
    assert not a.has_unfinished() and not b.has_unfinished()
    k = min(names.count("a"), names.count("b"))
    assert k > 1 and names[:2 * k] == ["a", "b"] * k      # round robin while both had work
    assert stepper.steps == {"a": names.count("a"), "b": names.count("b")}
    assert stepper.step_once() is None                     # idle engines are not stepped


def test_a_realtime_request_of_one_model_goes_before_offline_work_of_the_other(engines):
    a, b = engines
    stepper = DeviceStepper()
    stepper.join("a", a, a.step)
    stepper.join("b", b, b.step)
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
    _add(b, "off-b", 2, 4)                # then offline work of both shares the device again
    rest = _drain(stepper)
    assert rest[:2] in (["a", "b"], ["b", "a"]) and not a.has_unfinished() and not b.has_unfinished()


def test_offline_work_is_slowed_by_another_models_online_work_but_never_stopped(engines):
    a, b = engines
    stepper = DeviceStepper(starve_limit=2)
    stepper.join("a", a, a.step)
    stepper.join("b", b, b.step)
    _add(a, "chat-a", 1, 16, sla_class="interactive")
    _add(b, "off-b", 2, 16)
    names = _drain(stepper)
    assert names[:6] == ["a", "a", "b", "a", "a", "b"]


def test_serve_steps_on_one_thread_and_a_failing_engine_ends_only_itself(engines):
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
