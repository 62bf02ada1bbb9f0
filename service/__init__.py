"""Tidepool service: the Flask app factory. Never imports torch or workers.

Importing the package does not import Flask: the workers import its Flask-free part (ledger models, guarded
transitions, shared protocol; the list is in tests/service/test_isolation_meta.py) through it."""
from typing import TYPE_CHECKING

from .ledger.settings import Config

if TYPE_CHECKING:
    from .app import App


def create_app(test_config: dict | Config | None = None) -> "App":
    """The web app over services built once from the settings (the environment, with `test_config` laid over it, or
    a Config as it is); they are `app.services`, and `services()` in a request."""
    from . import access_log, admission, db, error_responses, metrics_http, panel
    from . import api
    from .api import admin, anthropic, batches, files, health, jobs, openai_compat, responses
    from .app import App
    from .ledger.services import Services

    cfg = test_config if isinstance(test_config, Config) else Config.from_env(test_config)
    app = App(__name__, Services.from_config(cfg), static_folder=None)
    app.config["TIDEPOOL"] = cfg
    if cfg.trusted_proxies:     # request.remote_addr is then the client's address, as the proxies saw it
        from werkzeug.middleware.proxy_fix import ProxyFix
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=cfg.trusted_proxies, x_proto=cfg.trusted_proxies)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_file_bytes + (1 << 20)  # multipart overhead
    app.json.sort_keys = False
    db.init_app(app)
    error_responses.init_app(app)
    for bp in (health.bp, jobs.bp, files.bp, batches.bp, admin.bp, openai_compat.bp, responses.bp, anthropic.bp):
        app.register_blueprint(bp)
    api.init_app(app)
    admission.init_app(app)
    metrics_http.init_app(app)
    access_log.init_app(app)
    panel.init_app(app)
    return app
