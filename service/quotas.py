"""Admission control: per-minute rate limits (Redis or memory), monthly budget, max queued."""
import threading
import time
from datetime import datetime, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from .errors import APIError
from .metrics import quota_rejected
from .models import Quota, Tenant, Usage

WINDOW = 60

_LUA = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if rpm >= 0 and r + 1 > rpm then return 1 end
if tpm >= 0 and t + n > tpm then return 2 end
redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('INCRBY', KEYS[2], n); redis.call('EXPIRE', KEYS[2], ARGV[4])
return 0
"""
_REASONS = {1: ("requests_per_minute", "requests per minute"), 2: ("tokens_per_minute", "tokens per minute")}


class RedisLimiter:
    """Fixed one-minute windows; the check and both increments are one Lua call, so it is atomic."""

    def __init__(self, client):
        self.client = client
        self.script = client.register_script(_LUA)

    def hit(self, tenant_id: str, rpm: int | None, tpm: int | None, tokens: int, now: float) -> int:
        window = int(now // WINDOW)
        keys = [f"tp:rl:{{{tenant_id}}}:req:{window}", f"tp:rl:{{{tenant_id}}}:tok:{window}"]
        return int(self.script(keys=keys, args=[-1 if rpm is None else rpm, -1 if tpm is None else tpm,
                                                tokens, WINDOW * 2]))


class MemoryLimiter:
    """The same fixed windows for the embedded mode (one process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, int], list[int]] = {}

    def hit(self, tenant_id: str, rpm: int | None, tpm: int | None, tokens: int, now: float) -> int:
        window = int(now // WINDOW)
        with self.lock:
            if len(self.counts) > 10_000:
                self.counts = {k: v for k, v in self.counts.items() if k[1] >= window - 1}
            c = self.counts.setdefault((tenant_id, window), [0, 0])
            if rpm is not None and c[0] + 1 > rpm:
                return 1
            if tpm is not None and c[1] + tokens > tpm:
                return 2
            c[0] += 1
            c[1] += tokens
            return 0


def check_rate(limiter, quota: Quota, tokens: int, now: float | None = None) -> None:
    if quota.requests_per_minute is None and quota.tokens_per_minute is None:
        return
    if quota.tokens_per_minute is not None and tokens > quota.tokens_per_minute:
        quota_rejected(quota.tenant_id, "request_too_large")
        raise APIError(400, f"This request needs {tokens} tokens (prompt + max_tokens), more than the "
                            f"{quota.tokens_per_minute} tokens per minute this tenant is allowed.",
                       "request_too_large", "max_tokens")
    now = time.time() if now is None else now
    verdict = limiter.hit(quota.tenant_id, quota.requests_per_minute, quota.tokens_per_minute, tokens, now)
    if verdict:
        code, what = _REASONS[verdict]
        quota_rejected(quota.tenant_id, code)
        raise APIError(429, f"Rate limit reached for {what}; retry after the window resets.", code,
                       retry_after=WINDOW - int(now) % WINDOW)


def period(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m")


def _seconds_to_next_month(now: datetime) -> int:
    nxt = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=timezone.utc)
    return int((nxt - now).total_seconds()) + 1


def check_budget(s: Session, quota: Quota, tokens: int) -> None:
    if quota.monthly_token_budget is None:
        return
    now = datetime.now(timezone.utc)
    used = s.scalar(select(func.coalesce(Usage.prompt_tokens + Usage.completion_tokens, 0))
                    .where(Usage.tenant_id == quota.tenant_id, Usage.period == period(now))) or 0
    if used + tokens > quota.monthly_token_budget:
        quota_rejected(quota.tenant_id, "insufficient_quota")
        raise APIError(429, f"Monthly token budget exhausted: {used} of {quota.monthly_token_budget} tokens "
                            f"used, this request needs up to {tokens}.", "insufficient_quota",
                       retry_after=_seconds_to_next_month(now))


def reserve_queued(s: Session, quota: Quota, n: int) -> None:
    """Count n more queued jobs against max_queued in one conditional UPDATE (row-locked until commit)."""
    stmt = update(Tenant).where(Tenant.id == quota.tenant_id).values(queued_count=Tenant.queued_count + n)
    if quota.max_queued is not None:
        stmt = stmt.where(Tenant.queued_count + n <= quota.max_queued)
    if s.execute(stmt).rowcount != 1:
        quota_rejected(quota.tenant_id, "max_queued")
        raise APIError(429, f"Too many queued jobs: this tenant may have at most {quota.max_queued} "
                            f"queued and this request adds {n}.", "max_queued", retry_after=1)


def check_class(quota: Quota, sla_class: str) -> None:
    if sla_class not in (quota.allowed_sla_classes or []):
        quota_rejected(quota.tenant_id, "sla_class_not_allowed")
        raise APIError(403, f"SLA class '{sla_class}' is not allowed for this tenant.",
                       "sla_class_not_allowed", "sla_class")
