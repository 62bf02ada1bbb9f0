"""The services a Tidepool process shares, built once from the settings: the ledger's database, file storage,
Redis, the rate limiter and concurrency slots, job admission, the Celery publisher, the dispatcher and the model
registry. Flask-free: the web app (create_app) builds one and keeps it on the app (service/app.py), beat builds
one without Flask (workers/celery_app.py), and code that needs a service is handed it."""
from dataclasses import dataclass

import redis as redis_lib
from celery import Celery
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from . import redis_conn
from .settings import Config
from .database import make_engine, make_replica_engine, sessions as session_factory
from .dispatch import Dispatcher, make_celery
from .quotas import GroupAdmission, MemoryLimiter, MemorySlots, RedisLimiter, RedisSlots
from .registry import Registry
from .storage import Storage


@dataclass(frozen=True, eq=False)
class Services:
    config: Config
    database: Engine
    sessions: sessionmaker          # sessions over `database`, expire_on_commit off
    replica: Engine                 # TIDEPOOL_DATABASE_REPLICA_URL's engine (read only); `database` when unset
    replica_sessions: sessionmaker
    storage: Storage
    redis: redis_lib.Redis | None   # None in embedded mode (no TIDEPOOL_REDIS_URL); a RedisCluster on a cluster
    limiter: RedisLimiter | MemoryLimiter
    slots: RedisSlots | MemorySlots
    admission: GroupAdmission       # groups concurrent admissions of one key (Postgres)
    celery: Celery                  # the publisher over the broker
    dispatcher: Dispatcher
    registry: Registry

    @classmethod
    def from_config(cls, cfg: Config) -> "Services":
        database = make_engine(cfg.database_url)
        replica = make_replica_engine(cfg.database_replica_url) if cfg.database_replica_url else database
        if cfg.redis_url:
            client = redis_conn.client(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
            limiter, slots = RedisLimiter(client), RedisSlots(client)
        else:
            client, limiter, slots = None, MemoryLimiter(), MemorySlots()
        celery = make_celery(cfg.broker_url)
        return cls(config=cfg, database=database, sessions=session_factory(database),
                   replica=replica, replica_sessions=session_factory(replica),
                   storage=Storage(cfg.storage_dir), redis=client, limiter=limiter, slots=slots,
                   admission=GroupAdmission(), celery=celery,
                   dispatcher=Dispatcher(celery, database, cfg.dispatch_chunk_size, mark_interval=cfg.mark_interval,
                                         default_model=cfg.served_model_name),
                   registry=Registry(database, cfg.served_model_name, cfg.model, max_model_len=cfg.max_model_len))

