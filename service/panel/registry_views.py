"""Panel page for the model registry: register a model, retier it, enable or disable it, grant it to tenants or
revoke it, and see each model's tensor_parallel_size (its own or the deployment's), its KV cache dtype (asked for,
in use, and the loss its calibration measured) and queues (depth per SLA class, and whether a live worker serves
them); and the fleet planner's last plan with its forecast."""
from datetime import datetime, timezone

from flask import flash, redirect, render_template, request, url_for

from ..ledger import fleet, registry
from ..app import services
from ..api.admin import model_queues
from ..db import session as db
from ..protocol.errors import APIError
from ..ledger.models import Tenant
from .blueprint import bp

ACTOR = "panel"


def _page(form: dict | None = None, errors: dict | None = None, status: int = 200):
    entries = list(services().registry.entries().values())
    try:
        queues = model_queues()
    except Exception as exc:   # broker down: the registry is still shown
        queues, errors = [], {**(errors or {}), "queues": f"Broker unreachable: {type(exc).__name__}"}
    by_model: dict[str, list] = {}
    for row in queues:
        by_model.setdefault(row["model"], []).append(row)
    tenants = registry.grants(db())
    deployment = registry.tensor_parallel_size(None, services().config.tensor_parallel_size)  # a model without its own
    try:
        plan = fleet.PlanStore(services().redis).get()
    except Exception:   # Redis down: the registry is still shown
        plan = None
    if plan is not None:
        plan["at"] = datetime.fromtimestamp(plan["at"], timezone.utc)
    kv = {e.name: registry.kv_cache_use(e, services().config.kv_cache_dtype) for e in entries}
    return render_template("models.html", entries=entries, queues=by_model, tenants=tenants, tiers=registry.TIERS,
                           tensor_parallel_size=deployment, plan=plan, kv=kv, form=form or {}, errors=errors or {}),\
        status


@bp.get("/models")
def models_page():
    return _page()


@bp.post("/models")
def register_model():
    form = {k: request.form.get(k, "").strip() for k in ("name", "source", "tier")}
    s = db()
    try:
        registry.register(s, form["name"], form["source"], form["tier"] or "warm", actor=ACTOR)
        s.commit()
    except APIError as exc:
        s.rollback()
        flash("The model was not registered: fix the field marked below.", "error")
        return _page(form, {exc.param or "name": exc.message}, 400)
    flash(f"Model '{form['name']}' registered ({form['tier'] or 'warm'}).", "ok")
    return redirect(url_for("panel.models_page"), 303)


@bp.post("/models/update")
def update_model():
    """One change per form: a new tier, or enabled on/off."""
    name = request.form.get("name", "")
    values = {}
    if "tier" in request.form:
        values["tier"] = request.form["tier"]
    if "enabled" in request.form:
        values["enabled"] = request.form["enabled"] == "1"
    s = db()
    try:
        registry.update(s, name, values, actor=ACTOR, default=services().registry.get(name))
        s.commit()
    except APIError as exc:
        s.rollback()
        flash(f"'{name}' was not changed: {exc.message}", "error")
        return _page(status=exc.status)
    what = f"tier {values['tier']}" if "tier" in values else ("enabled" if values.get("enabled") else "disabled")
    flash(f"Model '{name}': {what}.", "ok")
    return redirect(url_for("panel.models_page"), 303)


@bp.post("/models/grants")
def grant_model():
    # the Revoke button posts to ?action=revoke (a submit button's own value is lost: panel.js disables it)
    tenant_id, name = request.form.get("tenant_id", ""), request.form.get("model", "")
    action = request.args.get("action", "grant")
    s = db()
    try:
        if s.get(Tenant, tenant_id) is None:
            raise APIError(404, "Choose a tenant.", "not_found", "tenant_id")
        if services().registry.get(name) is None:
            raise APIError(404, "Choose a registered model.", "not_found", "model")
        if action == "revoke":
            registry.revoke(s, tenant_id, name, list(services().registry.entries()), actor=ACTOR)
        else:
            registry.grant(s, tenant_id, name, actor=ACTOR)
        s.commit()
    except APIError as exc:
        s.rollback()
        flash(f"Not changed: {exc.message}", "error")
        return _page(status=exc.status)
    flash(f"'{name}' {'revoked from' if action == 'revoke' else 'granted to'} the tenant.", "ok")
    return redirect(url_for("panel.models_page") + "#grants", 303)
