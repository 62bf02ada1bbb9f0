"""Panel pages: sign-in, tenants (usage, weight, default online class, disable, quota, keys), jobs and batches."""
import logging
from datetime import datetime, timezone

from flask import abort, flash, redirect, render_template, request, send_file, session, url_for
from werkzeug.exceptions import HTTPException

from ..ledger import batches as ledger, eta, jobs as transitions, keys as credentials, pages, tenants
from ..protocol import embeddings
from ..api import cfg
from ..app import services
from ..auth import admin_failed, admin_throttled
from ..db import reads, session as db
from ..protocol.errors import APIError
from ..ledger.logging import log_job
from ..protocol import EMBEDDINGS
from ..ledger.models import ONLINE_CLASSES, SLA_CLASSES, Batch, BatchStatus, File, Job, JobStatus, Quota, Tenant
from .blueprint import bp, check_token, sign_in, sign_out, signed_in

log = logging.getLogger("tidepool.panel")
ACTOR = "panel"
INT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_running", "max_queued", "monthly_token_budget",
              "max_tokens_per_request", "max_file_bytes", "max_concurrent_requests", "max_files", "max_storage_bytes")
FIELD_HELP = {
    "requests_per_minute": "Requests accepted per minute.", "tokens_per_minute": "Prompt + max_tokens per minute.",
    "max_running": "Jobs running at once.", "max_queued": "Jobs waiting at once.",
    "monthly_token_budget": "Tokens per calendar month (UTC).",
    "max_tokens_per_request": "Cap on max_tokens of one request.", "max_file_bytes": "Largest batch file upload.",
    "max_concurrent_requests": "Online requests in progress at once.", "max_files": "Files kept at once.",
    "max_storage_bytes": "Bytes of files kept at once.",
}


def _safe_next(target: str | None) -> str:
    if target and target.startswith("/admin") and not target.startswith("//"):
        return target
    return url_for("panel.dashboard")


@bp.route("/login", methods=["GET", "POST"])
def login():
    if request.method == "GET":
        if signed_in():
            return redirect(_safe_next(request.args.get("next")))
        return render_template("login.html", next=request.args.get("next", ""))
    wait = admin_throttled()
    if wait is not None:
        log.warning("panel sign-in throttled", extra={"actor": ACTOR, "event": "panel.login_throttled"})
        return render_template("login.html", next=request.form.get("next", ""),
                               error=f"Too many sign-in attempts from this address; wait {wait} s."), 429, \
            {"Retry-After": str(wait)}
    if not check_token(request.form.get("token", "")):
        admin_failed()
        log.warning("panel sign-in refused", extra={"actor": ACTOR, "event": "panel.login_failed"})
        return render_template("login.html", next=request.form.get("next", ""),
                               error="That admin token is not right." if cfg().admin_token else
                               "The panel is off: set TIDEPOOL_ADMIN_TOKEN on the server."), 401
    sign_in()
    log.info("panel sign-in", extra={"actor": ACTOR, "event": "panel.login"})
    flash("Signed in.", "ok")
    return redirect(_safe_next(request.form.get("next")))


@bp.post("/logout")
def logout():
    sign_out()
    flash("Signed out.", "ok")
    return redirect(url_for("panel.login"))


# --- tenants -------------------------------------------------------------------------------------------

def _usage_by_tenant() -> dict[str, dict]:
    return tenants.usage(reads(), datetime.now(timezone.utc))


@bp.get("/tenants")
def tenants_page():
    rows = tenants.with_quotas(reads(), order_by="name")
    return render_template("tenants.html", rows=rows, usage=_usage_by_tenant(), classes=SLA_CLASSES,
                           online_classes=ONLINE_CLASSES, form={}, errors={})


@bp.post("/tenants")
def create_tenant():
    name, raw_weight = request.form.get("name", "").strip(), request.form.get("weight", "1").strip()
    raw_class = request.form.get("default_sla_class", "").strip()
    errors = {}
    weight = _parse_weight(raw_weight, errors)
    default_class = _parse_default_class(raw_class, errors)
    if not name:
        errors["name"] = "Give the tenant a name."
    if not errors:
        s = db()
        try:
            tenant, key = tenants.create_tenant(s, name, weight, actor=ACTOR, default_sla_class=default_class)
            s.commit()
        except APIError as exc:
            s.rollback()
            errors[exc.param or "name"] = exc.message
        else:
            flash(f"Tenant '{tenant.name}' created.", "ok")
            return _show_key_once(tenant.id, key)
    rows = tenants.with_quotas(reads(), order_by="name")
    return render_template("tenants.html", rows=rows, usage=_usage_by_tenant(), classes=SLA_CLASSES,
                           online_classes=ONLINE_CLASSES,
                           form={"name": name, "weight": raw_weight, "default_sla_class": raw_class}, errors=errors), 400


