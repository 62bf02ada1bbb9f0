"""Tidepool service: the Flask app factory. Never imports torch or workers.

Importing the package does not import Flask: the workers import its Flask-free part (ledger models, guarded
transitions, shared protocol; the list is in tests/service/test_isolation_meta.py) through it."""
from typing import TYPE_CHECKING

from .ledger.settings import Config

if TYPE_CHECKING:
    from flask import Flask


def create_app(test_config: dict | Config | None = None) -> "Flask":
    import redis as redis_lib
    from flask import Flask

    from . import access_log, admission, db, error_responses, metrics_http, panel
    from . import api
    from .api import admin, anthropic, batches, files, health, jobs, openai_compat, responses
    from .ledger.dispatch import Dispatcher, make_celery
    from .ledger.quotas import MemoryLimiter, MemorySlots, RedisLimiter, RedisSlots
    from .ledger.storage import Storage

    cfg = test_config if isinstance(test_config, Config) else Config.from_env(test_config)
    app = Flask(__name__, static_folder=None)
    app.config["TIDEPOOL"] = cfg
    if cfg.trusted_proxies:     # request.remote_addr is then the client's address, as the proxies saw it
        from werkzeug.middleware.proxy_fix import ProxyFix
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=cfg.trusted_proxies, x_proto=cfg.trusted_proxies)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_file_bytes + (1 << 20)  # multipart overhead
    app.json.sort_keys = False
    db.init_app(app, cfg.database_url)
    error_responses.init_app(app)
    app.extensions["tidepool.storage"] = Storage(cfg.storage_dir)
    if cfg.redis_url:
        client = redis_lib.Redis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
        app.extensions["tidepool.redis"] = client
        app.extensions["tidepool.limiter"] = RedisLimiter(client)
        app.extensions["tidepool.slots"] = RedisSlots(client)
    else:
        app.extensions["tidepool.redis"] = None
        app.extensions["tidepool.limiter"] = MemoryLimiter()
        app.extensions["tidepool.slots"] = MemorySlots()
    celery = make_celery(cfg.broker_url)
    app.extensions["tidepool.celery"] = celery
    app.extensions["tidepool.dispatcher"] = Dispatcher(celery, app.extensions["tidepool.db"],
                                                       cfg.dispatch_chunk_size, mark_interval=cfg.mark_interval,
                                                       default_model=cfg.served_model_name)
    from .ledger.registry import Registry
    app.extensions["tidepool.registry"] = Registry(app.extensions["tidepool.db"], cfg.served_model_name, cfg.model,
                                                   max_model_len=cfg.max_model_len)
    for bp in (health.bp, jobs.bp, files.bp, batches.bp, admin.bp, openai_compat.bp, responses.bp, anthropic.bp):
        app.register_blueprint(bp)
    api.init_app(app)
    admission.init_app(app)
    metrics_http.init_app(app)
    access_log.init_app(app)
    panel.init_app(app)
    return app
