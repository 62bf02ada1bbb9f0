"""The admin panel's blueprint: sign-in (the admin token exchanged for a signed session cookie that names a
server-side session, ended by sign-out), the per-session CSRF token every form carries, the guard in front of every
page, security headers and template filters."""
import hashlib
import hmac
import secrets

from flask import Blueprint, current_app, g, redirect, render_template, request, session, url_for

from ..db import session as db
from ..ledger import keys

from ..resources import WEB

bp = Blueprint("panel", __name__, url_prefix="/admin", template_folder=str(WEB / "templates"),
               static_folder=str(WEB / "static"), static_url_path="/static")
PUBLIC = {"panel.login", "panel.static"}


def _token() -> str | None:
    return current_app.config["TIDEPOOL"].admin_token


def _fingerprint(token: str) -> str:
    """Stored in the session instead of the token; rotating the admin token signs every operator out."""
    return hmac.new(current_app.secret_key.encode(), token.encode(), hashlib.sha256).hexdigest()[:32]


def _session_key(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def signed_in() -> bool:
    """The cookie was signed for the current admin token and names a session that has not signed out or expired."""
    if "tp_signed_in" not in g:
        token, sid = _token(), session.get("sid")
        g.tp_signed_in = bool(token) and bool(sid) and hmac.compare_digest(session.get("admin", ""),
                                                                           _fingerprint(token)) \
            and keys.signed_in(db(), _session_key(sid))
    return g.tp_signed_in


def csrf_token() -> str:
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    return session["csrf"]


def check_token(candidate: str) -> bool:
    token = _token()
    return bool(token) and hmac.compare_digest(candidate.encode(), token.encode())


def sign_in() -> None:
    session.clear()  # a fresh session (and CSRF token) on sign-in: no fixation
    session.permanent = True
    sid = secrets.token_urlsafe(32)
    s = db()
    keys.sign_in(s, _session_key(sid), current_app.permanent_session_lifetime)
    s.commit()
    session["sid"] = sid
    session["admin"] = _fingerprint(_token())
    session["csrf"] = secrets.token_urlsafe(32)
    g.pop("tp_signed_in", None)


def sign_out() -> None:
    """End the session for every copy of its cookie."""
    sid = session.get("sid")
    if sid:
        s = db()
        keys.sign_out(s, _session_key(sid))
        s.commit()
    session.clear()
    g.pop("tp_signed_in", None)


LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")
PLAIN_HTTP = ("This page came over plain HTTP from {host}, so the browser drops the panel's Secure session cookie "
              "and no form can work (the CSRF check fails). Serve the panel over HTTPS (TLS in front of Tidepool), "
              "or, for development only, set TIDEPOOL_INSECURE_COOKIES=1 on the server and restart it.")


def plain_http_warning() -> str | None:
    """Why sign-in cannot work here: a Secure cookie over plain HTTP to a host browsers do not treat as local."""
    if not current_app.config.get("SESSION_COOKIE_SECURE") or request.is_secure:
        return None
    if request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower() == "https":
        return None     # TLS ends at a proxy in front
    host = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
    if host in LOCAL_HOSTS or host.endswith(".localhost"):
        return None     # browsers treat these as secure contexts and keep Secure cookies
    return PLAIN_HTTP.format(host=request.host)


@bp.before_request
def _guard():
    if request.method == "POST":
        sent = request.form.get("csrf_token", "")
        if not sent or not hmac.compare_digest(sent, session.get("csrf", "")):
            return render_template("error.html", title="Form rejected",
                                   message=plain_http_warning() or
                                   "This form was missing its security token or it has expired "
                                   "(CSRF check failed). Reload the page and try again."), 400
    if request.endpoint not in PUBLIC and not signed_in():
        if request.endpoint == "panel.dashboard_data":
            return {"error": {"message": "Sign in to the admin panel.", "code": "signed_out"}}, 401
        return redirect(url_for("panel.login", next=request.full_path.rstrip("?") if request.method == "GET" else None))


@bp.after_request
def _headers(resp):
    resp.headers.setdefault("Cache-Control", "no-store")
    resp.headers.setdefault("X-Frame-Options", "DENY")
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("Referrer-Policy", "same-origin")
    resp.headers.setdefault("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
                            "style-src 'self'; script-src 'self'; frame-ancestors 'none'")
    return resp


@bp.app_template_filter("dt")
def _dt(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "—"


@bp.app_template_filter("num")
def _num(value) -> str:
    return "—" if value is None else f"{value:,}"


@bp.app_template_filter("secs")
def _secs(value) -> str:
    if value is None:
        return ""
    return f"+{value * 1000:.0f} ms" if value < 1 else f"+{value:.2f} s" if value < 120 else f"+{value / 60:.1f} min"


@bp.context_processor
def _context() -> dict:
    return {"signed_in": signed_in(), "plain_http_warning": plain_http_warning()}