def _parse_weight(raw: str, errors: dict) -> float | None:
    try:
        weight = float(raw)
        if not weight > 0 or weight > 1e6:
            raise ValueError
        return weight
    except ValueError:
        errors["weight"] = "Weight must be a number greater than 0 (1 is the default share)."
        return None


def _parse_default_class(raw: str, errors: dict) -> str | None:
    """'' is no default (online requests that name no class run as interactive)."""
    if raw == "":
        return None
    if raw not in ONLINE_CLASSES:
        errors["default_sla_class"] = (f"Choose {' or '.join(ONLINE_CLASSES)}, or no default "
                                       "(interactive).")
        return None
    return raw


def _tenant_or_404(tenant_id: str) -> Tenant:
    t = db().get(Tenant, tenant_id)
    if t is None:
        abort(404, f"No tenant with id {tenant_id}.")
    return t


def _tenant_page(tenant_id: str, *, new_key: str | None = None, quota_form: dict | None = None,
                 errors: dict | None = None, scheduling_form: dict | None = None, status: int = 200):
    s = db()
    t = _tenant_or_404(tenant_id)
    s.refresh(t)
    quota = s.get(Quota, tenant_id)
    keys = tenants.keys_of(s, tenant_id, newest_first=True)
    if quota_form is None:
        quota_form = {f: "" if getattr(quota, f) is None else str(getattr(quota, f)) for f in INT_FIELDS}
        quota_form["allowed_sla_classes"] = list(quota.allowed_sla_classes or [])
    if scheduling_form is None:
        scheduling_form = {"weight": f"{t.weight:g}", "default_sla_class": t.default_sla_class or ""}
    recent = pages.page(reads(), Job, 10, tenant_id=tenant_id)[:10]
    return render_template("tenant.html", t=t, quota=quota, keys=keys, new_key=new_key, qf=quota_form,
                           sf=scheduling_form, errors=errors or {}, fields=INT_FIELDS, help=FIELD_HELP,
                           classes=SLA_CLASSES, online_classes=ONLINE_CLASSES,
                           usage=_usage_by_tenant().get(tenant_id), recent=recent), status


def _show_key_once(tenant_id: str, key: str):
    """Post/redirect/get: the new key rides in the (signed, HttpOnly) session to the next page view only, so a
    refresh neither re-submits the form nor shows the key again."""
    session["new_key"] = {"tenant": tenant_id, "key": key}
    return redirect(url_for("panel.tenant_page", tenant_id=tenant_id), 303)


@bp.get("/tenants/<tenant_id>")
def tenant_page(tenant_id):
    shown = session.pop("new_key", None)
    return _tenant_page(tenant_id, new_key=shown["key"] if shown and shown.get("tenant") == tenant_id else None)


@bp.post("/tenants/<tenant_id>/scheduling")
def set_scheduling(tenant_id):
    """Weight and default online SLA class (what PATCH /v1/admin/tenants/<id> changes)."""
    t = _tenant_or_404(tenant_id)
    form = {"weight": request.form.get("weight", "").strip(),
            "default_sla_class": request.form.get("default_sla_class", "").strip()}
    errors: dict = {}
    weight = _parse_weight(form["weight"], errors)
    default_class = _parse_default_class(form["default_sla_class"], errors)
    if errors:
        flash("Scheduling was not saved: fix the fields marked below.", "error")
        return _tenant_page(tenant_id, scheduling_form=form, errors=errors, status=400)
    s = db()
    tenants.update_tenant(s, t, {"weight": weight, "default_sla_class": default_class}, actor=ACTOR)
    s.commit()
    flash(f"Scheduling saved: weight {weight:g}, online requests without a class run as "
          f"{default_class or 'interactive'}.", "ok")
    return redirect(url_for("panel.tenant_page", tenant_id=tenant_id))


@bp.post("/tenants/<tenant_id>/disable")
def disable_tenant(tenant_id):
    return _set_disabled(tenant_id, True)


@bp.post("/tenants/<tenant_id>/enable")
def enable_tenant(tenant_id):
    return _set_disabled(tenant_id, False)


def _set_disabled(tenant_id: str, disabled: bool):
    t = _tenant_or_404(tenant_id)
    s = db()
    tenants.set_disabled(s, tenant_id, disabled, actor=ACTOR)
    s.commit()
    flash(f"Tenant '{t.name}' {'disabled: its keys are refused' if disabled else 'enabled'}.", "ok")
    return redirect(url_for("panel.tenant_page", tenant_id=tenant_id))


