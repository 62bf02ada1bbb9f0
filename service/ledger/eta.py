"""When an in-progress batch will be done, from the ledger alone (Flask-free; the batches API, the panel and /metrics
use it).

The capacity model of the scaling benchmarks, applied to one class: the class drains at the rate its jobs
completed over the last DRAIN_WINDOW; the fair take gives the batch's tenant its weight's share of that rate while
other tenants are backlogged in the class; within the tenant, jobs go earliest deadline first (a batch's deadline is
its expires_at), then by arrival. So the batch finishes once the `position` jobs of its tenant ahead of it and its
own `remaining` ones have drained at the tenant's share. A batch whose estimate falls after its window is
`at_risk` (flagged in the panel and on /metrics), before it expires."""
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, aliased

from .models import Batch, BatchStatus, Job, JobStatus, Tenant, utcnow

DRAIN_WINDOW = timedelta(seconds=120)
MIN_SPAN = 5.0      # seconds: a rate is not measured over less than this
WAITING = (JobStatus.queued, JobStatus.running)


@dataclass
class Estimate:
    eta: datetime | None        # None: nothing of the class completed lately, no rate to go by
    position: int               # the tenant's jobs of the class the fair take serves before this batch's
    remaining: int              # this batch's queued and running jobs
    drain_rate: float           # jobs per second the class completed over DRAIN_WINDOW
    share: float                # the tenant's share of it (its weight over the backlogged tenants' weights)
    at_risk: bool               # the estimate falls after expires_at

    def json(self) -> dict:
        return {"eta": None if self.eta is None else int(self.eta.timestamp()), "position": self.position,
                "remaining": self.remaining, "drain_rate": round(self.drain_rate, 3), "share": round(self.share, 3),
                "at_risk": self.at_risk}


def drain_rate(s: Session, sla_class, now: datetime) -> float:
    """Jobs of the class completed per second over DRAIN_WINDOW (measured from the first of them)."""
    n, first = s.execute(select(func.count(), func.min(Job.finished_at)).where(
        Job.sla_class == sla_class, Job.status == JobStatus.completed, Job.finished_at >= now - DRAIN_WINDOW)).one()
    if not n:
        return 0.0
    first = first if first.tzinfo else first.replace(tzinfo=now.tzinfo)
    return n / max((now - first).total_seconds(), MIN_SPAN)


def share(s: Session, sla_class, tenant_id: str) -> float:
    """The tenant's weight over the weights of every tenant with work waiting in the class (itself included)."""
    weights = dict(s.execute(select(Tenant.id, Tenant.weight).where(Tenant.id.in_(
        select(Job.tenant_id).where(Job.sla_class == sla_class, Job.status.in_(WAITING)).distinct()))).all())
    weights.setdefault(tenant_id, s.scalar(select(Tenant.weight).where(Tenant.id == tenant_id)) or 1.0)
    total = sum(w or 1.0 for w in weights.values())
    return (weights[tenant_id] or 1.0) / total


def estimate(s: Session, batch: Batch, now: datetime | None = None) -> Estimate | None:
    """The estimate of an in-progress batch; None for any other state."""
    if batch.status != BatchStatus.in_progress:
        return None
    now = now or utcnow()
    remaining = s.scalar(select(func.count()).where(Job.batch_id == batch.id, Job.status.in_(WAITING))) or 0
    other = aliased(Batch)
    deadline = func.coalesce(Job.deadline, other.expires_at)
    if batch.expires_at is None:      # no deadline: after every deadlined job, then by arrival
        ahead = or_(deadline.is_not(None), Job.queued_at < batch.created_at)
    else:
        ahead = or_(deadline < batch.expires_at, and_(deadline == batch.expires_at, Job.queued_at < batch.created_at))
    position = s.scalar(
        select(func.count()).select_from(Job).outerjoin(other, other.id == Job.batch_id).where(
            Job.tenant_id == batch.tenant_id, Job.sla_class == batch.sla_class, Job.status == JobStatus.queued,
            or_(Job.batch_id.is_(None), Job.batch_id != batch.id), ahead)) or 0
    rate = drain_rate(s, batch.sla_class, now)
    part = share(s, batch.sla_class, batch.tenant_id)
    eta = None
    if remaining == 0:
        eta = now
    elif rate > 0:
        eta = now + timedelta(seconds=(position + remaining) / (rate * part))
    expires = batch.expires_at
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=now.tzinfo)
    return Estimate(eta, position, remaining, rate, part, eta is not None and expires is not None and eta > expires)


def in_progress(s: Session, now: datetime | None = None) -> list[tuple[Batch, Estimate]]:
    """Every in-progress batch with its estimate (for /metrics and the panel)."""
    now = now or utcnow()
    out = []
    for batch in s.scalars(select(Batch).where(Batch.status == BatchStatus.in_progress)).all():
        est = estimate(s, batch, now)
        if est is not None:
            out.append((batch, est))
    return out
