"""Admission of the current request's job: one statement counts it against max_queued and the budget, inserts it
and commits (service.ledger.quotas); on Postgres concurrent requests' statements are grouped (GroupAdmission).
An online request also holds one of its tenant's concurrency slots until it ends (hold_online_slot)."""
from flask import g

from .app import services
from .db import autocommit
from .ledger.quotas import Slot, admit_one, hold_slot


def admit(job) -> str | None:
    """Admit one queued job under the request's API key; returns its xmin on Postgres."""
    key_id = g.get("api_key_id")
    if services().database.dialect.name != "postgresql":
        with autocommit() as conn:
            return admit_one(conn, job, key_id)
    return services().admission.admit(job, key_id, autocommit)


def hold_online_slot() -> Slot | None:
    """One of the tenant's max_concurrent_requests slots for the current request (429 when none is free). It is
    released when the request ends, whatever the way; a streamed answer takes it over (streaming) and releases it
    when the stream ends or the client goes away."""
    slot = hold_slot(services().slots, g.quota)
    if slot is not None:
        g.online_slot = slot
    return slot


class _SlotStream:
    """A streamed response body that holds its request's slot: renewed as events go out, released at its end or on
    close() (the WSGI server calls it after the stream, and when the client disconnects)."""

    def __init__(self, events, slot: Slot):
        self.events, self.slot = events, slot

    def __iter__(self):
        return self

    def __next__(self):
        self.slot.renew()
        try:
            return next(self.events)
        except BaseException:      # the end of the stream (or its failure): the request is over
            self.slot.release()
            raise

    def close(self) -> None:
        try:
            close = getattr(self.events, "close", None)
            if close is not None:
                close()
        finally:
            self.slot.release()


def streaming(events):
    """The body of a streamed answer: it takes over the request's slot, if it holds one."""
    slot = g.pop("online_slot", None)
    return events if slot is None else _SlotStream(events, slot)


def _release(_exc=None) -> None:
    slot = g.pop("online_slot", None)
    if slot is not None:
        slot.release()


def init_app(app) -> None:
    app.teardown_request(_release)
