"""Admission of the current request's job: one statement counts it against max_queued and the budget, inserts it
and commits (service.ledger.quotas); on Postgres concurrent requests' statements are grouped (GroupAdmission)."""
from flask import current_app, g

from .db import autocommit
from .ledger.quotas import GroupAdmission, admit_one


def admit(job) -> str | None:
    """Admit one queued job under the request's API key; returns its xmin on Postgres."""
    key_id = g.get("api_key_id")
    engine = current_app.extensions["tidepool.db"]
    if engine.dialect.name != "postgresql":
        with autocommit() as conn:
            return admit_one(conn, job, key_id)
    group = current_app.extensions.get("tidepool.admission")
    if group is None:
        group = current_app.extensions.setdefault("tidepool.admission", GroupAdmission())
    return group.admit(job, key_id, autocommit)
