"""Panel page for the LoRA adapters: register one over a registered model (the folder is checked against its base,
and a misfit is shown with the reason), see them all, pin or unpin, enable or disable."""
from flask import flash, redirect, render_template, request, url_for

from ..api import cfg
from ..app import services
from ..db import session as db
from ..ledger import adapters
from ..protocol.errors import APIError
from .blueprint import bp

ACTOR = "panel"


def _page(form: dict | None = None, errors: dict | None = None, status: int = 200):
    return render_template("adapters.html", adapters=adapters.listing(db()),
                           models=[e.name for e in services().registry.entries().values() if e.name],
                           form=form or {}, errors=errors or {}), status


@bp.get("/adapters")
def adapters_page():
    return _page()


@bp.post("/adapters")
def register_adapter():
    form = {k: request.form.get(k, "").strip() for k in ("name", "base_model", "source", "tenant_id")}
    pinned = request.form.get("pinned") == "1"
    s = db()
    try:
        base = services().registry.get(form["base_model"])
        adapters.register(s, form["name"], form["base_model"], form["source"], base,
                          cfg().max_lora_rank or adapters.DEFAULT_MAX_LORA_RANK, form["tenant_id"] or None, pinned,
                          actor=ACTOR)
        s.commit()
    except APIError as exc:
        s.rollback()
        flash("The adapter was not registered: fix the field marked below.", "error")
        return _page(form, {exc.param or "name": exc.message}, 400)
    flash(f"Adapter '{form['name']}' registered.", "ok")
    return redirect(url_for("panel.adapters_page"), 303)


@bp.post("/adapters/update")
def update_adapter():
    """One change per form: pinned or enabled on/off."""
    name = request.form.get("name", "")
    values = {k: request.form[k] == "1" for k in ("pinned", "enabled") if k in request.form}
    s = db()
    try:
        adapters.update(s, name, values, actor=ACTOR)
        s.commit()
    except APIError as exc:
        s.rollback()
        flash(f"'{name}' was not changed: {exc.message}", "error")
        return _page(status=exc.status)
    flash(f"Adapter '{name}' updated.", "ok")
    return redirect(url_for("panel.adapters_page"), 303)
