"""Beat's Celery app: service/ledger/wire.py's, with reliability settings shared with the workers' consumers, and
the beat schedule (sweeper, batch finaliser, fleet planner, job partitions) whose tasks run on the `maintenance` queue of `tidepool beat`, over the
ledger's services (service/ledger/services.py) built from the settings: beat never imports Flask.

Inference messages (`tidepool.run_job(job_id)` on realtime|interactive|batch|deferrable) are consumed
by the gpu/cpu workers (workers/worker.py), not by a Celery worker pool: they pull offline queues only
when their engine has room, which a prefetching Celery consumer cannot express.

On a Redis Cluster, which kombu's Redis transport cannot use, `tidepool beat` runs the same upkeep on a loop of its own
(workers/beat.py run_forever, as embedded mode does), every TIDEPOOL_SWEEP_INTERVAL seconds, until SIGTERM."""
import functools

from celery import Celery
from kombu import Queue

from tidepool.service.ledger.settings import Config
from tidepool.service.ledger.fleet import PLAN_INTERVAL
from tidepool.service.ledger.services import Services

PARTITIONS_EVERY = 3600.0   # seconds between two checks that the coming months' job partitions exist


def make_celery(cfg: Config | None = None) -> Celery:
    from tidepool.service.ledger.wire import make_celery as celery_app, transport_options
    cfg = cfg or Config.from_env()
    every = cfg.sweep_interval
    app = celery_app(cfg.broker_url, name="tidepool", publisher=False)
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        broker_transport_options=transport_options(cfg.visibility_timeout), broker_connection_retry_on_startup=True,
        result_backend=None, task_ignore_result=True,
        task_default_queue="maintenance", task_queues=[Queue("maintenance")],
        worker_hijack_root_logger=False, beat_schedule_filename=cfg.beat_schedule,
        beat_schedule={
            "sweep": {"task": "tidepool.sweep", "schedule": every, "options": {"expires": every * 2}},
            "finalize-batches": {"task": "tidepool.finalize_batches", "schedule": every,
                                 "options": {"expires": every * 2}},
            "plan-fleet": {"task": "tidepool.plan_fleet", "schedule": PLAN_INTERVAL,
                           "options": {"expires": PLAN_INTERVAL}},
            "partitions": {"task": "tidepool.partitions", "schedule": PARTITIONS_EVERY,
                           "options": {"expires": PARTITIONS_EVERY}},
        })

    @functools.cache
    def services() -> Services:
        """Built at the first task, straight from the settings (no Flask app)."""
        return Services.from_config(cfg)

    @app.task(name="tidepool.sweep")
    def sweep_task():
        from tidepool.workers import beat
        return beat.sweep(services(), republish_after=cfg.republish_after, max_attempts=cfg.max_attempts,
                          visibility_timeout=cfg.visibility_timeout)

    @app.task(name="tidepool.plan_fleet")
    def plan_task():
        from tidepool.workers import beat
        beat.plan_fleet(services())

    @app.task(name="tidepool.finalize_batches")
    def finalize_task():
        from tidepool.workers import beat
        return beat.finalize_batches(services())

    @app.task(name="tidepool.partitions")
    def partitions_task():
        from tidepool.workers import beat
        return beat.create_partitions(services())

    return app


def _upkeep_loop(cfg: Config) -> int:
    """`tidepool beat` on a Redis Cluster: the upkeep on this process's own loop until SIGTERM or SIGINT."""
    import signal
    import threading

    from tidepool.workers import beat
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    beat.run_forever(Services.from_config(cfg), interval=cfg.sweep_interval, stop=stop,
                     republish_after=cfg.republish_after, max_attempts=cfg.max_attempts,
                     visibility_timeout=cfg.visibility_timeout)
    return 0


def main_beat(args) -> int:
    """`tidepool beat`: Celery beat embedded in a one-thread worker that runs the upkeep tasks."""
    import logging
    from pathlib import Path

    cfg = Config.from_env()
    Path(cfg.beat_schedule).parent.mkdir(parents=True, exist_ok=True)

    from celery.apps import worker as celery_worker
    from celery.signals import setup_logging
    setup_logging.connect(lambda **_: None, weak=False)   # Celery keeps to the root logger `tidepool` configured
    # its shutdown notice is printed straight to stdout; make it a log line like every other
    celery_worker.safe_say = lambda msg, f=None: logging.getLogger("tidepool.beat").info(msg.strip())
    app = make_celery(cfg)
    if cfg.redis_url is None:
        raise SystemExit("tidepool beat needs TIDEPOOL_REDIS_URL; embedded mode (tidepool serve) runs upkeep itself")
    from tidepool.service.ledger.redis_conn import is_cluster
    if is_cluster(cfg.redis_url):
        return _upkeep_loop(cfg)
    worker = app.Worker(beat=True, pool="solo", concurrency=1, queues=["maintenance"],
                        loglevel=cfg.log_level, quiet=True)
    worker.start()
    return worker.exitcode or 0
