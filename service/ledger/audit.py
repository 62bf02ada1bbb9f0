"""The audit log: who changed what in the ledger's administration (tenants, quotas, keys, models)."""
from sqlalchemy.orm import Session

from .models import AuditLog, utcnow


def audit(s: Session, actor: str, action: str, target: str | None, details: dict | None = None) -> None:
    s.add(AuditLog(actor=actor, action=action, target=target, details=details, at=utcnow()))
