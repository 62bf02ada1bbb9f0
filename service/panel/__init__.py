"""Admin panel (HTML, under /admin): the admin token is exchanged for a signed session cookie, and every
form carries a per-session CSRF token. The JSON admin API (/v1/admin) stays bearer-only."""
import hashlib
import secrets
from datetime import timedelta

from ..ledger.logging import register_secret
from .blueprint import bp, csrf_token


def init_app(app) -> None:
    from . import adapter_views, dashboard, registry_views, views  # noqa: F401  (routes)

    cfg = app.config["TIDEPOOL"]
    secret = cfg.secret_key
    if not secret and cfg.admin_token:  # every web process derives the same key from the shared admin token
        secret = hashlib.sha256(b"tidepool-panel-session:" + cfg.admin_token.encode()).hexdigest()
    app.secret_key = app.secret_key or secret or secrets.token_hex(32)
    register_secret(cfg.admin_token)
    register_secret(app.secret_key)
    insecure = cfg.insecure_cookies
    app.config.update(SESSION_COOKIE_NAME="tidepool_admin", SESSION_COOKIE_HTTPONLY=True,
                      SESSION_COOKIE_SAMESITE="Strict", SESSION_COOKIE_SECURE=not insecure,
                      SESSION_COOKIE_PATH="/admin", PERMANENT_SESSION_LIFETIME=timedelta(hours=12))
    app.jinja_env.globals["csrf_token"] = csrf_token
    app.register_blueprint(bp)