@bp.post("/tenants/<tenant_id>/quota")
def set_quota(tenant_id):
    _tenant_or_404(tenant_id)
    form = {f: request.form.get(f, "").strip() for f in INT_FIELDS}
    form["allowed_sla_classes"] = request.form.getlist("allowed_sla_classes")
    values, errors = {}, {}
    for f in INT_FIELDS:
        raw = form[f].replace("_", "").replace(",", "")
        if raw == "":
            values[f] = None
        elif raw.isdigit():
            values[f] = int(raw)
        else:
            errors[f] = "Enter a whole number of 0 or more, or leave empty for no limit."
    values["allowed_sla_classes"] = form["allowed_sla_classes"]
    for f in [f for f in values if f not in errors]:     # the admin API's validator, field by field
        try:
            tenants.check_quota_fields({f: values[f]})
        except APIError as exc:
            errors[f] = exc.message
    if not form["allowed_sla_classes"] and "allowed_sla_classes" not in errors:
        errors["allowed_sla_classes"] = "Allow at least one class (disable the tenant to stop all work)."
    if errors:
        flash("The quota was not saved: fix the fields marked below.", "error")
        return _tenant_page(tenant_id, quota_form=form, errors=errors, status=400)
    s = db()
    tenants.set_quota(s, tenant_id, values, actor=ACTOR)
    s.commit()
    flash("Quota saved.", "ok")
    return redirect(url_for("panel.tenant_page", tenant_id=tenant_id) + "#quota")


@bp.post("/tenants/<tenant_id>/keys")
def issue_key(tenant_id):
    _tenant_or_404(tenant_id)
    s = db()
    row, key = tenants.issue_key(s, tenant_id, actor=ACTOR)
    s.commit()
    flash(f"Key {row.prefix} issued. Copy it now: it is shown only once.", "ok")
    return _show_key_once(tenant_id, key)


@bp.post("/keys/<prefix>/revoke")
def revoke_key(prefix):
    s = db()
    key = credentials.by_prefix(s, prefix)
    if key is None:
        abort(404, f"No key with prefix {prefix}.")
    if tenants.revoke_key(s, prefix, actor=ACTOR):
        s.commit()
        flash(f"Key {prefix} revoked.", "ok")
    else:
        flash(f"Key {prefix} was already revoked.", "error")
    return redirect(url_for("panel.tenant_page", tenant_id=key.tenant_id) + "#keys")


# --- jobs and batches ------------------------------------------------------------------------------------

def _parse_time(name: str, errors: dict) -> datetime | None:
    raw = request.args.get(name, "").strip()
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        errors[name] = "Use a date and time like 2026-01-31T14:00."
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _tenant_names() -> dict[str, str]:
    return {t.id: t.name for t in tenants.by_name(reads())}


@bp.get("/jobs")
def jobs_page():
    args, errors, filters = request.args, {}, {}
    if args.get("tenant"):
        filters["tenant_id"] = args["tenant"]
    if args.get("status"):
        if args["status"] not in JobStatus.__members__:
            errors["status"] = "Unknown status."
        else:
            filters["status"] = JobStatus(args["status"])
    if args.get("sla_class"):
        if args["sla_class"] not in SLA_CLASSES:
            errors["sla_class"] = "Unknown class."
        else:
            filters["sla_class"] = args["sla_class"]
    if args.get("batch"):
        filters["batch_id"] = args["batch"]
    since, until = _parse_time("since", errors), _parse_time("until", errors)
    limit = cfg().page_size * 2
    rows = pages.page(reads(), Job, limit, after=args.get("cursor"), created_from=since, created_before=until,
                      **filters) if not errors else []
    more = rows[limit - 1].id if len(rows) > limit else None
    query = {k: v for k, v in args.items() if k != "cursor" and v}
    return render_template("jobs.html", jobs=rows[:limit], names=_tenant_names(), errors=errors, args=args,
                           statuses=list(JobStatus.__members__), classes=SLA_CLASSES, next_cursor=more,
                           query=query), 400 if errors else 200


def _job_or_404(job_id: str) -> Job:
    job = db().get(Job, job_id)
    if job is None:
        abort(404, f"No job with id {job_id}.")
    return job


def timeline(job: Job) -> list[dict]:
    """The job's milestones in order, each with the time since the previous one."""
    steps = [("queued", job.created_at), ("dispatched", job.dispatched_at), ("started", job.started_at),
             ("first token", job.first_token_at), (job.status.value if job.status in
                                                   (JobStatus.completed, JobStatus.failed, JobStatus.cancelled,
                                                    JobStatus.expired) else "finished", job.finished_at)]
    out, prev = [], None
    for label, at in steps:
        delta = (at - prev).total_seconds() if at and prev else None
        out.append({"label": label, "at": at, "delta": delta})
        prev = at or prev
    return out


