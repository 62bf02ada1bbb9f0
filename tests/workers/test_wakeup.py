"""Nothing on the online path polls: the engine thread sleeps until a request arrives, and an idle worker's
intake sleeps until the dispatcher rings the doorbell (Redis pub/sub across processes, an in-process event
in embedded mode) after publishing a job."""
import threading

import pytest
import redis

from tidepool.service import create_app
from tidepool.service.ledger import doorbell
from tidepool.workers.engine import EngineConfig, LLMEngine, SamplingParams

from .conftest import flush_redis


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64))


def test_engine_wait_for_work_returns_when_a_request_is_added(engine):
    assert not engine.wait_for_work(0.01)           # nothing queued: the timeout passes
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(engine.wait_for_work(30)))
    waiter.start()
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=2))
    waiter.join(30)
    assert woke == [True]
    assert engine.wait_for_work(0)                  # work pending: returns at once, without consuming it
    while engine.has_unfinished():
        engine.step()
    assert not engine.wait_for_work(0)


def _app(pg_url, tmp_path, broker_redis: str | None):
    return create_app({"database_url": pg_url, "redis_url": broker_redis, "storage_dir": str(tmp_path / "s"),
                       "model": "tiny", "admin_token": "admin"})


def test_publishing_rings_workers_in_this_process(pg_url, tmp_path):
    app = _app(pg_url, tmp_path, None)               # memory:// broker, as in embedded mode
    rung = threading.Event()
    doorbell.register(rung)
    try:
        assert app.services.dispatcher.publish([("job_x", "realtime")]) == 1
        assert rung.is_set()
    finally:
        doorbell.unregister(rung)
    rung.clear()
    app.services.dispatcher.publish([("job_y", "realtime")])
    assert not rung.is_set()                         # unregistered: no longer rung
    app.services.database.dispose()


@pytest.mark.parametrize("path", ["publish_one", "publish"])
def test_publishing_rings_the_redis_doorbell(pg_url, tmp_path, redis_url, path):
    flush_redis(redis_url)
    app = _app(pg_url, tmp_path, redis_url)
    dispatcher = app.services.dispatcher
    rung, stop = threading.Event(), threading.Event()
    listener = doorbell.listen(redis_url, rung, stop)
    try:
        assert rung.wait(30)                          # set once subscribed (messages may have come meanwhile)
        rung.clear()
        if path == "publish_one":
            assert dispatcher.publish_one("job_z", "realtime", xmin="1")
        else:
            assert dispatcher.publish([("job_z", "realtime")]) == 1
        assert rung.wait(30)
        assert redis.Redis.from_url(redis_url).llen("realtime") == 1     # the message itself is there too
    finally:
        stop.set()
        listener.join(5)
        app.services.database.dispose()
        flush_redis(redis_url)
