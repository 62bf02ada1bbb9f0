"""Listings in cursor pages: the rows of one table that match, ordered by id, one page after another."""
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session


def page(s: Session, model, limit: int, *, after=None, before=None, ascending: bool = False,
         created_from: datetime | None = None, created_before: datetime | None = None, **match) -> list:
    """Up to limit + 1 rows of `model` with the column values `match` names (the row past `limit` tells the caller
    there is more), newest id first, or oldest first with `ascending`. `after`: only the rows that come after this
    id in that order (the next page); `before`: only those that come before it; created_from / created_before: a
    range of created_at."""
    stmt = select(model).filter_by(**match)
    if after:
        stmt = stmt.where(model.id > after if ascending else model.id < after)
    if before:
        stmt = stmt.where(model.id < before if ascending else model.id > before)
    if created_from is not None:
        stmt = stmt.where(model.created_at >= created_from)
    if created_before is not None:
        stmt = stmt.where(model.created_at < created_before)
    return s.scalars(stmt.order_by(model.id.asc() if ascending else model.id.desc()).limit(limit + 1)).all()