@bp.get("/jobs/<job_id>")
def job_page(job_id):
    job = _job_or_404(job_id)
    vectors = None
    if job.endpoint == EMBEDDINGS and job.output is not None:    # base64 in the ledger: shown as numbers
        vectors = [d["embedding"] for d in embeddings.data(job.output, {})]
    return render_template("job.html", job=job, steps=timeline(job), tenant=db().get(Tenant, job.tenant_id),
                           cancellable=job.status in (JobStatus.queued, JobStatus.running), vectors=vectors)


@bp.post("/jobs/<job_id>/cancel")
def cancel_job(job_id):
    job = _job_or_404(job_id)
    s = db()
    if transitions.cancel(s, job_id):
        s.commit()
        s.refresh(job)
        log_job("job.cancelled", job, actor=ACTOR)
        flash("Job cancelled.", "ok")
    else:
        s.rollback()
        flash(f"The job is already {job.status.value}; nothing to cancel.", "error")
    return redirect(url_for("panel.job_page", job_id=job_id))


@bp.get("/batches")
def batches_page():
    args, filters = request.args, {}
    if args.get("tenant"):
        filters["tenant_id"] = args["tenant"]
    if args.get("status") in BatchStatus.__members__:
        filters["status"] = BatchStatus(args["status"])
    limit = cfg().page_size * 2
    s = reads()
    rows = pages.page(s, Batch, limit, after=args.get("cursor"), **filters)
    counts = {b.id: ledger.request_counts(s, b) for b in rows[:limit]}
    estimates = {b.id: eta.estimate(s, b) for b in rows[:limit]}
    query = {k: v for k, v in args.items() if k != "cursor" and v}
    return render_template("batches.html", batches=rows[:limit], counts=counts, names=_tenant_names(), args=args,
                           estimates=estimates,
                           statuses=list(BatchStatus.__members__), query=query,
                           next_cursor=rows[limit - 1].id if len(rows) > limit else None)


def _batch_or_404(batch_id: str) -> Batch:
    b = db().get(Batch, batch_id)
    if b is None:
        abort(404, f"No batch with id {batch_id}.")
    return b


@bp.get("/batches/<batch_id>")
def batch_page(batch_id):
    b = _batch_or_404(batch_id)
    s = db()
    counts = ledger.request_counts(s, b)
    by_status = ledger.status_counts(s, b.id)
    files = ledger.files_of(s, b)
    return render_template("batch.html", b=b, counts=counts, by_status={k.value: v for k, v in by_status.items()},
                           est=eta.estimate(s, b),
                           files=files, tenant=s.get(Tenant, b.tenant_id),
                           cancellable=b.status in (BatchStatus.validating, BatchStatus.in_progress))


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id):
    b = _batch_or_404(batch_id)
    s = db()
    if b.status not in (BatchStatus.validating, BatchStatus.in_progress) or not ledger.cancel(s, b):
        flash(f"The batch is {b.status.value} and cannot be cancelled.", "error")
        return redirect(url_for("panel.batch_page", batch_id=batch_id))
    ledger.finalize(s, services().storage, b, cfg().served_model_name)
    s.commit()
    log.info("batch cancelled", extra={"event": "batch.cancelled", "batch_id": b.id, "tenant": b.tenant_id,
                                       "sla_class": b.sla_class.value, "actor": ACTOR})
    flash("Batch cancelled: queued requests were dropped; running ones finish or are aborted."
          if b.status == BatchStatus.cancelling else "Batch cancelled.", "ok")
    return redirect(url_for("panel.batch_page", batch_id=batch_id))


@bp.get("/files/<file_id>")
def download_file(file_id):
    f = db().get(File, file_id)
    if f is None:
        abort(404, f"No file with id {file_id}.")
    try:
        path = services().storage.path(file_id)
    except ValueError:
        abort(404, f"No file with id {file_id}.")
    if not path.exists():
        abort(404, f"The bytes of file {file_id} are missing from storage.")
    return send_file(path, mimetype="application/jsonl", as_attachment=True, download_name=f.filename)


@bp.errorhandler(404)
def _not_found(exc):
    return render_template("error.html", title="Not found", message=exc.description), 404


@bp.errorhandler(APIError)
def _api_error(exc: APIError):
    return render_template("error.html", title="That did not work", message=exc.message), exc.status


@bp.errorhandler(Exception)
def _unexpected(exc: Exception):
    if isinstance(exc, HTTPException):
        return render_template("error.html", title=exc.name, message=exc.description), exc.code
    log.exception("panel error", extra={"path": request.path})
    return render_template("error.html", title="Something went wrong",
                           message=f"The server failed on this page ({type(exc).__name__}); "
                                   "the error is in the server log."), 500
